"""``memsave bench --pp``: the simulator fed what the runtime measured, and the report table.

[Note: the simulator's inputs] From the per-action records of the timed steps ([Note: action timing] in
memsave/pp/runtime.py; every rank's clock is the machine's monotonic clock, so records of different ranks compare):

- per stage and kind (F, B, I, W): the mean time of the action less its receive waits: the compute and the
  runner's own work around it (running the user's forward, posting sends, bookkeeping);
- the transfer latency: for each receive wait that blocked, the time from the end of the producing action on the
  other rank (its sends are posted inside it) to the end of the wait (the action's start plus its wait: the
  receives come first); the mean;
- the step's fixed cost outside the actions: before the first action (the step's checks, the layout look-up)
  and after the last (the gradient sync, the wait for the loss), per step the smallest over ranks (a rank that
  finished early waits there for the last one: that wait is the schedule's, which the simulator plays), the mean
  over steps. The closing drain's wait counts as idle, as in the measured idle, so it is left out.

Means, not medians: on a shared machine an action's time has a long tail, and a step is the sum of its actions'
times, whose mean is the sum of their means. Predicted step = fixed before + :func:`memsave.pp.simulate` step +
fixed after, against the mean measured step (the slowest rank's); predicted idle of a rank = (the simulated step
less the rank's busy time) / the predicted step, against the measured idle (1 - the rank's busy time / its step). *Replay*: each timed
step against the simulator fed that step's own records (the median of the ratios): what is left when the
step-to-step drift of the machine is taken out, i.e. what the simulator's model (dependencies, one latency per
message, a fixed cost per step) misses.
The activation peak per rank: the simulator's, with each stage's bytes per micro-batch from the formula for a
block of ``Linear`` + GELU (each saves its ``rows x d`` input: ``2 rows d 4`` bytes a block, fp32) and, on the
last stage, the model's output (the loss saves it; the target is the caller's tensor, as the input micro-batch
is); against memsave's tracker in one step (the micro-batches are separate tensors, so that the tracker, which
counts storages, does not count the whole batch for one saved micro-batch).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from memsave.pp import Costs, build, simulate

__all__ = ["format_pp_table", "simulate_case"]


def _mean(xs: list[float]) -> float:
    return statistics.mean(xs) if xs else 0.0


def measured_costs(name: str, pp: int, m: int, virtual: int, ranks: list[dict[str, Any]],
                   steps: list[int] | None = None) -> tuple[Costs, float, float]:
    """(Costs for the simulator, fixed seconds before the first action, after the last) from every rank's records
    of the timed ``steps`` (default: all), each the mean of its samples ([Note: the simulator's inputs])."""
    n_stages = pp * virtual
    compute: dict[tuple[str, int], list[float]] = defaultdict(list)
    latency: list[float] = []
    before: list[float] = []
    after: list[float] = []
    for step in (range(len(ranks[0]["timing"])) if steps is None else steps):
        step_before: list[float] = []
        step_after: list[float] = []
        ends: dict[tuple[str, int, int], float] = {}
        records = [r["timing"][step] for r in ranks]
        for recs in records:
            for kind, stage, mb, _t0, t1, _ in recs:
                if kind in ("F", "B", "I", "W"):
                    ends[(kind, stage, mb)] = t1
        for recs in records:
            acts = [r for r in recs if r[0] in ("F", "B", "I", "W")]
            start = next(r[3] for r in recs if r[0] == "step")
            end = next(r[3] for r in recs if r[0] == "end")
            drain = sum(r[4] - r[3] for r in recs if r[0] == "drain")
            step_before.append(acts[0][3] - start)
            step_after.append(end - acts[-1][4] - drain)
            for kind, stage, mb, t0, t1, waited in acts:
                compute[(kind, stage)].append(t1 - t0 - waited)
                producer = (("F", stage - 1, mb) if kind == "F" else
                            next(((k, stage + 1, mb) for k in "BI" if (k, stage + 1, mb) in ends), None))
                if waited > 1e-4 and producer is not None and producer in ends and (stage - producer[1]) % pp:
                    latency.append(max(0.0, t0 + waited - ends[producer]))
        before.append(min(step_before))  # the rank that waited least there: the work, not a wait for a peer
        after.append(min(step_after))
    split = any(k == "I" for k, _ in compute)
    fwd = [_mean(compute[("F", s)]) for s in range(n_stages)]
    if split:
        bi = [_mean(compute[("I", s)]) for s in range(n_stages)]
        bw = [_mean(compute[("W", s)]) for s in range(n_stages)]
    else:
        bi = [_mean(compute[("B", s)]) for s in range(n_stages)]
        bw = [0.0] * n_stages
    act = [float(x) for x in activation_bytes(ranks[0], n_stages)]
    costs = Costs(fwd, bi, bw, act, latency=_mean(latency), kept_after_input=1.0)
    return costs, _mean(before), _mean(after)


def activation_bytes(rank: dict[str, Any], n_stages: int) -> list[int]:
    """Bytes one micro-batch keeps for backward on each stage ([Note: the simulator's inputs])."""
    per_block = 2 * rank["send_bytes"]
    blocks = rank["blocks"] // n_stages
    out = [per_block * blocks] * n_stages
    out[-1] += rank["send_bytes"]  # the model's output, which the loss saves (its target is the caller's)
    return out


def simulate_case(name: str, pp: int, m: int, virtual: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The simulator's prediction for one (schedule, m) from what the runtime measured, beside the measurement."""
    schedule = build(name, pp, m, virtual)
    costs, before, after = measured_costs(name, pp, m, virtual, ranks)
    sim = simulate(schedule, costs)
    step = before + sim.step_time + after
    idle = [(sim.step_time - b) / step for b in sim.busy]
    measured = [max(r["steps"][k] for r in ranks) for k in range(len(ranks[0]["steps"]))]
    replay = []  # each step against the simulator fed that step's own records
    for k, took in enumerate(measured):
        c, b, a = measured_costs(name, pp, m, virtual, ranks, [k])
        replay.append(took / (b + simulate(schedule, c).step_time + a))
    return {"simulated_step_s": step, "simulated_idle": idle, "simulated_peak": sim.peak_bytes,
            "mean_step_s": statistics.mean(measured), "replay_ratio": statistics.median(replay),
            "costs": {"forward": list(costs.forward), "backward_input": list(costs.backward_input),
                      "backward_weight": list(costs.backward_weight), "latency": costs.latency,
                      "before": before, "after": after}}


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def format_pp_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'schedule':<15} {'m':>3} {'memsave s':>9} {'torch s':>8} {'x torch':>7} {'cpu x':>5} | {'formula':>7} "
            f"{'idle (measured)':<15} {'idle (simulated)':<16} {'mean s':>6} {'sim s':>6} {'x sim':>5} {'replay':>6} | "
            f"{'act MiB sim':<13} {'act MiB tracker':<15}")
    lines = [head]
    mib = 2.0 ** 20
    for r in rows:
        name = r["schedule"] + (f" v={r['virtual']}" if r["virtual"] > 1 else "")
        torch_s = f"{r['torch_step_s']:.3f}" if r.get("torch_step_s") else "-"
        idle = " ".join(f"{x:.3f}" for x in r["idle"])
        sim = " ".join(f"{x:.3f}" for x in r["simulated_idle"])
        act_sim = " ".join(f"{x / mib:.1f}" for x in r["simulated_peak"])
        act = " ".join(f"{x / mib:.1f}" for x in r["activation_peak"])
        lines.append(f"{name:<15} {r['m']:>3} {r['step_s']:>9.3f} {torch_s:>8} "
                     f"{_ratio(r['step_s'], r.get('torch_step_s')):>7} {_ratio(r['cpu_s'], r.get('torch_cpu_s')):>5} | "
                     f"{r['formula']:>7.3f} {idle:<15} {sim:<16} "
                     f"{r['mean_step_s']:>6.3f} {r['simulated_step_s']:>6.3f} {_ratio(r['mean_step_s'], r['simulated_step_s']):>5} "
                     f"{r['replay_ratio']:>6.2f} | "
                     f"{act_sim:<13} {act:<15}")
    notes = {r["torch_note"] for r in rows if r.get("torch_note")}
    return "\n".join(lines + sorted(notes))
