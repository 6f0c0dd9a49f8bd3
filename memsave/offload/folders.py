"""Offload folders: where a disk tier's files live, and their removal however the process that made them ends.

A :class:`~memsave.offload.tiers.DiskTier` keeps its files in a folder of its own, made by :func:`new_folder`.
This module names that folder, keeps the set of folders this process holds, removes them (on ``close()``, on a
signal, or as a later run's leftovers) and records them for the launcher.

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

import ctypes
import json
import os
import re
import shutil
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from memsave._logging import get_logger

__all__ = ["MADE", "PREFIX", "RECORD_ENV", "cleanup_on_signals", "live_folders", "make_root", "mark_made", "new_folder",
           "remove_folder", "remove_live_folder", "remove_live_folders", "remove_made", "remove_stale"]

PREFIX = "memsave-offload-"
RECORD_ENV = "MEMSAVE_OFFLOAD_RECORD"  # a file each new folder's path is appended to ([Note: offload files])
# memsave-offload-<host>-<pid>-<8 hex>-rank<r>; the host name may itself contain dashes
_FOLDER_NAME = re.compile(rf"{re.escape(PREFIX)}(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{{8}}-rank\d+")


# -- folders on disk --------------------------------------------------------------------------------------------
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


def remove_stale(root: Path) -> None:
    """Remove the folders (and probe files) of runs on this host whose process is gone ([Note: offload files])."""
    host = socket.gethostname()
    for d in root.glob(PREFIX + "*"):
        pid = _owner_pid(d, host) if d.is_dir() else None
        if pid is not None and pid != os.getpid() and not _pid_alive(pid) and remove_folder(d):
            get_logger().info("removed the offload folder %s left by a run that ended without closing it", d)
    for probe in root.glob(f".{PREFIX}probe-*"):  # .memsave-offload-probe-<pid>-<hex> (check_disk_path, tiers.py)
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


def remove_live_folder(folder: Path) -> None:
    """Remove ``folder``, one this process holds, and forget it; then the ``path`` above it if memsave made it
    and nothing else is left in it (:func:`mark_made`)."""
    remove_folder(folder)
    with _live_lock:
        _live.discard(folder)
    remove_made(folder.parent)


MADE = ".memsave-made"  # in an offload path that memsave created: it goes with the last folder in it


def mark_made(root: Path) -> None:
    """``root`` (``[offload] path``) did not exist and memsave created it: marked, so that the process removing
    the last offload folder in it removes it too (``zero3-infinity``'s relative default left an empty
    ``memsave-offload/`` in the working directory after every run). A folder that existed is never removed."""
    try:
        (root / MADE).touch()
    except OSError:
        pass


def make_root(root: Path) -> None:
    """Create ``root`` where it is missing, marked as memsave's (:func:`mark_made`)."""
    made = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    if made:
        mark_made(root)


def remove_made(root: Path) -> None:
    """Remove ``root`` if memsave made it (:func:`mark_made`) and only its marker is left. Not called where a
    new folder may follow (:func:`remove_stale`, before this run's own).

    [Note: a shared path] Ranks on one host share ``path``, and one rank may close while another is opening
    (wrap, close, wrap: ranks drift apart between collectives). Removal can therefore run between another
    rank's :func:`make_root` and its :func:`new_folder`; both of those create ``root`` again where it is gone,
    and a removal that finds a folder came in after its check puts the marker back, so ``root`` stays
    memsave's and goes with the last folder."""
    try:
        if {p.name for p in root.iterdir()} != {MADE}:
            return
        (root / MADE).unlink()
    except OSError:  # another rank removed it first
        return
    try:
        root.rmdir()
    except OSError:  # another rank's folder (or the user's file) came in between: still memsave's
        mark_made(root)


def remove_live_folders() -> None:
    """Remove every offload folder this process holds (the signal path; ``close()`` is the normal one)."""
    for folder in live_folders():
        remove_live_folder(folder)


def new_folder(root: Path, rank: int) -> Path:
    """Create this process's offload folder for ``rank`` under ``root`` ([Note: offload files]): removed on
    SIGTERM, recorded for the launcher and held as live before it exists, its ``OWNER`` file written."""
    folder = root / f"{PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}-rank{rank}"
    cleanup_on_signals()  # SIGTERM removes the folder ([Note: cleanup on signals])
    _record(folder)
    with _live_lock:
        _live.add(folder)
    for attempt in range(3):
        try:
            folder.mkdir()
            break
        except FileNotFoundError:  # another rank removed root after this one checked it ([Note: a shared path])
            if attempt == 2:
                raise
            make_root(root)
    (folder / "OWNER").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    return folder


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
