"""Faults under the local launcher (issue 24, items 1, 3, 5 and 7): the launcher killed (no orphan), a rank
killed or out of memory (that rank named, with the signal and an out-of-memory hint, not the survivor), SIGTERM
and Ctrl-C (every process ended, within the grace period), and no offload folder left on disk after any of
them; stale folders without an OWNER file removed by the next run.

Each launch runs two ranks that create a disk tier, write a file in it, say they are ready (a pid file) and
then wait: rank 0 in an all-reduce rank 1 never joins (blocked inside gloo, where Python signal handlers do not
run), rank 1 in a sleep. The fault is injected from inside (a rank kills itself or raises) or from the test."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch

import memsave
from memsave import _launch
from memsave import dist as mdist
from memsave._launch import LaunchError, LaunchInterrupted, describe_exit, spawn_local
from memsave.cli import main
from memsave.offload import tiers
from memsave.offload.tiers import DiskTier, aligned_empty

ROOT = Path(__file__).resolve().parents[1]
END_S = 10.0  # issue 24: every injected fault ends all processes within 10 s


# -- the ranks ------------------------------------------------------------------------------------------------------
def _rank(tmp: str, fault: str) -> None:
    mesh = memsave.init()
    tier = DiskTier(os.path.join(tmp, "offload"), rank=mesh.rank, needed_bytes=1 << 20)
    region = tier.allocate("unit0", 1 << 16)
    tier.write_async(region, aligned_empty(1 << 16, torch.device("cpu"))).wait()
    mdist.barrier()  # both folders exist
    Path(tmp, f"rank{mesh.rank}.pid").write_text(str(os.getpid()))
    if mesh.rank == 1:
        if fault == "sigkill":
            Path(tmp, "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer does
        if fault == "memory":
            raise MemoryError("cannot grow the buffer by 3.0 GiB")
        time.sleep(600)
    mdist.all_reduce(torch.ones(4), None)  # rank 1 never joins: blocked in gloo until a peer dies or a signal
    time.sleep(600)


def _pids(tmp: Path, timeout: float = 120.0) -> list[int]:
    """The ranks' pids, once both are ready."""
    deadline = time.monotonic() + timeout
    files = [tmp / "rank0.pid", tmp / "rank1.pid"]
    while not all(f.exists() and f.read_text() for f in files):
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)
    time.sleep(0.3)  # rank 0 into its all-reduce
    return [int(f.read_text()) for f in files]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # dead, not yet reaped by its new parent
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids: list[int], since: float) -> float:
    """Seconds from ``since`` until every pid is gone; fails after END_S."""
    while not all(_gone(p) for p in pids):
        assert time.monotonic() - since < END_S, [p for p in pids if not _gone(p)]
        time.sleep(0.05)
    return time.monotonic() - since


def _left(tmp: Path) -> list[str]:
    """What is left in the offload path: every file's path and size."""
    return [f"{p} ({p.stat().st_size} B)" for p in (tmp / "offload").rglob("*")]


def _launcher(tmp: Path, fault: str = "block") -> subprocess.Popen[str]:
    """``spawn_local`` in a process of its own (its own session, as a terminal's job), printing how it ended."""
    # SIGINT as a terminal's job has it: a job started with & by a non-interactive shell (as CI may run the suite)
    # inherits SIGINT ignored, and so would the launcher and its ranks
    code = (f"import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            f"import sys; from memsave._launch import spawn_local; from tests.test_launch_faults import _rank\n"
            f"try:\n    spawn_local(_rank, 2, ({str(tmp)!r}, {fault!r}), timeout_s=120)\n"
            f"except KeyboardInterrupt as exc:\n    print('interrupted', getattr(exc, 'signum', 2)); sys.exit(1)\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    # output to files, not pipes: a pipe nobody drains until the processes are gone could block a rank's or the
    # launcher's write of its traceback, and so the very ending this measures
    with open(tmp / "launcher.out", "w") as out, open(tmp / "launcher.err", "w") as err:
        return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, text=True, stdout=out, stderr=err,
                                start_new_session=True)


def _output(tmp: Path) -> tuple[str, str]:
    return (tmp / "launcher.out").read_text(), (tmp / "launcher.err").read_text()


