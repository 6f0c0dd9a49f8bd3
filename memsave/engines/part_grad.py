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

[Note: guarded param_groups] The optimizer's ``param_groups`` hold what it steps, which is not always the
model's parameters: under ZeRO this rank's rows of each (shards), under bf16/fp16 their fp32 masters. A loop
that clips over them (``clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], c)``: PyTorch
Lightning's ``gradient_clip_val``, fairseq, Megatron clip what the optimizer holds) read plain tensors: under
ZeRO each rank clipped its rows by the norm of its rows (a different factor per rank, parameters 21% off after
three steps), under mixed precision it found no gradients at all (the masters get theirs in the step: a norm of
0, nothing clipped), with no error (a review). So after each sync :class:`StepGuards` marks the shards'
gradients :class:`ShardGrad` (torch's total norm refused, everything else plain) and gives each master a
:class:`MasterGrad` (metadata only: any value read refused); the optimizer's first read (its clip, its step,
``full_grads``) takes the marks off before it makes the masters' real gradients.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

from memsave.engines.grad_scaler import GRAD_SCALER_REFUSED
from memsave.zero.guards import ReducedGrad, _describe, make_reduced_grad

__all__ = ["MasterGrad", "PartGrad", "ScaledGrad", "ShardGrad", "StepGuards", "mark", "unmark"]

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


SHARDS = ("the optimizer's param_groups hold what this rank steps, under ZeRO its rows of each parameter, so a "
          "total norm over their gradients, as torch.nn.utils.clip_grad_norm_ over the param_groups takes (PyTorch "
          "Lightning's gradient clipping), is the norm of this rank's rows only")
MASTERS = ("under bf16/fp16 the optimizer's param_groups hold the fp32 master weights, whose gradients are made "
           "(cast and unscaled) only when the optimizer clips or steps: a read before that, as "
           "torch.nn.utils.clip_grad_norm_ over the param_groups (PyTorch Lightning's gradient clipping), found none")
_MASTER_READ = f"an fp32 master's gradient was read: {MASTERS}{ADVICE}"


class ShardGrad(PartGrad):
    """The gradient of a ZeRO shard in the optimizer's ``param_groups`` ([Note: guarded param_groups])."""

    why = SHARDS


class MasterGrad(ReducedGrad):
    """An fp32 master's ``.grad`` before the optimizer makes it: metadata only, as a ZeRO parameter's reduced
    gradient ([Note: guarded param_groups]); ``GradScaler.unscale_`` on it is refused as its step is."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if _describe(func)[1].startswith("_amp_"):
            raise NotImplementedError(GRAD_SCALER_REFUSED)
        return super().__torch_function__(func, types, args, kwargs)


class StepGuards:
    """[Note: guarded param_groups] ``shards``: stepped tensors that are this rank's rows of a parameter (their
    gradients are marked); ``masters``: fp32 masters that are copies (given a :class:`MasterGrad`)."""

    def __init__(self, shards: list[torch.Tensor], masters: list[torch.Tensor]) -> None:
        self.shards, self.masters = shards, masters
        self._guards: list[torch.Tensor | None] = [None] * len(masters)  # each master's (an expanded zero)
        # masters whose mark the user cleared before the step reads them ([Note: a gradient cleared before the
        # step] in memsave/zero/guards.py): not stepped, not marked again, until the next sync marks them
        self.dropped: set[torch.Tensor] = set()
        self._marked: set[torch.Tensor] = set()  # masters whose .grad memsave set to a mark, not taken off since

    def mark(self) -> None:
        self.dropped.clear()
        for s in self.shards:
            if type(s.grad) is torch.Tensor:
                s.grad.__class__ = ShardGrad
        for k, m in enumerate(self.masters):
            self._mark(k, m)

    def rest(self, held: dict[torch.Tensor, torch.Tensor], grad_of: Any) -> None:
        """After a step or a read: a master whose gradient the engine still holds (``held``: master -> what the
        engine steps for it) is marked again ([Note: gradients cleared through the optimizer] in freshness.py)."""
        for k, m in enumerate(self.masters):
            if m.grad is None and m not in self.dropped and grad_of(held[m]) is not None:
                self._mark(k, m)

    def _mark(self, k: int, m: torch.Tensor) -> None:
        guard = self._guards[k]
        if guard is None or guard.shape != m.shape:  # (an offloaded master's storage is emptied)
            guard = self._guards[k] = make_reduced_grad(m, _MASTER_READ, cls=MasterGrad)
        m.grad = guard
        self._marked.add(m)

    def unmark(self, made: Any = None) -> list[torch.Tensor]:
        """Take the marks off; returns the masters the user cleared since (not stepped: the engine drops theirs):
        marked by memsave, or ``made(m)``: given its real gradient by the clip's unscaling, and None now."""
        cleared = []
        for s in self.shards:
            if isinstance(s.grad, ShardGrad):
                s.grad.__class__ = torch.Tensor  # type: ignore[assignment]
        for m in self.masters:
            if isinstance(m.grad, MasterGrad):
                m.grad = None
            elif m.grad is None and m not in self.dropped and (m in self._marked or (made and made(m))):
                self.dropped.add(m)  # cleared by the user (or by a zero_grad, which cleared the engine's too)
                cleared.append(m)
        self._marked.clear()
        return cleared
