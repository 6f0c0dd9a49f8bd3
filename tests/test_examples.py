"""examples/train_gpt.py runs as a user would start it: plain python, torchrun, and accelerate launch.

The three launches start together (they spend most of their time starting Python and torch, so they overlap
well) and each must exit 0 within the timeout, print losses and the memory report, with one row per rank.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "examples/train_gpt.py"
TIMEOUT_S = 120
ARGS = ["--size", "tiny", "--steps", "5", "--batch-size", "2", "--seq-len", "32", "--log-every", "2"]


def _console_script(name: str, module: str) -> list[str]:
    """The ``torchrun`` / ``accelerate`` command installed beside this interpreter, else ``python -m`` of the
    module it runs (the same entry point, whatever PATH says)."""
    script = Path(sys.executable).with_name(name)
    return [str(script)] if script.is_file() else [sys.executable, "-m", module]


def _commands() -> dict[str, tuple[list[str], int]]:
    """name -> (command line, number of processes)."""
    return {
        "python": ([sys.executable, SCRIPT, *ARGS, "--profile", "ddp"], 1),
        "torchrun": ([*_console_script("torchrun", "torch.distributed.run"), "--nproc-per-node", "2",
                      "--master-port", str(free_port()), SCRIPT, *ARGS, "--profile", "zero3"], 2),
        # --multi_gpu also on a CPU-only machine (accelerate refuses it together with --cpu); the other flags
        # answer what accelerate would otherwise take from a config file or warn about; port 0: a free one
        "accelerate": ([*_console_script("accelerate", "accelerate.commands.accelerate_cli"), "launch",
                        "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                        "--dynamo_backend", "no", "--main_process_port", "0", SCRIPT, *ARGS, "--profile", "zero2"], 2),
    }


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith(("TORCHELASTIC_", "ACCELERATE_"))}
    env["OMP_NUM_THREADS"] = "1"
    env["MEMSAVE_TIMEOUT_S"] = str(TIMEOUT_S - 30)  # a hung collective fails inside the run, with its traceback
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["HF_HOME"] = str(tmp / "hf")  # no accelerate config file of this machine's user is read
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, str, float, int]]:
    """Start every launch at once; name -> (exit code, stdout, stderr, seconds, number of processes)."""
    env = _env(tmp_path_factory.mktemp("examples"))
    started = {}
    for name, (cmd, nproc) in _commands().items():
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # its own process group, so a hang can be killed whole
        started[name] = (proc, nproc, time.monotonic())
    results = {}
    for name, (proc, nproc, t0) in started.items():
        try:
            out, err = proc.communicate(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            # SIGTERM first: torchrun and accelerate then stop their workers (which run in sessions of their own)
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                out, err = proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
            err += f"\n[test] stopped after {TIMEOUT_S}s"
        results[name] = (proc.returncode, out, err, time.monotonic() - t0, nproc)
    return results


@pytest.mark.parametrize("launcher", ["python", "torchrun", "accelerate"])
def test_train_gpt_example_runs(runs: dict, launcher: str) -> None:
    rc, out, err, seconds, nproc = runs[launcher]
    assert rc == 0, f"{launcher}: exit code {rc} after {seconds:.0f}s\n--- stdout\n{out}\n--- stderr\n{err[-4000:]}"
    assert f"dp={nproc} " in out, out  # the mesh line: every process joined
    losses = [float(x) for x in re.findall(r"\| loss (\d+\.\d+) \|", out)]
    assert len(losses) == 3 and all(0 < x < 10 for x in losses), out  # steps 0, 2, 4 on rank 0 only
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("memory report"))
    assert "params" in lines[start + 1] and "optimizer_state" in lines[start + 1], out
    ranks = [int(line.split()[0]) for line in lines[start + 2 :] if re.match(r"^\s*\d+\s", line)]
    assert ranks == list(range(nproc)), f"{launcher}: report rows for ranks {ranks}, expected {nproc}\n{out}"
