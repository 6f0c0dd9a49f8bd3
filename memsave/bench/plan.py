"""``memsave bench --plan``: the planner's predictions against measurement, and its speed.

1. On this machine (rates from ``memsave calibrate``), every configuration the planner offers for the reference
   GPT on ``--nproc`` ranks at a global batch (with a disk budget: its disk offload too), in fresh processes:
   predicted peak per rank (memsave.estimate) and step time (the cost model) beside the measured ones (the
   tracker's peak; the median over three fresh runs of each run's median step, and the runs' spread, the
   measurement's own error). The planner's choice for a budget is then compared with the fastest *measured*
   configuration that fits it.
2. A full plan for a 70B-parameter Llama over 1,024 H100s (vendor rates): seconds to answer, configurations
   considered, the choice.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from memsave.bench.common import BenchOptions

__all__ = ["LLAMA_70B", "run_command", "run_plan_bench"]

LLAMA_70B = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
             "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
             "max_position_embeddings": 8192, "tie_word_embeddings": False}


def _step(model: Any, opt: Any, data: Any, c: Any, device: torch.device, i: int) -> None:
    """Optimizer step ``i`` of candidate ``c``."""
    from memsave.plan.calibrate_engines import train_step

    batches = [data.batch(i * c.micro_batches + j) for j in range(c.micro_batches)]
    train_step(model, opt, [{k: v.to(device) for k, v in b.items()} for b in batches])


def _measure(cases: list[dict[str, Any]], size: str, shape: dict[str, Any], seq: int, steps: int,
             warmup: int) -> list[dict[str, Any]]:
    """In each rank: every case trained ``steps`` steps; the tracker's peak of two tracked steps (on CUDA also the
    allocator's: everything allocated above what the case started with, workspaces and transients included) and
    the median of the untracked steps after ``warmup``."""
    import gc

    import memsave
    from memsave.estimate_cuda import measured_workspace
    from memsave.memory import MemoryTracker
    from memsave.models import GPT, TokenBatches, gpt_config
    from memsave.plan import Candidate, to_profile

    out = []
    cuda = torch.cuda.is_available()
    # cuBLAS's workspace, allocated by the first matmul and kept: below every case's base, so added to each
    workspace = measured_workspace() if cuda else 0
    for raw in cases:
        c = Candidate(**raw)
        mesh = memsave.init(tp=c.tp, pp=c.pp)
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        torch.manual_seed(0)
        model: Any = GPT(gpt_config(size, **shape)).to(mesh.device)
        prof = to_profile(c, offload_path=f"/tmp/memsave-bench-plan-{mesh.rank}")
        opt = memsave.optim.build_optimizer(model.parameters(), prof.optimizer)
        model, opt = memsave.wrap(model, opt, prof, mesh=mesh)
        data = TokenBatches(seq_len=seq, batch_size=c.micro_batch, dp_rank=mesh.dp_rank, dp_size=mesh.dp_size)
        step = functools.partial(_step, model, opt, data, c, mesh.device)
        tracker = MemoryTracker(model, opt)
        step(0)
        step(1)
        peak = tracker.peak["total"]
        tracker.close()
        allocator = torch.cuda.max_memory_allocated() - base + workspace if cuda else None
        times = []
        for i in range(2, 2 + steps):
            memsave.dist.barrier(None)
            t0 = time.perf_counter()
            step(i)
            memsave.dist.barrier(None)
            if i >= 2 + warmup:
                times.append(time.perf_counter() - t0)
        out.append({"peak": peak, "allocator_peak": allocator, "step_s": statistics.median(times)})
        close = getattr(opt, "close", None)
        if close is not None:
            close()
        del model, opt, step, tracker
    return out


def run_plan_bench(opts: BenchOptions, *, global_batch: int | None = None, budget_mib: float | None = None,
                   rounds: int = 3, disk_gib: float = 4.0, timeout_s: float = 1800,
                   shape: dict[str, Any] | None = None) -> dict[str, Any]:
    """See the module docstring. On a CPU machine: a global batch of 8 and a 64 MiB budget, recomputation none and
    full; on CUDA (one process per GPU): ``global_batch`` (default ``opts.batch_size``) and ``budget_mib``
    (default 4 GiB), every recomputation, and the measured peak is the allocator's. ``shape``: the GPT's
    ``d_model``, ``n_head``, ``n_layer`` instead of the size's."""
    from memsave._launch import spawn_local
    from memsave.cli_plan import _rows
    from memsave.models import GPT, gpt_config
    from memsave.plan import VENDOR, calibrate, exact_peak, from_gpt, from_hf_config, plan

    hw = calibrate()
    cuda = hw.device == "cuda"
    global_batch = global_batch or (opts.batch_size if cuda else 8)
    budget_mib = budget_mib or (4096.0 if cuda else 64.0)
    shape = {**(shape or {}), "dropout": 0.0, "block_size": max(opts.seq_len, 8)}
    cfg = gpt_config(opts.size, **shape)
    with torch.device("meta"):
        meta = GPT(cfg)
    ids = torch.zeros(1, opts.seq_len, dtype=torch.long, device="meta")
    batch = {"input_ids": ids, "labels": ids}

    @functools.cache
    def exact(c: Any) -> dict[str, int]:
        return exact_peak(meta, c, _rows(batch, c.micro_batch), device=hw.device)

    budget = budget_mib * 2**20
    # with a disk budget: the optimizer's (and at stage 3 the parameters') offload to the disk is offered too
    result = plan(from_gpt(cfg), hw, world=opts.nproc, global_batch=global_batch, seq=opts.seq_len, budget=budget,
                  exact=exact, recomputes=("none", "selective", "full") if cuda else ("none", "full"),
                  disk_budget=disk_gib * 2**30)
    # one of each (mesh, stage, recompute, schedule, offload): the fastest micro-batch split of each (offload:
    # without recomputation only)
    seen: dict[Any, Any] = {}
    for p in result.ranked:
        c = p.candidate
        if c.offload == "none" or c.recompute == "none":
            seen.setdefault((c.tp, c.pp, c.stage, c.recompute, c.schedule if c.pp > 1 else "", c.offload), p)
    chosen = list(seen.values())
    # the machine's speed drifts between runs: every configuration is measured in each of ``rounds`` fresh runs,
    # and its step is the median of the runs' medians; the spread of the runs is the measurement's own error
    runs = [spawn_local(_measure, opts.nproc, ([dataclasses.asdict(p.candidate) for p in chosen], opts.size,
                                               shape, opts.seq_len, opts.steps, opts.warmup), timeout_s=timeout_s)
            for _ in range(rounds)]
    rows = []
    for i, p in enumerate(chosen):
        peak = max(r[i]["peak"] for r in runs[0])
        allocator = max(r[i]["allocator_peak"] or 0 for r in runs[0]) or None
        steps = [max(r[i]["step_s"] for r in run) for run in runs]
        step = statistics.median(steps)
        transient = p.device.get("transient", 0)  # on CUDA: the allocator's beyond the tensors
        rows.append({"config": p.candidate.label(), "predicted_peak": p.peak - transient, "peak": peak,
                     "predicted_device": p.peak, "allocator_peak": allocator,
                     "predicted_step_s": p.step_time, "step_s": step, "runs_s": steps,
                     "run_spread": (max(steps) - min(steps)) / step, "bottleneck": p.bottleneck})
    fits = [r for r in rows if (r["allocator_peak"] or r["peak"]) <= budget]
    fastest = min(fits, key=lambda r: r["step_s"]) if fits else None
    t0 = time.perf_counter()
    big = plan(from_hf_config(LLAMA_70B), VENDOR["h100"], world=1024, global_batch=1024, seq=4096,
               budget=80 * 2**30)
    seconds = time.perf_counter() - t0
    return {"hardware": hw.to_dict(), "global_batch": global_batch, "budget": budget, "rows": rows, "choice": chosen[0].candidate.label(),
            "choice_step_s": rows[0]["step_s"], "fastest_measured": fastest["config"] if fastest else None,
            "fastest_step_s": fastest["step_s"] if fastest else None,
            "llama70b": {"seconds": seconds, "considered": big.considered, "choice": big.best.candidate.label(),
                         "binding": big.binding(), "predicted_step_s": big.best.step_time}}