def _in_thread(fn: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


# -- item 1: the launcher dies --------------------------------------------------------------------------------------
def test_launcher_killed_every_rank_ends_and_removes_its_folder(tmp_path: Path) -> None:
    """SIGKILL of the launcher (as the OOM killer would): the ranks get SIGTERM from the kernel
    (PR_SET_PDEATHSIG) and end, the one blocked in gloo too, each removing its offload folder."""
    proc = _launcher(tmp_path)
    try:
        pids = _pids(tmp_path)
        children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert set(pids) <= set(children) and len(list((tmp_path / "offload").glob("memsave-offload-*"))) == 2
        start = time.monotonic()
        proc.kill()
        proc.wait()
        took = _wait_gone(children, start)  # the ranks and multiprocessing's resource tracker
    finally:
        proc.kill()
    assert took < 5, took
    assert _left(tmp_path) == []
    assert not any(Path(d).exists() for d in tmp_path.glob("memsave-launch-*"))


def test_a_rank_whose_parent_changed_ends_and_a_disk_tier_cleans_up_on_sigterm(tmp_path: Path) -> None:
    """The fallback to PR_SET_PDEATHSIG: a parent-alive check that finds another parent sends SIGTERM; and a
    DiskTier outside the launcher (torchrun's workers) removes its folder on SIGTERM and still ends by it."""
    code = (f"import os; from memsave.offload.tiers import DiskTier; from memsave._launch import _watch_parent\n"
            f"tier = DiskTier({str(tmp_path / 'offload')!r}, rank=0, needed_bytes=1 << 16)\n"
            f"tier.allocate('unit0', 4096); tier._fd('unit0'); print(tier.folder, flush=True)\n"
            f"_watch_parent(os.getppid() + 1)\nimport time; time.sleep(30)\n")  # the signal ends it, not the script
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-2000:]
    assert Path(proc.stdout.strip()).parent == tmp_path / "offload" and _left(tmp_path) == []


# -- item 3 and 7: the dead rank named, out of memory said --------------------------------------------------------
def test_a_killed_rank_is_named_not_the_survivor(tmp_path: Path) -> None:
    """Rank 1 SIGKILLs itself; rank 0, in an all-reduce, sees "Connection reset by peer" and reports that first.
    The error names rank 1, the signal and out of memory, lists rank 0 as stopped because of it, comes within
    END_S, and the launcher removes rank 1's folder (rank 0 removed its own on SIGTERM)."""
    with pytest.raises(LaunchError) as info:
        spawn_local(_rank, 2, (str(tmp_path), "sigkill"), timeout_s=120)
    took = time.time() - float((tmp_path / "killed_at").read_text())
    err = info.value
    assert (err.rank, err.exc_type, err.exit_code, err.out_of_memory) == (1, "", -9, True), err
    lines = err.summary.splitlines()
    assert lines[0] == "rank 1 of 2 died: killed by SIGKILL (exit code -9): often out of memory (the kernel's OOM killer)"
    assert lines[1].startswith("rank 1's resident memory peaked at ") and "MiB (the last the launcher saw); " in lines[1]
    assert "`memsave estimate`" in lines[1]
    assert lines[2].startswith("  rank 0: stopped because rank 1 died"), lines
    assert "rank 0 of 2" not in err.summary and err.peak_rss is not None and err.peak_rss > 10 * 2**20
    assert took < END_S, took
    assert _left(tmp_path) == []


def test_memory_error_says_out_of_memory_with_the_peak(tmp_path: Path) -> None:
    with pytest.raises(LaunchError) as info:
        spawn_local(_rank, 2, (str(tmp_path), "memory"), timeout_s=120)
    err = info.value
    assert (err.rank, err.exc_type, err.out_of_memory) == (1, "MemoryError", True), err
    lines = err.summary.splitlines()
    assert lines[0] == "rank 1 of 2 failed: MemoryError: cannot grow the buffer by 3.0 GiB"
    assert lines[1].startswith("out of memory: rank 1's resident memory peaked at ") and "`memsave estimate`" in lines[1]
    assert lines[2].startswith("  rank 0: stopped because rank 1 failed"), lines
    assert "raise MemoryError" in err.child_traceback
    assert _left(tmp_path) == []


def test_out_of_memory_is_recognized_and_exits_described() -> None:
    assert _launch._is_out_of_memory("RuntimeError", "DefaultCPUAllocator: can't allocate memory: you tried to "
                                     "allocate 3221225472 bytes. Error code 12 (Cannot allocate memory)")
    assert _launch._is_out_of_memory("OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB")
    assert not _launch._is_out_of_memory("RuntimeError", "Connection reset by peer")
    assert describe_exit(-9) == "killed by SIGKILL (exit code -9)"
    assert describe_exit(-15) == "terminated by SIGTERM (exit code -15)"
    assert describe_exit(137) == "exited with code 137 (128 + SIGKILL)" and describe_exit(1) == "exited with code 1 without a result or an error"


