"""What a failed local launch reports: :class:`LaunchError`, raised by :func:`memsave._launch.spawn_local`, and
what the launcher knows of each rank, from which it names the rank that caused a failure.

[Note: root cause] A rank killed by a signal (the OOM killer's SIGKILL) reports nothing, and its peers then fail
in their next collective ("Connection reset by peer"), which is all they can report. So after the first failure
the launcher waits up to ``SETTLE_S`` for the others, and names as the cause the first rank, in the order seen,
that died without a word or raised something other than a lost peer; the rest are listed as stopped because of
it, as torchrun's "root cause" does. Out of memory (SIGKILL, ``MemoryError``, "can't allocate memory", CUDA's
out of memory) is said as such, with the rank's peak resident memory: the kernel's high-water mark, from the
rank itself when it raised, else the last the launcher read in ``/proc``.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Sequence
from typing import Any

import psutil

__all__ = ["LaunchError", "Ranks", "describe_exit"]

_RSS_POLL_S = 0.25
_OOM_HINT = ("see what a run needs per rank with `memsave estimate`, or use a profile that needs less memory "
             "(zero3, offload to CPU or disk, recompute, a smaller batch)")
# what a rank reports when a peer vanished under it: a consequence, never the cause ([Note: root cause])
_PEER_LOST = re.compile(r"connection (reset|closed|refused|aborted)|broken pipe|by peer|peer (closed|died|hung)|"
                        r"socket closed|ECONNRESET|EPIPE|timed out|timeout", re.IGNORECASE)


class LaunchError(RuntimeError):
    """A local process failed, died or timed out.

    Attributes:
        rank: the rank that caused it ([Note: root cause]; -1 for a timeout).
        exc_type: the name of the exception it raised ("" when it died without one, "TimeoutError").
        message: the exception's message, or how it died ("killed by SIGKILL (exit code -9)").
        child_traceback: the traceback in the child, as text.
        exit_code: the process's exit code when it died (negative: the signal), else None.
        out_of_memory: it ran out of memory, or was SIGKILLed (which is usually that).
        peak_rss: its peak resident memory in bytes, where known.
    """

    def __init__(self, summary: str, *, rank: int, exc_type: str, message: str, child_traceback: str = "",
                 exit_code: int | None = None, out_of_memory: bool = False, peak_rss: int | None = None) -> None:
        super().__init__(summary if not child_traceback else f"{summary}\n\n{child_traceback}")
        self.summary = summary
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.child_traceback = child_traceback
        self.exit_code = exit_code
        self.out_of_memory = out_of_memory
        self.peak_rss = peak_rss

    def with_note(self, note: str) -> LaunchError:
        """The same error with ``note`` added to its summary (e.g. the caller's advice for out of memory)."""
        return LaunchError(f"{self.summary}\n{note}", rank=self.rank, exc_type=self.exc_type, message=self.message,
                           child_traceback=self.child_traceback, exit_code=self.exit_code,
                           out_of_memory=self.out_of_memory, peak_rss=self.peak_rss)


def describe_exit(code: int | None) -> str:
    """How a process ended, from its exit code: "killed by SIGKILL (exit code -9)", "exited with code 1"."""
    if code is None:
        return "still running"
    signum = -code if code < 0 else code - 128 if code > 128 else 0
    try:
        name = signal.Signals(signum).name if signum else ""
    except ValueError:
        name = ""
    if code < 0:
        verb = "terminated" if signum == signal.SIGTERM else "interrupted" if signum == signal.SIGINT else "killed"
        return f"{verb} by {name or f'signal {signum}'} (exit code {code})"
    return f"exited with code {code}" + (f" (128 + {name})" if name else " without a result or an error")


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def _rss_peak(pid: int) -> int:
    """The kernel's high-water mark of ``pid``'s resident memory (``VmHWM``), else its current RSS; 0 if gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return 0


def _is_out_of_memory(exc_type: str, message: str) -> bool:
    text = message.lower()
    return (exc_type in ("MemoryError", "OutOfMemoryError") or "can't allocate memory" in text
            or "out of memory" in text or "cannot allocate memory" in text)


class Ranks:
    """What the launcher knows of each rank: its result, its error or how it died, in the order seen."""

    def __init__(self, procs: Sequence[Any]) -> None:
        self.procs = procs
        self.results: dict[int, Any] = {}
        self.errors: dict[int, tuple[str, str, str, dict[str, int]]] = {}
        self.deaths: dict[int, int] = {}
        self.order: list[int] = []  # ranks in the order their error or death was seen
        self.peaks = [0] * len(procs)
        self._next_sample = 0.0

    def done(self, rank: int) -> bool:
        return rank in self.results or rank in self.errors or rank in self.deaths

    def _drain(self, queue: Any) -> None:
        while not queue.empty():
            rank, succeeded, value = queue.get()
            if succeeded:
                self.results[rank] = value
            elif rank not in self.errors:
                self.errors[rank] = value
                self.order.append(rank)

    def poll(self, queue: Any) -> None:
        self._drain(queue)
        if time.monotonic() >= self._next_sample:
            self._next_sample = time.monotonic() + _RSS_POLL_S
            for r, p in enumerate(self.procs):
                if p.pid is not None and not self.done(r):
                    self.peaks[r] = max(self.peaks[r], _rss_peak(p.pid))
        for r, p in enumerate(self.procs):
            if not self.done(r) and not p.is_alive():
                self._drain(queue)  # what it sent before it ended is in the pipe by now
                if not self.done(r):
                    self.deaths[r] = p.exitcode
                    self.order.append(r)

    def failed(self) -> bool:
        return bool(self.order)

    def all_ended(self) -> bool:
        return all(self.done(r) for r in range(len(self.procs)))

    def _root(self) -> int:
        for r in self.order:
            if r in self.deaths or not _PEER_LOST.search(self.errors[r][1]):
                return r
        return self.order[0]

    def error(self) -> LaunchError:
        """The :class:`LaunchError` naming the root cause ([Note: root cause]) and what became of the others."""
        n, root = len(self.procs), self._root()
        if root in self.deaths:
            code = self.deaths[root]
            exc_type, message, tb, verb = "", describe_exit(code), "", "died"
            oom = code == -signal.SIGKILL
            lines = [f"rank {root} of {n} died: {message}" + (": often out of memory (the kernel's OOM killer)"
                                                              if oom else "")]
            peak, seen = self.peaks[root] or None, " (the last the launcher saw)"
        else:
            exc_type, message, tb, facts = self.errors[root]
            code, verb = None, "failed"
            oom = _is_out_of_memory(exc_type, message)
            lines = [f"rank {root} of {n} failed: {exc_type}: {message}"]
            peak, seen = facts.get("peak_rss") or self.peaks[root] or None, ""
            if "device_peak" in facts:
                seen += f", its device's {_mib(facts['device_peak'])}"
        if oom:
            said = f"rank {root}'s resident memory peaked at {_mib(peak)}{seen}; " if peak else ""
            lines.append(f"{'' if code else 'out of memory: '}{said}{_OOM_HINT}")
        for r in range(n):
            if r == root:
                continue
            if r in self.results:
                lines.append(f"  rank {r}: had finished")
            elif r in self.deaths:
                lines.append(f"  rank {r}: also died: {describe_exit(self.deaths[r])}")
            elif r in self.errors and not _PEER_LOST.search(self.errors[r][1]) and self.errors[r][1] != message:
                lines.append(f"  rank {r}: also failed: {self.errors[r][0]}: {_first_line(self.errors[r][1])}")
            else:
                what = f" ({self.errors[r][0]}: {_first_line(self.errors[r][1])})" if r in self.errors else ""
                lines.append(f"  rank {r}: stopped because rank {root} {verb}{what}")
        return LaunchError("\n".join(lines), rank=root, exc_type=exc_type, message=message, child_traceback=tb,
                           exit_code=code, out_of_memory=oom, peak_rss=peak)


def _first_line(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."

