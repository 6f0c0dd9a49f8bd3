"""How each tensor Adafactor steps is cut over the mesh, and the grouped reductions of its partial sums.

See [Note: Adafactor under row sharding] in memsave/optim/adafactor.py for which statistic sums over which axes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from memsave.dist import Placement, Shard

__all__ = ["Layout", "ReduceOver", "layout_of", "reduce_grouped", "without"]

# sums a flat tensor in place over every rank of the given mesh axes (a no-op for axes of one rank)
ReduceOver = Callable[[torch.Tensor, tuple[str, ...]], object]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which mesh axes cut a stepped tensor: ``rows`` split its factored rows (dim -2), ``cols`` its columns (dim
    -1), ``every`` lists all axes that cut it (rows, columns and any other dim); ``full_shape`` is the shape of the
    whole tensor (for a padded vocabulary: its real rows)."""

    rows: tuple[str, ...]
    cols: tuple[str, ...]
    every: tuple[str, ...]
    full_shape: torch.Size


def layout_of(placement: Placement, ndim: int, full_shape: Sequence[int]) -> Layout:
    """The layout of a tensor of ``ndim`` dims placed so (every axis of a ``Shard(dim)`` cuts that dim of it)."""
    rows, cols, every = [], [], []
    for axis in placement.sharded_axes():
        along = placement.along(axis)
        assert isinstance(along, Shard)
        if along.dim is None:  # other tensors altogether (a pipeline stage's): nothing to add up
            continue
        every.append(axis)
        dim = along.dim % ndim if ndim else 0
        if ndim >= 2 and dim == ndim - 2:
            rows.append(axis)
        elif ndim >= 2 and dim == ndim - 1:
            cols.append(axis)
    return Layout(tuple(rows), tuple(cols), tuple(every), torch.Size(full_shape))


def without(axes: tuple[str, ...], drop: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(a for a in axes if a not in drop)


def reduce_grouped(parts: dict[tuple[str, ...], list[torch.Tensor]], reduce_over: ReduceOver) -> None:
    """Sum every tensor of ``parts`` in place over its key's axes: one flat reduction per distinct axis set, the
    sets in a fixed order (every rank issues the same collectives)."""
    for axes in sorted(parts):
        tensors = parts[axes]
        if not axes or not tensors:
            continue
        flat = torch.cat([t.reshape(-1) for t in tensors])
        reduce_over(flat, axes)
        for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(piece.view_as(t))
