"""Host-allocator policy for CPU training: keep peak RSS close to the bytes that are live.

[Note: host allocator] glibc serves a large allocation with mmap only while it is above a *dynamic*
threshold, and raises that threshold to the size of every mmapped block that is freed. After the first step
nearly every activation, gradient and staging buffer therefore comes from the brk heap, whose free space is
fragmented by tensors of many sizes and is not given back: measured on the bench GPT, glibc's arena exceeds
the live bytes by 80 MiB under DDP and 170 MiB under ZeRO-3. That is why torch FSDP2's ZeRO-3 peaks *above*
DDP on CPU although it holds a quarter of the model state.

memsave answers in two ways, both process-wide (the allocator is), both set by ``memsave.init()``:

- ``trim_after_forward`` (default on, CPU only): at the end of each forward, ``malloc_trim(0)`` returns the
  free heap pages (the forward's temporaries) to the OS just before the peak of the step, the start of
  backward. Cost: one heap walk per step and re-faulting the pages that are reused. Not inside a pipeline
  step ([Note: no trim in a pipeline step]).
- ``mmap_threshold`` (default off; the ``zero3`` preset sets 8 MiB through ``[zero] host_mmap_threshold_mb``):
  pin the threshold so every buffer above it is an mmap that is unmapped when freed, so the big transient
  buffers (gathered units, staging, per-unit gradients) stop inflating RSS, at the price of page faults when
  they are allocated again. Measured on the bench GPT, 2 ranks: ZeRO-3 peak RSS 1113-1142 -> 909 MiB for
  +11% step time at 8 MiB; at 1-2 MiB nearly every activation is mmapped too (884 MiB, +22% or more).

Environment overrides: ``MEMSAVE_HOST_TRIM=0|1`` and ``MEMSAVE_MMAP_THRESHOLD=<bytes>`` (0 = off).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import sys
from collections.abc import Iterator

from memsave._logging import get_logger

__all__ = ["HostMemoryPolicy", "after_forward", "configure_host_memory", "host_memory_policy", "trim_held",
           "trim_host_memory"]

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


@dataclasses.dataclass(frozen=True)
class HostMemoryPolicy:
    trim_after_forward: bool = False
    mmap_threshold: int = 0


_policy = HostMemoryPolicy()
_libc: ctypes.CDLL | None = None


def _glibc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        try:
            lib = ctypes.CDLL("libc.so.6")
            if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt"):
                _libc = lib
        except OSError:
            pass
    return _libc


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    if not value.isdigit():
        raise ValueError(f"{name}={value!r} is not allowed; expected a non-negative integer")
    return int(value)


def configure_host_memory(
    *, trim_after_forward: bool | None = None, mmap_threshold: int | None = None
) -> HostMemoryPolicy:
    """Set the process's host-allocator policy; None keeps that part as it is, and the environment overrides
    win. Returns what took effect."""
    global _policy
    trim = _env_int("MEMSAVE_HOST_TRIM")
    threshold = _env_int("MEMSAVE_MMAP_THRESHOLD")
    if trim is not None:
        trim_after_forward = bool(trim)
    elif trim_after_forward is None:
        trim_after_forward = _policy.trim_after_forward
    if threshold is not None:
        mmap_threshold = threshold
    elif mmap_threshold is None:
        mmap_threshold = _policy.mmap_threshold
    libc = _glibc()
    if libc is None:
        if trim_after_forward or mmap_threshold:
            get_logger().info("host allocator policy skipped: not Linux/glibc")
        _policy = HostMemoryPolicy()
        return _policy
    if mmap_threshold:
        mmap_threshold = mmap_threshold if libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)) == 1 else 0
    _policy = HostMemoryPolicy(trim_after_forward=trim_after_forward, mmap_threshold=mmap_threshold)
    get_logger().info("host allocator policy: %s", _policy)
    return _policy


def host_memory_policy() -> HostMemoryPolicy:
    return _policy


_held = [0]  # > 0: inside trim_held(), after_forward() does nothing


@contextlib.contextmanager
def trim_held() -> Iterator[None]:
    """[Note: no trim in a pipeline step] Inside, :func:`after_forward` does nothing. A pipeline step runs one
    forward per micro-batch and stage: a trim after each gave back the pages every next forward faults in again
    (``memsave bench --pp``, m = 8, one run on a loaded machine: 1F1B's step 2.0x torch's with it, 1.2x
    without), and even one trim per step, after a rank's last
    forward, cost 5-10% of the step's CPU time (interleaved 1F1B, m = 16: 290-315 -> 262-291 ms per step and rank)
    for no lower peak RSS (372-386 MiB with it, 375-384 without; GPipe, 1F1B and ZB-H1 alike). There is no one
    start of backward in a pipeline step, where the step's activations peak, to trim before: its forwards and
    backwards alternate. So the stage runner holds the trim for its forwards."""
    _held[0] += 1
    try:
        yield
    finally:
        _held[0] -= 1


def after_forward() -> None:
    """Called by the engines at the end of each forward on CPU (see [Note: host allocator])."""
    if _policy.trim_after_forward and not _held[0]:
        libc = _glibc()
        if libc is not None:
            libc.malloc_trim(0)


def trim_host_memory() -> None:
    """Return the heap's free pages to the OS now (``malloc_trim(0)``; a no-op off glibc). ``wrap`` calls it between
    the units of a deferred model it materializes: each unit's full parameters are freed once the unit keeps its
    shard, and without a trim the next unit and shard would come, fragmented, on top of them ([Note: host
    allocator]; measured at 4 ranks: a wrap peaking at 1.85x the bytes of shards + the largest unit instead of 1.16x)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
