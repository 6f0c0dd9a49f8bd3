"""Whether a backward's gradient replaces the one an engine holds or adds to it.

[Note: gradients cleared through the optimizer] torch decides per parameter: ``.grad`` None (cleared) means the
next backward starts a new gradient, anything else is added to. The engines keep gradients where ``.grad`` does
not show them (a ZeRO shard's rows, an fp32 reduce bucket), so each tells freshness from a guard left in
``.grad`` ([Note: gradient freshness] in memsave/zero/unit.py, [Note: reduce dtype] in memsave/engines/dp.py).
That saw a loop clearing the *model's* parameters (``for p in model.parameters(): p.grad = None``: torch's
performance guide) but not one clearing what the *optimizer* holds:

    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None

which is what FSDP2 users write (the optimizer's tensors are the sharded parameters there) and what a custom
``zero_grad`` does. Under memsave the optimizer holds this rank's ZeRO rows (shards) or, under bf16/fp16, their
fp32 masters; clearing those changed nothing, and the next step stepped the sum of two steps' gradients (a
review: losses off from the third step under ZeRO-1/2/3 and every mixed-precision profile).

So the optimizer gives the engine ``cleared(p)``: the tensor it steps for ``p`` has no ``.grad`` (the user cleared
it). It keeps a mark there while the engine holds a gradient: a shard's ``.grad`` is its rows, a master gets a
:class:`~memsave.engines.part_grad.MasterGrad` after each sync and again after each step or read
(``StepGuards.rest``; the masters' real gradients live from unscaling to the step only). The engine asks at the
parameter's first gradient after a sync (a tensor pre-hook, before torch accumulates), as it asks its guard.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["pre_accumulate_hooks"]


def pre_accumulate_hooks(engine: Any, params: list[nn.Parameter]) -> list[Any]:
    """A tensor hook per parameter calling ``engine.before_accumulate(p)`` before torch accumulates its gradient
    (the engine held weakly, as memsave/engines/dp.py holds its hooks)."""
    ref = weakref.ref(engine)

    def make(p: nn.Parameter) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            e = ref()
            if e is not None:
                e.before_accumulate(p)
        return hook
    return [p.register_hook(make(p)) for p in params]

