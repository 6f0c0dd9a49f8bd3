"""Reused communication staging buffers.

Every gather and reduce-scatter needs an ``N * C`` staging buffer for a few milliseconds. Allocating each anew
cycles tens of MiB through the host allocator per unit and step, which on CPU fragments glibc's heap and
inflates peak RSS well past what is live (see [Note: host allocator] in ``memsave/dist/host_memory.py``).
Units of the same shape (the blocks of a transformer) share buffers, so the pool settles at the in-flight
window: a handful of buffers per distinct size, counted as communication memory in reports.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from memsave.phases import MemoryCategory

__all__ = ["BufferPool"]


class BufferPool:
    """Free lists of flat buffers keyed by (numel, dtype, device)."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._all: list[torch.Tensor] = []

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free.get((numel, dtype, device))
        if free:
            return free.pop()
        buf = torch.empty(numel, dtype=dtype, device=device)
        self._all.append(buf)
        return buf

    def put(self, buf: torch.Tensor) -> None:
        self._free.setdefault((buf.numel(), buf.dtype, buf.device), []).append(buf)

    def memory_tensors(self) -> Iterator[tuple[MemoryCategory, torch.Tensor]]:
        for buf in self._all:
            yield MemoryCategory.COMM, buf
