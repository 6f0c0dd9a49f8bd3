"""Tensor-parallel layers: the user's ``nn.Linear`` / ``nn.Embedding`` objects, their class swapped for one of
these subclasses and their weights cut to this rank's slice (memsave/tp/apply.py), so the model's own forward
runs unchanged.

- :class:`ColumnParallelLinear` (weight split on the output dim, Megatron's ``ColumnParallelLinear``): its input
  enters the TP region once per input tensor (:class:`TPContext`), its output stays split unless
  ``gather_output``, or becomes :class:`~memsave.tp.loss.ShardedLogits` for the parallel loss.
- :class:`RowParallelLinear` (weight split on the input dim): the partial outputs are all-reduced (or
  reduce-scattered along the sequence), then the bias is added once.
- :class:`VocabParallelEmbedding`: a masked lookup in this rank's rows of the (padded) vocabulary, then an
  all-reduce.

[Note: one entry per input] Hugging Face attention feeds one ``hidden_states`` to three column-parallel linears
(``q/k/v``), the MLP to two (``gate/up``). They share one entry into the TP region: the first linear maps the
tensor (identity forward, or the sequence all-gather), the others reuse it (the context keeps the last input and
its mapping), so backward sums their input gradients before the one all-reduce or reduce-scatter: two per block
each way, the Megatron count, whatever the module layout.

[Note: sequence-parallel input regathered] Under sequence parallelism a column-parallel linear does not save the
gathered input for its weight gradient (``tp`` times its shard): it saves nothing of it and all-gathers the shard
again in backward, once for all the linears that shared it (Megatron's
``LinearWithGradAccumulationAndAsyncCommunication``; Korthikanti et al., 2022, section 4.2.2). That extra
all-gather counts as ``tp_regather``.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memsave import dist as mdist
from memsave.dist import ProcessGroup
from memsave.tp.loss import ShardedLogits, VocabShard
from memsave.tp.mappings import (
    CopyToTP,
    GatherLast,
    GatherSeq,
    ReduceFromTP,
    ReduceScatterSeq,
    ScatterSeq,
    all_gather_dim,
)
from memsave.tp.random import RegionRandom

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "TPContext", "VocabParallelEmbedding"]


class _Regather:
    """The sequence shard a column-parallel input was gathered from, gathered again once in backward for every
    linear that used it ([Note: sequence-parallel input regathered]). The shard is saved for backward by the first
    linear that reads it (through autograd's saved tensors, so the memory tracker, activation offload, compression
    and recomputation see it), and the others read it from there."""

    def __init__(self, shard: torch.Tensor, dim: int, group: ProcessGroup) -> None:
        self.dim, self.group = dim, group
        self._shard: torch.Tensor | None = shard.detach()
        self._owner: Any = None  # weakref to the autograd context that saved the shard
        self._owner_saved: tuple[torch.Tensor, ...] | None = None
        self.users = 0
        self._full: torch.Tensor | None = None

    def save(self, ctx: Any, weight: torch.Tensor) -> None:
        """Save ``weight`` on ``ctx``, and the shard too if no linear saved it yet."""
        self.users += 1
        if self._shard is None:
            ctx.save_for_backward(weight)
            return
        ctx.save_for_backward(weight, self._shard)
        self._owner, self._shard = weakref.ref(ctx), None

    def saved(self, ctx: Any) -> tuple[torch.Tensor, ...]:
        """``ctx.saved_tensors``, unpacked once for the owner (a recomputed unit's saved tensors may be unpacked
        only once, and the other linears read the shard from the owner's)."""
        owner = self._owner() if self._owner is not None else None
        if ctx is not owner or ctx is None:
            return tuple(ctx.saved_tensors)
        if self._owner_saved is None:
            self._owner_saved = tuple(ctx.saved_tensors)
        return self._owner_saved

    def take(self) -> torch.Tensor:
        if self._full is None:
            owner = self._owner()
            if owner is None:
                raise RuntimeError("memsave TP: the sequence shard saved for backward is gone (its graph was freed)")
            self._full = all_gather_dim(self.saved(owner)[1], self.dim, self.group, count_as="tp_regather")
        full = self._full
        self.users -= 1
        if self.users <= 0:
            self._full = self._owner_saved = None
        return full


class _LinearRegather(torch.autograd.Function):
    """``F.linear`` on the gathered input, saving the shard instead of the gathered input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                source: _Regather) -> torch.Tensor:
        ctx.source, ctx.has_bias = source, bias is not None
        source.save(ctx, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        weight = ctx.source.saved(ctx)[0]
        x = ctx.source.take()
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad.flatten(0, -2).t() @ x.flatten(0, -2).to(grad.dtype) if ctx.needs_input_grad[1] else None
        grad_b = grad.flatten(0, -2).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


@dataclasses.dataclass(eq=False)
class TPContext:
    """What the TP layers of one model share: the group, the sequence-parallel setting, the dropout streams and
    the last input that entered a column-parallel region ([Note: one entry per input])."""

    group: ProcessGroup
    rank: int
    size: int
    sequence: bool
    seq_dim: int
    random: RegionRandom
    _last: tuple[torch.Tensor, torch.Tensor, _Regather | None] | None = None

    def column_input(self, x: torch.Tensor) -> tuple[torch.Tensor, _Regather | None]:
        last = self._last
        if last is not None and last[0] is x:
            return last[1], last[2]
        self.random.leave()  # (under SP the input is a sequence shard: its region's stream ends here)
        if not torch.is_grad_enabled() or not x.requires_grad:
            mapped = all_gather_dim(x, self.seq_dim, self.group) if self.sequence else x
            source = None
        elif self.sequence:
            mapped = GatherSeq.apply(x, self.seq_dim, self.group)
            source = _Regather(x, self.seq_dim, self.group)
        else:
            mapped, source = CopyToTP.apply(x, self.group), None
        self._last = (x, mapped, source)
        return mapped, source

    def gather_input(self, x: torch.Tensor) -> torch.Tensor:
        """Under sequence parallelism: the whole sequence of the shard ``x``, at the entry of a module whose column-
        parallel children read it (a Hugging Face attention or MLP: ``sequence_gather``); the children use it as
        it is and regather the shard in backward."""
        self.random.leave()
        if not torch.is_grad_enabled() or not x.requires_grad:
            full, source = all_gather_dim(x, self.seq_dim, self.group), None
        else:
            full, source = GatherSeq.apply(x, self.seq_dim, self.group), _Regather(x, self.seq_dim, self.group)
        self._last = (full, full, source)
        return full

    def clear(self) -> None:
        self._last = None


class ColumnParallelLinear(nn.Linear):
    """An ``nn.Linear`` holding rows ``[rank * out/tp, (rank + 1) * out/tp)`` of its weight (of each packed block)."""

    tp: TPContext
    gather_output: bool
    vocab: VocabShard | None  # the parallel-loss LM head: its output is ShardedLogits
    select: tuple[int, int] | None  # replicated weight whose output columns [a, b) this rank uses (GQA KV heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = self.tp
        mapped, source = ctx.column_input(x)
        if source is not None:
            out = _LinearRegather.apply(mapped, self.weight, self.bias, source)
        else:
            out = F.linear(mapped, self.weight, self.bias)
        ctx.random.enter()
        if self.select is not None:
            out = out[..., self.select[0] : self.select[1]]
        if self.gather_output:
            ctx.random.leave()
            out = GatherLast.apply(out, ctx.group)
        elif self.vocab is not None:
            out = ShardedLogits.wrap(out, self.vocab)
        return out


class RowParallelLinear(nn.Linear):
    """An ``nn.Linear`` holding columns ``[rank * in/tp, (rank + 1) * in/tp)`` of its weight; the bias whole."""

    tp: TPContext
    split_input: bool = False  # rowwise_split_input: a whole input, this rank's columns cut from it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = self.tp
        ctx.random.leave()
        if self.split_input:  # this rank's columns; the gradient gathered whole again (as a sequence's slice is)
            x = ScatterSeq.apply(x, -1, ctx.group)
        y = F.linear(x, self.weight)
        if ctx.sequence:
            y = ReduceScatterSeq.apply(y, ctx.seq_dim, ctx.group)
            ctx.random.enter()  # the sequence-parallel region: each rank its slice of the sequence
        else:
            y = ReduceFromTP.apply(y, ctx.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Embedding):
    """An ``nn.Embedding`` holding rows ``[start, start + local)`` of the (padded) vocabulary."""

    tp: TPContext
    vocab: VocabShard

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        shard = self.vocab
        local = ids - shard.start
        outside = (local < 0) | (local >= shard.local - shard.padded)
        local = local.masked_fill(outside, 0)  # (a stand-in row for the ids other ranks hold; output masked)
        pad = self.padding_idx
        if pad is not None and not 0 <= pad - shard.start < shard.local:
            pad = None
        elif pad is not None:
            pad -= shard.start
        if self.max_norm is None and not self.scale_grad_by_freq:
            out = F.embedding(local, self.weight, pad, None, self.norm_type, False, self.sparse)
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        else:  # this rank's ids only: F.embedding would also renorm the stand-in row 0 (max_norm), or count the
            inside = ~outside  # other ranks' ids as its uses (scale_grad_by_freq), where one process does not
            out = self.weight.new_zeros((*ids.shape, self.embedding_dim))
            out[inside] = F.embedding(local[inside], self.weight, pad, self.max_norm, self.norm_type,
                                      self.scale_grad_by_freq, self.sparse)
        return ReduceFromTP.apply(out, self.tp.group)


def gather_tp(local: torch.Tensor, dim: int, group: ProcessGroup, *, blocks: int = 1,
              full: int | None = None) -> torch.Tensor:
    """The whole tensor from every ``tp`` rank's slice along ``dim`` (of each of ``blocks`` packed blocks),
    cut to ``full`` along ``dim`` (a padded vocabulary). Not differentiable; for checks and state dicts."""
    n = mdist.group_size(group)
    if n == 1 and full is None:
        return local
    parts = all_gather_dim(local.detach(), dim, group, count_as="tp_state").chunk(n, dim)
    if blocks > 1:
        per = [p.chunk(blocks, dim) for p in parts]
        whole = torch.cat([per[r][b] for b in range(blocks) for r in range(n)], dim)
    else:
        whole = torch.cat(parts, dim)
    return whole.narrow(dim, 0, full) if full is not None else whole
