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

[Note: offload files] The folder is ``<path>/memsave-offload-<host>-<pid>-<random>-rank<r>``; its ``OWNER``
file names the process. Nothing in it is ever reopened by another run: the state in it is valid only inside
the process that wrote it (which keeps the index of its regions in memory), so a crashed run's leftovers can
never be mistaken for valid state. They are removed
- by ``close()``, or by a ``weakref.finalize`` at garbage collection or interpreter exit;
- on SIGTERM (and, in ranks of ``memsave._launch.spawn_local``, SIGINT) by :func:`cleanup_on_signals`, even
  while the main thread is blocked in a collective ([Note: cleanup on signals]);
- for a process killed outright (SIGKILL, the OOM killer), by its launcher: a process started with
  ``MEMSAVE_OFFLOAD_RECORD`` set appends each folder's path to that file *before* creating it, and
  ``spawn_local`` removes what is listed there once its processes are gone;
- otherwise by the next run that uses the same ``path`` on the same host: its owner process no longer exists,
  named by ``OWNER`` or, where ``OWNER`` is missing (a process killed while creating or removing the folder),
  by the pid in the folder's name. Removal deletes ``OWNER`` last, so a half-removed folder still names its
  owner.

[Note: cleanup on signals] A Python signal handler runs in the main thread, and only between bytecodes: a rank
blocked in a gloo collective would not run it until the collective returns (up to its timeout). So the handler
installed here does no work; the C-level handler Python installs with it also writes the signal's number to
``signal.set_wakeup_fd``'s pipe, and a daemon thread reading that pipe removes this process's live offload
folders (and runs the extra cleanups registered) and then ends the process *by the same signal* (default
disposition restored through libc, so the parent sees -15, as it would without the handler). A SIGTERM handler
is installed only where SIGTERM still has its default action, so a user's own handler is left alone; a forked
child resets all of it (it holds none of the folders).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import json
import os
import re
import shutil
import signal
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from memsave._logging import get_logger, warn_once
from memsave.phases import MemoryCategory

__all__ = ["ALIGN", "RECORD_ENV", "DiskTier", "Handle", "HostTier", "Tier", "aligned_empty", "check_disk_path",
           "cleanup_on_signals", "live_folders", "remove_folder", "remove_live_folders", "round_up"]

ALIGN = 4096  # O_DIRECT wants buffer addresses, file offsets and lengths aligned to the logical block size
BOUNCE = 1 << 20  # per I/O thread, for targets that are not aligned (stage-3 parameter shards)
PREFIX = "memsave-offload-"
RECORD_ENV = "MEMSAVE_OFFLOAD_RECORD"  # a file each new folder's path is appended to ([Note: offload files])
# memsave-offload-<host>-<pid>-<8 hex>-rank<r>; the host name may itself contain dashes
_FOLDER_NAME = re.compile(rf"{re.escape(PREFIX)}(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{{8}}-rank\d+")


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
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_folder(folder: Path) -> bool:
    """Remove an offload folder, ``OWNER`` last ([Note: offload files]); True when it is gone. A file created
    meanwhile (an I/O thread opening a unit's file) is caught by the next of a few passes."""
    for _ in range(5):
        try:
            entries = [e for e in folder.iterdir() if e.name != "OWNER"]
        except FileNotFoundError:
            return True
        except OSError:
            entries = []
        for entry in entries:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        (folder / "OWNER").unlink(missing_ok=True)
        try:
            folder.rmdir()
        except FileNotFoundError:
            return True
        except OSError:
            continue  # not empty yet: another pass
        return True
    return not folder.exists()


def _owner_pid(folder: Path, host: str) -> int | None:
    """The pid of the process on this host that owns ``folder``, by its ``OWNER`` file or else by its name; None
    when it is another host's folder or not one of ours."""
    try:
        owner = json.loads((folder / "OWNER").read_text())
    except FileNotFoundError:
        owner = None  # killed while creating or removing it: the name still says whose it is
    except (OSError, ValueError):
        return None  # unreadable: not ours to judge
    if isinstance(owner, dict):
        pid = owner.get("pid")
        return pid if owner.get("host") == host and isinstance(pid, int) else None
    match = _FOLDER_NAME.fullmatch(folder.name)
    return int(match["pid"]) if match and match["host"] == host else None


def _remove_stale(root: Path) -> None:
    """Remove the folders (and probe files) of runs on this host whose process is gone ([Note: offload files])."""
    host = socket.gethostname()
    for d in root.glob(PREFIX + "*"):
        pid = _owner_pid(d, host) if d.is_dir() else None
        if pid is not None and pid != os.getpid() and not _pid_alive(pid) and remove_folder(d):
            get_logger().info("removed the offload folder %s left by a run that ended without closing it", d)
    for probe in root.glob(f".{PREFIX}probe-*"):  # .memsave-offload-probe-<pid>-<hex> (check_disk_path)
        pid_text = probe.name.rsplit("-", 2)[-2]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            probe.unlink(missing_ok=True)


# -- leftovers: folders this process holds, removed on SIGTERM ([Note: cleanup on signals]) ------------------------
_live: set[Path] = set()
_live_lock = threading.Lock()
_extra_cleanups: list[Callable[[], None]] = []
_handled: dict[int, Any] = {}  # signal -> the handler it had before
_owner_pid_of_handlers = 0  # the process that installed them (a forked child has none of it)
_watcher: threading.Thread | None = None  # reads the wakeup pipe and does the work


