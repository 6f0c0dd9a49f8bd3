"""Where offloaded state lives: files on local storage (the disk tier) or pinned host memory (the host tier).

ZeRO-Offload (Ren et al., 2021) moves optimizer state to host memory; ZeRO-Infinity (Rajbhandari et al., 2021)
also to NVMe, read and written in large aligned blocks by a pool of I/O threads. A tier here stores *regions*:
byte ranges of a fixed size that a window buffer (``uint8``, on the compute device) is read into and written
from, asynchronously. The chunked optimizer step of :mod:`memsave.offload.state` decides what a region holds.

- :class:`DiskTier`: one file per *group* (memsave uses one per ZeRO unit) in a run-unique folder under
  ``[offload] path``; regions are 4 KiB aligned, read and written with ``os.preadv`` / ``os.pwritev`` (they
  release the GIL) from a thread pool, with ``O_DIRECT`` where the file system takes it (no page cache: the
  state really leaves memory, and the copy costs no CPU time; buffered I/O otherwise, said once). CPU only.
- :class:`HostTier`: pinned host tensors, copied to and from device window buffers on a side CUDA stream.

Where a disk tier's folder lives and how it is removed however the process ends, SIGTERM and SIGKILL included,
is :mod:`memsave.offload.folders` ([Note: offload files], [Note: cleanup on signals]).
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import shutil
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from memsave._logging import warn_once
from memsave.offload.folders import (
    PREFIX,
    RECORD_ENV,
    cleanup_on_signals,
    live_folders,
    make_root,
    new_folder,
    remove_folder,
    remove_live_folder,
    remove_live_folders,
    remove_stale,
)
from memsave.phases import MemoryCategory

__all__ = ["ALIGN", "RECORD_ENV", "DiskTier", "EventHandle", "Handle", "HostTier", "Tier", "aligned_empty", "check_disk_path",
           "cleanup_on_signals", "live_folders", "remove_folder", "remove_live_folders", "round_up"]

ALIGN = 4096  # O_DIRECT wants buffer addresses, file offsets and lengths aligned to the logical block size
BOUNCE = 1 << 20  # per I/O thread, for targets that are not aligned (stage-3 parameter shards)
IO_THREADS = 2  # a disk tier's I/O threads


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def aligned_empty(nbytes: int, device: torch.device) -> torch.Tensor:
    """An uninitialized ``uint8`` buffer of ``nbytes`` whose address is ``ALIGN``-aligned (CPU), or a plain one."""
    if device.type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + nbytes]  # the view keeps the allocation alive


class Handle(Protocol):
    def wait(self) -> None:
        """Block until the transfer is done (the buffer's bytes are usable), raising its error if it failed."""
        ...

    def done(self) -> bool:
        """The transfer is complete (waiting would not block)."""
        ...


class _Done:
    def wait(self) -> None:
        return None

    def done(self) -> bool:
        return True


class _FutureHandle:
    def __init__(self, future: concurrent.futures.Future[None]) -> None:
        self.future = future

    def wait(self) -> None:
        self.future.result()

    def done(self) -> bool:
        return self.future.done()


class Tier(Protocol):
    kind: str
    slots: int  # regions per chunk or unit: 2 where a write can fail half way ([Note: failed I/O]), else 1
    io_seconds: float
    io_bytes: int

    def allocate(self, group: str, nbytes: int) -> Any: ...
    def read_async(self, region: Any, buf: torch.Tensor) -> Handle: ...
    def write_async(self, region: Any, buf: torch.Tensor) -> Handle: ...
    def claim(self, buf: torch.Tensor) -> None: ...
    def drain(self) -> None: ...
    def close(self) -> None: ...
    def describe(self, region: Any) -> str: ...


# -- disk -------------------------------------------------------------------------------------------------------
def check_disk_path(path: str, needed_bytes: int) -> Path:
    """Create ``path`` if needed, check it is a writable folder with room for ``needed_bytes``; else ValueError
    naming ``offload.path``, the value and what is needed."""
    root = Path(path).expanduser()
    for attempt in range(3):  # another rank may remove root meanwhile ([Note: a shared path] in folders.py)
        try:
            make_root(root)
            probe = root / f".{PREFIX}probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            probe.write_bytes(b"\0" * 16)
            probe.unlink()
            free = shutil.disk_usage(root).free
            break
        except FileNotFoundError:
            if attempt == 2:
                raise ValueError(f"profile key 'offload.path' = {path!r} kept disappearing while it was checked; "
                                 "choose a folder no other program removes") from None
        except OSError as exc:
            raise ValueError(f"profile key 'offload.path' = {path!r} is not a writable folder ({exc}); choose a "
                             "folder on local storage this process can write") from exc
    if free < needed_bytes:
        raise ValueError(
            f"profile key 'offload.path' = {path!r} has {free / 2**20:,.1f} MiB free, and offloading needs "
            f"{needed_bytes / 2**20:,.1f} MiB (two slots per chunk of optimizer state, every local rank); free "
            "space, choose another folder or lower offload.fraction")
    return root


def _bytes_view(buf: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU ``uint8`` tensor, for ``os.preadv`` / ``os.pwritev``."""
    return memoryview(buf.numpy()).cast("B")  # type: ignore[arg-type]


def _full_io(fn: Any, fd: int, view: memoryview, offset: int) -> None:
    """``os.preadv`` / ``os.pwritev`` until every byte moved (a short transfer is retried, 0 bytes is an error)."""
    done = 0
    while done < len(view):
        n = fn(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO if fn is os.preadv else errno.ENOSPC,
                          f"{'read' if fn is os.preadv else 'write'} stopped after {done} of {len(view)} bytes")
        done += n


def _close_dir(folder: Path, fds: dict[str, int], pool: concurrent.futures.ThreadPoolExecutor) -> None:
    pool.shutdown(wait=True)
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
    remove_live_folder(folder)


class DiskTier:
    """Regions in files under a run-unique folder of ``path`` ([Note: offload files] in folders.py);
    asynchronous aligned I/O on ``threads`` threads, ``O_DIRECT`` when ``direct`` (None: where the file system
    supports it)."""

    kind = "disk"
    slots = 2  # a write goes to the other region, current once it succeeded ([Note: failed I/O])

    def __init__(self, path: str, *, rank: int, needed_bytes: int, direct: bool | None = None,
                 threads: int = IO_THREADS) -> None:
        root = check_disk_path(path, needed_bytes)
        remove_stale(root)
        self.folder = new_folder(root, rank)  # SIGTERM removes it ([Note: cleanup on signals] in folders.py)
        self._fds: dict[str, int] = {}
        self._ends: dict[str, int] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="memsave-offload")
        self._finalizer = weakref.finalize(self, _close_dir, self.folder, self._fds, self._pool)
        self.direct = self._probe_direct() if direct is None else direct
        self.allocated_bytes = 0
        self.io_seconds = 0.0  # summed over the I/O threads (an approximation: updated without a lock)
        self.io_bytes = 0
        self._local = threading.local()  # each I/O thread's bounce buffer (unaligned targets, see _io_bounced)
        self._bounces: list[torch.Tensor] = []

    def _probe_direct(self) -> bool:
        if not hasattr(os, "O_DIRECT"):
            warn_once("[offload] disk tier: O_DIRECT is not available on this platform; using buffered I/O "
                      "(the page cache holds a copy of the state that is written)")
            return False
        probe = self.folder / "probe"
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
            try:
                _full_io(os.pwritev, fd, _bytes_view(aligned_empty(ALIGN, torch.device("cpu"))), 0)
            finally:
                os.close(fd)
            return True
        except OSError as exc:
            warn_once(f"[offload] disk tier: {str(self.folder.parent)!r} does not take O_DIRECT ({exc}); using "
                      "buffered I/O (the page cache holds a copy of the state that is written)")
            return False
        finally:
            probe.unlink(missing_ok=True)

    def _fd(self, group: str) -> int:
        if group not in self._fds:
            flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if self.direct else 0)
            self._fds[group] = os.open(self.folder / f"{group}.state", flags, 0o600)
            self._ends[group] = 0
        return self._fds[group]

    def allocate(self, group: str, nbytes: int) -> tuple[str, int, int]:
        """A new region of ``nbytes`` (rounded up to ``ALIGN``) at the end of ``group``'s file."""
        self._fd(group)
        size = round_up(nbytes)
        offset = self._ends[group]
        self._ends[group] = offset + size
        self.allocated_bytes += size
        return group, offset, size

    def _io(self, write: bool, region: tuple[str, int, int], buf: torch.Tensor) -> None:
        group, offset, size = region
        view = _bytes_view(buf[:size])
        start = time.perf_counter()
        try:
            _full_io(os.pwritev if write else os.preadv, self._fds[group], view, offset)
            self.io_seconds += time.perf_counter() - start
            self.io_bytes += size
        except OSError as exc:
            raise OSError(exc.errno, f"offload: {'writing' if write else 'reading'} {size} bytes at offset "
                          f"{offset} of {self.describe(region)} failed: {exc.strerror or exc}") from exc

    def read_async(self, region: tuple[str, int, int], buf: torch.Tensor) -> Handle:
        return _FutureHandle(self._pool.submit(self._io, False, region, buf))

    def _bounce(self) -> torch.Tensor:
        buf = getattr(self._local, "bounce", None)
        if buf is None:
            buf = self._local.bounce = aligned_empty(BOUNCE, torch.device("cpu"))
            self._bounces.append(buf)
        return buf

    def _io_bounced(self, write: bool, region: tuple[str, int, int], target: torch.Tensor) -> None:
        """Move the bytes of any contiguous CPU ``uint8`` tensor (no alignment needed) through the thread's
        aligned bounce buffer, ``BOUNCE`` bytes at a time."""
        group, offset, size = region
        bounce, done, total = self._bounce(), 0, target.numel()
        assert total <= size, (total, size)
        start = time.perf_counter()
        try:
            while done < total:
                take = min(BOUNCE, total - done)
                view = _bytes_view(bounce[: round_up(take)])
                if write:
                    bounce[:take].copy_(target[done : done + take])
                    _full_io(os.pwritev, self._fds[group], view, offset + done)
                else:
                    _full_io(os.preadv, self._fds[group], view, offset + done)
                    target[done : done + take].copy_(bounce[:take])
                done += take
        except OSError as exc:
            raise OSError(exc.errno, f"offload: {'writing' if write else 'reading'} {total} bytes at offset "
                          f"{offset} of {self.describe(region)} failed: {exc.strerror or exc}") from exc
        self.io_seconds += time.perf_counter() - start
        self.io_bytes += total

    def read_into_async(self, region: tuple[str, int, int], target: torch.Tensor) -> _FutureHandle:
        """Read the region into ``target`` (any contiguous CPU ``uint8`` tensor of at most the region's size)."""
        return _FutureHandle(self._pool.submit(self._io_bounced, False, region, target))

    def write_from_async(self, region: tuple[str, int, int], source: torch.Tensor) -> _FutureHandle:
        return _FutureHandle(self._pool.submit(self._io_bounced, True, region, source))

    def bounce_tensors(self) -> Iterator[tuple[MemoryCategory, torch.Tensor]]:
        for b in self._bounces:
            yield MemoryCategory.COMM, b

    def write_async(self, region: tuple[str, int, int], buf: torch.Tensor) -> Handle:
        return _FutureHandle(self._pool.submit(self._io, True, region, buf))

    def claim(self, buf: torch.Tensor) -> None:
        return None  # writes are waited (their futures) before a buffer is reused

    def drain(self) -> None:
        return None  # every handle is waited by its owner

    def describe(self, region: Any) -> str:
        return str(self.folder / f"{region[0]}.state")

    def close(self) -> None:
        self._finalizer()


# -- host (pinned memory, CUDA) -----------------------------------------------------------------------------------
class EventHandle:
    """A CUDA copy's :class:`Handle`: ``wait`` makes the compute stream wait for its event (the host does not)."""

    def __init__(self, event: Any) -> None:
        self.event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)  # the compute stream waits; the host does not

    def done(self) -> bool:
        return bool(self.event.query())


class HostTier:
    """Regions in pinned host memory; copies on one side stream ([Note: host tier ordering] below).

    [Note: host tier ordering] Reads (host -> device window buffer) and writes (device buffer -> host) are
    issued on one side stream, so they run in issue order. Before either, the side stream waits for the compute
    stream's work queued so far: a read must not overwrite a window buffer the previous chunk's step may still
    read, and a write must see the step's updates. The compute stream waits on the read's event before the step
    uses the buffer. A window buffer is reused for a read issued after the write of its previous chunk, so stream
    order keeps it safe; a buffer the compute stream fills itself (a chunk's first state, no read) is
    :meth:`claim`-ed first: the compute stream waits for the side stream, whose write of the previous chunk may
    still be reading it. The host regions are read on the host only after :meth:`drain`.
    """

    kind = "host"
    slots = 1  # a copy into pinned memory cannot fail half way

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise NotImplementedError(f"the host tier moves state off a CUDA device; on {device.type} it already "
                                      "lives in host memory")
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.allocated_bytes = 0
        self.io_seconds = 0.0  # not measured on the host tier (it would need a synchronization)
        self.io_bytes = 0

    def allocate(self, group: str, nbytes: int) -> torch.Tensor:
        self.allocated_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> Handle:
        self.io_bytes += src.numel()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        event = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event.record(self.stream)
        return EventHandle(event)

    def read_async(self, region: torch.Tensor, buf: torch.Tensor) -> Handle:
        return self._copy(buf[: region.numel()], region)

    def write_async(self, region: torch.Tensor, buf: torch.Tensor) -> Handle:
        self._copy(region, buf[: region.numel()])
        return _Done()  # reuse of buf is ordered by the stream ([Note: host tier ordering])

    def read_into_async(self, region: torch.Tensor, target: torch.Tensor) -> Handle:
        """``[offload] params = "cpu"``: copy the region into ``target`` (a stage-3 shard's bytes on the device)."""
        return self._copy(target, region[: target.numel()])

    def write_from_async(self, region: torch.Tensor, source: torch.Tensor) -> Handle:
        """Copy ``source`` (a shard's bytes on the device) into the region. Its handle's ``wait`` orders the
        compute stream after the copy, so the shard's storage may be freed then; ``done`` says the copy ran."""
        return self._copy(region[: source.numel()], source)

    def bounce_tensors(self) -> Iterator[tuple[MemoryCategory, torch.Tensor]]:
        return iter(())  # copies go straight between pinned regions and device tensors

    def claim(self, buf: torch.Tensor) -> None:
        """The compute stream is about to fill ``buf`` without a read: it waits for the side stream's copies
        (a write of the buffer's previous chunk may still be reading it)."""
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def drain(self) -> None:
        self.stream.synchronize()

    def describe(self, region: Any) -> str:
        return "pinned host memory"

    def close(self) -> None:
        self.drain()
