"""The loss-scaled optimizer on its own: fp16/bf16 training of any model with fp32 master weights.

For a user who keeps their own model (plain, or under torch DDP) and wants mixed precision without the rest
of memsave::

    model = MyModel().half()                                   # or .to(torch.bfloat16)
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), scaler=LossScaler())
    opt.backward(model(x).loss)      # (loss * scale).backward()
    opt.clip_grad_norm(1.0)          # unscaled fp32 gradients, then clipped
    opt.step()                       # skipped (and the scale lowered) if any gradient overflowed
    opt.zero_grad()

The wrapped optimizer steps fp32 master copies of the low-precision parameters (its ``param_groups`` hold the
masters, so LR schedulers work on either object); after each step the masters are cast back into the model's
parameters. Parameters that are already fp32 are their own master. The state dict carries the wrapped
optimizer's state, the masters and the scaler's state, so a resumed run continues bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from memsave import dist as mdist
from memsave.phases import MemoryCategory
from memsave.precision.edits import EditWatch, follow
from memsave.precision.nonfinite import NonfiniteGuard
from memsave.precision.scaler import LossScaler
from memsave.wrapped import WrappedOptimizer, inner_step

__all__ = ["MixedPrecisionOptimizer", "follow"]


def _own_grad(p: torch.Tensor) -> torch.Tensor | None:
    return p.grad

_EXTRA_KEYS = ("master_params", "loss_scaler")  # what the state dict adds to the wrapped optimizer's


def _is_mark(grad: torch.Tensor) -> bool:
    """A ``.grad`` that holds no gradient: a guard of memsave/zero/guards.py (a master's mark, a reduced gradient),
    told by the attribute it carries (this layer does not import ZeRO's)."""
    return hasattr(grad, "_memsave_message")


class MixedPrecisionOptimizer(WrappedOptimizer):
    """fp32 master weights and optional dynamic loss scaling around any ``torch.optim.Optimizer``.

    scaler: a :class:`LossScaler` (fp16 needs one), or None (bf16: its range needs no scaling).
    master_device: where the fp32 masters are made (default: beside each parameter); offload makes them on the
        host and moves them to its tier, so the device never holds them all ([Note: offloaded masters]).
    group: the process group (or groups, one per mesh axis) whose ranks must agree on skipping a step, when
        their gradients differ (each rank checks its own; one MAX all-reduce per group). None: decide locally, right when gradients are identical on
        every rank (a single process, or after torch DDP's all-reduce).
    nonfinite: what a step with an inf/NaN gradient does (memsave/precision/nonfinite.py; default: skipped, and
        an error after 10 in a row).
    grad_of: where a model parameter's gradient is read (default ``p.grad``); engines that keep gradients
        in another dtype than the parameter (fp32 reduction of bf16 gradients) hand them over here. An fp32
        gradient becomes the master's ``.grad`` without a copy (and is unscaled in place).
    param_of: the model parameter whose storage holds a stepped tensor's values (default: the tensor itself), or
        None where none does (ZeRO-3's shard): in-place edits of that parameter between steps reach the master
        ([Note: edits between steps] in memsave/precision/edits.py).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, scaler: LossScaler | None = None,
                 group: mdist.AgreeOver = None,
                 grad_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
                 master_device: torch.device | None = None, nonfinite: NonfiniteGuard | None = None,
                 param_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None) -> None:
        super().__init__(optimizer)
        self.nonfinite = nonfinite if nonfinite is not None else NonfiniteGuard()
        if optimizer.state:
            raise ValueError(f"optimizer already has state for {len(optimizer.state)} parameters; wrap it before "
                             "its first step (then load a checkpoint with load_state_dict)")
        if scaler is not None and not isinstance(scaler, LossScaler):
            raise ValueError(f"scaler must be a memsave.precision.LossScaler or None, got {type(scaler).__name__}")
        self.scaler, self.group = scaler, group
        self._grad_of = grad_of if grad_of is not None else _own_grad
        self._pairs: list[tuple[nn.Parameter, torch.Tensor]] = []  # (master, model parameter)
        for g in optimizer.param_groups:
            masters = []
            for p in g["params"]:
                if not p.is_floating_point():
                    raise ValueError(f"parameter of dtype {p.dtype} cannot have an fp32 master weight")
                master = p if p.dtype == torch.float32 else nn.Parameter(
                    p.detach().to(master_device or p.device, torch.float32), requires_grad=p.requires_grad)
                self._pairs.append((master, p))
                masters.append(master)
            g["params"] = masters
        # [Note: edits between steps] (the stepped tensor's values are the model parameter's, or its rows)
        watched = [(m, p, param_of(p) if param_of is not None else p) for m, p in self._pairs if m is not p]
        self.edits = EditWatch([(m, p, full) for m, p, full in watched if full is not None])
        self._checked: bool | None = None  # overflow found in this step's gradients (None: not checked yet)

    @property
    def last_step_skipped(self) -> bool:
        """The last step skipped its update: :attr:`step_was_skipped`, by its earlier name."""
        return self.step_was_skipped

    @property
    def pairs(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """``(fp32 master, model parameter)`` in param-group order; a parameter that is fp32 is its own master."""
        return self._pairs

    @property
    def unscaled(self) -> bool:
        """Whether this step's gradients were already divided by the scale (by clip_grad_norm)."""
        return self._checked is not None

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward`` on (multiplied by the scale); starts a new step's gradients."""
        self._checked = None
        return self.scaler.scale_loss(loss) if self.scaler is not None else loss

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.scale(loss).backward(**kwargs)

    @torch.no_grad()
    def unscale(self) -> bool:
        """Once per step: fp32, unscaled gradients on the masters; whether any overflowed (agreed over group)."""
        if self._checked is None:
            grads = []
            for master, p in self._pairs:
                g = self._grad_of(p)
                if g is None:
                    if master is not p:
                        master.grad = None
                    continue
                if master is not p:
                    g = master.grad = g if g.dtype == torch.float32 else g.float()
                grads.append(g)
            if self.scaler is not None:
                self._checked = self.scaler.unscale_and_check(grads, self.group)
            else:  # bf16: no overflow to expect, but a NaN loss must not reach the masters
                self._checked = self.nonfinite.found(grads, self.group)
        return self._checked

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Unscale, then clip the fp32 gradients by their norm (of this process's gradients, as
        ``torch.nn.utils.clip_grad_norm_``); inf when they overflowed (the step will be skipped)."""
        if self.unscale():
            return torch.tensor(math.inf)
        grads = [m for m, _ in self._pairs if m.grad is not None]
        return torch.nn.utils.clip_grad_norm_(grads, max_norm, norm_type)

    def _step(self) -> None:
        self.step_masters()

    def step_masters(self, step: Callable[[], None] | None = None) -> None:
        """Unscale, check, step the masters and cast them into the parameters; ``step`` (offload: it streams the
        masters with the optimizer state) does both of the latter itself. First the masters of parameters edited
        in place since the last step follow the edits ([Note: edits between steps]). With no loss scale there is nothing to
        unscale or check, so ``step`` gets no fp32 gradient copies: it casts the model's gradients chunk by chunk
        ([Note: offloaded masters] in memsave/offload/state.py); ``clip_grad_norm`` still makes them (it needs
        every gradient at once)."""
        self.edits.sync()
        if step is not None and self.scaler is None and self._checked is None:  # check the model's gradients
            self._checked = self.nonfinite.found([self._grad_of(p) for _, p in self._pairs], self.group)
        overflow = self.unscale()
        self.step_was_skipped = overflow
        stuck = self.scaler is None or self.scaler.scale <= self.scaler.min_scale  # nothing left to adjust
        self.nonfinite.after_step(overflow, counts=stuck)  # (raises per [precision] nonfinite / max_skipped)
        if not overflow and step is not None:
            step()
        elif not overflow:
            inner_step(self.optimizer)
            with torch.no_grad():
                for master, p in self._pairs:
                    if master is not p:
                        p.copy_(master)
        self.edits.mark()
        for master, p in self._pairs:
            if master is not p:
                master.grad = None  # the fp32 gradients live from unscaling to the step only
        if self.scaler is not None:
            self.scaler.update(overflow)
        self._checked = None

    def forget(self) -> None:
        """Drop what :meth:`unscale` derived from the gradients (their fp32 copies and the overflow check): the
        next read derives it again from the model's gradients ([Note: what a step derives from its gradients] in
        memsave/engines/optimizer.py)."""
        for master, p in self._pairs:
            if master is not p:
                master.grad = None
        self._checked = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for master, p in self._pairs:
            for t in (p, master) if master is not p else (p,):
                if t.grad is None:
                    continue
                if set_to_none:
                    t.grad = None
                else:
                    t.grad.zero_()
        self._checked = None

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict (so a plain optimizer loads it), plus ``master_params`` (fp32, in
        param-group order) and ``loss_scaler``."""
        self.edits.sync()  # the masters saved hold the model's edits since the last step
        return {**self.optimizer.state_dict(),
                        "master_params": [m.detach().clone() for m, _ in self._pairs],
                "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        masters = state_dict.get("master_params")
        if masters is not None and len(masters) != len(self._pairs):
            raise ValueError(f"state dict holds {len(masters)} master weights, this optimizer has {len(self._pairs)}")
        self.optimizer.load_state_dict({k: v for k, v in state_dict.items() if k not in _EXTRA_KEYS})
        if masters is not None:
            self.load_masters(masters)
        else:  # a plain optimizer's state dict: the masters follow the parameters (loaded by hand, perhaps)
            self.refresh_masters()
        if self.scaler is not None and state_dict.get("loss_scaler") is not None:
            self.scaler.load_state_dict(state_dict["loss_scaler"])

    @torch.no_grad()
    def refresh_masters(self, rows: dict[torch.Tensor, torch.Tensor] | None = None) -> None:
        """After the model's weights were loaded: every fp32 master element that no longer rounds to its
        parameter becomes the parameter (as ``__init__`` made it), so the next step does not copy the old weights
        back. Elements that still round to it keep their extra precision: a resume that loads the optimizer (with
        its masters) before or after the model stays bit for bit. ``rows``: only these parameters, with these
        values (ZeRO-3 shards the user edited)."""
        for master, p in self._pairs:
            if master is not p and (rows is None or p in rows):
                master.copy_(follow(master, p if rows is None else rows[p]))
        self.edits.mark()

    @torch.no_grad()
    def load_masters(self, masters: list[torch.Tensor]) -> None:
        """Set the fp32 masters (param-group order) and cast them into the low-precision parameters."""
        for (master, p), saved in zip(self._pairs, masters):
            master.copy_(saved)
            if master is not p:
                p.copy_(master)
        self.edits.mark()

    def master_tensors(self) -> Iterator[tuple[MemoryCategory, torch.Tensor]]:
        """The fp32 masters that are copies (and their gradients while they exist)."""
        for master, p in self._pairs:
            if master is not p:
                yield MemoryCategory.MASTER, master
                if master.grad is not None and not _is_mark(master.grad):
                    yield MemoryCategory.GRADS, master.grad

    def memory_tensors(self) -> Iterator[tuple[MemoryCategory, torch.Tensor]]:
        for master, p in self._pairs:
            yield MemoryCategory.PARAMS, p
            if master is not p:
                yield MemoryCategory.MASTER, master
            for t in {id(x): x for x in (p.grad, master.grad) if x is not None and not _is_mark(x)}.values():
                yield MemoryCategory.GRADS, t
        yield from self._optimizer_state_tensors()
