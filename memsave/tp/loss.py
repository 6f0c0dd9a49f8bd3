"""The vocab-parallel cross-entropy, and the logits that carry it into an unchanged model's loss.

[Note: vocab-parallel cross-entropy] Each ``tp`` rank holds the logits of its slice of the (padded) vocabulary.
The loss needs, per token, the log-sum-exp over the *global* vocabulary and the target's logit: one all-reduce of
the row maxima (MAX) and one of the stacked sums (SUM: sum-exp, the target logit, and under label smoothing the
sum of all logits), so the ``[tokens, vocab]`` logits are never gathered (Megatron's
``vocab_parallel_cross_entropy`` does three all-reduces and no ``ignore_index``; torch's ``loss_parallel`` has no
label smoothing). Padded columns (a vocabulary that does not divide by ``tp``) are masked to -inf, so they add
nothing to the sum and get no gradient (Megatron-LM#1754); label smoothing averages over the real vocabulary
(Megatron-LM#737 took the local one).

[Note: sharded logits] A column-parallel LM head returns :class:`ShardedLogits`: this rank's columns as a tensor
subclass that knows the global vocabulary. The model's own loss code runs unchanged: ``float()``, ``view(-1,
vocab_size)``, ``flatten(0, 1)``, slicing that keeps the vocabulary dim and ``F.cross_entropy`` work on the shard
(the last one as :func:`vocab_parallel_cross_entropy`); any other operation sees the whole logits, gathered over
``tp`` first (a collective: every ``tp`` rank must run it, as DTensor's redistribute), and this is said once in
the log, since it holds ``[tokens, vocab]`` on every rank.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F

from memsave import dist as mdist
from memsave._logging import warn_once
from memsave.dist import ProcessGroup
from memsave.tp.mappings import all_gather_dim

__all__ = ["ShardedLogits", "VocabShard", "vocab_parallel_cross_entropy"]


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """Which columns of the global vocabulary this rank holds: ``[start, start + local)``, of ``vocab`` real ones
    (columns at or past ``vocab`` are padding). ``group`` None: the estimator's meta copy (:func:`cut_shapes`),
    where the loss runs for the bytes it saves and its reductions are left out (meta tensors hold no values)."""

    group: ProcessGroup | None
    start: int
    local: int
    vocab: int

    @property
    def padded(self) -> int:
        """Padding columns in this rank's slice."""
        return max(0, self.start + self.local - max(self.vocab, self.start))


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, shard: VocabShard, ignore_index: int,
                smoothing: float) -> torch.Tensor:
        group = shard.group
        logits = logits.detach()
        real = shard.local - shard.padded
        if shard.padded:
            logits = logits.clone()
            logits[:, real:] = -math.inf
        row_max = logits.max(dim=-1).values
        if group is not None:
            mdist.all_reduce(row_max, group, op=mdist.ReduceOp.MAX, count_as="tp_loss")
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        local_t = target - shard.start
        mine = (local_t >= 0) & (local_t < real) & (target != ignore_index)
        picked = shifted.gather(-1, torch.where(mine, local_t, 0).unsqueeze(-1)).squeeze(-1)
        picked = torch.where(mine, picked, 0.0)  # (not * mine: a rank holding only padding gathers -inf)
        sums = [exp.sum(-1), picked]
        if smoothing:
            sums.append(shifted[:, :real].sum(-1))
        stacked = torch.stack(sums)
        if group is not None:
            mdist.all_reduce(stacked, group, count_as="tp_loss")
        lse = stacked[0].log()
        loss = lse - stacked[1]
        if smoothing:
            loss = (1.0 - smoothing) * loss + smoothing * (lse - stacked[2] / shard.vocab)
        keep = target != ignore_index
        loss = loss * keep
        ctx.save_for_backward(exp, stacked[0], torch.where(mine, local_t, -1), keep)
        ctx.real, ctx.smoothing, ctx.vocab = real, smoothing, shard.vocab
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        exp, sumexp, local_t, keep = ctx.saved_tensors
        g = exp / sumexp.unsqueeze(-1)  # softmax over the global vocabulary; 0 on padding columns
        hit = local_t >= 0
        rows = hit.nonzero().squeeze(-1)
        g[rows, local_t[rows]] -= 1.0 - ctx.smoothing
        if ctx.smoothing:
            g[:, : ctx.real] -= ctx.smoothing / ctx.vocab
        # ignored rows get 0, as in torch, also when the incoming gradient is not finite (not grad * keep: the
        # mean over a batch whose every label is ignored is 0 / 0, whose gradient inf * 0 would be nan)
        g *= torch.where(keep, grad, 0.0).unsqueeze(-1)
        return g, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, shard: VocabShard, *,
                                 ignore_index: int = -100, reduction: str = "mean",
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """``F.cross_entropy`` of ``[tokens, vocab]`` logits of which this rank holds the columns ``shard`` names.

    Same definition as torch's (``ignore_index`` rows count neither in the sum nor in the mean; label smoothing
    mixes in the mean over the real vocabulary), computed with two small all-reduces over ``tp``.
    """
    if logits.dim() != 2 or target.dim() != 1 or target.shape[0] != logits.shape[0]:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and target "
                         f"{tuple(target.shape)}; expected [tokens, local vocab] and [tokens]")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction={reduction!r}; allowed are 'mean', 'sum', 'none'")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"vocab_parallel_cross_entropy: label_smoothing={label_smoothing!r}; allowed is [0, 1]")
    losses = _VocabParallelCE.apply(logits, target, shard, ignore_index, float(label_smoothing))
    if reduction == "none":
        return losses
    total = losses.sum()
    return total / (target != ignore_index).sum() if reduction == "mean" else total


