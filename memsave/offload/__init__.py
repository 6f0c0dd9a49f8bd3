"""Layer 1: host tiers for what does not fit on the device. Today: activation offload to pinned host memory."""

from memsave.offload.activations import (
    MIN_NUMEL,
    ActivationOffload,
    ForwardContext,
    forward_under,
    is_activation,
    module_storages,
    offload_saved,
)

__all__ = [
    "MIN_NUMEL",
    "ActivationOffload",
    "ForwardContext",
    "forward_under",
    "is_activation",
    "module_storages",
    "offload_saved",
]
