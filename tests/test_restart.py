"""``torchrun --max-restarts 1`` after SIGKILL of one rank: the restarted ranks rendezvous and finish (issue 24,
item 6; [Note: elastic restarts] in memsave/dist/init.py). Before, they failed at start-up with "Gloo
connectFullMesh failed ... Connection refused"."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.harness import torchrun

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_torchrun_restarts_after_a_rank_is_killed(tmp_path: Path) -> None:
    out, _ = torchrun(ROOT, "tests/scripts/restart_once.py")
    # (the two ranks share torchrun's stdout: their lines may run into each other)
    assert sorted(re.findall(r"done rank \d attempt \d", out)) == ["done rank 0 attempt 1", "done rank 1 attempt 1"], out
