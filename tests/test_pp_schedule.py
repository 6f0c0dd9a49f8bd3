"""Pipeline schedules as data (memsave/pp/schedule.py), the simulator that plays them (memsave/pp/simulate.py) and
the stage balancer (memsave/pp/balance.py): single process, no communication.

The simulator with equal stage costs and free transfers reproduces the bubble formulas of the literature (GPipe and
1F1B (p-1)/(m+p-1), interleaved (p-1)/(v m+p-1)) exactly and each schedule's activation residency (GPipe m, 1F1B
p - i on stage i, interleaved (1 + (p-1)/(p v)) times 1F1B's first stage); zero-bubble's is measured against
ZB-H1's (p-1)/(3m+p-1)."""

from __future__ import annotations

import math

import pytest

from memsave.pp import Action, Schedule
from memsave.pp.balance import balance, balance_by_params, by_count
from memsave.pp.schedule import SCHEDULES, build, check, interleaved
from memsave.pp.simulate import Costs, bubble_formula, simulate

GRID = [(2, 4), (2, 8), (2, 16), (4, 4), (4, 8), (4, 16)]


@pytest.mark.parametrize(("p", "m"), GRID)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_and_memory_follow_the_formulas(name: str, p: int, m: int) -> None:
    res = simulate(build(name, p, m), Costs.uniform(p))
    assert all(math.isclose(x, bubble_formula(name, p, m)) for x in res.idle_fraction), res.idle_fraction
    assert res.step_time == 3 * (m + p - 1)  # F + B = 1 + 2 units per micro-batch
    expected = [m] * p if name == "gpipe" else [min(p - i, m) for i in range(p)]
    assert res.peak_micro_batches == expected


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (2, 4, 3), (4, 8, 2), (4, 16, 2), (2, 8, 3)])
def test_interleaved_bubble_and_memory(p: int, m: int, v: int) -> None:
    sched = build("interleaved", p, m, v)
    assert sched.n_stages == p * v and sched.stages_of(0) == list(range(0, p * v, p))
    # each chunk does 1/v of a stage's work
    res = simulate(sched, Costs.uniform(p * v, 1 / v, 1 / v, 1 / v, activation_bytes=1 / v))
    assert all(math.isclose(x, bubble_formula("interleaved", p, m, v)) for x in res.idle_fraction)
    # the first rank holds (1 + (p-1)/(p v)) times 1F1B's p micro-batches of one whole stage
    assert math.isclose(res.peak_bytes[0], p * (1 + (p - 1) / (p * v)))


def test_interleaved_needs_whole_groups() -> None:
    with pytest.raises(ValueError, match=r"micro_batches divisible by pp: micro_batches=6, pp=4"):
        interleaved(4, 6, 2)


@pytest.mark.parametrize(("p", "m"), GRID)
def test_zero_bubble_beats_1f1b_at_1f1b_memory(p: int, m: int) -> None:
    h1 = simulate(build("zero-bubble", p, m), Costs.uniform(p))
    one = simulate(build("1f1b", p, m), Costs.uniform(p))
    h2 = simulate(build("zero-bubble-h2", p, m), Costs.uniform(p))
    assert max(h1.peak_micro_batches) == max(one.peak_micro_batches) == p  # ZB-H1: 1F1B's peak
    assert max(h2.peak_micro_batches) <= 2 * p - 1
    idle = {n: r.step_time * p - sum(r.busy) for n, r in (("1f1b", one), ("h1", h1), ("h2", h2))}
    assert idle["h2"] <= idle["h1"] <= 0.6 * idle["1f1b"], idle
    formula = bubble_formula("zero-bubble", p, m)  # (p-1)/(3m+p-1): a third of 1F1B's idle time
    assert all(math.isclose(x, formula) for x in h1.idle_fraction), (h1.idle_fraction, formula)
    assert math.isclose(idle["h1"], idle["1f1b"] / 3)
    assert h2.idle_fraction[0] <= formula + 1e-9


