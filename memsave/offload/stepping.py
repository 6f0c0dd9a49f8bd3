"""How the chunked optimizer step (memsave/offload/state.py) drives the user's optimizer: the raw ``step`` of its
class, called once per chunk, with the step hooks run once around all of them, and the probe that finds how
many bytes of state the optimizer keeps per element."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["hooked", "post_hooks", "pre_hooks", "raw_step", "shadow", "state_bytes_per_element"]


def state_bytes_per_element(optimizer: torch.optim.Optimizer, group: dict[str, Any], dtype: torch.dtype,
                            device: torch.device | None = None) -> int:
    """Bytes of per-element state the optimizer keeps for a tensor of ``dtype`` under ``group``'s
    hyperparameters, found by stepping a fresh instance on a 2-element probe (e.g. 8 for fp32 AdamW)."""
    probe = nn.Parameter(torch.zeros(2, dtype=dtype, device=device))
    probe.grad = torch.zeros(2, dtype=dtype, device=device)
    make: Any = type(optimizer)
    twin = make([{**{k: v for k, v in group.items() if k != "params"}, "params": [probe]}])
    twin.step()
    return sum(v.element_size() for v in twin.state[probe].values()
               if isinstance(v, torch.Tensor) and v.shape == probe.shape)


def raw_step(optimizer: torch.optim.Optimizer) -> Callable[[torch.optim.Optimizer], Any]:
    """The optimizer class's ``step`` without torch's hook wrapper (hooks run once, see :func:`hooked`)."""
    step = type(optimizer).step
    return step.__wrapped__ if getattr(step, "hooked", False) else step  # type: ignore[attr-defined]


def pre_hooks(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's step pre-hooks (global ones first), as ``optimizer.step()`` runs them."""
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    for pre in itertools.chain(_global_optimizer_pre_hooks.values(), optimizer._optimizer_step_pre_hooks.values()):
        pre(optimizer, (optimizer,), {})


def post_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Tell an LR scheduler built on ``optimizer`` that it stepped; run the step post-hooks."""
    from torch.optim.optimizer import _global_optimizer_post_hooks

    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        optimizer._opt_called = True  # type: ignore[attr-defined]
    for post in itertools.chain(optimizer._optimizer_step_post_hooks.values(), _global_optimizer_post_hooks.values()):
        post(optimizer, (optimizer,), {})


def hooked(optimizer: torch.optim.Optimizer, body: Callable[[], None]) -> None:
    """Run ``body`` (several raw steps) between the optimizer's step pre- and post-hooks, once each, as one
    ``optimizer.step()`` would."""
    pre_hooks(optimizer)
    body()
    post_hooks(optimizer)


def shadow(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A shallow copy of ``optimizer`` that a raw step can be pointed at: its own ``param_groups`` (each group's
    hyperparameters as they are now, an empty ``params``) and its own ``state``, so neither the user's groups nor
    an LR scheduler changing them while a step runs in the background are touched."""
    twin = object.__new__(type(optimizer))  # every attribute kept (copy.copy keeps only __getstate__'s)
    twin.__dict__.update(optimizer.__dict__)
    twin.param_groups = [{**{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items()
                             if k != "params"}, "params": []} for g in optimizer.param_groups]
    twin.state = collections.defaultdict(dict)
    return twin