# what runs on this rank's columns as it is: metadata, and autograd bookkeeping
_PASSTHROUGH = {"__get__", "__set__", "size", "dim", "numel", "element_size", "is_floating_point", "is_contiguous",
                "stride", "data_ptr", "register_hook", "retain_grad", "requires_grad_", "untyped_storage",
                "storage_offset", "get_device", "_is_view", "is_complex", "nelement", "ndimension",
                "backward", "__bool__"}
# elementwise or layout operations that keep the vocabulary as the last dim: their result is sharded as well
_KEEP_SHARDED = {"float", "half", "bfloat16", "double", "to", "type_as", "contiguous", "detach", "clone",
                 "__mul__", "__truediv__", "mul", "div", "__rmul__"}


class ShardedLogits(torch.Tensor):
    """This rank's vocabulary columns of the logits ([Note: sharded logits]); ``.full()`` gathers them whole."""

    _shard: VocabShard

    @staticmethod
    def wrap(local: torch.Tensor, shard: VocabShard) -> ShardedLogits:
        out = local.as_subclass(ShardedLogits)
        out._shard = shard
        return out

    def full(self) -> torch.Tensor:
        """The whole logits (an all-gather over ``tp``, differentiable; padding columns dropped)."""
        return _gather_full(self)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # no collective in a print
        with torch._C.DisableTorchFunctionSubclass():
            return (f"ShardedLogits(columns {self._shard.start}..{self._shard.start + self._shard.local} of "
                    f"{self._shard.vocab}, local={torch.Tensor.__repr__(self)})")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        shard = _shard_of(args, kwargs)
        name = getattr(func, "__name__", "")
        if func is F.cross_entropy:
            return _cross_entropy(shard, *args, **kwargs)
        local = _unwrap(args), _unwrap(kwargs)
        if name in _PASSTHROUGH or (name in _KEEP_SHARDED and _keeps_last(func, args, kwargs)):
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*local[0], **local[1])
            return ShardedLogits.wrap(out, shard) if name in _KEEP_SHARDED and isinstance(out, torch.Tensor) else out
        if name in ("view", "reshape", "flatten", "__getitem__"):
            mapped = _local_layout(name, args, shard)
            if mapped is not None:
                with torch._C.DisableTorchFunctionSubclass():
                    out = func(local[0][0], *mapped, **local[1])
                return ShardedLogits.wrap(out, shard)
        warn_once(f"tensor parallelism: {name or func} on the vocab-parallel logits gathers them whole over tp "
                  "([tokens, vocab] on every rank); F.cross_entropy, float(), view(-1, vocab) and flatten work on "
                  "the shard")
        full_args = [_gather_full(a) if isinstance(a, ShardedLogits) else a for a in args]
        full_kwargs = {k: _gather_full(v) if isinstance(v, ShardedLogits) else v for k, v in kwargs.items()}
        return func(*full_args, **full_kwargs)


