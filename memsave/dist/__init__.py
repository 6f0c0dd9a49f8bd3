"""Layer 1: the only place that calls ``torch.distributed``."""

from memsave.dist.agreement import Agreement
from memsave.dist.collectives import (
    COMM_STATS,
    CollectiveError,
    CommStats,
    Handle,
    ProcessGroup,
    ReduceOp,
    all_gather_into,
    all_gather_object,
    all_reduce,
    barrier,
    broadcast,
    doing,
    expect_every_rank,
    group_rank,
    group_size,
    reduce_scatter_into,
    shutdown,
)
from memsave.dist.host_memory import (
    HostMemoryPolicy,
    after_forward,
    configure_host_memory,
    host_memory_policy,
)
from memsave.dist.init import default_device, init, launch_env
from memsave.dist.mesh import AXES, Mesh, validate_degrees

__all__ = [
    "AXES",
    "COMM_STATS",
    "Agreement",
    "CollectiveError",
    "CommStats",
    "Handle",
    "HostMemoryPolicy",
    "Mesh",
    "ProcessGroup",
    "ReduceOp",
    "after_forward",
    "all_gather_into",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast",
    "configure_host_memory",
    "default_device",
    "doing",
    "expect_every_rank",
    "group_rank",
    "group_size",
    "host_memory_policy",
    "init",
    "launch_env",
    "reduce_scatter_into",
    "shutdown",
    "validate_degrees",
]
