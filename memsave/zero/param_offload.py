"""``[offload] params``: stage 3's parameter shards off the compute device between uses (ZeRO-Infinity,
Rajbhandari et al., 2021, parameter offload): in files (``"disk"``, CPU devices) or in pinned host memory
(``"cpu"``, CUDA devices: copies on the host tier's side stream, [Note: host tier ordering] in
memsave/offload/tiers.py).

Each unit's ``flat_shard`` (this rank's rows of the unit, C elements) is the only persistent copy of its
parameters at stage 3. With params offloaded it lives in the unit's region on the tier and is in memory only
while it is used: as the input of the unit's all-gather (forward, backward, ``state_dict``) and while the
optimizer steps the unit's chunks. Reads run ahead of use, ``prefetch`` units ahead in the order of use
(forward order in forward, backward order in backward, unit order in the optimizer step, whose chunks are
sorted by unit): on the disk tier's thread pool, or on the host tier's side stream. Evicting a unit shrinks its
storage to 0 bytes, as [Note: stage-3 storage] in unit.py does for the gathered parameters, so every view (the
shards the optimizer steps, their row pieces) stays valid.

[Note: parameter residency] A unit is EVICTED, READING, CLEAN (in memory, equal to the tier's copy), DIRTY
(changed in memory: stepped, or loaded by ``load_state_dict``) or WRITING. ``load`` makes it readable (waiting
for a read in flight; a unit being written is readable as it is). ``enter`` (before the unit is changed) also
waits for a write in flight and marks it DIRTY. ``release`` (after the gather that read it completed) evicts a
CLEAN unit; a DIRTY one stays until ``finish`` (the end of the optimizer step) writes it back. On disk that write
goes into the other of its two regions, and the file copy becomes current, and the unit is evicted, only once
the write succeeded (seen at the next ``collect``); a failed write leaves the unit DIRTY in memory (its
parameters are right there) and raises. On the host tier a unit has one region (a copy cannot fail half way);
"waiting" for a transfer there orders the compute stream after it, so a shard's storage is freed only after the
side stream's copy out of it, and refilled only by a copy issued after the compute stream's work that read it.
With ``[offload] overlap`` the optimizer step (``enter``, ``finish``) runs on a background thread while the
next forward's gathers ``load`` and ``release``: every transition holds one lock.
"""

from __future__ import annotations

import enum
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from memsave.phases import MemoryCategory
from memsave.zero.unit import Unit

__all__ = ["ParamOffload", "Residency", "StepHooks"]