def _shard_of(args: Any, kwargs: dict[str, Any]) -> VocabShard:
    for a in [*args, *kwargs.values()]:
        if isinstance(a, ShardedLogits):
            return a._shard
    raise AssertionError("ShardedLogits.__torch_function__ without a ShardedLogits argument")


def _plain(t: Any) -> Any:
    if isinstance(t, ShardedLogits):
        with torch._C.DisableTorchFunctionSubclass():
            return t.as_subclass(torch.Tensor)
    return t


def _unwrap(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return [_plain(v) for v in x]


def _keeps_last(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """An elementwise op keeps the sharding only against a scalar (a ``[vocab]`` operand would not line up)."""
    others = [a for a in [*args[1:], *kwargs.values()] if isinstance(a, torch.Tensor)]
    return all(o.dim() == 0 for o in others)


def _local_layout(name: str, args: Any, shard: VocabShard) -> tuple[Any, ...] | None:
    """The arguments of a view/reshape/flatten/index that keeps the vocabulary as the last dim, for the local
    shard; None when the op touches that dim (then the logits are gathered)."""
    x = args[0]
    ndim = x.dim()
    if name in ("view", "reshape"):
        shape = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)) else args[1:]
        shape = list(shape)
        if shape and shape[-1] == shard.vocab and ndim >= 1:
            return (*shape[:-1], shard.local),
        if shape and shape[-1] == shard.local and ndim >= 1:  # the width the logits report (``size(-1)``,
            return (*shape[:-1], shard.local),  # ``shape[-1]``: this rank's): the classic view(-1, logits.size(-1))
        return None
    if name == "flatten":
        start = args[1] if len(args) > 1 else 0
        end = args[2] if len(args) > 2 else -1
        return (start, end) if end % ndim != ndim - 1 else None
    index = args[1]
    if not isinstance(index, tuple):
        index = (index,)
    if any(i is None for i in index) or ndim < 2:
        return None
    if any(i is Ellipsis for i in index):
        return (args[1],) if index[-1] is Ellipsis or index[-1] == slice(None) else None
    if len(index) < ndim or index[-1] == slice(None):
        return (args[1],)
    return None


def _gather_full(t: ShardedLogits) -> torch.Tensor:
    shard = t._shard
    full = _GatherColumns.apply(_plain(t), shard.group)
    return full[..., : shard.vocab] if full.shape[-1] != shard.vocab else full


class _GatherColumns(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.local = group, x.shape[-1]
        return all_gather_dim(x, -1, group, count_as="tp_logits_gather")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        r = mdist.group_rank(ctx.group)
        return grad[..., r * ctx.local : (r + 1) * ctx.local].contiguous(), None


def _cross_entropy(shard: VocabShard, input: Any, target: Any, weight: Any = None, size_average: Any = None,
                   ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                   label_smoothing: float = 0.0) -> torch.Tensor:
    if (isinstance(input, ShardedLogits) and input.dim() == 2 and isinstance(target, torch.Tensor)
            and not target.is_floating_point() and target.dim() == 1 and weight is None
            and size_average is None and reduce is None):
        return vocab_parallel_cross_entropy(_plain(input), target, shard, ignore_index=ignore_index,
                                            reduction=reduction, label_smoothing=label_smoothing)
    warn_once("tensor parallelism: F.cross_entropy with class weights, probability targets or logits that are not "
              "[tokens, vocab] gathers the logits whole over tp first")
    full = _gather_full(input) if isinstance(input, ShardedLogits) else input
    return F.cross_entropy(full, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
