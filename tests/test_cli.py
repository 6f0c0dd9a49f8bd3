"""The ``memsave`` command: ``demo`` end to end on 2 local processes, profile errors, ``profiles``; and the
local launcher's failure handling."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memsave._launch import LaunchError, spawn_local
from memsave.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--size", "tiny", "--nproc", "2", "--batch-size", "4", "--seq-len", "32", "--lr", "3e-3"]


def _losses(text: str) -> tuple[float, float]:
    match = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+) over (\d+) steps", text)
    assert match, text
    return float(match[1]), float(match[2])


def test_demo_tiny_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "out" / "report.json"
    argv = ["demo", *TINY, "--steps", "20", "--micro-batches", "2", "--profile", "zero2", "--no-progress",
            "--optimizer.weight_decay=0.01", "--optimizer.warmup_steps", "2", "--report-json", str(report),
            "--report-dir", str(tmp_path / "run")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "memory report (zero2)" in out and "optimizer_state" in out
    first, last = _losses(out)
    assert first > 5.0 and last < first - 0.5
    data = json.loads(report.read_text())
    assert data["schema"] == "memsave.report/2" and [r["rank"] for r in data["ranks"]] == [0, 1]
    # tracked by default, with the estimate beside it, as JSON and as the page, in this run's own folder
    match = re.search(r"report directory of this run: (\S+)", out)
    assert match, out
    run_dir = Path(match[1])
    assert run_dir.parent == tmp_path / "run" and re.fullmatch(r"zero2-\d{8}-\d{6}", run_dir.name), run_dir
    tracked = json.loads((run_dir / "report.json").read_text())
    assert all(r["timeline"] for r in tracked["ranks"]) and tracked["estimate"]["peak_total"] > 0
    assert tracked["ranks"][0]["peak"]["total"] == pytest.approx(tracked["estimate"]["peak_total"], rel=0.1)
    assert (run_dir / "report.html").stat().st_size > 10_000


def test_demo_through_python_m() -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "memsave.cli", "demo", *TINY, "--steps", "12", "--profile", "zero3",
                           "--report-dir", ""],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "memsave demo: GPT tiny" in proc.stdout and "memory report (zero3)" in proc.stdout
    assert re.search(r"step 12/12 \| loss \d", proc.stdout), proc.stdout  # rank 0's log lines
    assert proc.stdout.count("memsave demo: GPT tiny") == 1  # printed by rank 0 only
    # stderr is a pipe here, not a terminal: a plain progress line (the last step's at least), no tqdm frames
    assert "\r" not in proc.stderr and "it/s" not in proc.stderr and "step/s" not in proc.stderr, proc.stderr
    assert re.search(r"^train 12/12 \(100%\) \| loss \d+\.\d+ \| [\d,]+ tok/s", proc.stderr, re.M), proc.stderr
    first, last = _losses(proc.stdout)
    assert last < first


@pytest.mark.parametrize(("override", "needle"), [
    ("--zero.stagee=1", "'zero.stagee'"),
    ("--zero.stage=7", "'zero.stage' = 7"),
    ("--zeroo.stage=1", "'zeroo'"),
])
def test_bad_override_exits_2_naming_the_key(override: str, needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    start = time.monotonic()
    assert main(["demo", override]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert time.monotonic() - start < 5  # refused before any process starts


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--profile", "nosuch"]) == 2
    assert "'nosuch' is neither a preset nor a .toml file" in capsys.readouterr().err
    assert main(["demo", "--steps", "0"]) == 2
    assert "TrainConfig.steps=0" in capsys.readouterr().err
    assert main(["demo", "stray"]) == 2
    assert "unrecognized argument 'stray'" in capsys.readouterr().err
    assert main([]) == 2


def test_unsupported_profile_in_a_child_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """An error raised inside the processes (here by memsave.wrap) reaches the user as one line."""
    assert main(["demo", *TINY, "--steps", "2", "--offload.activations=cpu", "--recompute.compress=bf16"]) == 2
    err = capsys.readouterr().err
    assert "[offload]" in err and "not implemented" in err and "Traceback" not in err


def test_profiles_lists_presets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profiles"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split()[0] for line in lines]
    assert {"ddp", "zero1", "zero2", "zero3"} <= set(names)
    assert any(line.startswith("ddp") and "data parallel" in line for line in lines)


def _fail_on_rank_1() -> None:
    if os.environ["RANK"] == "1":
        env = [os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")]
        raise KeyError(f"boom {env}")
    time.sleep(600)  # rank 0 would wait forever: the launcher must kill it


def _hang() -> None:
    time.sleep(600)


def test_spawn_local_fails_fast_with_the_child_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 of 2 failed: KeyError: \"boom \['1', '2', '1', '127.0.0.1'\]") as info:
        spawn_local(_fail_on_rank_1, 2, timeout_s=60)
    assert info.value.rank == 1 and info.value.exc_type == "KeyError" and "_fail_on_rank_1" in str(info.value)
    with pytest.raises(LaunchError, match="did not finish within 2 s"):
        spawn_local(_hang, 1, timeout_s=2)
    assert time.monotonic() - start < 30


def test_demo_tensor_parallel_prints_the_one_process_losses(capfd: pytest.CaptureFixture[str]) -> None:
    """`memsave demo --nproc 2 --parallel.tp=2` trains what `--nproc 1` trains: the same global batch, the losses of
    every step equal to the 4 printed decimals (fp32; TP differs from one process by reduction order only)."""
    base = ["demo", "--size", "tiny", "--batch-size", "2", "--seq-len", "32", "--steps", "4", "--log-every", "1",
            "--no-progress", "--report-dir", ""]

    def losses(*more: str) -> list[str]:
        assert main([*base, *more]) == 0
        captured = capfd.readouterr()
        out = captured.out + captured.err  # (rank 0's log lines)
        found = re.findall(r"^step (\d+)/4 \| loss (\d+\.\d+)", out, re.M)
        assert [s for s, _ in found] == ["1", "2", "3", "4"], out
        return [v for _, v in found]

    one = losses("--nproc", "1")
    tp2 = losses("--nproc", "2", "--parallel.tp=2")
    assert tp2 == one
