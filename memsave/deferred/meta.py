"""A meta-device copy of a module, for what runs a model to learn shapes and call order without its data (the
estimate, the pipeline split)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["meta_call_order", "meta_copy"]


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers live on the meta device (no data is copied); a model
    already on the meta device is copied the same way, so the caller's model is never changed."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def meta_call_order(model: nn.Module, names: list[str], *, partial: bool = False) -> list[str] | None:
    """The modules ``names`` in the order a forward first calls them, from one run of a meta copy of a Hugging Face
    model on its own ``dummy_inputs`` (no data; nothing of the model changes); None for any other model, or where
    that run fails (a forward that reads values, inputs this model does not take), unless ``partial``: then the
    calls before the failure. A run that fails in the model's dtype is tried once more in bf16 (the meta device
    runs a mixture of experts' grouped matmul in bf16 only). A name the run did not call is left out."""
    try:
        dummy = model.dummy_inputs if callable(getattr(model, "get_input_embeddings", None)) else None
    except Exception:  # (a model class whose dummy inputs do not apply to it)
        return None
    if not isinstance(dummy, dict) or not all(isinstance(v, torch.Tensor) for v in dummy.values()):
        return None
    copied = meta_copy(model)
    order: list[str] = []
    for name in names:
        copied.get_submodule(name).register_forward_pre_hook(
            lambda *_, name=name: None if name in order else order.append(name))
    inputs = {k: v.to("meta") for k, v in dummy.items()}
    for attempt in range(2):
        try:
            with torch.no_grad():
                copied(**inputs)
            return order
        except Exception:
            floating = {p.dtype for p in copied.parameters() if p.is_floating_point()}
            if attempt or floating <= {torch.bfloat16}:
                break
            order.clear()  # once more in bf16: the meta device runs a grouped matmul (experts) in bf16 only
            copied.to(torch.bfloat16)
    return order if partial else None
