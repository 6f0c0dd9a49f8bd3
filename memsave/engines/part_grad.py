"""Gradients that refuse torch's total norm where they are one rank's part of the model's gradient.

[Note: a rank's part of the gradient] Under tensor or pipeline parallelism with plain data parallelism (``ddp``),
a parameter's ``.grad`` after backward holds real values, but only this rank's part of the model's gradient: its
slice of each tensor that tp cuts, the parameters of its own pipeline stages. ``torch.nn.utils.clip_grad_norm_(
model.parameters(), c)`` would then clip by the norm of that part, a wrong number with no error; under tp the
ranks would also scale the tensors they share by different factors, which then drift apart. (ZeRO's gradients
are guards that refuse any read: memsave/zero/guards.py.)

So once the engine has synchronized the gradients, each is marked :class:`PartGrad`, which refuses the norms
torch's total norm takes of a list of tensors (``torch.linalg.vector_norm`` of each, or ``torch._foreach_norm``
with ``foreach=True``: ``clip_grad_norm_`` and ``get_total_norm``) and hands everything else through as a plain
tensor, so a parameter's own values (and ``p.grad.norm()``) stay readable. The optimizer unmarks them the first
time it reads the gradients (its ``clip_grad_norm``, its step, ``full_grads``): the user's optimizer steps plain
tensors, at no cost.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

__all__ = ["PartGrad", "mark", "unmark"]

_REFUSED = (torch.linalg.vector_norm, torch._foreach_norm)
MESSAGE = ("this rank holds part of the model's gradient (tensor or pipeline parallelism: its slices, its stages), "
           "so a total norm over its gradients, as torch.nn.utils.clip_grad_norm_(model.parameters(), ...) takes, "
           "is the norm of that part only; clip with optimizer.clip_grad_norm(max_norm), the norm over every rank "
           "(or read the whole gradients with optimizer.full_grads(), a collective)")


def _holds_part(args: tuple[Any, ...]) -> bool:
    first = args[0] if args else None
    if isinstance(first, list | tuple):
        return any(isinstance(t, PartGrad) for t in first)
    return isinstance(first, PartGrad)


class PartGrad(torch.Tensor):
    """A ``.grad`` that is one rank's part of the model's gradient (module docstring)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _REFUSED and _holds_part(args):
            raise RuntimeError(f"{getattr(func, '__name__', func)} of parameter gradients: {MESSAGE}")
        with DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def mark(params: Iterable[torch.nn.Parameter]) -> None:
    for p in params:
        if type(p.grad) is torch.Tensor:
            p.grad.__class__ = PartGrad


def unmark(params: Iterable[torch.nn.Parameter]) -> None:
    for p in params:
        if type(p.grad) is PartGrad:
            p.grad.__class__ = torch.Tensor  # type: ignore[assignment]
