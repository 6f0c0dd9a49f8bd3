"""Host-allocator tuning for CPU training: give freed large buffers back to the OS.

[Note: host allocator] glibc serves a large allocation with mmap only while it is above a *dynamic*
threshold, and raises that threshold to the size of every mmapped block that is freed. After the first step
nearly every activation, gradient and staging buffer therefore comes from the brk heap, whose free space is
fragmented by tensors of many sizes and never returned: peak RSS grows well above what is live. This is why
torch FSDP2's ZeRO-3 peaks *above* DDP on CPU although it holds a quarter of the model state. Pinning the
threshold (``mallopt(M_MMAP_THRESHOLD)``, which also turns the dynamic adjustment off) makes every buffer above
it an mmap that is unmapped when freed, so RSS tracks live memory. The cost is page faults for the large
tensors each step (measured in ``memsave bench``).
"""

from __future__ import annotations

import ctypes
import os
import sys

from memsave._logging import get_logger

__all__ = ["DEFAULT_MMAP_THRESHOLD", "tune_host_allocator"]

DEFAULT_MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def tune_host_allocator(threshold: int | None) -> bool:
    """Pin glibc's mmap threshold to ``threshold`` bytes (None or 0: leave the allocator alone).

    ``MEMSAVE_MMAP_THRESHOLD`` in the environment overrides the argument (0 turns the tuning off). Returns
    whether the setting took effect (only on Linux with glibc).
    """
    env = os.environ.get("MEMSAVE_MMAP_THRESHOLD")
    if env is not None:
        if not env.isdigit():
            raise ValueError(f"MEMSAVE_MMAP_THRESHOLD={env!r} is not allowed; expected a number of bytes (0 = off)")
        threshold = int(env)
    if not threshold:
        return False
    if not sys.platform.startswith("linux"):
        get_logger().info("host allocator tuning skipped: not Linux")
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)) == 1
    except (OSError, AttributeError):
        ok = False
    get_logger().info("host allocator: mmap threshold %s -> %s", threshold, "set" if ok else "not available")
    return ok
