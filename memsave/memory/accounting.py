"""Who holds which bytes: the registration protocol, per-category accounting, and process memory figures.

Components never import the tracker and the tracker never imports them (``zero/`` and ``memory/`` are
siblings): a component that owns tensors implements :class:`HoldsMemory`, and :func:`account` asks every
holder it is given. Tensors are deduplicated by storage, so a gradient that is a view of a bucket, or a shard
that is a view of a flat buffer, is counted once, at the size of the storage actually allocated.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import psutil
import torch
from torch import nn

from memsave.phases import MemoryCategory

__all__ = ["HoldsMemory", "MemoryAccount", "account", "default_tensors", "peak_rss_bytes", "rss_bytes"]


@runtime_checkable
class HoldsMemory(Protocol):
    def memory_tensors(self) -> Iterable[tuple[MemoryCategory, torch.Tensor]]:
        """Every tensor this component keeps alive, with its category."""
        ...


@dataclasses.dataclass
class MemoryAccount:
    """Bytes per category on one rank (storage-deduplicated), by device type."""

    bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    device_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    # StorageImpl addresses counted (or empty): what the tracker's activation count must not count again
    storages: set[int] = dataclasses.field(default_factory=set, repr=False, compare=False)

    @property
    def total(self) -> int:
        """In-memory bytes: every category but the offloaded tiers (``offload_host``, ``offload_disk``)."""
        return sum(v for k, v in self.bytes.items() if not k.startswith("offload_"))

    def model_state(self) -> int:
        """Parameters (sharded and gathered), gradients, master weights and optimizer state."""
        keep = (MemoryCategory.PARAMS, MemoryCategory.PARAMS_GATHERED, MemoryCategory.GRADS,
                MemoryCategory.MASTER, MemoryCategory.OPTIMIZER_STATE)
        return sum(self.bytes.get(c.value, 0) for c in keep)


def account(holders: Iterable[object], *, by_device: bool = True) -> MemoryAccount:
    """Sum the storages every holder reports, each storage once (first category wins), and the bytes it holds on
    other tiers (``offloaded_bytes()``). ``by_device=False`` skips the per-device split (the tracker's hot path)."""
    out = MemoryAccount()
    seen = out.storages
    for holder in holders:
        tensors = holder.memory_tensors() if isinstance(holder, HoldsMemory) else default_tensors(holder)
        for category, t in tensors:
            if t.is_meta:
                continue
            storage = t.untyped_storage()
            key = storage._cdata  # the StorageImpl: stable while a ZeRO-3 buffer is freed and re-grown
            if key in seen:
                continue
            seen.add(key)  # also when empty: a resharded ZeRO-3 buffer's saved views are not activations
            nbytes = storage.nbytes()
            if nbytes:
                name = category._value_  # not .value (a descriptor) nor the enum as a key (a Python __hash__)
                out.bytes[name] = out.bytes.get(name, 0) + nbytes
                if by_device:
                    out.device_bytes[t.device.type] = out.device_bytes.get(t.device.type, 0) + nbytes
        offloaded = getattr(holder, "offloaded_bytes", None)  # another tier: {"host": n, "disk": n}
        if callable(offloaded):
            for tier, nbytes in offloaded().items():
                if nbytes:
                    out.bytes[f"offload_{tier}"] = out.bytes.get(f"offload_{tier}", 0) + int(nbytes)
    return out


def default_tensors(obj: object) -> Iterable[tuple[MemoryCategory, torch.Tensor]]:
    """What a plain module or optimizer holds: parameters, gradients, buffers, optimizer state tensors."""
    if isinstance(obj, nn.Module):
        for p in obj.parameters():
            yield MemoryCategory.PARAMS, p
            if p.grad is not None:
                yield MemoryCategory.GRADS, p.grad
        for b in obj.buffers():
            yield MemoryCategory.BUFFERS, b
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    yield MemoryCategory.OPTIMIZER_STATE, v
    else:
        raise TypeError(f"cannot account the memory of {type(obj).__name__}: it implements no memory_tensors()")


_PROCESS: list[psutil.Process] = []  # this process, made once (a new psutil.Process reads /proc each time)


def rss_bytes() -> int:
    """Resident set size of this process now."""
    if not _PROCESS or _PROCESS[0].pid != os.getpid():  # after a fork: the child's own
        _PROCESS[:] = [psutil.Process()]
    return _PROCESS[0].memory_info().rss


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since it started (the kernel's high-water mark)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
