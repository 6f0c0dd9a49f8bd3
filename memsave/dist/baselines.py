"""torch's own data-parallel implementations, set up as ``memsave bench`` measures them.

memsave does not build on these; they are what it is compared against. They live in ``dist/`` because this
is the only layer that touches ``torch.distributed``. Each returns ``(model, optimizer, holder)``: the model
to call, an optimizer with ``step`` / ``zero_grad``, and an object whose ``memory_tensors()`` lists what the
baseline keeps (local shards for FSDP2), so its bytes are counted like memsave's.

[Note: FSDP2 mixed precision] Under ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, ...)`` FSDP2 keeps the
*sharded* parameters in their original dtype (fp32: they are the master copy the optimizer steps), casts them to
``param_dtype`` for the all-gather, and frees the bf16 unsharded parameters on reshard. Gradients are
reduce-scattered in ``reduce_dtype`` and the sharded ``.grad`` is cast back to the parameter's dtype (fp32). So
its model state per rank is 4/N params + 4/N grads + 8/N Adam = 16 bytes/param / N whatever ``reduce_dtype``
is, the fp32 stage-3 figure, while memsave's zero3-bf16 keeps bf16 shards beside fp32 masters (also 16/N).

[Note: baselines import cost] Importing this module loads FSDP2, DDP, ZeroRedundancyOptimizer and DTensor:
about a second on a CPU machine. ``memsave/cli.py`` imports the bench, so the bench imports this module inside
the workers that run a torch baseline, not at its top, and every other ``memsave`` command is spared it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from memsave.phases import MemoryCategory

if TYPE_CHECKING:
    from torch.distributed._tools.mem_tracker import MemTracker

__all__ = ["BASELINES", "build_baseline", "mem_tracker"]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _Holder:
    """Reports a baseline's tensors: parameters, gradients, buffers and optimizer state (local parts)."""

    def __init__(self, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        self.module, self.optimizers = module, optimizers

    def memory_tensors(self) -> Iterator[tuple[MemoryCategory, torch.Tensor]]:
        for p in self.module.parameters():
            yield MemoryCategory.PARAMS, _local(p)
            if p.grad is not None:
                yield MemoryCategory.GRADS, _local(p.grad)
        for b in self.module.buffers():
            yield MemoryCategory.BUFFERS, _local(b)
        for opt in self.optimizers:
            for state in opt.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        yield MemoryCategory.OPTIMIZER_STATE, _local(v)


def _ddp(model: nn.Module, make_opt: OptimizerFactory, blocks: list[nn.Module]) -> tuple:
    # gradient_as_bucket_view: the memory-lean DDP setting (gradients are views of the buckets, 16 bytes per
    # fp32 Adam parameter instead of 20); the stronger baseline for memory.
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    opt = make_opt(list(model.parameters()))
    return ddp, opt, _Holder(model, [opt])


def _torch_zero(model: nn.Module, make_opt: OptimizerFactory, blocks: list[nn.Module]) -> tuple:
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    probe = make_opt([nn.Parameter(torch.zeros(1))])
    accepted = inspect.signature(type(probe).__init__).parameters  # defaults may hold derived keys
    kwargs = {k: v for k, v in probe.defaults.items() if k in accepted}
    opt = ZeroRedundancyOptimizer(list(model.parameters()), optimizer_class=type(probe), **kwargs)
    return ddp, opt, _Holder(model, [opt.optim])


def _fsdp2(reshard_after_forward: bool, mp_policy: MixedPrecisionPolicy | None = None) -> Callable[..., tuple]:
    """FSDP2 as torchtitan applies it: ``fully_shard`` on each block, then on the root (bottom-up); with
    ``mp_policy`` on every one of them (see [Note: FSDP2 mixed precision])."""
    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()  # torch's default: no casts

    def build(model: nn.Module, make_opt: OptimizerFactory, blocks: list[nn.Module]) -> tuple:
        for block in blocks:
            fully_shard(block, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        # the root keeps its parameters after forward, as fully_shard documents for a root (they are gathered
        # again at once for backward); said explicitly: torch 2.11 resharded a root whose forward returns a
        # dataclass and never gathered it again for backward ("setStorage: ... storage of size 0")
        fully_shard(model, reshard_after_forward=False, mp_policy=policy)
        opt = make_opt(list(model.parameters()))
        return model, opt, _Holder(model, [opt])

    return build


BASELINES: dict[str, Callable[..., tuple]] = {
    "torch-ddp": _ddp,
    "torch-zero1": _torch_zero,
    "fsdp2": _fsdp2(True),
    "fsdp2-noreshard": _fsdp2(False),
    "fsdp2-bf16": _fsdp2(True, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)),
    "fsdp2-bf16-fp32reduce": _fsdp2(True, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
}


def build_baseline(name: str, model: nn.Module, make_opt: OptimizerFactory, blocks: list[nn.Module]) -> tuple:
    """Wrap ``model`` with the baseline ``name`` (see :data:`BASELINES`)."""
    if name not in BASELINES:
        raise ValueError(f"baseline {name!r} is not known; expected one of {', '.join(BASELINES)}")
    return BASELINES[name](model, make_opt, blocks)


def mem_tracker() -> type[MemTracker]:
    """torch's ``MemTracker`` class (``torch.distributed._tools.mem_tracker``): the peak memory of one process by
    category, from a dispatch mode and module hooks. It calls no collective, but it lives under
    ``torch.distributed``, so the bench reaches it here. Imported when asked for: it costs most of a second more
    (see [Note: baselines import cost])."""
    from torch.distributed._tools.mem_tracker import MemTracker as tracker

    return tracker
