"""memsave: train PyTorch models that do not fit.

ZeRO-1/2/3 sharding, offload, activation recomputation, mixed precision and memory reports, composed on
``torch.distributed``. See README.md for the quickstart and ``memsave.wrap`` for the entry point.
"""

from memsave import memory, optim, precision, recompute, zero
from memsave.api import parallelize, wrap
from memsave.checkpoint import load, load_weights, save
from memsave.config import Profile, list_presets, load_profile
from memsave.deferred import deferred_init
from memsave.dist import Mesh, init
from memsave.engines import MemsaveOptimizer
from memsave.estimator import Estimate, estimate
from memsave.memory import MemoryReport, MemoryTracker, report
from memsave.phases import MemoryCategory, Phase
from memsave.trainer import TrainConfig, Trainer, TrainResult, cosine_schedule
from memsave.wrapped import MemsaveModule

__version__ = "0.1.0"

__all__ = [
    "Estimate",
    "MemoryCategory",
    "MemoryReport",
    "MemoryTracker",
    "MemsaveModule",
    "MemsaveOptimizer",
    "Mesh",
    "Phase",
    "Profile",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "__version__",
    "cosine_schedule",
    "deferred_init",
    "estimate",
    "init",
    "list_presets",
    "load",
    "load_profile",
    "load_weights",
    "memory",
    "optim",
    "parallelize",
    "precision",
    "recompute",
    "report",
    "save",
    "wrap",
    "zero",
]
