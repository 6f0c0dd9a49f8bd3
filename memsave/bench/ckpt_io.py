"""What ``memsave bench --checkpoint`` measures besides the checkpoints: the disk itself (a plain write of the
same bytes with ``fsync``, a plain read), the page cache dropped for the files a load reads, the bytes each rank
wrote, and the peak RSS of a phase.

[Note: fair disk baseline] ``memsave.save`` (DCP's ``FileSystemWriter(sync_files=True)``) and ``dcp.save``
``fsync`` every file they write, so the plain write does too: one ``write`` of a ready buffer (no serialization),
then ``fsync``, in the same directory as the checkpoints, on every rank at once as the ranks save. Before each
timed load (and plain read) the files it reads are dropped from the page cache (``posix_fadvise(DONTNEED)``, on
those files only: they are clean after the ``fsync``), so every load reads from the disk.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import torch

from memsave.memory import rss_bytes

__all__ = ["PeakRss", "evict", "files_bytes", "plain_read", "plain_write", "rank_files"]

_BLOCK = 8 << 20


def plain_write(path: Path, data: memoryview) -> float:
    """Seconds to create ``path``, write ``data`` and ``fsync`` it (see [Note: fair disk baseline])."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def plain_read(path: Path, into: bytearray) -> float:
    """Seconds to read ``path`` whole into ``into`` (as large as the file)."""
    view = memoryview(into)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < len(view):
            n = f.readinto(view[done : done + _BLOCK])
            if not n:
                break
            done += n
    return time.perf_counter() - t0


def random_bytes(n: int) -> memoryview:
    """``n`` bytes of random data (nothing a file system could compress or skip)."""
    words = torch.randint(-(2**31), 2**31 - 1, ((n + 3) // 4,), dtype=torch.int32)
    return memoryview(words.numpy().tobytes())[:n]


def evict(paths: list[Path]) -> None:
    """Drop ``paths`` (files, or every file under a directory) from the page cache."""
    for p in paths:
        for f in ([p] if p.is_file() else [q for q in p.rglob("*") if q.is_file()]):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def rank_files(path: Path, rank: int, *, memsave: bool) -> list[Path]:
    """The files rank ``rank`` wrote into checkpoint ``path``: its DCP shard file, and memsave's per-rank JSON;
    rank 0 also DCP's ``.metadata`` (and memsave's manifest)."""
    files = sorted(path.glob(f"__{rank}_*.distcp"))
    if memsave:
        files.append(path / f"rank{rank}.json")
    if rank == 0:
        files += [path / ".metadata"] + ([path / "memsave.json"] if memsave else [])
    return files


def files_bytes(files: list[Path]) -> int:
    return sum(f.stat().st_size for f in files)


class PeakRss:
    """The peak resident memory of this process over a phase: :meth:`reset` at its start, :meth:`read` at its end.

    Exact where the kernel lets a process reset its high-water mark (``/proc/self/clear_refs`` 5, Linux >= 4.0;
    read back as ``VmHWM``); elsewhere a thread samples the RSS every ``interval_s``."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.exact = self._clear()
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if not self.exact:
            self._thread = threading.Thread(target=self._sample, args=(interval_s,), daemon=True,
                                            name="memsave-bench-rss")
            self._thread.start()

    @staticmethod
    def _clear() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return _hwm() is not None
        except OSError:
            return False

    def _sample(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self._peak = max(self._peak, rss_bytes())

    def reset(self) -> None:
        if self.exact:
            self._clear()
        else:
            self._peak = rss_bytes()

    def read(self) -> int:
        if self.exact:
            return max(_hwm() or 0, rss_bytes())
        return max(self._peak, rss_bytes())

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            found = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M)
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None
