"""Dynamic loss scaling (Micikevicius et al., 2018, "Mixed Precision Training"), agreed across ranks.

fp16 gradients underflow below 6e-8; multiplying the loss by a scale S shifts them into range, and the
optimizer sees them divided by S again. S is chosen dynamically: after ``growth_interval`` steps without an
inf/NaN it grows by ``growth_factor`` (up to ``max_scale``); an inf/NaN anywhere skips the step and, once
``hysteresis`` overflows have been seen since the last growth, backs S off by ``backoff_factor`` (down to
``min_scale``). ``hysteresis = 1`` is torch's GradScaler; Megatron and DeepSpeed default to 2.

[Note: overflow agreement] The skip decision must be the same on every rank, or ranks holding parameter
shards would diverge (and stage 3 would hang on the next gather). Each rank checks the gradients it holds and
the found-inf flags are combined with one MAX all-reduce over the group that holds gradients, *before*
anything is stepped; the scale is then updated identically everywhere.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from memsave import dist as mdist

__all__ = ["LossScaler"]


class LossScaler:
    """The loss scale, its growth/backoff schedule, and the overflow check (see the module docstring)."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        *,
        dynamic: bool = True,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
    ) -> None:
        checks = [
            ("init_scale", init_scale, init_scale > 0 and math.isfinite(init_scale), "a finite number > 0"),
            ("growth_factor", growth_factor, growth_factor > 1, "a number > 1"),
            ("backoff_factor", backoff_factor, 0 < backoff_factor < 1, "a number in (0, 1)"),
            ("growth_interval", growth_interval, isinstance(growth_interval, int) and growth_interval >= 1,
             "a whole number of steps >= 1"),
            ("hysteresis", hysteresis, isinstance(hysteresis, int) and hysteresis >= 1, "a whole number >= 1"),
            ("min_scale", min_scale, 0 < min_scale <= init_scale, f"a number in (0, init_scale={init_scale}]"),
            ("max_scale", max_scale, max_scale >= init_scale, f"a number >= init_scale={init_scale}"),
        ]
        for name, value, ok, allowed in checks:
            if not ok:
                raise ValueError(f"LossScaler: {name}={value!r} is not allowed; expected {allowed}")
        self.dynamic = dynamic
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.min_scale, self.max_scale = min_scale, max_scale
        self.scale = float(init_scale)
        self.good_steps = 0  # consecutive steps without overflow since the last growth or overflow
        self.hysteresis_left = hysteresis
        self.num_steps = 0  # optimizer steps attempted (taken or skipped)
        self.num_skipped = 0

    def __repr__(self) -> str:
        return (f"LossScaler(scale={self.scale:g}, dynamic={self.dynamic}, skipped={self.num_skipped}/"
                f"{self.num_steps})")

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    @torch.no_grad()
    def unscale_and_check(self, grads: list[torch.Tensor], group: mdist.AgreeOver = None,
                          device: torch.device | None = None) -> bool:
        """Divide ``grads`` by the scale in place and say whether any rank of ``group`` holds an inf/NaN
        (collective over ``group``: see [Note: overflow agreement]). ``group=None``: this process alone."""
        dev = device if device is not None else (grads[0].device if grads else torch.device("cpu"))
        found = torch.zeros(1, device=dev)
        if grads:
            inv = torch.full((), 1.0 / self.scale, device=dev)
            for dtype_grads in _by_device_dtype(grads):
                torch._amp_foreach_non_finite_check_and_unscale_(dtype_grads, found, inv)
        mdist.all_reduce_over(found, group, op=mdist.ReduceOp.MAX)
        return bool(found.item() > 0)

    def update(self, overflow: bool) -> None:
        """After a step was taken (``overflow=False``) or skipped (``True``): count it and move the scale."""
        self.num_steps += 1
        if overflow:
            self.num_skipped += 1
            self.good_steps = 0
            if self.dynamic:
                self.hysteresis_left -= 1
                if self.hysteresis_left <= 0:
                    self.scale = max(self.scale * self.backoff_factor, self.min_scale)
                    self.hysteresis_left = self.hysteresis
            return
        self.good_steps += 1
        if self.dynamic and self.good_steps >= self.growth_interval:
            self.scale = min(self.scale * self.growth_factor, self.max_scale)
            self.good_steps = 0
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "hysteresis_left": self.hysteresis_left,
                "num_steps": self.num_steps, "num_skipped": self.num_skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"scale", "good_steps", "hysteresis_left", "num_steps", "num_skipped"} - set(state)
        if missing:
            raise ValueError(f"LossScaler.load_state_dict: missing keys {sorted(missing)}")
        self.scale = float(state["scale"])
        self.good_steps, self.hysteresis_left = int(state["good_steps"]), int(state["hysteresis_left"])
        self.num_steps, self.num_skipped = int(state["num_steps"]), int(state["num_skipped"])


def _by_device_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())
