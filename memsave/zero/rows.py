"""Row-sharded tensors outside the units: what an optimizer may step by rows, and moving its state between the
full shape and this rank's rows (consolidated state dicts, full gradients).

ZeRO shards every parameter along dim 0 (Placement ``dp=Shard(0)``), so each rank's optimizer steps its own rows.
That is exact for optimizers whose update is elementwise (SGD, Adam, AdamW, RMSprop, ...). Optimizers with
per-tensor statistics (LBFGS, torch's Adafactor) are refused; :class:`memsave.optim.Adafactor` is told it steps
row shards and reduces its column statistics and RMS sums over dp itself ([Note: Adafactor under row sharding]
in memsave/optim/).
"""

from __future__ import annotations

from typing import Any

import torch

from memsave import dist as mdist
from memsave._logging import warn_once
from memsave.optim import Adafactor
from memsave.zero.layout import ShardLayout

__all__ = ["ELEMENTWISE", "RowSharding", "check_shardable", "is_elementwise"]

# optimizers whose update of an element reads only that element: exact on row shards and on chunks
ELEMENTWISE = {"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop", "Adadelta", "ASGD", "Rprop"}
_NOT_SHARDABLE = {"LBFGS", "SparseAdam", "Adafactor", "Muon"}


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is one of torch's elementwise optimizers (:data:`ELEMENTWISE`) or a subclass of one
    that keeps its ``step`` (a user's ``class MyAdamW(torch.optim.AdamW)`` for logging: it was refused by its
    name). A subclass with a ``step`` of its own may do anything there (divide by the global gradient norm)."""
    base = next((c for c in type(optimizer).__mro__
                 if c.__name__ in ELEMENTWISE and c.__module__.startswith("torch.optim")), None)
    return base is not None and type(optimizer).step is getattr(base, "step", None)


def check_shardable(optimizer: torch.optim.Optimizer, stage: int) -> None:
    """Refuse what cannot step row shards exactly, before anything is changed."""
    name = type(optimizer).__name__
    if isinstance(optimizer, Adafactor):
        name = "memsave.optim.Adafactor"  # sharding-aware
    elif name in _NOT_SHARDABLE:
        raise NotImplementedError(
            f"{name} keeps per-tensor statistics, so stepping row shards independently would change its "
            f"updates; with ZeRO stage {stage} use an elementwise optimizer (AdamW, SGD, ...) or "
            "memsave.optim.Adafactor, which stays exact under sharding"
        )
    if optimizer.state:
        raise ValueError(
            f"optimizer already has state for {len(optimizer.state)} parameters; memsave.wrap must come before "
            "the first step (load a checkpoint with optimizer.load_state_dict after wrapping)"
        )
    if not is_elementwise(optimizer) and not isinstance(optimizer, Adafactor):
        warn_once(f"ZeRO assumes {name} updates each element independently; if it does not, results differ")


class RowSharding:
    """Moves row-sharded tensors (a parameter's rows, any trailing dims) between their full shape and this
    rank's rows over the dp axis of ``mesh``."""

    def __init__(self, mesh: mdist.Mesh) -> None:
        self.group, self.rank, self.size = mesh.dp_group, mesh.dp_rank, mesh.dp_size

    @staticmethod
    def full_shape(value: torch.Tensor, full_param: torch.Tensor) -> torch.Size:
        """The full shape of a row-sharded tensor: the parameter's rows, the value's own trailing dims."""
        return full_param.shape if full_param.dim() == 0 else torch.Size((full_param.shape[0], *value.shape[1:]))

    def gather(self, shard: torch.Tensor, full_param: torch.Tensor) -> torch.Tensor:
        """All-gather a row-sharded tensor into its full shape (collective over dp)."""
        shape = self.full_shape(shard, full_param)
        layout = ShardLayout([shape], self.size)
        chunk = torch.zeros(layout.chunk_numel, dtype=shard.dtype, device=shard.device)
        layout.shard_view(chunk, 0, self.rank).view_as(shard).copy_(shard)
        out = torch.empty(layout.padded_numel, dtype=shard.dtype, device=shard.device)
        mdist.all_gather_into(out, chunk, self.group)
        full = torch.empty(shape, dtype=shard.dtype, device=shard.device)
        layout.unpack(out, 0, full)
        return full

    def own_rows(self, value: torch.Tensor, full_param: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full row-sharded tensor."""
        rows = full_param.shape[0] if full_param.dim() else 1
        start, stop = ShardLayout([full_param.shape], self.size).slots[0].local_rows(self.rank)
        if full_param.dim() == 0:
            return value.reshape(1)[start:stop]
        return value.reshape(rows, -1)[start:stop].view(stop - start, *value.shape[1:])

    @staticmethod
    def is_per_element(optimizer: torch.optim.Optimizer, key: str, value: Any, like: torch.Tensor,
                       full_param: torch.Tensor) -> bool:
        """A state entry sharded by rows like the parameter (exp_avg, momentum_buffer, Adafactor's row_var, ...),
        not one every rank holds whole (``step``, the column statistics of a 2-D parameter)."""
        if not isinstance(value, torch.Tensor) or key == "step":
            return False
        if isinstance(optimizer, Adafactor):
            return optimizer.state_is_row_sharded(key, full_param.shape)
        return value.shape == like.shape and (value.dim() > 0 or full_param.dim() == 0)
