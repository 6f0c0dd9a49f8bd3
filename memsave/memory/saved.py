"""Activations held for backward, counted live: what autograd keeps from forward until the backward that uses it.

A :class:`SavedTensorCounter` installs ``torch.autograd.graph.saved_tensors_hooks`` around a forward. Its pack
hook hands the graph a small holder of what is actually kept (the tensor itself, or what the hooks it sits on
return: a bf16 copy under compression, a host copy under activation offload) and records a weak reference to
the holder with the storages inside; the bytes kept for backward at any moment are the storages of the holders
still alive, each storage once. Backward drops a node's holders once it has run, so the count falls through
backward without any hook there, even for tensors the user still holds (the batch, the logits).

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
import weakref
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


class _Saved:
    """What the graph holds for one saved tensor: it lives exactly as long as autograd keeps the tensor for
    backward (a node drops it once its backward ran), whoever else holds the tensor itself."""

    __slots__ = ("__weakref__", "outer", "packed")

    def __init__(self, outer: tuple[Any, Any] | None, packed: Any) -> None:
        self.outer, self.packed = outer, packed


class SavedTensorCounter:
    """Live bytes of the storages kept for backward by the forwards run inside :meth:`__call__`."""

    def __init__(self) -> None:
        # saved through the hooks: (weak reference to the graph's holder, StorageImpl address, bytes);
        # the address of the StorageImpl, not of its data: a ZeRO-3 buffer freed and re-grown keeps its StorageImpl
        # (and the views saved on it) but not its data
        self._saved: list[tuple[weakref.ref[_Saved], int, int]] = []
        # kept by reference (note_kept): the storage itself decides
        self._kept: dict[int, tuple[StorageWeakRef, int]] = {}
        self._outer: list[tuple[Any, Any] | None] = []  # the hooks below ours, per nested entry

    @staticmethod
    def _storages(obj: Any) -> list[torch.UntypedStorage]:
        out = []
        for t in tree_leaves(obj):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                if storage.nbytes():
                    out.append(storage)
        return out

    def add(self, obj: Any) -> None:
        """Tensors in ``obj`` are kept for backward by reference: count them while their storage lives."""
        for storage in self._storages(obj):
            self._kept[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())

    def pack(self, t: torch.Tensor) -> Any:
        outer = self._outer[-1] if self._outer else None
        # Not ``t`` itself: a saved op *output* returned as is makes a reference cycle through autograd's C++
        # graph that Python's collector cannot see (see memsave/recompute/measure.py); an alias costs nothing.
        packed = outer[0](t) if outer is not None else t.detach()
        holder = _Saved(outer, packed)
        ref = weakref.ref(holder)
        for storage in self._storages(packed):  # what is actually kept (a compressed copy, ...)
            self._saved.append((ref, storage._cdata, storage.nbytes()))
        return holder

    @staticmethod
    def unpack(holder: _Saved) -> torch.Tensor:
        return holder.outer[1](holder.packed) if holder.outer is not None else holder.packed

    def live(self, skip: set[int] | None = None) -> int:
        """Bytes of the storages still kept for backward, each once, minus ``skip`` (StorageImpl addresses
        attributed to another category)."""
        self._saved = [e for e in self._saved if e[0]() is not None]
        self._kept = {k: e for k, e in self._kept.items() if not e[0].expired()}
        sizes = {key: nbytes for _, key, nbytes in self._saved}
        sizes.update((key, nbytes) for key, (_, nbytes) in self._kept.items())
        return sum(n for key, n in sizes.items() if skip is None or key not in skip)

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
