"""``memsave bench --pp`` on a small model: every schedule and micro-batch count gives a row with memsave's and
torch's step (torch.distributed.pipelining in the same run), each rank's measured idle fraction, the formula, and
the simulator fed the runtime's per-action times. Checked against references: memsave and torch train the same
model on the same data under the same schedule, so their losses agree step by step; the simulator's activation
peak per rank (from the formula for Linear + GELU blocks) equals memsave's tracker. The timings themselves are
checked for sanity only (a shared machine), not against targets."""

from __future__ import annotations

import math

from memsave.bench.common import BenchOptions
from memsave.bench.pp import format_pp_table, run_pp_bench
from memsave.bench.pp_sim import measured_costs
from memsave.pp import bubble_formula
from tests.compare import rel
from tests.pp_cases import FP32_TOL


def test_bench_pp_small() -> None:
    opts = BenchOptions(steps=3, warmup=1, nproc=2)
    rows = run_pp_bench(opts, d=32, blocks=4, rows=4, ms=(2, 4), timeout_s=120)
    assert [(r["schedule"], r["m"]) for r in rows] == [
        (s, m) for s in ("gpipe", "1f1b", "interleaved", "zero-bubble") for m in (2, 4)]
    for r in rows:
        assert r["formula"] == bubble_formula(r["schedule"], 2, r["m"], r["virtual"])
        assert len(r["idle"]) == 2 and all(0.0 <= x < 1.0 for x in r["idle"]), r
        assert r["step_s"] > 0 and r["torch_step_s"] > 0 and r["cpu_s"] > 0 and r["torch_cpu_s"] > 0
        assert r["torch_note"] is None
        # the same model, data, schedule and SGD: the same losses (3 steps)
        assert len(r["losses"]) == len(r["torch_losses"]) == 3
        assert rel(r["losses"], r["torch_losses"]) < FP32_TOL, (r["losses"], r["torch_losses"])
        assert r["losses"][-1] < r["losses"][0]
        # the simulator: fed positive per-action times; its step covers at least each rank's busy time
        costs = r["costs"]
        assert all(x > 0 for x in costs["forward"] + costs["backward_input"]), costs
        assert (r["schedule"] == "zero-bubble") == any(x > 0 for x in costs["backward_weight"])
        assert r["simulated_step_s"] > 0 and all(0.0 <= x < 1.0 for x in r["simulated_idle"]), r
        assert r["mean_step_s"] > 0 and 0 < r["replay_ratio"] < 10, r
        assert r["simulated_peak"] == r["activation_peak"], r  # bytes: formula x schedule == tracker
    table = format_pp_table(rows)
    assert table.splitlines()[0].startswith("schedule") and "interleaved v=2" in table


def test_measured_costs_from_records() -> None:
    """The simulator's inputs from hand-made records of two ranks (one step, 1F1B, m = 1): compute less waits,
    latency from the producer's end to the end of the blocked wait, the fixed cost before and after."""
    r0 = [("step", -1, -1, 0.0, 0.0, 0.0), ("F", 0, 0, 0.1, 1.1, 0.0), ("B", 0, 0, 1.1, 5.2, 3.4),
          ("drain", -1, -1, 5.2, 5.3, 0.1), ("end", -1, -1, 5.5, 5.5, 0.0)]
    r1 = [("step", -1, -1, 0.0, 0.0, 0.0), ("F", 1, 0, 0.1, 2.4, 1.1), ("B", 1, 0, 2.4, 4.4, 0.0),
          ("drain", -1, -1, 4.4, 4.4, 0.0), ("end", -1, -1, 5.5, 5.5, 0.0)]
    ranks = [{"timing": [r0], "send_bytes": 16, "blocks": 2}, {"timing": [r1], "send_bytes": 16, "blocks": 2}]
    costs, before, after = measured_costs("1f1b", 2, 1, 1, ranks)
    assert [round(x, 9) for x in costs.forward] == [1.0, 1.2] and math.isclose(costs.backward_input[0], 0.7)
    assert list(costs.backward_weight) == [0.0, 0.0] and math.isclose(costs.backward_input[1], 2.0)
    # F1.0's wait ended at 1.2, F0.0 at 1.1; B0.0's wait ended at 4.5, B1.0 at 4.4
    assert math.isclose(costs.latency, 0.1)
    assert math.isclose(before, 0.1) and math.isclose(after, 0.2)  # rank 1 waited 1.1 for rank 0: not fixed
    assert list(costs.activation_bytes) == [2 * 16, 2 * 16 + 16]
