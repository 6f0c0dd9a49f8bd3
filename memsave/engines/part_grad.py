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

The same holds under fp16 with ``ddp`` at any layout, for another reason: ``.grad`` holds the gradient times the
loss scale (:class:`ScaledGrad`). A total norm over it is that many times too large (or inf), and torch's clip
would scale the scaled values, which the optimizer then unscales: the step's gradient norm came out 0.00085 where
``clip_grad_norm(1.0)`` gives 1.0, with no error.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

__all__ = ["PartGrad", "ScaledGrad", "mark", "unmark"]

_REFUSED = (torch.linalg.vector_norm, torch._foreach_norm)
PART = ("this rank holds part of the model's gradient (tensor or pipeline parallelism: its slices, its stages), "
        "so a total norm over its gradients, as torch.nn.utils.clip_grad_norm_(model.parameters(), ...) takes, "
        "is the norm of that part only")
SCALED = ("they hold the gradient times the fp16 loss scale (optimizer.mp.loss_scale), so a total norm over them, as "
          "torch.nn.utils.clip_grad_norm_(model.parameters(), ...) takes, is that many times too large and the clip "
          "would scale the scaled values")
ADVICE = ("; clip with optimizer.clip_grad_norm(max_norm), the norm of the unscaled gradient over every rank (or "
          "read the whole gradients with optimizer.full_grads(), a collective; transformers' Trainer and "
          "accelerator.clip_grad_norm_ call torch's clip: README, 'Hugging Face accelerate and Trainer')")


def _marked(args: tuple[Any, ...]) -> type[PartGrad] | None:
    first = args[0] if args else None
    for t in first if isinstance(first, list | tuple) else (first,):
        if isinstance(t, PartGrad):
            return type(t)
    return None


class PartGrad(torch.Tensor):
    """A ``.grad`` that is one rank's part of the model's gradient (module docstring)."""

    why = PART

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _REFUSED:
            marked = _marked(args)
            if marked is not None:
                raise RuntimeError(f"{getattr(func, '__name__', func)} of parameter gradients: {marked.why}{ADVICE}")
        with DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class ScaledGrad(PartGrad):
    """A ``.grad`` multiplied by the fp16 loss scale (module docstring)."""

    why = SCALED


class ScaledPartGrad(PartGrad):
    """Both: one rank's part, times the loss scale."""

    why = f"{PART}, and {SCALED}"


def mark(params: Iterable[torch.nn.Parameter], *, part: bool = True, scaled: bool = False) -> None:
    cls = ScaledPartGrad if part and scaled else ScaledGrad if scaled else PartGrad
    for p in params:
        if type(p.grad) is torch.Tensor:
            p.grad.__class__ = cls


def unmark(params: Iterable[torch.nn.Parameter]) -> None:
    for p in params:
        if isinstance(p.grad, PartGrad):
            p.grad.__class__ = torch.Tensor  # type: ignore[assignment]
