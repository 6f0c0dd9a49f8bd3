"""``memsave bench --recompute``: activation recomputation policies on one process, against torch's own
checkpointing (Chen et al., 2016, "Training Deep Nets with Sublinear Memory Cost"; selective recomputation:
Korthikanti et al., 2022).

Each policy (memsave's ``none``, ``full``, ``every:K``, ``selective``, ``budget:<size>``, or torch's per-block
``checkpoint`` and selective checkpointing) trains the reference GPT in a fresh single-thread process and
reports the median step time, the bytes one forward saves for backward, torch ``MemTracker``'s peak by category
and the peak RSS, each against the first policy.
"""

from __future__ import annotations

import functools
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from memsave import dist as mdist
from memsave._launch import spawn_local
from memsave.bench.common import BenchOptions, columns, mib, run_each, show_results, split_names
from memsave.memory import peak_rss_bytes
from memsave.models import GPT, TokenBatches
from memsave.recompute import DEFAULT_SAVE_OPS, parse_policy
from memsave.recompute import apply as apply_recompute
from memsave.recompute.checkpoint import selective_contexts
from memsave.recompute.measure import measure_saved_bytes, note_saved

__all__ = ["DEFAULT_RECOMPUTE", "RECOMPUTE_BASELINES", "format_recompute_table", "run_command",
           "run_recompute_bench"]

RECOMPUTE_BASELINES = ("torch-full", "torch-selective")
DEFAULT_RECOMPUTE = ("none", "full", "every:2", "selective", "budget:150MiB", *RECOMPUTE_BASELINES)
_TRACKED_CATEGORIES = ("Parameter", "Gradient", "Activation", "Temp", "Optstate")


def _torch_save_ops() -> list[Any]:
    """What ``torch-selective`` saves: the matmuls and attention kernels of memsave's selective policy, passed to
    ``create_selective_checkpoint_contexts`` as a plain op list (torch's own policy: no exception for random ops;
    the bench model has no dropout)."""
    return sorted(DEFAULT_SAVE_OPS, key=str)


