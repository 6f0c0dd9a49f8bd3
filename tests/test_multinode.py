"""Multi-node launch, simulated (issue 18, C): two ``torchrun --nnodes 2 --rdzv-backend c10d`` invocations on this
machine, one process each, train ``memsave demo`` to the same losses as one ``torchrun --nproc-per-node 2``. On
the two "nodes" each process is LOCAL_RANK 0 while RANK is 0 and 1, so anything that took the local rank for the
global one (the mesh, the data shard, rank-0 printing, the report folder) would show here.

The three launchers start together (they spend most of their time starting Python and torch, so they overlap),
each in a session of its own with its output in files (not undrained pipes, as tests/test_launch_faults.py
explains) and a deadline, after which SIGTERM and then SIGKILL stop the whole group (as tests/test_examples.py
does). c10d rendezvous ignores ``--node-rank`` (torchrun says so) and hands out the node ranks in the order the
agents join, so which invocation gets RANK 0 is not fixed: the test asks only that both ranks are there.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.harness import free_port
from tests.test_examples import _console_script, _env

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 150
DEMO = ["-m", "memsave", "demo", "--size", "tiny", "--profile", "zero2", "--steps", "4", "--batch-size", "2",
        "--seq-len", "32", "--log-every", "1", "--no-progress", "--no-track"]
# not anchored at line starts: ranks that share torchrun's stdout may run their lines into each other
RANK_LINE = re.compile(r"memsave demo: rank (\d+) of (\d+), local rank (\d+) on ")


def _start(cmd: list[str], out: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    with open(out.with_suffix(".out"), "w") as stdout, open(out.with_suffix(".err"), "w") as stderr:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=stdout, stderr=stderr,
                                start_new_session=True)  # its own process group, so a hang can be stopped whole


def _finish(proc: subprocess.Popen[str], out: Path, deadline: float) -> tuple[int, str, str]:
    """Exit code, stdout and stderr, once the launcher ended or was stopped at ``deadline``."""
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # torchrun then stops its workers (in sessions of their own)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out.with_suffix(".out").read_text(), out.with_suffix(".err").read_text()


def _losses(stdout: str) -> list[str]:
    """Rank 0's loss per step and its val loss, as printed."""
    steps = re.findall(r"step +\d+/\d+ \| loss (\d+\.\d+) \|", stdout)
    final = re.search(r"over \d+ steps \(val loss (\d+\.\d+)\)", stdout)
    return [*steps, final[1] if final else "no val loss"]


@pytest.mark.slow
def test_two_nodes_of_one_process_train_as_one_node_of_two(tmp_path: Path) -> None:
    # gloo on the CPU also on a GPU machine: with one GPU, NCCL refuses two ranks on the same device
    env = {**_env(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    torchrun = _console_script("torchrun", "torch.distributed.run")
    endpoint = f"127.0.0.1:{free_port()}"
    reports = tmp_path / "reports"
    runs = {}
    for node in (0, 1):
        cmd = [*torchrun, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "memsave-multinode",
               *DEMO, "--report-dir", str(reports)]
        runs[f"node{node}"] = cmd
    runs["one-node"] = [*torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), *DEMO,
                        "--report-dir", ""]
    procs = {name: _start(cmd, tmp_path / name, env) for name, cmd in runs.items()}
    deadline = time.monotonic() + TIMEOUT_S
    results = {name: _finish(proc, tmp_path / name, deadline) for name, proc in procs.items()}
    for name, (rc, out, err) in results.items():
        assert rc == 0, f"{name}: exit code {rc}\n--- stdout\n{out}\n--- stderr\n{err[-4000:]}"

    # each node's process is local rank 0 of its node, and between them they are ranks 0 and 1 of 2
    seen = {name: RANK_LINE.findall(results[name][1]) for name in ("node0", "node1")}
    assert sorted(seen["node0"] + seen["node1"]) == [("0", "2", "0"), ("1", "2", "0")], seen
    # on one node the same two ranks are local ranks 0 and 1
    assert sorted(RANK_LINE.findall(results["one-node"][1])) == [("0", "2", "0"), ("1", "2", "1")]
    main = "node0" if seen["node0"] == [("0", "2", "0")] else "node1"
    other = "node1" if main == "node0" else "node0"

    # rank 0 alone prints the run and writes its report folder; the losses are the one-node run's
    assert "memsave demo: GPT tiny" not in results[other][1] and "loss " not in results[other][1]
    losses = _losses(results[main][1])
    assert len(losses) == 5 and losses == _losses(results["one-node"][1]), (losses, results["one-node"][1])
    folders = list(reports.iterdir())
    assert len(folders) == 1 and (folders[0] / "report.json").is_file(), folders


def test_demo_under_a_launcher_takes_its_processes(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Started as one of torchrun's ranks, ``memsave demo`` runs as that rank; a --nproc that is not the launcher's
    WORLD_SIZE is refused before anything starts."""
    from memsave.cli import main

    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    assert main(["demo", "--size", "tiny", "--nproc", "3", "--report-dir", ""]) == 2
    err = capsys.readouterr().err
    assert "--nproc 3" in err and "WORLD_SIZE=2" in err, err