def test_every_schedule_handles_fewer_micro_batches_than_stages() -> None:
    for name in SCHEDULES:
        if name != "interleaved":
            res = simulate(build(name, 4, 2), Costs.uniform(4))
            assert res.step_time > 0 and len(res.timed) == sum(len(a) for a in res.schedule.actions)


def test_check_rejects_deadlocks_and_incomplete_schedules() -> None:
    # rank 0 runs its backward before the forward of the second micro-batch, which rank 1 needs to start: fine;
    # but here rank 1 waits for B of mb 0 from... itself after F1.1, which needs F0.1, which rank 0 runs after B0.0,
    # which needs B1.0: a cycle
    bad = Schedule("hand", 2, 2, ((Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)),
                                  (Action("F", 1, 0), Action("F", 1, 1), Action("B", 1, 0), Action("B", 1, 1))))
    with pytest.raises(ValueError, match=r"would deadlock: rank 0 waits at B0\.0 for B1\.0.*rank 1 waits at F1\.1 "
                                         r"for F0\.1"):
        check(bad)
    missing = Schedule("hand", 2, 1, ((Action("F", 0, 0), Action("B", 0, 0)), (Action("F", 1, 0),)))
    with pytest.raises(ValueError, match=r"stage 1 micro-batch 0 has \['F'\]"):
        check(missing)
    wrong_rank = Schedule("hand", 2, 1, ((Action("F", 1, 0),), ()))
    with pytest.raises(ValueError, match="stage 1 is on rank 1"):
        check(wrong_rank)
    with pytest.raises(ValueError, match="'zb' is not allowed; expected one of"):
        build("zb", 2, 4)
    with pytest.raises(ValueError, match="virtual = 2 needs schedule 'interleaved'"):
        build("1f1b", 2, 4, 2)


def test_simulator_counts_transfers_and_draws_a_timeline() -> None:
    costs = Costs.uniform(2)
    slow = Costs([1, 1], [1, 1], [1, 1], [1, 1], send_bytes=[100, 0], bandwidth=100.0, latency=0.5)
    a, b = simulate(build("gpipe", 2, 2), costs), simulate(build("gpipe", 2, 2), slow)
    assert b.step_time == a.step_time + 2 * 1.5  # one forward and one backward transfer on the critical path
    text = a.to_text()
    assert text.splitlines()[1].startswith("rank 0 |F0.0|F0.1|") and "idle" in text
    assert {r["action"] for r in a.rows()} >= {"F0.0", "B1.1"}


def test_balance_by_measured_time_evens_out_wide_and_narrow_blocks() -> None:
    names = ["embed", *(f"layers.{i}" for i in range(12)), "head"]
    times = [4.0, *[1.0] * 12, 4.0]  # wide embedding and head, narrow layers
    for p, costs in ((2, [9.0, *[1.0] * 12, 1.0]), (4, times)):
        measured, counted = balance(names, costs, p), by_count(names, costs, p)
        assert measured.slowest_vs_ideal <= 1.10 and counted.slowest_vs_ideal >= 1.3, (measured, counted)
        assert sum(len(s) for s in measured.stages) == len(names) and measured.stages[0][0] == "embed"
    table = balance(names, times, 4).to_text()
    assert "embed" in table and "x the ideal" in table
    # 1F1B residency: stage i holds 4 - i micro-batches' activations, so a memory limit moves blocks to the last
    # stages (at 12 bytes: at most 2, 3, 4 and 6 blocks on stages 0-3)
    free = balance(names, times, 4, nbytes=[1] * 14, activation_bytes=[1] * 14, memory_limit=100)
    tight = balance(names, times, 4, nbytes=[1] * 14, activation_bytes=[1] * 14, memory_limit=12)
    assert len(free.stages[-1]) == 2 and len(tight.stages[-1]) >= 5, (free.stages, tight.stages)
    with pytest.raises(ValueError, match="no split of 14 blocks into 4 stages fits memory_limit=3"):
        balance(names, times, 4, nbytes=[1] * 14, activation_bytes=[1] * 14, memory_limit=3)
    assert balance_by_params(["a", "b", "c", "d"], [10, 10, 10, 30], 2).bounds == (0, 3)
