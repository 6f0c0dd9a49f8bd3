"""``memsave bench --pp`` on a small model: every schedule and micro-batch count gives a row with each rank's
measured idle fraction, the formula and the simulator's prediction (the figures themselves are timings: checked
for sanity, not against targets)."""

from __future__ import annotations

import math

from memsave.bench.common import BenchOptions
from memsave.bench.pp import format_pp_table, run_pp_bench
from memsave.pp import bubble_formula


def test_bench_pp_small() -> None:
    opts = BenchOptions(steps=2, warmup=1, nproc=2)
    rows = run_pp_bench(opts, d=32, blocks=4, rows=4, ms=(2, 4), timeout_s=120)
    assert [(r["schedule"], r["m"]) for r in rows] == [
        (s, m) for s in ("gpipe", "1f1b", "interleaved", "zero-bubble") for m in (2, 4)]
    for r in rows:
        assert r["formula"] == bubble_formula(r["schedule"], 2, r["m"], r["virtual"])
        assert len(r["idle"]) == 2 and all(0.0 <= x < 1.0 for x in r["idle"]), r
        assert r["step_s"] > 0 and r["simulated_step_s"] > 0 and all(math.isfinite(x) for x in r["simulated_idle"])
        if r["m"] >= 2 and r["schedule"] in ("gpipe", "1f1b"):  # equal stage costs: the simulator gives the formula
            assert all(math.isclose(x, r["formula"], rel_tol=1e-6) for x in r["simulated_idle"]), r
    table = format_pp_table(rows)
    assert table.splitlines()[0].startswith("schedule") and "interleaved v=2" in table
