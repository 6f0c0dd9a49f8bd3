"""The tensors inside a forward's inputs, wherever the user's loader put them.

torch's pytree sees through tuples, lists, dicts and named tuples, but takes a dataclass batch or a Hugging Face
``BatchEncoding`` (what tokenizers and ``DataCollatorWithPadding`` return: a ``UserDict``) for one opaque leaf.
Where memsave reads or changes a forward's tensors (the bf16 cast of float inputs, a pipeline's probe key, the tp
ranks' input check), it walks those too, as FSDP2's ``cast_forward_inputs`` walks dataclasses.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["leaves", "map_tensors", "tensors_in"]


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any, other: Callable[[Any], Any] | None = None) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it (a new container of the same type; ``obj`` is untouched),
    and ``other`` to every other leaf."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: map_tensors(fn, getattr(obj, f.name), other) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **fields)
    if isinstance(obj, dict | collections.UserDict):  # a copy keeps the type and its extras (a default factory)
        out = copy.copy(obj)
        for key, value in obj.items():
            out[key] = map_tensors(fn, value, other)
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(map_tensors(fn, v, other) for v in obj))
    if isinstance(obj, tuple | list):
        return type(obj)(map_tensors(fn, v, other) for v in obj)
    if other is not None:
        other(obj)
    return obj


def leaves(obj: Any) -> list[Any]:
    """Every leaf of ``obj`` (tensors and other values), in order."""
    found: list[Any] = []
    map_tensors(found.append, obj, found.append)
    return found


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj``, in order."""
    found: list[torch.Tensor] = []
    map_tensors(found.append, obj)
    return found
