"""Layer 1: tiers for what does not fit on the device: activation offload to pinned host memory, and optimizer
state on disk or in pinned host memory, streamed in chunks with prefetch (ZeRO-Offload, Ren et al., 2021;
ZeRO-Infinity, Rajbhandari et al., 2021)."""

from memsave.offload.activations import (
    MIN_NUMEL,
    ActivationOffload,
    ForwardContext,
    forward_under,
    is_activation,
    module_storages,
    offload_saved,
)
from memsave.offload.state import OffloadedState
from memsave.offload.stepping import state_bytes_per_element
from memsave.offload.tiers import DiskTier, HostTier, check_disk_path

__all__ = [
    "MIN_NUMEL",
    "ActivationOffload",
    "DiskTier",
    "ForwardContext",
    "HostTier",
    "OffloadedState",
    "check_disk_path",
    "forward_under",
    "is_activation",
    "module_storages",
    "offload_saved",
    "state_bytes_per_element",
]
