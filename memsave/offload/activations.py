"""Activation offload: tensors autograd saves in forward are copied to pinned host memory and brought back for
backward (the host tier of ZeRO-Offload / ZeRO-Infinity's activation offload, Ren et al., 2021; Rajbhandari
et al., 2021), with ``torch.autograd.graph.saved_tensors_hooks``.

Which saved tensors are *activations* (:func:`is_activation`, shared with the compression of
``memsave.recompute.compress``): floating-point tensors of at least ``min_numel`` elements that are not a
parameter, not a view of one, not a leaf that requires grad and not one of the storages passed as ``exclude``
(the model's buffers). Those are held anyway; a copy of them would add memory, not save it.

[Note: activation offload ordering] On pack, in forward, the compute (current) stream records an event after
the op that produced the tensor; the side stream waits on that event, copies the tensor into a pinned host
buffer (``non_blocking``) and records a *copy event*. The compute stream waits on nothing and runs ahead.
The device tensor must not be freed or its memory reused before its copy event completes: the caching
allocator hands freed memory to the next allocation on the compute stream, which would overwrite the bytes
the side stream is still reading. So the hooks keep a reference to each device tensor, in order, next to its
copy event, and drop it only once the event has completed (checked at every pack, without waiting). When the
forward ends, tensors whose copy is still in flight are handed to the allocator with ``record_stream(side)``,
which defers reuse of their memory until the side stream's work queued so far is done. On unpack, in
backward, the compute stream waits on the copy event (the host buffer is complete) and copies the buffer back
with ``non_blocking``; the pinned allocator keeps the host buffer until that copy is done. A saved tensor must
not be modified in place after it is saved (autograd refuses that anyway), or the copy could read the new
values.

On CPU there is nothing to move: the tensors already live in host memory. :func:`offload_saved` then says so
once and changes nothing.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from memsave._logging import warn_once

__all__ = ["MIN_NUMEL", "ActivationOffload", "ForwardContext", "forward_under", "is_activation", "module_storages",
           "offload_saved"]

MIN_NUMEL = 1024  # saved tensors smaller than this stay as they are: not worth a copy, a stream or an event

CPU_NOOP = ('[offload] activations = "cpu" on a CPU device: saved activations already live in host memory, '
            "nothing is moved")


def module_storages(module: nn.Module | None) -> frozenset[int]:
    """Storage addresses of ``module``'s parameters and buffers: saved tensors on them are never moved or
    compressed (they are held by the module anyway)."""
    if module is None:
        return frozenset()
    return frozenset(t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]
                     if t.device.type != "meta")


def is_activation(t: torch.Tensor, min_numel: int = MIN_NUMEL, exclude: frozenset[int] = frozenset(),
                  dtypes: tuple[torch.dtype, ...] | None = None) -> bool:
    """Whether a saved tensor is an activation worth moving or compressing (see the module docstring)."""
    if not t.is_floating_point() or t.numel() < min_numel or (dtypes is not None and t.dtype not in dtypes):
        return False
    root = t._base if t._base is not None else t  # a view of a parameter (w.t() in a linear) is the parameter
    if isinstance(root, nn.Parameter) or (root.is_leaf and root.requires_grad) or root.device.type == "meta":
        return False
    return not exclude or t.untyped_storage().data_ptr() not in exclude


class ActivationOffload:
    """The pack / unpack pair of activation offload to pinned host memory (CUDA only; see the Note)."""

    def __init__(self, *, min_numel: int = MIN_NUMEL, exclude: frozenset[int] = frozenset()) -> None:
        self.min_numel, self.exclude = min_numel, exclude
        self.stream: torch.cuda.Stream | None = None
        # device tensors whose copy to host may still be running, in pack order, with their copy events
        self.in_flight: collections.deque[tuple[torch.cuda.Event, torch.Tensor]] = collections.deque()
        self.offloaded_bytes = 0  # bytes copied to host since the last reset

    def _release(self, *, wait: bool) -> None:
        """Drop device tensors whose copy is done; with ``wait``, hand the rest to the allocator (record_stream)."""
        while self.in_flight and self.in_flight[0][0].query():
            self.in_flight.popleft()
        if wait:
            assert self.stream is not None or not self.in_flight
            while self.in_flight:
                _, t = self.in_flight.popleft()
                t.record_stream(self.stream)  # type: ignore[arg-type]

    def pack(self, t: torch.Tensor) -> Any:
        if t.device.type != "cuda" or not is_activation(t, self.min_numel, self.exclude):
            return t
        self._release(wait=False)
        compute = torch.cuda.current_stream(t.device)
        if self.stream is None:
            self.stream = torch.cuda.Stream(t.device)
        produced = compute.record_event()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(produced)
            host.copy_(t, non_blocking=True)
            copied = self.stream.record_event()
        self.in_flight.append((copied, t))  # t stays alive until `copied` completes: [Note: activation offload ordering]
        self.offloaded_bytes += t.numel() * t.element_size()
        return host, t.device, copied

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        host, device, copied = packed
        torch.cuda.current_stream(device).wait_event(copied)
        return host.to(device, non_blocking=True)

    def end_forward(self) -> None:
        self._release(wait=True)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            try:
                yield
            finally:
                self.end_forward()


@contextlib.contextmanager
def offload_saved(module: nn.Module | None = None, *, min_numel: int = MIN_NUMEL) -> Iterator[ActivationOffload | None]:
    """Within this context, saved CUDA activations live in pinned host memory until backward needs them.

    ``module``: its parameters and buffers are never offloaded (they stay on the device anyway). Without CUDA
    this is a no-op that says so once (yields None).
    """
    if not torch.cuda.is_available():
        warn_once(CPU_NOOP)
        yield None
        return
    offload = ActivationOffload(min_numel=min_numel, exclude=module_storages(module))
    with offload():
        yield offload


class ForwardContext:
    """Runs every call of a module's forward (its hooks included) inside a context from ``make_context``: a
    forward pre-hook (prepended: the outermost) enters it, a forward hook (``always_call``: also when the
    forward raises) leaves it. Keep it to :meth:`remove` the hooks."""

    def __init__(self, module: nn.Module, make_context: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
        self.module, self.make_context = module, make_context
        self._open: list[contextlib.AbstractContextManager[Any]] = []  # a stack: the root may be called re-entrantly
        self._handles: list[RemovableHandle] = [
            module.register_forward_pre_hook(self._enter, prepend=True),
            module.register_forward_hook(self._exit, always_call=True),
        ]

    def _enter(self, module: nn.Module, args: Any) -> None:
        context = self.make_context()
        context.__enter__()
        self._open.append(context)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._open:
            self._open.pop().__exit__(None, None, None)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def forward_under(module: nn.Module, make_context: Callable[[], contextlib.AbstractContextManager[Any]]) -> ForwardContext:
    """Make ``module``'s forward run inside ``make_context()`` (a fresh context per call); see :class:`ForwardContext`."""
    return ForwardContext(module, make_context)
