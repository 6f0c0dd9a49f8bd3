"""``memsave bench --pp``: the pipeline schedules' measured bubble against the formulas and the simulator.

One group of ``--nproc`` gloo processes (pp = ``--nproc``) trains a model of identical blocks (an ``nn.Sequential``
of ``Linear(d, d)`` + GELU; stage compute uniform, as the bubble formulas assume) under each schedule and number of
micro-batches ``m``, with a fixed micro-batch size. Per rank it measures the step (median of the timed steps) and
the time spent waiting for point-to-point messages (the P2P waits, the drain at the step's end): the idle fraction
is their ratio. Beside it: the formula's bubble ((p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m+p-1) interleaved,
(p-1)/(3m+p-1) ZB-H1) and :func:`memsave.pp.simulate`'s step time and idle fraction, fed the stage's forward and
backward times measured in the same process on one micro-batch (the backward split half and half into I and W).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memsave.bench.common import BenchOptions

__all__ = ["format_pp_table", "run_pp_bench"]

CASES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero-bubble", 1))


def _model(d: int, blocks: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(blocks)])


def _stage_costs(d: int, blocks: int, rows: int, reps: int = 5) -> tuple[float, float]:
    """(forward, backward) seconds of ``blocks`` blocks on one micro-batch, plain torch, median of ``reps``."""
    net = _model(d, blocks)
    x = torch.randn(rows, d, requires_grad=True)
    fwd, bwd = [], []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        y = net(x)
        t1 = time.perf_counter()
        y.sum().backward()
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    return statistics.median(fwd[1:]), statistics.median(bwd[1:])


def _timed(fn: Any, waited: list[float]) -> Any:
    """``fn``, adding the seconds each call takes to ``waited[0]``."""
    def call(*args: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            waited[0] += time.perf_counter() - t
    return call


def _worker(d: int, blocks: int, rows: int, ms: list[int], steps: int, warmup: int) -> list[dict[str, Any]]:
    import memsave
    from memsave import dist as mdist

    mesh = memsave.init(pp=int(os.environ["WORLD_SIZE"]))
    pp = mesh.degree("pp")
    out = []
    for name, virtual in CASES:
        for m in ms:
            if name == "interleaved" and m % pp:
                continue
            net: Any = _model(d, blocks)
            opt = torch.optim.SGD(net.parameters(), lr=1e-4)
            prof = memsave.load_profile("ddp", [f"parallel.pp={pp}", f"parallel.schedule={name!r}",
                                                f"parallel.virtual={virtual}"])
            net, mopt = memsave.wrap(net, opt, prof, mesh=mesh)
            runner = net.memsave_engine.runner
            waited = [0.0]
            runner.p2p.wait, runner.p2p.drain = _timed(runner.p2p.wait, waited), _timed(runner.p2p.drain, waited)
            x, y = torch.randn(m * rows, d), torch.randn(m * rows, d)
            mbs, targets = list(x.chunk(m)), list(y.chunk(m))
            samples = []
            for i in range(warmup + steps):
                mdist.barrier(None)
                waited[0] = 0.0
                t0 = time.perf_counter()
                net.pipeline_step(mbs, targets=targets, loss_fn=nn.functional.mse_loss)
                step = time.perf_counter() - t0
                mopt.step()
                mopt.zero_grad()
                if i >= warmup:
                    samples.append((step, waited[0]))
            step, wait = sorted(samples)[len(samples) // 2]
            out.append({"schedule": name, "virtual": virtual, "m": m, "pp": pp, "rank": mesh.axis_rank("pp"),
                        "step_s": step, "idle": wait / step})
    return out


def run_pp_bench(opts: BenchOptions, *, d: int = 1024, blocks: int = 8, rows: int = 64,
                 ms: tuple[int, ...] = (4, 8, 16), timeout_s: float = 1800) -> list[dict[str, Any]]:
    """Every (schedule, m) on ``opts.nproc`` pipeline ranks; one row per (schedule, m) with every rank's figures."""
    from memsave._launch import spawn_local
    from memsave.pp import Costs, bubble_formula, build, simulate

    pp = opts.nproc
    if pp < 2:
        raise ValueError(f"memsave bench --pp: --nproc {pp} is the pp degree; expected >= 2")
    per_rank = spawn_local(_worker, pp, (d, blocks, rows, list(ms), opts.steps - opts.warmup, opts.warmup),
                           timeout_s=timeout_s)
    rows_out = []
    for i, first in enumerate(per_rank[0]):
        name, virtual, m = first["schedule"], first["virtual"], first["m"]
        n_stages = pp * virtual
        f, b = _stage_costs(d, blocks // n_stages, rows)
        sim = simulate(build(name, pp, m, virtual), Costs([f] * n_stages, [b / 2] * n_stages, [b / 2] * n_stages,
                                                          [1.0] * n_stages))
        ranks = [r[i] for r in per_rank]
        rows_out.append({"schedule": name, "virtual": virtual, "m": m, "pp": pp,
                         "formula": bubble_formula(name, pp, m, virtual),
                         "idle": [r["idle"] for r in ranks], "step_s": max(r["step_s"] for r in ranks),
                         "simulated_idle": sim.idle_fraction, "simulated_step_s": sim.step_time})
    return rows_out


def format_pp_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'schedule':<14} {'m':>3}  {'formula':>7}  {'idle per rank (measured)':<26} {'simulated':<18} "
            f"{'step s':>7} {'simulated':>9} {'x':>5}")
    lines = [head]
    for r in rows:
        name = r["schedule"] + (f" v={r['virtual']}" if r["virtual"] > 1 else "")
        idle = " ".join(f"{x:.3f}" for x in r["idle"])
        sim = " ".join(f"{x:.3f}" for x in r["simulated_idle"])
        ratio = r["step_s"] / r["simulated_step_s"] if r["simulated_step_s"] else float("nan")
        lines.append(f"{name:<14} {r['m']:>3}  {r['formula']:>7.3f}  {idle:<26} {sim:<18} {r['step_s']:>7.3f} "
                     f"{r['simulated_step_s']:>9.3f} {ratio:>5.2f}")
    return "\n".join(lines)


def run_command(opts: BenchOptions, json_path: Path | None) -> int:
    rows = run_pp_bench(opts)
    print(f"memsave bench --pp: pp = {opts.nproc}, nn.Sequential of 8 Linear(1024) + GELU blocks (uniform stages), "
          "64 rows per micro-batch; idle = time in P2P waits / step (median step)")
    print(format_pp_table(rows))
    if json_path is not None:
        json_path.write_text(json.dumps(rows, indent=2))
    return 0
