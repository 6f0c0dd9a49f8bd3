"""Layer 4: the typed :class:`Engine` protocol, its engines, and the one :class:`MemsaveOptimizer` that composes
gradient sync, precision, offload and clipping over any of them."""

from memsave.engines.dp import DataParallelEngine
from memsave.engines.optimizer import MemsaveOptimizer
from memsave.engines.protocol import Engine

__all__ = ["DataParallelEngine", "Engine", "MemsaveOptimizer"]
