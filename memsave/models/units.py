"""Which submodules act as units by default: the blocks that ZeRO gathers together and recompute checkpoints
(layer 0, so that both ``zero/`` and ``recompute/`` use one definition without importing each other)."""

from __future__ import annotations

from torch import nn

__all__ = ["default_units"]


def default_units(model: nn.Module) -> list[nn.Module]:
    """The blocks of the model's largest ``nn.ModuleList`` (by parameter count); none if it has no list."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    biggest = max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters()))
    return list(biggest)