def _locked(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: ParamOffload, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return call


class Residency(enum.Enum):
    EVICTED = "evicted"
    READING = "reading"
    CLEAN = "clean"
    DIRTY = "dirty"
    WRITING = "writing"


class ParamOffload:
    """The stage-3 parameter shards of ``units`` on ``tier`` (a ``DiskTier`` or a ``HostTier``; [Note: parameter
    residency])."""

    def __init__(self, units: Sequence[Unit], tier: Any, *, prefetch: int) -> None:
        self.units, self.tier, self.prefetch = list(units), tier, prefetch
        self._slots = tier.slots
        self._lock = threading.RLock()
        self.state = {u.index: Residency.DIRTY for u in self.units}
        self._regions: dict[int, list[Any]] = {}
        self._slot = {u.index: -1 for u in self.units}
        self._pending: dict[int, tuple[Any, int]] = {}  # unit index -> (handle, target region) in flight
        self._in_use: set[int] = set()  # a gather reads the shard
        for u in self.units:
            nbytes = self._bytes(u).numel()
            self._regions[u.index] = [tier.allocate(f"params-unit{u.index}", max(nbytes, 1))
                                      for _ in range(self._slots)]
        self.finish()
        for u in self.units:  # before training: every shard on disk, none in memory
            self._finish_write(u)
            self._evict(u)

    @staticmethod
    def _bytes(u: Unit) -> torch.Tensor:
        return u.flat_shard.view(torch.uint8)

    def _evict(self, u: Unit) -> None:
        if u.flat_shard.numel():
            u.flat_shard.untyped_storage().resize_(0)
        self.state[u.index] = Residency.EVICTED

    def _wait(self, index: int) -> None:
        handle, _ = self._pending.pop(index)
        handle.wait()

    # -- the transitions -----------------------------------------------------------------------------------
    @_locked
    def read_ahead(self, units: Sequence[Unit]) -> None:
        """Start reading the EVICTED ones among the first ``prefetch`` of ``units`` (the next to be used)."""
        for u in units[: self.prefetch]:
            self._start_read(u)

    def _start_read(self, u: Unit) -> None:
        if self.state[u.index] is Residency.EVICTED and u.flat_shard.numel():
            storage = u.flat_shard.untyped_storage()
            storage.resize_(u.flat_shard.numel() * u.flat_shard.element_size())
            region = self._regions[u.index][self._slot[u.index]]
            self._pending[u.index] = (self.tier.read_into_async(region, self._bytes(u)), self._slot[u.index])
            self.state[u.index] = Residency.READING

    @_locked
    def load(self, u: Unit, *, ahead: Sequence[Unit] = ()) -> None:
        """Make ``u``'s shard readable (a gather's input), and read ``ahead`` units."""
        self.collect()
        if self.state[u.index] is Residency.EVICTED:
            if not u.flat_shard.numel():
                self.state[u.index] = Residency.CLEAN
            else:
                self._start_read(u)
        self.read_ahead(ahead)
        if self.state[u.index] is Residency.READING:
            try:
                self._wait(u.index)
            except BaseException:
                self._evict(u)
                raise
            self.state[u.index] = Residency.CLEAN
        assert u.flat_shard.untyped_storage().nbytes() >= u.flat_shard.numel() * u.flat_shard.element_size()
        self._in_use.add(u.index)

    @_locked
    def release(self, u: Unit) -> None:
        """The gather that read ``u``'s shard completed: evict it if the file holds the same."""
        self._in_use.discard(u.index)
        if self.state[u.index] is Residency.CLEAN:
            self._evict(u)

    @_locked
    def enter(self, u: Unit, *, ahead: Sequence[Unit] = ()) -> None:
        """``u``'s shard is about to change (an optimizer step, a state-dict load)."""
        self.load(u, ahead=ahead)
        self._in_use.discard(u.index)
        if self.state[u.index] is Residency.WRITING:
            self._finish_write(u)
        self.state[u.index] = Residency.DIRTY

    @_locked
    def finish(self, units: Sequence[Unit] | None = None) -> None:
        """Write every DIRTY shard (of ``units``; default: all) back, asynchronously; evicted once written, see
        :meth:`collect`."""
        for u in self.units if units is None else units:
            if self.state[u.index] is Residency.DIRTY:
                target = (self._slot[u.index] + 1) % self._slots
                self._pending[u.index] = (self.tier.write_from_async(self._regions[u.index][target], self._bytes(u)),
                                          target)
                self.state[u.index] = Residency.WRITING

    def _finish_write(self, u: Unit) -> None:
        handle, target = self._pending.pop(u.index)
        try:
            handle.wait()
        except BaseException:
            self.state[u.index] = Residency.DIRTY  # the shard in memory is right; written at the next finish
            raise
        self._slot[u.index] = target
        self.state[u.index] = Residency.CLEAN

    @_locked
    def collect(self) -> None:
        """Complete the writes that are done; evict those units unless a gather reads them."""
        for u in self.units:
            if self.state[u.index] is Residency.WRITING and self._pending[u.index][0].done():
                self._finish_write(u)
                if u.index not in self._in_use:
                    self._evict(u)

    @_locked
    def drain(self) -> None:
        """Wait for every transfer and evict what no gather reads (before a checkpoint, a measurement, close)."""
        for u in self.units:
            if self.state[u.index] is Residency.WRITING:
                self._finish_write(u)
            elif self.state[u.index] is Residency.READING:
                self._wait(u.index)
                self.state[u.index] = Residency.CLEAN
            if self.state[u.index] is Residency.CLEAN and u.index not in self._in_use:
                self._evict(u)

    # -- accounting ----------------------------------------------------------------------------------------
    @_locked
    def offloaded_bytes(self) -> dict[str, int]:
        """Parameter bytes held on the tier now (``{"host": n, "disk": 0}`` or the reverse, as the tracker reads
        it)."""
        held = sum(self._bytes_held(u) for u in self.units if self._slot[u.index] >= 0)
        return {"host": 0, "disk": 0, self.tier.kind: held}

    @staticmethod
    def _bytes_held(u: Unit) -> int:
        return u.param_layout.chunk_numel * u.flat_shard.element_size()

    def memory_tensors(self) -> Iterator[tuple[MemoryCategory, torch.Tensor]]:
        yield from self.tier.bounce_tensors()


class StepHooks:
    """What the chunked optimizer step (memsave/offload/state.py) calls: ``enter(file)`` before a chunk of unit
    ``file`` steps (its shard is loaded, the next units read ahead), ``finish()`` after the last chunk."""

    def __init__(self, offload: ParamOffload) -> None:
        self.offload = offload
        self.by_file = {f"unit{u.index}": k for k, u in enumerate(offload.units)}
        self._last: int | None = None

    def enter(self, file: str) -> None:
        units = self.offload.units
        k = self.by_file[file]
        if self._last is not None and self._last != k and self.offload.tier.kind == "host":
            # the chunks go unit by unit, so the last unit is stepped: written back now and evicted once copied,
            # and the step holds a few units' shards, not all. (On disk the write waits for finish(): a failed
            # state write still restores the unit's rows in memory, [Note: failed I/O] in offload/state.py.)
            self.offload.finish([units[self._last]])
        self._last = k
        self.offload.enter(units[k], ahead=units[k + 1 :])

    def finish(self) -> None:
        self._last = None
        self.offload.finish()
