"""Layer 3: ZeRO stages 1-3 (Rajbhandari et al., 2020). ``memsave.zero.shard`` is the hand-composed entry."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from memsave.config import OffloadConfig, ZeroConfig
from memsave.dist import Mesh
from memsave.precision import LossScaler
from memsave.precision.nonfinite import NonfiniteGuard
from memsave.wrapped import swap_class
from memsave.zero.engine import ZeroEngine, default_units
from memsave.zero.layout import ShardLayout
from memsave.zero.optimizer import ZeroOptimizer

__all__ = ["ShardLayout", "ZeroEngine", "ZeroOptimizer", "default_units", "shard"]


def shard(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    stage: int,
    mesh: Mesh,
    units: Sequence[nn.Module] | None = None,
    config: ZeroConfig | None = None,
    mixed_precision: bool = False,
    scaler: LossScaler | None = None,
    reduce_dtype: torch.dtype | None = None,
    offload: OffloadConfig | None = None,
    nonfinite: NonfiniteGuard | None = None,
) -> tuple[nn.Module, ZeroOptimizer]:
    """Shard ``model`` and ``optimizer`` with ZeRO ``stage`` over ``mesh``'s dp axis, in place.

    The model must already be on ``mesh.device`` with identical values on every dp rank (``memsave.wrap``
    sees to both). ``units`` default to the blocks of the largest ``nn.ModuleList``; the root unit holds the
    rest. ``mixed_precision``: the parameters are already in a low-precision compute dtype; the optimizer
    steps fp32 master shards (with ``scaler`` for fp16; a scaler alone also works on fp32 parameters).
    ``reduce_dtype``: the dtype gradients are reduce-scattered and kept in (default: the parameters'). ``offload``: the
    optimizer state goes to its tier (see memsave/zero/offload.py; None or optimizer = "none": it stays). Returns the model (class swapped, see
    :func:`memsave.wrapped.swap_class`) and a ZeroOptimizer.
    """
    cfg = config if config is not None else ZeroConfig(stage=stage)
    if cfg.stage != stage:
        raise ValueError(f"shard(stage={stage}) contradicts config.stage={cfg.stage}; pass one of them")
    ZeroOptimizer.check(optimizer, stage)  # before the model is touched: a refused wrap loses nothing
    if offload is not None and offload.optimizer != "none":
        from memsave.zero.offload import check_offload

        check_offload(optimizer, offload, mesh.dp_size,
                      master_elements=None if mixed_precision or scaler is not None else 0)
    engine = ZeroEngine(model, mesh, cfg, units, reduce_dtype=reduce_dtype)
    swap_class(model, engine)
    return model, ZeroOptimizer(optimizer, engine, mixed_precision=mixed_precision, scaler=scaler, offload=offload,
                                nonfinite=nonfinite)