def format_plan_table(res: dict[str, Any]) -> str:
    cuda = any(r["allocator_peak"] for r in res["rows"])
    alloc = f" {'alloc':>8} {'err':>6}" if cuda else ""
    lines = [f"{'configuration':<58} {'peak MiB':>8} {'pred':>8} {'err':>6}{alloc}  {'step ms':>8} {'runs':>6} "
             f"{'pred':>8} {'err':>6}"]
    for r in res["rows"]:
        alloc = (f" {r['allocator_peak'] / 2**20:>8.1f} {r['predicted_device'] / r['allocator_peak'] - 1:>+6.1%}"
                 if cuda else "")
        lines.append(f"{r['config']:<58} {r['peak'] / 2**20:>8.2f} {r['predicted_peak'] / 2**20:>8.2f} "
                     f"{r['predicted_peak'] / r['peak'] - 1:>+6.1%}{alloc}  {r['step_s'] * 1e3:>8.1f} "
                     f"{r['run_spread']:>6.0%} {r['predicted_step_s'] * 1e3:>8.1f} "
                     f"{r['predicted_step_s'] / r['step_s'] - 1:>+6.1%}")
    if cuda:
        errors = sorted(r["predicted_device"] / r["allocator_peak"] - 1 for r in res["rows"])
        lines.append(f"peak with the CUDA allocator's transients against its own (max_memory_allocated): "
                     f"from {errors[0]:+.1%} to {errors[-1]:+.1%}")
    errors = sorted(abs(r["predicted_step_s"] / r["step_s"] - 1) for r in res["rows"])
    lines.append(f"step time: {sum(e <= 0.2 for e in errors)} of {len(errors)} within 20%, median error "
                 f"{statistics.median(errors):.0%}, largest {errors[-1]:.0%}; the runs' own spread (max - min over "
                 f"median) {statistics.median(r['run_spread'] for r in res['rows']):.0%} in the median row")
    lines.append(f"planner's choice: {res['choice']} ({res['choice_step_s'] * 1e3:.1f} ms measured); fastest measured "
                 f"that fits: {res['fastest_measured']} ({(res['fastest_step_s'] or 0) * 1e3:.1f} ms): the choice is "
                 f"{res['choice_step_s'] / res['fastest_step_s']:.2f}x the fastest")
    b = res["llama70b"]
    lines.append(f"Llama 70B on 1,024 H100 (vendor rates): planned in {b['seconds']:.2f} s over {b['considered']} "
                 f"configurations: {b['choice']}, predicted step {b['predicted_step_s']:.2f} s; {b['binding']}")
    return "\n".join(lines)


def run_command(opts: BenchOptions, json_path: Path | None, device_gib: float, d_model: int, n_layer: int) -> int:
    cuda = torch.cuda.is_available()
    shape = {"d_model": d_model, "n_head": max(1, d_model // 64), "n_layer": n_layer} if cuda else {}
    res = run_plan_bench(opts, budget_mib=device_gib * 1024 if cuda else None, shape=shape)
    hw = res["hardware"]
    print(f"memsave bench --plan: reference GPT {opts.size} {shape or ''}, {opts.nproc} ranks, seq {opts.seq_len}, global batch "
          f"{res['global_batch']}; rates of {hw['name']} ({hw['source']}); every configuration the planner offers "
          f"within {res['budget'] / 2**20:.0f} MiB, the "
          "fastest micro-batch split of each; with 4 GiB of disk, the disk offload too (without recomputation)")
    print(format_plan_table(res))
    if json_path is not None:
        json_path.write_text(json.dumps(res, indent=1) + "\n")
    return 0
