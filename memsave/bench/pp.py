"""``memsave bench --pp``: memsave's pipeline schedules against torch's (``torch.distributed.pipelining``), the
bubble formulas and the simulator, in one run.

One group of ``--nproc`` gloo processes (pp = ``--nproc``) trains a model of identical blocks (an ``nn.Sequential``
of ``Linear(d, d)`` + GELU; stage compute uniform, as the bubble formulas assume) under each schedule and number of
micro-batches ``m``, with a fixed micro-batch size, twice side by side: memsave's engine (``memsave.wrap`` with
``[parallel] pp``) and torch's ``PipelineStage`` + schedule of the same name on the same stages (the blocks memsave's
split gives each stage; memsave/dist/baselines_pp.py), from the same weights, data and SGD. Their steps alternate,
so the drift of a shared machine falls on both alike. Per (schedule, m) it reports:

1. the step time (median of the timed steps, the slowest rank) of each, and memsave / torch; both losses (the same
   trajectory: the same model, data and schedule);
2. each rank's idle fraction in memsave: the share of the step it does not compute (1 - its actions' time less
   their receive waits, over the step), against the formula's bubble ((p-1)/(m+p-1) GPipe and 1F1B,
   (p-1)/(v m+p-1) interleaved, (p-1)/(3m+p-1) ZB-H1);
3. :func:`memsave.pp.simulate` fed the per-action times measured inside the runtime ([Note: action timing] in
   memsave/pp/runtime.py; memsave/bench/pp_sim.py): predicted step and idle against the measured ones, and the
   predicted activation peak per rank against the tracker's.

A hang (torch's batched P2P can hang on gloo: pytorch/PiPPy#1130) ends the run at ``timeout_s``; it is then made
again without torch, and the table says so (with torch 2.13 all four torch schedules run on gloo).
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
from memsave.bench.pp_sim import format_pp_table, simulate_case

__all__ = ["CASES", "format_pp_table", "run_pp_bench"]

CASES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero-bubble", 1))
LR = 1e-3


def _model(d: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(blocks)])


def _torch_pipeline(split: Any, d: int, blocks: int, name: str, pp_rank: int, pp: int, m: int) -> Any:
    from memsave.dist.baselines_pp import TorchPipeline

    net = _model(d, blocks)
    stages = [nn.Sequential(*[net.get_submodule(a) for a in split.atoms_of(s)]) for s in range(split.n_stages)]
    return TorchPipeline(stages, name=name, pp_rank=pp_rank, pp=pp, micro_batches=m,
                         loss_fn=nn.functional.mse_loss, device=torch.device("cpu"))


def _activation_peak(net: Any, mbs: list[torch.Tensor], targets: list[torch.Tensor]) -> int:
    """The most bytes of activations (the tensors autograd saved for backward) this rank held at once in one
    step, as memsave's tracker counts them (sampled at every forward's start and end and every unit boundary)."""
    from memsave.memory import MemoryTracker

    tracker = MemoryTracker(net, timeline=False)
    try:
        net.pipeline_step(mbs, targets=targets, loss_fn=nn.functional.mse_loss)
    finally:
        tracker.close()
    return int(tracker.category_peak.get("activations", 0))


def _worker(d: int, blocks: int, rows: int, ms: list[int], steps: int, warmup: int,
            with_torch: bool) -> list[dict[str, Any]]:
    import memsave
    from memsave import dist as mdist

    mesh = memsave.init(pp=int(os.environ["WORLD_SIZE"]))
    pp, rank = mesh.degree("pp"), mesh.axis_rank("pp")
    out = []
    for name, virtual in CASES:
        for m in ms:
            if name == "interleaved" and m % pp:
                continue
            net: Any = _model(d, blocks)
            opt = torch.optim.SGD(net.parameters(), lr=LR)
            prof = memsave.load_profile("ddp", [f"parallel.pp={pp}", f"parallel.schedule={name!r}",
                                                f"parallel.virtual={virtual}"])
            net, mopt = memsave.wrap(net, opt, prof, mesh=mesh)
            runner = net.memsave_engine.runner
            tpipe = _torch_pipeline(runner.split, d, blocks, name, rank, pp, m) if with_torch else None
            topt = torch.optim.SGD(tpipe.parameters(), lr=LR) if tpipe is not None else None
            torch.manual_seed(1)
            x, y = torch.randn(m * rows, d), torch.randn(m * rows, d)
            mbs, targets = [c.clone() for c in x.chunk(m)], [c.clone() for c in y.chunk(m)]  # own storages
            ours: list[tuple[float, list[Any]]] = []
            theirs: list[float] = []
            ours_cpu: list[float] = []  # CPU seconds of the process (every thread) per step
            theirs_cpu: list[float] = []
            losses: list[float] = []
            torch_losses: list[float] = []
            for i in range(warmup + steps):
                for first in ((0, 1) if i % 2 else (1, 0)):
                    if first == 0:
                        timing: list[Any] = []
                        runner.timing = timing
                        mdist.barrier(None)
                        t0, c0 = time.perf_counter(), time.process_time()
                        timing.append(("step", -1, -1, t0, t0, 0.0))
                        loss = net.pipeline_step(mbs, targets=targets, loss_fn=nn.functional.mse_loss)
                        step, cpu = time.perf_counter() - t0, time.process_time() - c0
                        timing.append(("end", -1, -1, t0 + step, t0 + step, 0.0))
                        runner.timing = None
                        mopt.step()
                        mopt.zero_grad()
                        losses.append(float(loss))
                        if i >= warmup:
                            ours.append((step, timing))
                            ours_cpu.append(cpu)
                    elif tpipe is not None and topt is not None:
                        mdist.barrier(None)
                        t0, c0 = time.perf_counter(), time.process_time()
                        tl = tpipe.step(x, y)
                        step, cpu = time.perf_counter() - t0, time.process_time() - c0
                        topt.step()
                        topt.zero_grad()
                        torch_losses.append(float(tl) if tl is not None else float("nan"))
                        if i >= warmup:
                            theirs.append(step)
                            theirs_cpu.append(cpu)
            step, timing = sorted(ours, key=lambda s: s[0])[len(ours) // 2]
            # the bubble: the share of the step this rank does not compute (its actions less their receive
            # waits), as the formula and the simulator count it; the waits alone miss the step's start and end
            busy = sum(t[4] - t[3] - t[5] for t in timing if t[0] in ("F", "B", "I", "W"))
            peak = _activation_peak(net, mbs, targets)
            out.append({"schedule": name, "virtual": virtual, "m": m, "pp": pp, "rank": rank, "step_s": step,
                        "idle": max(0.0, 1.0 - busy / step), "timing": [tm for _, tm in ours],
                        "steps": [s for s, _ in ours], "torch_step_s": statistics.median(theirs) if theirs else None,
                        "cpu_s": statistics.median(ours_cpu),
                        "torch_cpu_s": statistics.median(theirs_cpu) if theirs_cpu else None,
                        "losses": losses, "torch_losses": torch_losses, "activation_peak": peak,
                        "send_bytes": rows * d * 4, "blocks": blocks})
            net.memsave_engine.remove()
    return out


def run_pp_bench(opts: BenchOptions, *, d: int = 1024, blocks: int = 8, rows: int = 64,
                 ms: tuple[int, ...] = (4, 8, 16), timeout_s: float = 1800, with_torch: bool = True
                 ) -> list[dict[str, Any]]:
    """Every (schedule, m) on ``opts.nproc`` pipeline ranks; one row per (schedule, m) with every rank's figures."""
    from memsave._launch import LaunchError, spawn_local
    from memsave.pp import bubble_formula

    pp = opts.nproc
    if pp < 2:
        raise ValueError(f"memsave bench --pp: --nproc {pp} is the pp degree; expected >= 2")
    args = (d, blocks, rows, list(ms), opts.steps - opts.warmup, opts.warmup)
    torch_note = None
    try:
        per_rank = spawn_local(_worker, pp, (*args, with_torch), timeout_s=timeout_s)
    except LaunchError as exc:
        if not with_torch or exc.exc_type != "TimeoutError":
            raise
        torch_note = f"torch's schedules did not finish within {timeout_s:.0f} s on gloo (run again without them)"
        per_rank = spawn_local(_worker, pp, (*args, False), timeout_s=timeout_s)
    rows_out = []
    for i, first in enumerate(per_rank[0]):
        name, virtual, m = first["schedule"], first["virtual"], first["m"]
        ranks = [r[i] for r in per_rank]
        last = (pp * virtual - 1) % pp
        row = {"schedule": name, "virtual": virtual, "m": m, "pp": pp,
               "formula": bubble_formula(name, pp, m, virtual),
               "idle": [r["idle"] for r in ranks], "step_s": max(r["step_s"] for r in ranks),
               "torch_step_s": max((r["torch_step_s"] for r in ranks if r["torch_step_s"] is not None),
                                   default=None),
               "cpu_s": sum(r["cpu_s"] for r in ranks),
               "torch_cpu_s": sum(r["torch_cpu_s"] for r in ranks) if ranks[0]["torch_cpu_s"] is not None else None,
               "losses": ranks[0]["losses"], "torch_losses": ranks[last]["torch_losses"],
               "activation_peak": [r["activation_peak"] for r in ranks], "torch_note": torch_note}
        row.update(simulate_case(name, pp, m, virtual, ranks))
        rows_out.append(row)
    return rows_out


def run_command(opts: BenchOptions, json_path: Path | None) -> int:
    rows = run_pp_bench(opts)
    print(f"memsave bench --pp: pp = {opts.nproc}, nn.Sequential of 8 Linear(1024) + GELU blocks (uniform stages), "
          "64 rows per micro-batch; memsave against torch.distributed.pipelining in the same run; idle = 1 - the "
          "rank's compute time / step (median step); simulated: memsave.pp.simulate fed the runtime's per-action times")
    print(format_pp_table(rows))
    if json_path is not None:
        json_path.write_text(json.dumps(rows, indent=2))
    return 0