def test_demo_out_of_memory_points_to_estimate(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from memsave import cli

    def oom(fn: object, nproc: int, args: tuple, *, timeout_s: float) -> None:
        raise LaunchError("rank 1 of 2 died: killed by SIGKILL (exit code -9): often out of memory", rank=1,
                          exc_type="", message="killed by SIGKILL (exit code -9)", exit_code=-9, out_of_memory=True)

    monkeypatch.setattr(cli, "spawn_local", oom)
    assert main(["demo", "--size", "tiny", "--nproc", "2", "--profile", "zero2", "--report-dir", "",
                 "--zero.bucket_mb=4"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("memsave demo: rank 1 of 2 died: killed by SIGKILL"), err
    assert "memsave estimate predicted " in err and " MiB of tensors per rank for this run (profile zero2)" in err
    assert ("`memsave estimate --model gpt:tiny --world-size 2 --batch-size 8 --seq-len 64 --zero.bucket_mb=4`"
            in err), err


# -- item 5: SIGTERM, Ctrl-C, a rank's death: the grace period, nothing on disk -------------------------------------
def test_sigterm_to_a_rank_in_a_collective_removes_its_folder_itself(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM to rank 0 while it is blocked in gloo: it removes its folder and ends by SIGTERM (the launcher's own
    removal is switched off here, so this is the rank's doing); rank 1 is stopped with SIGTERM and does the same."""
    monkeypatch.setattr(_launch, "_remove_recorded", lambda record: None)
    sent: list[float] = []

    def term_rank_0() -> None:
        pid = _pids(tmp_path)[0]
        sent.append(time.monotonic())
        os.kill(pid, signal.SIGTERM)

    _in_thread(term_rank_0)
    with pytest.raises(LaunchError) as info:
        spawn_local(_rank, 2, (str(tmp_path), "block"), timeout_s=120)
    took = time.monotonic() - sent[0]
    err = info.value
    assert (err.rank, err.exit_code, err.out_of_memory) == (0, -15, False), err
    assert err.summary.splitlines() == ["rank 0 of 2 died: terminated by SIGTERM (exit code -15)",
                                        "  rank 1: stopped because rank 0 died"]
    assert took < 3, took  # no grace period used up: both ended on SIGTERM at once
    assert _left(tmp_path) == []


@pytest.mark.slow  # two launchers in processes of their own: ~15-30 s on 2 cores
@pytest.mark.parametrize("how", ["SIGTERM to the launcher", "Ctrl-C"])
def test_launcher_stopped_ends_everything_and_leaves_nothing(tmp_path: Path, how: str) -> None:
    """SIGTERM to the launcher alone, or SIGINT to the whole process group as a terminal's Ctrl-C sends it: the
    launcher stops its ranks (SIGTERM, grace period) and says it was interrupted; no folder is left."""
    proc = _launcher(tmp_path)
    try:
        pids = _pids(tmp_path)
        start = time.monotonic()
        if how == "Ctrl-C":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        took = _wait_gone(pids, start)
        proc.wait(timeout=END_S)
        launcher_took = time.monotonic() - start
        out, err = _output(tmp_path)
    finally:
        proc.kill()
    signum = signal.SIGINT if how == "Ctrl-C" else signal.SIGTERM
    assert out.strip() == f"interrupted {int(signum)}", (out, err[-2000:])
    assert took < 3 and launcher_took < END_S, (took, launcher_took)
    assert _left(tmp_path) == []


def test_cli_says_terminated(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from memsave import cli

    def terminated(fn: object, nproc: int, args: tuple, *, timeout_s: float) -> None:
        raise LaunchInterrupted(signal.SIGTERM)

    monkeypatch.setattr(cli, "spawn_local", terminated)
    assert main(["demo", "--size", "tiny", "--nproc", "2", "--report-dir", ""]) == 143
    assert capsys.readouterr().err == "memsave demo: terminated by SIGTERM\n"


def test_stale_folders_without_owner_are_removed(tmp_path: Path) -> None:
    """A folder whose OWNER file is gone (its process killed while creating or removing it) is judged by the pid
    in its name: removed when that process is gone, kept when it is alive or on another host."""
    host = socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid, live_pid = int(dead.stdout), os.getppid()
    half = tmp_path / f"memsave-offload-{host}-{dead_pid}-0123abcd-rank1"  # OWNER removed, one unit file left
    live = tmp_path / f"memsave-offload-{host}-{live_pid}-89abcdef-rank0"
    other = tmp_path / f"memsave-offload-other-host-{dead_pid}-deadbeef-rank0"
    owned = tmp_path / f"memsave-offload-{host}-{live_pid}-cafebabe-rank0"  # OWNER names a dead process
    for folder in (half, live, other, owned):
        folder.mkdir()
        (folder / "unit3.state").write_bytes(os.urandom(8192))
    (owned / "OWNER").write_text(json.dumps({"host": host, "pid": dead_pid}))
    probe = tmp_path / f".memsave-offload-probe-{dead_pid}-0badf00d"
    probe.write_bytes(b"\0" * 16)
    tier = DiskTier(str(tmp_path), rank=0, needed_bytes=1 << 16)
    assert not half.exists() and not owned.exists() and not probe.exists()
    assert live.exists() and other.exists() and tier.folder.exists()
    assert tiers.live_folders() == [tier.folder]
    tier.close()
    assert not tier.folder.exists() and tiers.live_folders() == []
