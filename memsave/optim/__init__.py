"""Layer 1: optimizers that need no communication of their own (a sharded caller passes a reduce function)."""

from memsave.optim.adafactor import Adafactor

__all__ = ["Adafactor"]
