"""A meta-device copy of a module, for what runs a model to learn shapes and call order without its data (the
estimate, the pipeline split)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["meta_copy"]


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers live on the meta device (no data is copied); a model
    already on the meta device is copied the same way, so the caller's model is never changed."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)
