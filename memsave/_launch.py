"""Start local processes the way ``torchrun`` would, for ``memsave demo`` and ``memsave bench``.

``spawn_local(fn, nprocs, args, timeout_s=...)`` picks a free port, starts ``nprocs`` processes (torch's
``spawn`` context) with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, so
``memsave.init()`` inside ``fn`` joins them into one process group, and returns ``fn(*args)`` of every rank in
rank order. On CPU each process gets an equal share of the cores as torch threads.

The first rank that raises or dies ends the run ([Note: root cause] in memsave/_launch_faults.py): the others
are stopped (their peers would otherwise wait in a collective until the timeout) and :class:`LaunchError` is
raised naming that rank, its exception or exit signal, and what became of the others. The same happens to all of
them after ``timeout_s``.

[Note: port clash] The port is free when :func:`free_port` looks, not necessarily when rank 0's store binds it a
few seconds later: another process may take it in between, or two launches may be handed the same one. Rank 0
then fails with ``EADDRINUSE`` before any work is done, so the launch is started again, all processes anew, on a
new port (``PORT_ATTEMPTS`` launches in all), and the retry is said in the log. Only that failure is retried.

[Note: orphans and leftovers] No process outlives its launcher, and none leaves offload files behind:
- each rank asks the kernel for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``; strictly, when the thread
  that started it ends); its parent is the fork server ([Note: fork server]), which exits when the launcher
  dies, so the rank's signal follows the launcher's death; and a thread checks the parent
  every ``PARENT_POLL_S`` as a fallback (other systems; a parent that died before the request);
- SIGTERM and SIGINT in a rank remove its offload folders and end it, even inside a collective
  ([Note: cleanup on signals] in ``memsave/offload/folders.py``);
- a result is handed over within ``HANDOFF_TIMEOUT_S`` or the rank exits (nobody may be reading);
- the launcher stops ranks with SIGTERM and gives them ``GRACE_S`` before SIGKILL; SIGTERM to the launcher
  stops them the same way (raising :class:`LaunchInterrupted`, a ``KeyboardInterrupt`` like Ctrl-C);
- then it removes any offload folder its ranks recorded that still exists (a rank that was SIGKILLed).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from memsave._launch_faults import LaunchError, Ranks, describe_exit
from memsave._launch_faults import _is_out_of_memory as _is_out_of_memory  # tests call it as _launch's
from memsave._logging import get_logger
from memsave.dist import shutdown
from memsave.offload import folders

__all__ = ["GRACE_S", "PORT_ATTEMPTS", "LaunchError", "LaunchInterrupted", "describe_exit", "free_port",
           "is_port_clash", "spawn_local"]

PORT_ATTEMPTS = 3  # launches per spawn_local call when the rendezvous port was taken (see [Note: port clash])
GRACE_S = 5.0  # seconds a rank has after SIGTERM before SIGKILL ([Note: orphans and leftovers])
SETTLE_S = 1.0  # after the first failure, the wait for the others' reports ([Note: root cause], _launch_faults.py)
HANDOFF_TIMEOUT_S = 60.0  # a rank whose result is not taken by then exits
PARENT_POLL_S = 1.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class LaunchInterrupted(KeyboardInterrupt):
    """The launcher got SIGTERM (or SIGINT, as ``KeyboardInterrupt``); its processes were stopped first."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


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


# -- in each rank ------------------------------------------------------------------------------------------------
def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)  # the same path as PR_SET_PDEATHSIG's signal


def _die_with_parent(parent_pid: int, workdir: str) -> None:
    """SIGTERM (removing the offload folders) when the launcher dies; see [Note: orphans and leftovers]."""

    def orphaned_leftovers() -> None:  # the launcher cannot remove its folder any more
        if os.getppid() != parent_pid:
            shutil.rmtree(workdir, ignore_errors=True)

    folders.cleanup_on_signals((signal.SIGTERM, signal.SIGINT), also=orphaned_leftovers)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        except (OSError, AttributeError):  # the poll below still catches it
            pass
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="memsave-parent-watch", daemon=True).start()


def _memory_facts() -> dict[str, int]:
    """This process's peak resident memory (and on CUDA the allocator's peak), for an out-of-memory report."""
    facts = {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)}
    try:
        if torch.cuda.is_initialized():
            facts["device_peak"] = int(torch.cuda.max_memory_allocated())
    except RuntimeError:
        pass
    return facts


