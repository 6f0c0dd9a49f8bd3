"""Lifecycle enums shared by every layer: the training phase and the memory category of a tensor."""

from __future__ import annotations

import enum

__all__ = ["MemoryCategory", "Phase", "ShardedState", "TrainingState", "UnitState"]


class Phase(enum.Enum):
    """Where a training step is; memory samples are labelled with it."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


class UnitState(enum.Enum):
    """A ZeRO-3 unit's parameters: only its shards, a gather in flight, or the full parameters (between
    unshard and reshard). The transitions are written once, in ``memsave.zero.unit.Unit._enter``."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


ShardedState = UnitState  # the name before the lifecycle had a gathering state


class TrainingState(enum.Enum):
    """Where a stage-3 engine's schedule is in a training step (FSDP2's ``TrainingState``, for a whole model).
    The transitions are written once, in ``memsave.zero.schedule``.

    IDLE: no forward's graph is waiting for its backward. FORWARD: inside the model's forward.
    AWAIT_BACKWARD: a grad-enabled forward ended and its backward has not started (or a ``create_graph``
    backward ended, whose graph the next backward runs through). BACKWARD: inside a backward."""

    IDLE = "idle"
    FORWARD = "forward"
    AWAIT_BACKWARD = "await_backward"
    BACKWARD = "backward"


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
