"""Run a function in N spawned processes with gloo, the way torchrun would, and fail fast on a hang.

``run_ranks(fn, world_size, *args)`` sets the launcher environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT`` on a free port) in each child, limits it to one thread, calls
``fn(*args)`` there and returns the per-rank results in rank order. A rank's exception is raised in the parent
with the child's traceback; if any rank is still running after ``timeout`` seconds every child is killed and
``TimeoutError`` is raised. ``fn`` must be a module-level function (it is pickled by reference). Run many
sub-cases inside one ``fn`` to pay the spawn cost once.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["free_port", "run_ranks", "torchrun"]


class LogRecords(logging.Handler):
    """The messages memsave's logger emits while attached (``_logging.get_logger().addHandler(...)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any, env: dict) -> None:
    os.environ.clear()  # the parent's environment at the call, as a spawned child would have it (not the fork server's)
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    stacks = _stacks_file(port, rank)
    with open(stacks, "w") as out:  # every thread's stack on SIGUSR1: what the parent shows for a hang
        faulthandler.register(signal.SIGUSR1, file=out, all_threads=True)
        _run_child(rank, fn, args, queue, dist)


def _stacks_file(port: int, rank: int) -> str:
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"memsave-test-stacks-{port}-{rank}.txt")


def _run_child(rank: int, fn: Callable[..., Any], args: tuple, queue: Any, dist: Any) -> None:
    ok = False
    try:
        result = fn(*args)
        queue.put((rank, True, result))
        ok = True
    except BaseException as exc:  # surfaced in the parent
        queue.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            if ok:
                _leave_together(dist)
            dist.destroy_process_group()


_PRELOAD = ["torch", "torch.distributed", "numpy", "transformers", "memsave", "memsave.zero", "memsave.tp", "tests.harness",
            # imported on first use in nearly every rank: torch._dynamo by torch.optim.Optimizer's constructor
            # (2.4 s of CPU a process), Llama's modeling, accelerate and DCP by many tests
            "torch._dynamo", "pytest", "transformers.models.llama.modeling_llama", "accelerate",
            "torch.distributed.checkpoint", "memsave.pp", "tests.toy"]


def _context() -> Any:
    """A fork server that has imported torch and memsave once: each rank forks from it in a fraction of a second,
    where a spawned interpreter imports them again (about 2.5 s a process on this project's CI machine, paid by
    every group of every test). The children still start clean: nothing in the server has run torch code, so no
    thread pool or process group is inherited, and ``_child`` gives them the caller's environment."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _leave_together(dist: Any) -> None:
    """Rank 0 hosts the store: after its result is handed over it waits for the others before leaving, so a rank
    still using the store (a late ``new_group``) does not find it gone. A rank that failed or hangs is the test's
    outcome already: the wait gives up quietly on an error, and the parent kills what is left."""
    try:
        dist.barrier()
    except Exception:  # (reported already, or not this rank's)
        pass


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, env: dict[str, str] | None = None
) -> list[Any]:
    """``fn(*args)`` on ``world_size`` spawned ranks; their return values in rank order."""
    ctx = _context()
    queue = ctx.SimpleQueue()
    port = free_port()
    # multi-rank tests run on CPU with gloo: on a GPU machine every rank would otherwise take its own GPU (or, with
    # one GPU, two ranks the same one, which NCCL cannot serve)
    child_env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    procs = [
        ctx.Process(target=_child, args=(r, world_size, port, fn, args, queue, child_env), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            if not queue.empty():
                rank, ok, value = queue.get()
                if not ok:
                    raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
                results[rank] = value
                continue
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results and p.exitcode != 0]
            if dead and queue.empty():
                time.sleep(0.2)  # a result may still be in flight
                if queue.empty():
                    raise RuntimeError(f"ranks {dead} died with exit codes {[procs[r].exitcode for r in dead]}")
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(results))
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s (hang?)"
                                   + _stacks(procs, missing, port))
            time.sleep(0.01)
    finally:
        for r in range(world_size):
            with contextlib.suppress(OSError):
                os.remove(_stacks_file(port, r))
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world_size)]


def _stacks(procs: list[Any], ranks: list[int], port: int) -> str:
    """The Python stacks of every thread of the ranks still running (faulthandler, on SIGUSR1)."""
    for r in ranks:
        if procs[r].is_alive():
            with contextlib.suppress(OSError):
                os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(1.0)
    out = []
    for r in ranks:
        with contextlib.suppress(OSError):
            with open(_stacks_file(port, r)) as f:
                out.append(f"\n--- rank {r} ---\n{f.read()}")
    return "".join(out)


def torchrun(root: Any, script: str, *args: str, nproc: int = 2, max_restarts: int = 1,
             timeout: float = 150) -> tuple[str, str]:
    """``torchrun --nproc-per-node nproc --max-restarts max_restarts script args`` from ``root`` in a session of its
    own (killed whole on timeout), with none of this process's launcher variables; its (stdout, stderr), after
    asserting it exited 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "RANK", "WORLD_SIZE",
                                                                     "LOCAL_", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(root), MEMSAVE_TIMEOUT_S="60")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--max-restarts",
           str(max_restarts), "--monitor-interval", "0.2", "--master-port", str(free_port()), script, *args]
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err[-3000:]}"
    return out, err
