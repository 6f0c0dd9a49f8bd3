"""Layer 3: ZeRO stages 1-3 (Rajbhandari et al., 2020). ``memsave.zero.shard`` is the hand-composed entry."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from memsave.config import ZeroConfig
from memsave.dist import Mesh
from memsave.wrapped import swap_class
from memsave.zero.engine import ZeroEngine, default_units
from memsave.zero.layout import ShardLayout
from memsave.zero.rows import RowSharding, check_shardable

__all__ = ["RowSharding", "ShardLayout", "ZeroEngine", "check_shardable", "default_units", "shard"]


def shard(
    model: nn.Module,
    *,
    stage: int,
    mesh: Mesh,
    units: Sequence[nn.Module] | None = None,
    config: ZeroConfig | None = None,
    reduce_dtype: torch.dtype | None = None,
    before_unit: Callable[[list[nn.Parameter]], None] | None = None,
) -> ZeroEngine:
    """Shard ``model``'s parameters and gradients with ZeRO ``stage`` over ``mesh``'s dp axis, in place; returns
    the engine. Compose the optimizer over it with :class:`memsave.engines.MemsaveOptimizer`::

        engine = memsave.zero.shard(model, stage=2, mesh=mesh)
        optimizer = memsave.engines.MemsaveOptimizer(torch.optim.AdamW(model.parameters()), engine)

    The model must already be on ``mesh.device`` with identical values on every dp rank (``memsave.wrap``
    sees to both). ``units`` default to :func:`default_units`; the root unit holds the rest. ``reduce_dtype``:
    the dtype gradients are reduce-scattered and kept in (default: the parameters'). The model's class is
    swapped (see :func:`memsave.wrapped.swap_class`). ``before_unit(params)`` is called with each unit's parameters
    just before the unit takes them (``wrap`` materializes a deferred model's units there).
    """
    cfg = config if config is not None else ZeroConfig(stage=stage)
    if cfg.stage != stage:
        raise ValueError(f"shard(stage={stage}) contradicts config.stage={cfg.stage}; pass one of them")
    engine = ZeroEngine(model, mesh, cfg, units, reduce_dtype=reduce_dtype, before_unit=before_unit)
    swap_class(model, engine)
    return engine