def _torch_checkpoint_blocks(blocks: list[torch.nn.Module], selective: bool) -> None:
    """``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` around each block's forward, as users write it;
    with ``selective``, torch's selective checkpointing contexts saving :func:`_torch_save_ops`."""
    save = frozenset(_torch_save_ops())

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in save:
            if not ctx.is_recompute:  # only so that the saved-bytes measurement sees torch's cache too
                note_saved(getattr(ctx, "op_output", None))
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(selective_contexts, policy)  # torch's contexts, the cache seen on every torch
    for block in blocks:
        forward = block.forward

        def run(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            if selective:
                return checkpoint(_forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = run  # type: ignore[method-assign]


def _recompute_worker(name: str, opts: BenchOptions) -> dict[str, Any]:
    """One recompute configuration on the reference GPT, one process, one thread: timed steps (forward, backward,
    AdamW step), then the saved-activation bytes of one forward (memsave.recompute.measure) and two more steps
    under torch's ``MemTracker`` for the peak by category (untimed: its dispatch mode slows every op)."""
    # torch's MemTracker is a single-process memory tool that lives under torch.distributed: memsave/dist/ hands
    # it over (here: [Note: baselines import cost] in memsave/dist/baselines.py)
    from memsave.dist.baselines import mem_tracker

    tracker = mem_tracker()
    torch.set_num_threads(1)
    mdist.init()
    torch.manual_seed(opts.seed)
    model = GPT(opts.model_config())
    blocks = list(model.blocks)
    data = TokenBatches(seq_len=opts.seq_len, batch_size=opts.batch_size, seed=opts.seed)
    plan = None
    if name in RECOMPUTE_BASELINES:
        _torch_checkpoint_blocks(blocks, selective=name == "torch-selective")
    else:
        plan = apply_recompute(blocks, name, model=model,
                               example_inputs=data.batch(0) if name.startswith("budget:") else None)
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=0.1)

    def step(i: int) -> float:
        batch = data.batch(i)
        t0 = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        return float(loss.detach())

    times: list[float] = []
    losses = [step(i) for i in range(opts.steps)]
    batch0 = data.batch(0)
    saved = measure_saved_bytes(lambda: model(**batch0), blocks, model=model)
    with tracker() as mt:
        mt.track_external(model, opt)
        for i in range(opts.steps, opts.steps + 2):
            mt.reset_mod_stats()  # its per-module stats take one iteration; the peak snapshot stays
            step(i)
        peak = mt.get_tracker_snapshot("peak")
    snap = next(iter(peak.values())) if peak else {}
    by_cat = {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}
    return {
        "name": name, "kind": "baseline" if name in RECOMPUTE_BASELINES else "memsave",
        "params": sum(p.numel() for p in model.parameters()),
        "median_step_s": statistics.median(times[opts.warmup : opts.steps]),
        "step_times": times[: opts.steps],
        "saved_activation_bytes": saved.total,
        "saved_activation_bytes_per_unit": list(saved.units),
        "peak_by_category": by_cat,
        "peak_total": by_cat.get("Total", sum(by_cat.values())),
        "peak_rss": peak_rss_bytes(),
        "losses": losses, "final_loss": losses[-1],
        "plan": None if plan is None else {"units": list(plan.names), "kinds": list(plan.kinds),
                                           "estimated_bytes": plan.estimated_bytes, "summary": plan.summary},
    }


def run_recompute_bench(names: list[str], opts: BenchOptions, *, timeout_s: float = 1800) -> list[dict[str, Any]]:
    """Each recompute configuration in a fresh single-thread process; step time, activations and peak memory
    against the first (``none``)."""

    def compare(rows: list[dict[str, Any]]) -> None:
        ref = rows[0]
        for r in rows:
            r["vs_ref_step_time"] = r["median_step_s"] / ref["median_step_s"]
            r["vs_ref_activations"] = r["saved_activation_bytes"] / max(ref["saved_activation_bytes"], 1)
            r["vs_ref_peak"] = r["peak_total"] / max(ref["peak_total"], 1)
            r["final_loss_diff"] = r["final_loss"] - ref["final_loss"]
            r["reference"] = ref["name"]
            if r["name"].startswith("budget:"):
                r["budget_bytes"] = parse_policy(r["name"]).budget_bytes

    return run_each(names, lambda name: spawn_local(_recompute_worker, 1, (name, opts), timeout_s=timeout_s)[0],
                    compare)


def format_recompute_table(rows: list[dict[str, Any]]) -> str:
    """One line per recompute configuration: step time, saved activations, MemTracker's peak by category, RSS."""
    head = ["policy", "step s", "x ref", "activations MiB", "x ref", "peak MiB", "x ref",
            *(c[:5].lower() for c in _TRACKED_CATEGORIES), "peak RSS MiB", "loss diff", "chosen"]
    lines = []
    for r in rows:
        cats = r["peak_by_category"]
        chosen = ""
        if r["plan"] is not None and r["name"].startswith("budget:"):
            kinds = r["plan"]["kinds"]
            chosen = ", ".join(f"{kinds.count(k)} {k}" for k in ("full", "selective") if k in kinds) or "nothing"
        lines.append([
            r["name"], f"{r['median_step_s']:.3f}", f"{r['vs_ref_step_time']:.2f}",
            mib(r["saved_activation_bytes"]), f"{r['vs_ref_activations']:.2f}",
            mib(r["peak_total"]), f"{r['vs_ref_peak']:.2f}",
            *(mib(cats.get(c, 0)) for c in _TRACKED_CATEGORIES),
            mib(r["peak_rss"]), f"{r['final_loss_diff']:+.1e}", chosen,
        ])
    out = columns(head, lines)
    out.append(f"model: {rows[0]['params']:,} parameters, one process, one thread, fp32 AdamW; 'x ref' against "
               f"{rows[0]['reference']}; activations: bytes saved for backward by one forward "
               "(memsave.recompute.measure; a budget:<size> constrains this); peak and its categories: torch's "
               "MemTracker over two steps")
    return "\n".join(out)


def run_command(spec: str, opts: BenchOptions, json_path: Path | None) -> int:
    """``memsave bench --recompute POLICIES``: every policy checked first, then run; the table (with the plan of
    each ``budget:<size>``) and the JSON file."""
    names = split_names(spec)
    for name in names:
        if name not in RECOMPUTE_BASELINES:
            parse_policy(name)  # a bad policy fails now

    def show(rows: list[dict[str, Any]]) -> None:
        print(format_recompute_table(rows))
        for r in rows:
            if r["plan"] is not None and r["name"].startswith("budget:"):
                print(r["plan"]["summary"])

    return show_results(lambda: run_recompute_bench(names, opts), show, json_path, opts,
                        schema="memsave.bench-recompute/1")
