"""Layer 1: optimizers that need no communication of their own (a sharded caller passes a reduce function)."""

from memsave.optim.adafactor import Adafactor
from memsave.optim.build import build_optimizer

__all__ = ["Adafactor", "build_optimizer"]