def _thread_lock_for_tqdm() -> None:
    """tqdm's default write lock is a multiprocessing lock: a named semaphore, which a rank ended by a signal leaves
    to the resource tracker, and the tracker then warns about it on the user's terminal. A rank's progress bars
    need only a thread lock."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def _hand_off(queue: Any, item: tuple[Any, ...]) -> BaseException | None:
    """``queue.put(item)``, given up after ``HANDOFF_TIMEOUT_S`` (the launcher is gone or stuck): then this
    process removes its offload folders and exits. Returns the exception ``put`` raised (e.g. pickling)."""
    raised: list[BaseException] = []

    def put() -> None:
        try:
            queue.put(item)
        except BaseException as exc:
            raised.append(exc)

    sender = threading.Thread(target=put, name="memsave-result", daemon=True)
    try:
        sender.start()
    except RuntimeError:  # no memory left for a thread's stack: hand it over from here, without the timeout
        put()
        return raised[0] if raised else None
    sender.join(HANDOFF_TIMEOUT_S)
    if sender.is_alive():
        print(f"memsave: rank {item[0]}: nobody took this process's result within {HANDOFF_TIMEOUT_S:.0f} s "
              "(the launcher is gone?); exiting", file=sys.stderr, flush=True)
        folders.remove_live_folders()
        os._exit(1)
    return raised[0] if raised else None


def _child(rank: int, nprocs: int, port: int, threads: int, fn: Callable[..., Any], args: tuple[Any, ...],
           queue: Any, env: dict[str, str], stdio: tuple[int, int], workdir: str) -> None:
    os.environ.clear()  # the launcher's environment at the launch, not the fork server's ([Note: fork server])
    os.environ.update(env)
    for fd, target in ((stdio[0], 1), (stdio[1], 2)):  # and its stdout and stderr now, not the server's
        os.dup2(fd, target)
        os.close(fd)
    _forget_fork_server()
    _die_with_parent(os.getppid(), workdir)
    _thread_lock_for_tqdm()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nprocs),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))
    os.environ[folders.RECORD_ENV] = os.path.join(workdir, "offload-folders")
    torch.set_num_threads(threads)
    try:
        result = fn(*args)
    except BaseException as exc:  # reported to the parent, which ends the run
        _hand_off(queue, (rank, False, (type(exc).__name__, str(exc), traceback.format_exc(), _memory_facts())))
        return
    failed = _hand_off(queue, (rank, True, result))
    if failed is not None:
        _hand_off(queue, (rank, False, (type(failed).__name__, f"its result could not be sent: {failed}", "", {})))
        return
    shutdown()  # a clean end for the process group (NCCL warns at exit otherwise)


# -- in the launcher ----------------------------------------------------------------------------------------------
def _stop(procs: Sequence[Any], *, graceful: bool) -> None:
    """Join the processes (after a clean run) or stop them: SIGTERM, which lets each remove its offload folders,
    then SIGKILL for any still alive after ``GRACE_S`` ([Note: orphans and leftovers])."""
    try:
        if graceful:
            deadline = time.monotonic() + 10
            for p in procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.terminate()
        deadline = time.monotonic() + GRACE_S
        for p in alive:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:  # also on a second Ctrl-C
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            if p.pid is not None:  # (one whose start() raised was never started: its own error goes on)
                p.join()


def _remove_recorded(record: Path) -> None:
    """Remove the offload folders the ranks recorded that still exist: theirs, and all of them are gone."""
    try:
        lines = record.read_text().splitlines()
    except OSError:
        return
    for line in dict.fromkeys(lines):
        folder = Path(line)
        if not line or not folder.name.startswith(folders.PREFIX):
            continue
        if folder.exists() and folders.remove_folder(folder):
            get_logger().info("removed the offload folder %s of a process that was stopped or died", folder)
        # and the path above it, if memsave made it and it is empty now: also where the rank removed its folder
        # but was stopped before the path (a CI run left the path's marker so, on a loaded machine)
        folders.remove_made(folder.parent)


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM to the launcher raises :class:`LaunchInterrupted` (as Ctrl-C raises ``KeyboardInterrupt``), so its
    ranks are stopped and their folders removed; only in the main thread and where SIGTERM has no handler yet."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise LaunchInterrupted(signum)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def is_port_clash(exc: LaunchError) -> bool:
    """Whether the launch failed because the rendezvous port was taken (rank 0's store could not listen)."""
    text = exc.message.lower()
    return "eaddrinuse" in text or "address already in use" in text


def spawn_local(fn: Callable[..., Any], nprocs: int, args: Sequence[Any] = (), *, timeout_s: float) -> list[Any]:
    """``fn(*args)`` in ``nprocs`` local processes; their return values in rank order.

    ``fn`` must be a module-level function and ``args`` and the results picklable. Raises :class:`LaunchError`
    if a rank raises, dies or has not returned after ``timeout_s`` seconds; all processes are gone by then, and
    their offload folders. A launch whose port was taken is started again on another one (see [Note: port
    clash]); ``timeout_s`` applies to each launch. SIGTERM raises :class:`LaunchInterrupted` once every process
    is stopped.
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


def _context() -> Any:
    """[Note: fork server] The ranks fork from a server process that imported torch and memsave once (started on
    the first launch, alive as long as the launcher), instead of each spawning an interpreter that imports them
    again (about 2.5 s a process on a small machine, paid on every launch: the benchmarks launch every
    configuration afresh). ``torch._dynamo`` is among them: torch's ``Optimizer`` constructor imports it on first
    use, another 2.4 s of CPU in every rank (``memsave bench``'s recompute, offload and precision rows together
    went from 55 s to 19 s with it preloaded). Nothing in the server has run torch code, so the ranks inherit no
    thread pool, device context or process group. What a spawned rank would get from the launcher at the launch, it still does:
    multiprocessing passes ``sys.path``, the working directory and the main module, and ``_child`` the
    environment. The ranks' parent is the server, which exits when the launcher dies: the death signal and the
    parent watch ([Note: orphans and leftovers]) follow the server."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "memsave", "memsave.cli"])
    return ctx


class _Fd:
    """A file descriptor of the launcher that arrives in the rank as a descriptor of its own (multiprocessing's
    ``DupFd``, made while the rank is being started: through the fork server's socket)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        from multiprocessing import reduction

        return _fd_in_child, (reduction.DupFd(self.fd),)


def _fd_in_child(dup: Any) -> int:
    return int(dup.detach())


def _forget_fork_server() -> None:
    """A rank inherits the launcher's end of the pipe by which the fork server learns that the launcher is gone
    (multiprocessing hands it over so that a child could use the server too). Held open by a rank, the server
    would outlive a killed launcher, and so would the rank, whose parent it is. The rank closes it; should the rank
    start processes through a fork server, multiprocessing starts a server of its own."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if server is None or fd is None:
        return
    with contextlib.suppress(OSError):
        os.close(fd)
    server._forkserver_alive_fd = None
    server._forkserver_pid = None
    server._forkserver_address = None


def _launch_once(fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...], timeout_s: float,
                 port: int) -> list[Any]:
    """One launch of ``nprocs`` processes rendezvousing on ``port``; see :func:`spawn_local`."""
    ctx = _context()
    queue = ctx.SimpleQueue()
    threads = max(1, _cpu_count() // nprocs)
    workdir = tempfile.mkdtemp(prefix="memsave-launch-")  # the ranks' record of their offload folders
    env = dict(os.environ)
    sys.stdout.flush()
    sys.stderr.flush()
    stdio = (_Fd(1), _Fd(2))
    procs = [ctx.Process(target=_child, args=(r, nprocs, port, threads, fn, args, queue, env, stdio, workdir),
                         daemon=True) for r in range(nprocs)]
    ranks = Ranks(procs)
    ok = False
    try:
        with _sigterm_interrupts():
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout_s
            settled = 0.0
            while len(ranks.results) < nprocs:
                ranks.poll(queue)
                if ranks.failed():
                    settled = settled or time.monotonic() + SETTLE_S
                    if ranks.all_ended() or time.monotonic() > settled:
                        raise ranks.error()
                elif time.monotonic() > deadline:
                    missing = sorted(set(range(nprocs)) - set(ranks.results))
                    raise LaunchError(
                        f"ranks {missing} of {nprocs} did not finish within {timeout_s:.0f} s; all processes were "
                        "stopped (a hang in a collective, or raise the timeout)",
                        rank=-1, exc_type="TimeoutError", message=f"timed out after {timeout_s:.0f} s",
                    )
                time.sleep(0.01)
            ok = True
    finally:
        _stop(procs, graceful=ok)
        _remove_recorded(Path(workdir) / "offload-folders")
        shutil.rmtree(workdir, ignore_errors=True)
    return [ranks.results[r] for r in range(nprocs)]
