"""Start local processes the way ``torchrun`` would, for ``memsave demo`` and ``memsave bench``.

``spawn_local(fn, nprocs, args, timeout_s=...)`` picks a free port, starts ``nprocs`` processes (torch's
``spawn`` context) with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, so
``memsave.init()`` inside ``fn`` joins them into one process group, and returns ``fn(*args)`` of every rank in
rank order. On CPU each process gets an equal share of the cores as torch threads.

The first rank that raises ends the run: every other process is killed (its peers would otherwise wait in a
collective until the timeout) and :class:`LaunchError` is raised with the rank, the exception's type and
message, and the child's traceback. The same happens to all of them after ``timeout_s``.

[Note: port clash] The port is free when :func:`free_port` looks, not necessarily when rank 0's store binds it a
few seconds later: another process may take it in between, or two launches may be handed the same one. Rank 0
then fails with ``EADDRINUSE`` before any work is done, so the launch is started again, all processes anew, on a
new port (``PORT_ATTEMPTS`` launches in all), and the retry is said in the log. Only that failure is retried.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp

from memsave._logging import get_logger
from memsave.dist import shutdown

__all__ = ["PORT_ATTEMPTS", "LaunchError", "free_port", "is_port_clash", "spawn_local"]

PORT_ATTEMPTS = 3  # launches per spawn_local call when the rendezvous port was taken (see [Note: port clash])


class LaunchError(RuntimeError):
    """A local process failed, died or timed out.

    Attributes:
        rank: the first rank that failed (-1 for a timeout).
        exc_type: the name of the exception it raised ("" when it died without one, "TimeoutError").
        message: the exception's message.
        child_traceback: the traceback in the child, as text.
    """

    def __init__(self, summary: str, *, rank: int, exc_type: str, message: str, child_traceback: str = "") -> None:
        super().__init__(summary if not child_traceback else f"{summary}\n\n{child_traceback}")
        self.summary = summary
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.child_traceback = child_traceback


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _child(rank: int, nprocs: int, port: int, threads: int, fn: Callable[..., Any], args: tuple[Any, ...],
           queue: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nprocs),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    try:
        result = fn(*args)
    except BaseException as exc:  # reported to the parent, which ends the run
        queue.put((rank, False, (type(exc).__name__, str(exc), traceback.format_exc())))
        return
    queue.put((rank, True, result))
    shutdown()  # a clean end for the process group (NCCL warns at exit otherwise)


def _stop(procs: Sequence[Any], *, graceful: bool) -> None:
    """Join the processes (after a clean run) or kill them (after a failure or a timeout)."""
    for p in procs:
        if graceful:
            p.join(timeout=10)
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join()


def is_port_clash(exc: LaunchError) -> bool:
    """Whether the launch failed because the rendezvous port was taken (rank 0's store could not listen)."""
    text = exc.message.lower()
    return "eaddrinuse" in text or "address already in use" in text


def spawn_local(fn: Callable[..., Any], nprocs: int, args: Sequence[Any] = (), *, timeout_s: float) -> list[Any]:
    """``fn(*args)`` in ``nprocs`` local processes; their return values in rank order.

    ``fn`` must be a module-level function and ``args`` and the results picklable. Raises :class:`LaunchError`
    if a rank raises, dies or has not returned after ``timeout_s`` seconds; all processes are gone by then. A
    launch whose port was taken is started again on another one (see [Note: port clash]); ``timeout_s`` applies
    to each launch.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs={nprocs!r} is not allowed; expected a positive number of processes")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r} is not allowed; expected a positive number of seconds")
    ports: list[int] = []
    while True:
        ports.append(free_port())
        try:
            return _launch_once(fn, nprocs, tuple(args), timeout_s, ports[-1])
        except LaunchError as exc:
            if not is_port_clash(exc):
                raise
            if len(ports) >= PORT_ATTEMPTS:
                tried = ", ".join(map(str, ports))
                raise LaunchError(f"{exc.summary} (the rendezvous port was taken on all {len(ports)} launches: "
                                  f"ports {tried})", rank=exc.rank, exc_type=exc.exc_type, message=exc.message,
                                  child_traceback=exc.child_traceback) from None
            get_logger().warning("port %d was taken before rank 0 could listen on it (%s); starting the %d "
                                 "processes again on another port", ports[-1], exc.exc_type, nprocs)


def _launch_once(fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...], timeout_s: float,
                 port: int) -> list[Any]:
    """One launch of ``nprocs`` processes rendezvousing on ``port``; see :func:`spawn_local`."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    threads = max(1, _cpu_count() // nprocs)
    procs = [ctx.Process(target=_child, args=(r, nprocs, port, threads, fn, args, queue), daemon=True)
             for r in range(nprocs)]
    results: dict[int, Any] = {}
    ok = False
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while len(results) < nprocs:
            if not queue.empty():
                rank, succeeded, value = queue.get()
                if not succeeded:
                    exc_type, message, tb = value
                    raise LaunchError(f"rank {rank} of {nprocs} failed: {exc_type}: {message}", rank=rank,
                                      exc_type=exc_type, message=message, child_traceback=tb)
                results[rank] = value
                continue
            dead = [r for r, p in enumerate(procs) if r not in results and not p.is_alive()]
            if dead:
                time.sleep(0.2)  # a result may still be in the pipe
                if queue.empty():
                    codes = ", ".join(f"rank {r}: {procs[r].exitcode}" for r in dead)
                    raise LaunchError(
                        f"{len(dead)} of {nprocs} processes exited without a result ({codes}); a negative code is "
                        "the signal that ended it (-9: killed, often out of memory)",
                        rank=dead[0], exc_type="", message=f"exit code {procs[dead[0]].exitcode}",
                    )
                continue
            if time.monotonic() > deadline:
                missing = sorted(set(range(nprocs)) - set(results))
                raise LaunchError(
                    f"ranks {missing} of {nprocs} did not finish within {timeout_s:.0f} s; all processes were "
                    "stopped (a hang in a collective, or raise the timeout)",
                    rank=-1, exc_type="TimeoutError", message=f"timed out after {timeout_s:.0f} s",
                )
            time.sleep(0.01)
        ok = True
    finally:
        _stop(procs, graceful=ok)
    return [results[r] for r in range(nprocs)]
