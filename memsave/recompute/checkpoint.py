"""Recompute one unit: replace the *instance's* ``forward`` by one that runs the original under
``torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=True)``.

Unlike torch's ``checkpoint_wrapper`` the module is not put inside a container: the object, its class, its
``state_dict`` keys and the hooks registered on it stay exactly as they were.

[Note: hooks stay outside the recomputed region] ``nn.Module.__call__`` runs the module's forward pre-hooks,
then ``self.forward`` (ours: the checkpoint around the *original* forward), then its forward hooks. The
recomputation in backward replays only the original forward, so hooks on the unit itself (ZeRO-3's gather in
a pre-hook, reshard in a post-hook, the pre-backward hooks it puts on the outputs) run once per forward, never
during recomputation. ZeRO-3 gathers the unit again before its backward (a hook on the unit's outputs, which
fires before any of the unit's backward nodes and so before the recomputation), so the recomputation finds
the parameters gathered and adds no collective; the unit is freed when its gradients are reduced, as without
recomputation. Submodules *inside* a unit are called through ``__call__`` during recomputation, so their
hooks do run again: never make a module with communication hooks part of a recomputed unit.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from memsave.recompute.measure import note_held
from memsave.recompute.policy import SelectivePolicy

__all__ = ["RecomputedForward", "is_recomputed", "recompute_unit", "restore_unit"]


class RecomputedForward:
    """What a recomputed unit's ``forward`` attribute holds; also the handle that restores it.

    ``original`` is the forward the instance had in its own ``__dict__`` before (None: the class's).
    ``selective``: the op-level policy of selective recomputation, or None for full recomputation.
    """

    def __init__(self, module: nn.Module, original: Callable[..., Any] | None,
                 selective: SelectivePolicy | None) -> None:
        self.module, self.original, self.selective = module, original, selective

    def _context_fn(self) -> tuple[Any, Any]:
        if self.selective is None:
            return noop_context_fn()
        return create_selective_checkpoint_contexts(self.selective)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.original if self.original is not None else types.MethodType(type(self.module).forward,
                                                                                   self.module)
        if not torch.is_grad_enabled():  # eval / no_grad: nothing is saved, so nothing to recompute
            return forward(*args, **kwargs)
        if kwargs:
            # Bound in a partial, not passed through checkpoint(**kwargs): a unit's keyword may not collide with
            # checkpoint's own (debug, context_fn, ...). Either way they are held by reference until backward.
            note_held(kwargs)
            forward = functools.partial(forward, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, context_fn=self._context_fn)


def is_recomputed(module: nn.Module) -> bool:
    """Whether ``module``'s forward is recomputed (by :func:`recompute_unit` / ``memsave.recompute.apply``)."""
    return isinstance(module.__dict__.get("forward"), RecomputedForward)


def recompute_unit(module: nn.Module, selective: SelectivePolicy | None = None) -> RecomputedForward:
    """Make ``module``'s activations recomputed in backward (fully, or selectively with ``selective``)."""
    if is_recomputed(module):
        raise ValueError(f"{type(module).__name__} is already recomputed; memsave.recompute.remove it first")
    handle = RecomputedForward(module, module.__dict__.get("forward"), selective)
    module.forward = handle  # type: ignore[method-assign]  # the instance attribute; the class is untouched
    return handle


def restore_unit(module: nn.Module) -> bool:
    """Give ``module`` back the forward it had before :func:`recompute_unit`; False if it was not recomputed."""
    handle = module.__dict__.get("forward")
    if not isinstance(handle, RecomputedForward):
        return False
    if handle.original is None:
        del module.forward
    else:
        module.forward = handle.original  # type: ignore[method-assign]
    return True
