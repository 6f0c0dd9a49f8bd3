"""``torchrun --max-restarts 1`` with checkpoints (issue 21, item 5): rank 1 is SIGKILLed mid-run, torchrun
restarts the group, the Trainer resumes from the latest committed checkpoint (``resume="latest"``) and its
losses from the step after it equal the uninterrupted run's bit for bit (fp32 CPU, dropout on). The restarted ranks
rendezvous and finish ("done rank r attempt 1": issue 24, item 6, [Note: elastic restarts] in memsave/dist/init.py;
they failed at start-up with "Gloo connectFullMesh failed ... Connection refused" before)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.harness import torchrun

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(ckpt: Path) -> tuple[str, str]:
    return torchrun(ROOT, "tests/scripts/ckpt_restart.py", str(ckpt))


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
