"""Where each tensor a rank holds sits in the global tensor: the rectangles of a checkpoint.

A wrapped model's parameter ``p`` is first cut by tensor parallelism (``tp_param(p)``: ``dim``, ``blocks``, the
whole tensor's ``full_shape``; a padded vocabulary's rows past the real ones are not part of it), then ZeRO keeps
this rank's dim-0 rows ``[start, stop)`` of the TP slice (``dp=Shard(0)``). Along each dim the rank's elements map
to one or more contiguous runs of the global tensor (one per packed block that the rows touch), so what a rank
holds is the product of those runs: rectangles (ANCHORS.md 3.5). Optimizer state follows the parameter along
the dims it has per element (``exp_avg``: all; Adafactor's ``row_var``: all but the last, ``col_var``: all but
the second to last) and is whole along the others (a reduced statistic, ``step``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch
from torch import nn

from memsave.dist import Mesh
from memsave.dist.dcp import Rect
from memsave.optim import Adafactor
from memsave.tp import tp_param
from memsave.zero.layout import ShardLayout

__all__ = ["Held", "follow_mask", "held_params"]

Segment = tuple[int, int, int]  # (start in the local tensor, start in the global tensor, length)


@dataclasses.dataclass
class Held:
    """One parameter as this rank holds it. ``local`` is the tensor the rank reads and writes (this rank's rows
    under ZeRO-3, the whole TP slice otherwise); ``stepped`` what the optimizer steps (rows under any ZeRO stage)
    with ``rows`` the TP slice's rows it holds (None: all)."""

    name: str
    param: nn.Parameter
    full_shape: tuple[int, ...]
    local: torch.Tensor
    local_rows: tuple[int, int] | None
    stepped: torch.Tensor | None
    rows: tuple[int, int] | None
    tp_dim: int | None
    tp_blocks: int
    tp_rank: int
    tp_size: int

    def segments(self, d: int, length: int, row_offset: int) -> list[Segment]:
        """The runs of the global tensor that ``length`` elements along dim ``d`` of the TP slice, from
        ``row_offset`` on, occupy."""
        if self.tp_dim != d or self.tp_size == 1:
            return [(0, row_offset, length)]
        per = self.param.shape[d] // self.tp_blocks  # one packed block's extent on this rank
        full = self.full_shape[d]
        out = []
        for b in range(self.tp_blocks):
            lo, hi = max(row_offset, b * per), min(row_offset + length, (b + 1) * per)
            if lo >= hi:
                continue
            g = b * per * self.tp_size + self.tp_rank * per + (lo - b * per)
            n = min(hi - lo, full - g)  # a padded vocabulary: rows past the real ones are not saved
            if n > 0:
                out.append((lo - row_offset, g, n))
        return out

    def rects(self, key: str, value: torch.Tensor, follows: Sequence[bool], rows: tuple[int, int] | None) -> list[Rect]:
        """The rectangles of ``value``, a tensor shaped like this rank's part of the parameter (``rows`` of the
        TP slice; None: all) along the dims it ``follows``, and whole along the others."""
        if not self.full_shape and tuple(follows) == (True,):  # per element of a 0-dim parameter: (1,) or (0,) rows
            return [Rect(key, value.reshape(()), (), ())] if value.numel() == 1 else []
        shape = tuple(self.full_shape[d] if f else value.shape[d] for d, f in enumerate(follows))
        per_dim = [self.segments(d, value.shape[d], rows[0] if d == 0 and rows is not None else 0) if f
                   else [(0, 0, value.shape[d])] for d, f in enumerate(follows)]
        out = []
        for combo in itertools.product(*per_dim):
            view = value
            for d, (lo, _g, n) in enumerate(combo):
                view = view.narrow(d, lo, n)
            out.append(Rect(key, view, tuple(g for _, g, _ in combo), shape))
        return out

    def local_shape(self, global_shape: Sequence[int], follows: Sequence[bool], like: torch.Tensor) -> tuple[int, ...]:
        """The shape this rank holds of a state tensor of ``global_shape`` that follows ``like``'s dims."""
        if not self.full_shape and tuple(follows) == (True,):
            return tuple(like.shape)
        return tuple(like.shape[d] if f else global_shape[d] for d, f in enumerate(follows))


def follow_mask(optimizer: torch.optim.Optimizer, key: str, shape: Sequence[int],
                param_shape: Sequence[int]) -> tuple[bool, ...]:
    """Along which dims state ``key`` (of ``shape``, local or global alike) is per element of a parameter of
    ``param_shape`` (the same kind of shape): those dims are cut like the parameter, the others are whole."""
    n = len(shape)
    if key == "step":
        return (False,) * n
    if not param_shape and tuple(shape) in ((), (0,), (1,)):  # a 0-dim parameter's state (its rows: (1,) or (0,))
        return (True,)
    if isinstance(optimizer, Adafactor) and len(param_shape) >= 2 and key in ("row_var", "col_var"):
        whole = n - 1 if key == "row_var" else n - 2
        return tuple(d != whole for d in range(n))
    if tuple(shape) == tuple(param_shape):
        return (True,) * n
    return (False,) * n


def _canonical(model: nn.Module) -> dict[str, str]:
    """Under pp, a weight tied across stages (an input embedding and the LM head) is held by each stage under the
    name of the module it has there (stage 0 ``model.embed_tokens.weight``, the last ``lm_head.weight``); it is
    saved and loaded under its name in the whole model, the first of the tie (memsave/pp/split.py ``ties``), so
    the checkpoint reads the same at any pp."""
    split = getattr(getattr(model, "memsave_engine", None), "split", None)
    return {n: names[0] for names, _ in getattr(split, "ties", ()) for n in names[1:]}


def held_params(model: nn.Module, mesh: Mesh, stage: int, stepped: dict[nn.Parameter, torch.Tensor]) -> list[Held]:
    """Every parameter of ``model`` (tied ones once, under their first name) as this rank holds it."""
    tp_size, tp_rank = mesh.degree("tp"), mesh.axis_rank("tp")
    out = []
    for name, p in model.named_parameters():
        name = _canonical(model).get(name, name)
        lay = tp_param(p)
        full = tuple(lay.full_shape) if lay is not None and lay.dim is not None else tuple(p.shape)
        s = stepped.get(p)
        rows = None
        if s is not None and s is not p:  # ZeRO: this rank's rows of the TP slice
            slot = ShardLayout([p.shape], mesh.dp_size).slots[0]
            rows = slot.local_rows(mesh.dp_rank)
        sharded_local = stage == 3 and s is not None
        out.append(Held(name, p, full, s if sharded_local else p.data, rows if sharded_local else None,  # type: ignore[arg-type]
                        s, rows, lay.dim if lay is not None else None, lay.blocks if lay is not None else 1,
                        tp_rank, tp_size))
    return out

