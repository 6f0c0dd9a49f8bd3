"""Activations held for backward, counted live: what autograd keeps from forward until the backward that uses it.

A :class:`SavedTensorCounter` installs ``torch.autograd.graph.saved_tensors_hooks`` around a forward. Its pack
hook records a weak reference to the storage of what is actually kept (the tensor itself, or what the hooks
it sits on return: a bf16 copy under compression, a host copy under activation offload) and its size; the
bytes still held at any moment are the recorded storages that are alive. Backward frees a node's saved
tensors once it has run, so the count falls through backward without any hook there.

[Note: composing saved-tensor hooks] Only the innermost ``saved_tensors_hooks`` apply, so a counter that simply
pushed its own would switch off the hooks of memsave's compression or activation offload (or a user's). The
counter therefore reads the hooks on top when it is entered and *chains* to them: its pack calls theirs and
counts what they return; its unpack calls theirs. Inside a recomputed unit the checkpoint pushes hooks of its
own on top of the counter's, so the counter sees what the checkpoint keeps (its inputs, saved through the
hooks below it); what a checkpoint keeps by reference instead (keyword inputs, the outputs selective
recomputation caches) is reported through :func:`note_kept` by ``memsave.recompute``.

Storages of parameters and buffers (a view of a weight saved by a matmul) are never activations; the tracker
skips every storage it has already attributed to another category.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

__all__ = ["SavedTensorCounter", "note_kept"]

_ACTIVE: list[SavedTensorCounter] = []  # counters inside a forward right now


def note_kept(obj: Any) -> None:
    """Tensors in ``obj`` are kept for backward by reference, not through saved-tensor hooks: count them in every
    active counter (see [Note: composing saved-tensor hooks])."""
    for counter in _ACTIVE:
        counter.add(obj)


class SavedTensorCounter:
    """Live bytes of the storages kept for backward by the forwards run inside :meth:`__call__`."""

    def __init__(self) -> None:
        # StorageImpl address -> (weak reference, bytes, device type); the address of the StorageImpl, not of its
        # data: a ZeRO-3 buffer freed and re-grown keeps its StorageImpl (and the views saved on it) but not its data
        self._live: dict[int, tuple[StorageWeakRef, int, str]] = {}
        self._outer: list[tuple[Any, Any] | None] = []  # the hooks below ours, per nested entry

    def add(self, obj: Any) -> None:
        for t in tree_leaves(obj):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes:
                self._live[storage._cdata] = (StorageWeakRef(storage), nbytes, t.device.type)

    def pack(self, t: torch.Tensor) -> Any:
        outer = self._outer[-1] if self._outer else None
        # Not ``t`` itself: a saved op *output* returned as is makes a reference cycle through autograd's C++
        # graph that Python's collector cannot see (see memsave/recompute/measure.py); an alias costs nothing.
        packed = outer[0](t) if outer is not None else t.detach()
        self.add(packed)
        return (outer, packed)

    @staticmethod
    def unpack(item: Any) -> torch.Tensor:
        outer, packed = item
        return outer[1](packed) if outer is not None else packed

    def live(self, skip: set[int] | None = None) -> tuple[int, dict[str, int]]:
        """``(bytes, bytes per device type)`` of the storages still alive, minus ``skip`` (StorageImpl addresses
        attributed to another category)."""
        total, by_device = 0, {}  # type: tuple[int, dict[str, int]]
        dead = []
        for key, (ref, nbytes, device) in self._live.items():
            if ref.expired():
                dead.append(key)
            elif skip is None or key not in skip:
                total += nbytes
                by_device[device] = by_device.get(device, 0) + nbytes
        for key in dead:
            del self._live[key]
        return total, by_device

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._outer.append(outer)
        _ACTIVE.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            _ACTIVE.remove(self)
            self._outer.pop()

    def enter(self) -> contextlib.ExitStack:
        """Enter :meth:`__call__` and return the stack that leaves it (for hook pairs that cannot use ``with``)."""
        stack = contextlib.ExitStack()
        stack.enter_context(self())
        return stack
