"""Lifecycle enums shared by every layer: the training phase and the memory category of a tensor."""

from __future__ import annotations

import enum

__all__ = ["MemoryCategory", "Phase", "ShardedState"]


class Phase(enum.Enum):
    """Where a training step is; memory samples are labelled with it."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


class ShardedState(enum.Enum):
    """A ZeRO-3 unit holds either only its shards or, between unshard and reshard, the full parameters."""

    SHARDED = "sharded"
    UNSHARDED = "unsharded"


class MemoryCategory(enum.Enum):
    """What a registered tensor is, for the memory tracker and reports."""

    PARAMS = "params"
    PARAMS_GATHERED = "params_gathered"
    GRADS = "grads"
    MASTER = "master"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATIONS = "activations"
    BUFFERS = "buffers"
    COMM = "comm"  # communication staging and prefetch buffers in flight
    OFFLOAD_HOST = "offload_host"  # moved off the device to host memory (another tier: not in the device total)
    OFFLOAD_DISK = "offload_disk"  # moved to files on disk
