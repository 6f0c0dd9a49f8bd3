"""Which submodules act as units by default: the blocks that ZeRO gathers together and recompute checkpoints
(layer 0, so that both ``zero/`` and ``recompute/`` use one definition without importing each other)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["default_units", "output_tensors"]


def default_units(model: nn.Module) -> list[nn.Module]:
    """The blocks of the model's largest ``nn.ModuleList`` (by parameter count); none if it has no list."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    biggest = max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters()))
    return list(biggest)


def output_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors inside a forward output: tensors, tuples/lists/dicts, dataclasses and ModelOutput-like objects
    (what the engines hook for backward, and what the memory tracker watches)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list | tuple):
        for x in obj:
            yield from output_tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from output_tensors(x)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from output_tensors(getattr(obj, name, None))
