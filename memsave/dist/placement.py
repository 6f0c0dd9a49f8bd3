"""Placements: how a tensor is laid out over each mesh axis, the one fact every layer reads (DESIGN.md).

DTensor's idea, kept as plain data with no DTensor dependency. Along each axis of the ``pp x dp x tp`` mesh a
tensor is
- :class:`Replicate`: every rank of the axis holds the same full values;
- :class:`Shard` ``(dim)``: each rank holds one slice along ``dim`` (ZeRO's dim-0 rows, a TP column block);
- :class:`Partial`: each rank holds a summand of the true value (a gradient before its all-reduce).

A stage of a pipeline owns its own parameters: along ``pp`` a parameter is a :class:`Shard` of the model (no
dim; each rank holds other tensors), so global sums over parameters add the stages' parts.

[Note: placements] What derives from a placement, so that no layer guesses which group to reduce over:
- the gradient sync axes (:data:`DATA_AXES` the parameter is not already reduced over);
- the global norm and any sum over parameters: a tensor sharded along an axis adds its part on every rank of
  that axis; a tensor replicated along it counts once (:func:`sum_over_shards`);
- the agreement axes of a decision taken from local values (overflow, "was it used"): the axes along which
  the values differ (:meth:`Placement.differs_along`);
- bytes per rank (:meth:`Placement.local_numel`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from memsave.dist.collectives import ProcessGroup, ReduceOp, all_reduce

if TYPE_CHECKING:
    from memsave.dist.mesh import Mesh

__all__ = ["DATA_AXES", "AgreeOver", "Partial", "Placement", "Replicate", "Shard", "all_reduce_over", "param_placement", "sum_over_shards"]

# The axes along which ranks see different data: a replicated parameter's gradient is averaged over them.
DATA_AXES = ("dp",)
_AXES = ("pp", "dp", "tp")


@dataclasses.dataclass(frozen=True)
class Replicate:
    """Every rank of the axis holds the same full tensor."""

    def __repr__(self) -> str:
        return "Replicate()"


@dataclasses.dataclass(frozen=True)
class Shard:
    """Each rank of the axis holds one slice along ``dim`` (padded to equal size); ``dim=None``: other tensors
    altogether (a pipeline stage's own parameters)."""

    dim: int | None = 0

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclasses.dataclass(frozen=True)
class Partial:
    """Each rank of the axis holds a summand of the value; the sum over the axis is the value."""

    def __repr__(self) -> str:
        return "Partial()"


AxisPlacement = Replicate | Shard | Partial
# where a decision from local values is agreed: one group, the groups of several axes in turn, or None (here alone)
AgreeOver = ProcessGroup | Sequence[ProcessGroup | None] | None
_REPLICATE = Replicate()


@dataclasses.dataclass(frozen=True)
class Placement:
    """A tensor's layout over the ``pp``, ``dp`` and ``tp`` axes (default: replicated everywhere)."""

    pp: AxisPlacement = _REPLICATE
    dp: AxisPlacement = _REPLICATE
    tp: AxisPlacement = _REPLICATE
    # axes over which the *gradient* of a parameter so placed is a partial sum to be added up (a norm weight
    # replicated over tp but used on sequence shards: sequence parallelism)
    partial_grad: tuple[str, ...] = ()
    # a copy of a parameter that an earlier pipeline stage also holds (an embedding tied to the LM head of the last
    # stage): its gradient is summed over the holders, and sums over parameters (the global norm) count it on
    # the first holder only
    tie_copy: bool = False

    def __post_init__(self) -> None:
        for axis in _AXES:
            value = getattr(self, axis)
            if not isinstance(value, Replicate | Shard | Partial):
                raise ValueError(f"placement for axis {axis!r} is {value!r}; expected Replicate(), Shard(dim) or "
                                 "Partial()")
        for axis in self.partial_grad:
            if axis not in _AXES:
                raise ValueError(f"partial_grad axis {axis!r} is not allowed; expected some of {', '.join(_AXES)}")

    def along(self, axis: str) -> AxisPlacement:
        if axis not in _AXES:
            raise ValueError(f"mesh axis {axis!r} is not allowed; expected one of {', '.join(_AXES)}")
        return getattr(self, axis)  # type: ignore[no-any-return]

    def with_axis(self, axis: str, value: AxisPlacement) -> Placement:
        self.along(axis)
        return dataclasses.replace(self, **{axis: value})  # type: ignore[arg-type]

    def sharded_axes(self) -> tuple[str, ...]:
        """Axes along which each rank holds only a part: a sum over the tensor adds every rank's part."""
        return tuple(a for a in _AXES if isinstance(self.along(a), Shard))

    def differs_along(self) -> tuple[str, ...]:
        """Axes along which the ranks' local values differ (sharded or partial): a decision taken from them must
        be agreed over these axes."""
        return tuple(a for a in _AXES if not isinstance(self.along(a), Replicate))

    def grad_sync_axes(self) -> tuple[str, ...]:
        """Axes over which the gradient of a parameter so placed is averaged (reduced): the data axes."""
        return tuple(a for a in DATA_AXES if not isinstance(self.along(a), Partial))

    def local_numel(self, shape: Sequence[int], mesh: Mesh | None = None, *,
                    degrees: dict[str, int] | None = None) -> int:
        """Elements this rank holds of a tensor of full ``shape`` (padded shards: the ceiling of each split)."""
        sizes = dict(degrees or {})
        if mesh is not None:
            sizes = {a: mesh.degree(a) for a in _AXES}
        dims = list(shape)
        for axis in _AXES:
            where = self.along(axis)
            n = sizes.get(axis, 1)
            if isinstance(where, Shard) and where.dim is not None and n > 1:
                if not dims:  # a scalar is padded to one row per rank
                    dims = [1]
                dims[where.dim] = -(-dims[where.dim] // n)
        return math.prod(dims)

    def __str__(self) -> str:
        grad = f", partial_grad={self.partial_grad}" if self.partial_grad else ""
        grad += ", tie_copy=True" if self.tie_copy else ""
        return "(" + ", ".join(f"{a}={self.along(a)!r}" for a in _AXES) + grad + ")"


def param_placement(p: torch.Tensor) -> Placement:
    """The placement a transform gave a parameter (tensor parallelism cuts it over ``tp``); replicated if none."""
    return getattr(p, "_memsave_placement", _REPLICATED_ALL)


def all_reduce_over(tensor: torch.Tensor, groups: AgreeOver | Iterable[ProcessGroup | None], *,
                    op: Any = ReduceOp.SUM, count_as: str = "all_reduce", via: torch.device | None = None,
                    ) -> torch.Tensor:
    """All-reduce ``tensor`` in place over each group in turn: a sum (or max) over every rank of their product.
    ``groups``: one group, several (the axes of a placement), or None (this process alone). ``via``: the groups'
    device; a tensor elsewhere (a host step's statistics, [Note: host step] in memsave/offload/host_step.py) is
    reduced through a copy there."""
    if groups is None or isinstance(groups, ProcessGroup):
        groups = [groups]
    groups = [g for g in groups if g is not None]
    if not groups:
        return tensor
    moved = tensor.to(via) if via is not None and tensor.device != via else tensor
    for group in groups:
        all_reduce(moved, group, op=op, count_as=count_as)
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


def sum_over_shards(parts: dict[tuple[str, ...], torch.Tensor], group_of: dict[str, ProcessGroup | None], *,
                    op: Any = ReduceOp.SUM) -> torch.Tensor:
    """Combine per-rank partial results into the global one, each tensor counted once.

    ``parts`` maps a set of sharded axes (:meth:`Placement.sharded_axes`) to this rank's sum (or max, with
    ``op=MAX``) over the tensors placed so; each is reduced over exactly the groups of its axes, then the parts
    are combined. A tensor replicated along an axis is thus never added once per rank of it."""
    out: torch.Tensor | None = None
    for axes, part in sorted(parts.items()):
        total = all_reduce_over(part.reshape(1).clone(), (group_of[a] for a in axes), op=op)[0]
        out = total if out is None else (out + total if op == ReduceOp.SUM else torch.maximum(out, total))
    return out if out is not None else torch.zeros(())


_REPLICATED_ALL = Placement()