def live_folders() -> list[Path]:
    """The offload folders this process has created and not yet removed."""
    with _live_lock:
        return sorted(_live)


def remove_live_folders() -> None:
    """Remove every offload folder this process holds (the signal path; ``close()`` is the normal one)."""
    for folder in live_folders():
        remove_folder(folder)
        with _live_lock:
            _live.discard(folder)


def _record(folder: Path) -> None:
    """Append ``folder`` to the launcher's record, if one was given ([Note: offload files])."""
    record = os.environ.get(RECORD_ENV)
    if record:
        try:
            with open(record, "a") as f:
                f.write(f"{folder}\n")
        except OSError as exc:
            get_logger().info("could not record the offload folder %s in %s (%s)", folder, record, exc)


def _die_by(signum: int) -> None:
    """End this process by ``signum`` with its default action, from any thread; else exit 128 + signum."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.signal(signum, None)  # SIG_DFL is the null handler
        os.kill(os.getpid(), signum)
        time.sleep(1.0)  # delivered by now unless blocked in this thread
    except Exception:  # no libc to call: the exit code still says which signal
        pass
    os._exit(128 + signum)


def _terminate(signum: int) -> None:
    for fn in list(_extra_cleanups):
        try:
            fn()
        except Exception:  # a cleanup must not keep the process alive
            pass
    remove_live_folders()
    _die_by(signum)


def _on_signal(signum: int, frame: Any) -> None:
    """The Python-level handler: the watcher thread does the work; without one (no wakeup pipe) do it here."""
    if os.getpid() != _owner_pid_of_handlers:
        _die_by(signum)
    if _watcher is None:
        _terminate(signum)


def _watch(read_fd: int) -> None:
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            if signum in _handled:
                _terminate(signum)


def _after_fork_in_child() -> None:
    global _watcher
    _watcher = None
    with _live_lock:
        _live.clear()
    _extra_cleanups.clear()
    if _handled:
        try:
            signal.set_wakeup_fd(-1)
            for signum, previous in _handled.items():
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        except (ValueError, OSError, TypeError):
            pass
        _handled.clear()


def cleanup_on_signals(signals: Iterable[int] = (signal.SIGTERM,), *, also: Callable[[], None] | None = None,
                       replace: bool = False) -> list[int]:
    """On each of ``signals``, remove this process's offload folders, run ``also``, and end the process by that
    signal, even while its main thread is blocked in a collective ([Note: cleanup on signals]).

    A signal is taken over only while it has its default action (SIGINT: Python's KeyboardInterrupt), unless
    ``replace``; nothing is installed outside the main thread. Returns the signals now handled.
    """
    global _watcher, _owner_pid_of_handlers
    if also is not None:
        _extra_cleanups.append(also)
    if threading.current_thread() is not threading.main_thread():
        return sorted(_handled)
    if _owner_pid_of_handlers != os.getpid():
        _handled.clear()
        _owner_pid_of_handlers = os.getpid()
    for signum in signals:
        current = signal.getsignal(signum)
        default = current in (signal.SIG_DFL, signal.default_int_handler)
        if signum in _handled or not (default or replace):
            continue
        signal.signal(signum, _on_signal)
        _handled[signum] = current
    if _handled and _watcher is None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        if previous != -1:  # someone else's (an event loop): leave it theirs
            signal.set_wakeup_fd(previous)
            os.close(read_fd)
            os.close(write_fd)
            return sorted(_handled)  # _on_signal does the work in the main thread
        _watcher = threading.Thread(target=_watch, args=(read_fd,), name="memsave-signal-cleanup", daemon=True)
        _watcher.start()
    return sorted(_handled)


os.register_at_fork(after_in_child=_after_fork_in_child)


def check_disk_path(path: str, needed_bytes: int) -> Path:
    """Create ``path`` if needed, check it is a writable folder with room for ``needed_bytes``; else ValueError
    naming ``offload.path``, the value and what is needed."""
    root = Path(path).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".{PREFIX}probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"\0" * 16)
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"profile key 'offload.path' = {path!r} is not a writable folder ({exc}); choose a folder "
                         "on local storage this process can write") from exc
    free = shutil.disk_usage(root).free
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
    remove_folder(folder)
    with _live_lock:
        _live.discard(folder)


class DiskTier:
    """Regions in files under a run-unique folder of ``path`` ([Note: offload files]); asynchronous aligned I/O
    on ``threads`` threads, ``O_DIRECT`` when ``direct`` (None: where the file system supports it)."""

    kind = "disk"
    slots = 2  # a write goes to the other region, current once it succeeded ([Note: failed I/O])

    def __init__(self, path: str, *, rank: int, needed_bytes: int, direct: bool | None = None,
                 threads: int = 2) -> None:
        root = check_disk_path(path, needed_bytes)
        _remove_stale(root)
        self.folder = root / f"{PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}-rank{rank}"
        cleanup_on_signals()  # SIGTERM removes the folder ([Note: cleanup on signals])
        _record(self.folder)
        with _live_lock:
            _live.add(self.folder)
        self.folder.mkdir()
        (self.folder / "OWNER").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
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
class _EventHandle:
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
        return _EventHandle(event)

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
