"""The ``Engine`` protocol: what a trainer, a pipeline schedule and :class:`~memsave.engines.MemsaveOptimizer`
need from an engine, whatever it shards.

Two engines implement it today: :class:`~memsave.engines.dp.DataParallelEngine` (every rank holds everything;
gradients averaged in buckets) and :class:`~memsave.zero.ZeroEngine` (stages 1-3). The optimizer composes
precision, offload, clipping and the step over any of them through this surface alone; every collective it
derives (the global norm, the overflow agreement) reads the placements the engine reports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from memsave import dist as mdist
from memsave.phases import MemoryCategory

__all__ = ["Engine"]


@runtime_checkable
class Engine(Protocol):
    """A model's training engine over a :class:`~memsave.dist.Mesh`."""

    model: nn.Module
    mesh: mdist.Mesh
    agreement: mdist.Agreement  # [Note: control-flow agreement] in memsave/dist/agreement.py
    require_grad_sync: bool  # False inside no_sync()
    num_syncs: int  # completed gradient synchronizations (one per synchronizing backward)
    loss_scaled: bool  # fp16: gradients must come from optimizer.backward (a scaled loss)
    in_scaled_backward: bool
    load_listeners: list[Callable[[Any], None]]  # called after model.load_state_dict
    zero_grad_listeners: list[Callable[[], None]]  # called by model.zero_grad(): what was derived from the gradients
    sync_listeners: list[Callable[[], None]]  # called after each gradient synchronization (num_syncs moved)

    # -- a schedule drives these -----------------------------------------------------------------------------
    def unshard(self, unit: Any = None) -> None:
        """Hold ``unit``'s full parameters (every unit's when None) until :meth:`reshard` (collective)."""

    def reshard(self, unit: Any = None) -> None:
        """Free what :meth:`unshard` gathered."""

    def no_sync(self) -> AbstractContextManager[None]:
        """Backwards inside accumulate locally; the first one after the block synchronizes."""

    def sync_gradients(self) -> None:
        """Settle this backward's gradients now (the end-of-backward callback; also a rank whose backward reached
        none of its parameters, so its peers' collectives are matched)."""

    # -- the optimizer reads these ------------------------------------------------------------------------
    def stepped(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """``(parameter, the tensor the optimizer steps for it)`` for every parameter: itself, or its shard."""

    def placement_of(self, stepped: torch.Tensor) -> mdist.Placement:
        """How a stepped tensor (and its gradient, once synchronized) is laid out over the mesh."""

    def grad_of(self, stepped: torch.Tensor) -> torch.Tensor | None:
        """The synchronized gradient of a stepped tensor, in the reduce dtype (may differ from ``.grad``'s)."""

    def zero_grad(self, set_to_none: bool) -> None: ...

    def drop_grad(self, stepped: torch.Tensor) -> None:
        """Forget the stepped tensor's gradient (its optimizer tensor was cleared before the step)."""

    def restarted_since(self, stepped: torch.Tensor, sync: int) -> bool:
        """Whether the stepped tensor's gradient started afresh after sync number ``sync``."""

    def set_cleared_check(self, cleared: Callable[[nn.Parameter], bool]) -> None:
        """``cleared(p)``: the optimizer's tensor for ``p`` lost its ``.grad``, so ``p``'s next gradient starts
        afresh ([Note: gradients cleared through the optimizer] in memsave/engines/freshness.py)."""

    def before_step(self) -> None:
        """Before the optimizer changes the stepped tensors (stage 3 frees units gathered on access)."""

    def after_step(self) -> None:
        """After the step (stages 1-2 gather the updated rows)."""

    # -- memory/ reads this -------------------------------------------------------------------------------
    def memory_tensors(self) -> Iterator[tuple[MemoryCategory, torch.Tensor]]:
        """What the engine holds, by category (the registry the tracker and reports read)."""

    def remove(self) -> None:
        """Remove the engine's hooks."""
