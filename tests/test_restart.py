"""``torchrun --max-restarts 1`` after SIGKILL of one rank: the restarted ranks rendezvous and finish (issue 24,
item 6; [Note: elastic restarts] in memsave/dist/init.py). Before, they failed at start-up with "Gloo
connectFullMesh failed ... Connection refused"."""

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


@pytest.mark.slow
def test_torchrun_restarts_after_a_rank_is_killed(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "RANK", "WORLD_SIZE",
                                                                     "LOCAL_", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MEMSAVE_TIMEOUT_S="60")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--monitor-interval", "0.2", "--master-port", str(free_port()), "tests/scripts/restart_once.py"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err[-3000:]}"
    # (the two ranks share torchrun's stdout: their lines may run into each other)
    assert sorted(re.findall(r"done rank \d attempt \d", out)) == ["done rank 0 attempt 1", "done rank 1 attempt 1"], out
