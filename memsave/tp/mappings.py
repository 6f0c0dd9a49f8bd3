"""The tensor-parallel mappings: autograd functions that move activations between layouts over the ``tp`` group.

After Megatron-LM (Shoeybi et al., 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using
Model Parallelism", the ``f``/``g`` conjugate operators) and Korthikanti et al. (2022, "Reducing Activation
Recomputation in Large Transformer Models", the sequence-parallel all-gather / reduce-scatter pair), written over
``memsave.dist`` collectives so that gloo on CPU is first-class. Each forward is the conjugate of its backward:

| function | forward | backward |
|---|---|---|
| :class:`CopyToTP` | identity | all-reduce |
| :class:`ReduceFromTP` | all-reduce | identity |
| :class:`GatherSeq` | all-gather along the sequence | reduce-scatter along it |
| :class:`ReduceScatterSeq` | reduce-scatter along the sequence | all-gather along it |
| :class:`ScatterSeq` | keep this rank's slice of the sequence | all-gather along it |
| :class:`GatherLast` | all-gather along the last dim | keep this rank's slice |

[Note: TP traffic kinds] The activation traffic counts under its own kinds in :data:`memsave.dist.COMM_STATS`
(``tp_all_reduce``, ``tp_all_gather``, ``tp_reduce_scatter``, and ``tp_regather`` for the sequence-parallel
input gathered again in backward), apart from the data-parallel gradient traffic, so tests and benchmarks check
each against its formula.
"""

from __future__ import annotations

from typing import Any

import torch

from memsave import dist as mdist
from memsave.dist import ProcessGroup

__all__ = ["CopyToTP", "GatherLast", "GatherSeq", "ReduceFromTP", "ReduceScatterSeq", "ScatterSeq",
           "all_gather_dim", "reduce_scatter_dim", "split_dim"]


def _check_divisible(size: int, n: int, dim: int) -> None:
    if size % n != 0:
        decoding = (" (a decoding step of generate(), with its key/value cache, runs one token: generate without "
                    "sequence parallelism)") if size == 1 else ""
        raise ValueError(f"sequence parallelism: dim {dim} has size {size}, which is not divisible by tp={n}; "
                         f"use a sequence length that is a multiple of {n}, or set [parallel] sequence = false"
                         f"{decoding}")


def all_gather_dim(x: torch.Tensor, dim: int, group: ProcessGroup, *, count_as: str = "tp_all_gather") -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order."""
    n = mdist.group_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    flat = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)
    mdist.all_gather_into(flat.view(-1), x.contiguous().view(-1), group, count_as=count_as)
    # (n, ..., d, ...) -> (..., n, d, ...) -> (..., n*d, ...)
    return flat.movedim(0, dim).flatten(dim, dim + 1).contiguous()


def reduce_scatter_dim(x: torch.Tensor, dim: int, group: ProcessGroup, *,
                       count_as: str = "tp_reduce_scatter") -> torch.Tensor:
    """The sum of every rank's ``x``, of which this rank keeps its slice along ``dim``."""
    n = mdist.group_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    _check_divisible(x.shape[dim], n, dim)
    chunks = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()  # (n, ..., d/n, ...)
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    mdist.reduce_scatter_into(out.view(-1), chunks.view(-1), group, count_as=count_as)
    return out


def split_dim(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` (a contiguous copy; no communication)."""
    n = mdist.group_size(group)
    if n == 1:
        return x
    _check_divisible(x.shape[dim], n, dim % x.dim())
    return x.chunk(n, dim)[mdist.group_rank(group)].contiguous()


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    mdist.all_reduce(out, group, count_as="tp_all_reduce")
    return out


class CopyToTP(torch.autograd.Function):
    """Enter a tensor-parallel region with a replicated input (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class ReduceFromTP(torch.autograd.Function):
    """Leave a tensor-parallel region by summing the ranks' partial outputs (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class GatherSeq(torch.autograd.Function):
    """Sequence shards -> the whole sequence (before a column-parallel region under sequence parallelism)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return all_gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return reduce_scatter_dim(grad, ctx.dim, ctx.group), None, None


class ReduceScatterSeq(torch.autograd.Function):
    """Partial sums over the whole sequence -> reduced sequence shards (after a row-parallel region under SP)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return reduce_scatter_dim(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather_dim(grad, ctx.dim, ctx.group), None, None


class ScatterSeq(torch.autograd.Function):
    """A replicated tensor -> this rank's sequence shard (where the residual stream enters sequence parallelism)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return split_dim(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather_dim(grad, ctx.dim, ctx.group), None, None


class GatherLast(torch.autograd.Function):
    """Column shards of an output -> the whole output (a column-parallel layer whose consumer needs it whole)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return all_gather_dim(x, -1, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return split_dim(grad, -1, ctx.group), None
