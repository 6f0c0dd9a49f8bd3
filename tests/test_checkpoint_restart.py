"""``torchrun --max-restarts 1`` with checkpoints (issue 21, item 5): rank 1 is SIGKILLed mid-run, torchrun
restarts the group, the Trainer resumes from the latest committed checkpoint (``resume="latest"``) and its
losses from the step after it equal the uninterrupted run's bit for bit (fp32 CPU, dropout on)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import free_port

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(ckpt: Path) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "RANK", "WORLD_SIZE",
                                                                     "LOCAL_", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MEMSAVE_TIMEOUT_S="60")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--monitor-interval", "0.2", "--master-port", str(free_port()), "tests/scripts/ckpt_restart.py",
           str(ckpt)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err[-3000:]}"
    return out, err


def _losses(out: str, tag: str) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for step, value in re.findall(tag + r" (\d+) (\S+)", out):
        found.setdefault(int(step), []).append(value)
    return found


@pytest.mark.slow
def test_a_killed_rank_restarts_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    out, _ = _torchrun(tmp_path / "killed")
    ref, got = _losses(out, "ref"), _losses(out, "loss")
    assert sorted(ref) == list(range(1, 9)), out
    # the first attempt logged steps 1-5 and died in step 6; the restart resumed from step 4 and logged 5-8
    assert "resumed from" in out and "step00000004 at step 4" in out, out
    assert {s: len(v) for s, v in got.items()} == {1: 1, 2: 1, 3: 1, 4: 1, 5: 2, 6: 1, 7: 1, 8: 1}, got
    assert all(got[s][-1] == ref[s][0] for s in range(1, 9)), (got, ref)
    assert sorted(re.findall(r"done rank \d attempt \d", out)) == ["done rank 0 attempt 1", "done rank 1 attempt 1"]
    assert sorted(p.name for p in (tmp_path / "killed").iterdir()) == ["step00000006", "step00000008"]
