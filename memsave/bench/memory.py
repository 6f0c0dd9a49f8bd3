"""``memsave bench --memory``: the tracker and the estimator on the reference GPT, per profile.

Each profile runs in a fresh group of local processes (the bench GPT, the bench batch, the profile's own
optimizer). Every rank first estimates its memory with ``memsave.estimate`` (meta device), then trains
untracked and tracked steps interleaved (the median step time with and without a tracker: the whole overhead,
hooks included), then two tracked steps, and reports: estimated vs measured model state (at the end of the
last step, as the ZeRO formula counts it), activations (at the end of the last forward) and peak (the largest
accounted sample), per category; and the tracker's time inside its samples per step. A
last row runs one process with torch's ``MemTracker`` beside ours and compares them at the same instant (the
end of each forward), category by category.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from memsave import dist as mdist
from memsave._launch import spawn_local
from memsave.api import wrap
from memsave.bench.common import BenchOptions, columns, run_each, show_results, split_names
from memsave.config import load_profile
from memsave.estimator import estimate
from memsave.memory import MemoryTracker, peak_rss_bytes
from memsave.models import GPT, TokenBatches
from memsave.optim import build_optimizer

__all__ = ["MEMTRACKER", "format_memory_table", "run_command", "run_memory_bench"]

_STATE = ("params", "grads", "master", "optimizer_state")
MEMTRACKER = "memtracker"  # the name of the comparison row


def _gpt(opts: BenchOptions, device: str = "cpu") -> GPT:
    torch.manual_seed(opts.seed)
    with torch.device(device):
        return GPT(opts.model_config())


def _worker(name: str, opts: BenchOptions) -> dict[str, Any]:
    mesh = mdist.init()
    prof = load_profile(name)
    data = TokenBatches(seq_len=opts.seq_len, batch_size=opts.batch_size, dp_rank=mesh.dp_rank,
                        dp_size=mesh.dp_size, seed=opts.seed)
    t0 = time.perf_counter()
    est = estimate(_gpt(opts, "meta"), prof, world_size=mesh.dp_size, batch=data.batch(0), device=mesh.device.type)
    estimate_s = time.perf_counter() - t0
    plain = _gpt(opts)
    opt_cfg = dataclasses.replace(prof.optimizer, lr=opts.lr) if prof.optimizer.name == "adamw" else prof.optimizer
    model, opt = wrap(plain, build_optimizer(plain.parameters(), opt_cfg), prof, mesh=mesh)

    def step(i: int) -> float:
        batch = data.batch(i)
        mdist.barrier()
        start = time.perf_counter()
        opt.backward(model(**batch).loss)
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start

    for i in range(opts.warmup):
        step(i)
    # the overhead: untracked and tracked steps interleaved (so drift over the run cancels), the tracker made
    # and closed outside the timed region; then the tracked steps whose figures the table reports
    off, on = [], []
    for i in range(opts.warmup, opts.steps):
        off.append(step(2 * i))
        timing = MemoryTracker(model, opt, timeline=False)
        on.append(step(2 * i + 1))
        timing.close()
    tracker = MemoryTracker(model, opt)
    for i in range(2):
        step(2 * opts.steps + i)
    samples = tracker.num_samples
    sample_s = tracker.sample_seconds
    state = [s for s in tracker.timeline if s["event"] == "step_end"][-1]["bytes"]
    acts = [s for s in tracker.timeline if s["event"] == "forward_end"][-1]["bytes"].get("activations", 0)
    out = {
        "rank": mesh.rank, "profile": name, "estimate": est.to_report_dict(), "estimate_s": estimate_s,
        "est_model_state": est.model_state, "est_activations": est.activations,
        "model_state": sum(state.get(c, 0) for c in _STATE), "activations": acts,
        "peak": dict(tracker.peak), "step_off": statistics.median(off), "step_on": statistics.median(on),
        "samples_per_step": samples / 2, "sample_s_per_step": sample_s / 2,
        "peak_rss": peak_rss_bytes(),
    }
    tracker.close()
    return out


def _memtracker_worker(opts: BenchOptions) -> dict[str, Any]:
    """One process, the plain (unwrapped) bench GPT and AdamW: MemTracker and ours, read at the same instants."""
    from memsave.dist.baselines import mem_tracker  # here: [Note: baselines import cost]

    tracker = mem_tracker()
    torch.set_num_threads(1)
    model = _gpt(opts)
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr)
    data = TokenBatches(seq_len=opts.seq_len, batch_size=opts.batch_size, seed=opts.seed)

    def step(i: int) -> None:
        model(**data.batch(i)).loss.backward()
        opt.step()
        opt.zero_grad()

    step(0)
    theirs: list[dict[str, int]] = []
    with MemoryTracker(model, opt) as ours, tracker() as mt:
        mt.track_external(model, opt)
        hook = model.register_forward_hook(lambda *_: theirs.append(
            {str(getattr(k, "value", k)): int(v) for k, v in next(iter(mt.get_tracker_snapshot("current").values())).items()}))
        for i in range(1, 3):
            mt.reset_mod_stats()
            step(i)
        hook.remove()
        peak = {str(getattr(k, "value", k)): int(v) for k, v in next(iter(mt.get_tracker_snapshot("peak").values())).items()}
    mine = [s["bytes"] for s in ours.timeline if s["event"] == "forward_end"][-1]
    return {"profile": MEMTRACKER, "ours": mine, "theirs": theirs[-1], "their_peak": peak, "our_peak": ours.peak}


def run_memory_bench(names: list[str], opts: BenchOptions, *, timeout_s: float = 1800) -> list[dict[str, Any]]:
    """Each profile (and ``memtracker``) in fresh processes; raises :class:`memsave.bench.common.ConfigFailed` with the
    rows finished so far if one fails."""

    def run_one(name: str) -> dict[str, Any]:
        if name == MEMTRACKER:
            return spawn_local(_memtracker_worker, 1, (opts,), timeout_s=timeout_s)[0]
        return {"profile": name, "ranks": spawn_local(_worker, opts.nproc, (name, opts), timeout_s=timeout_s)}

    return run_each(names, run_one, lambda rows: None)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _ratio(measured: float, est: float) -> str:
    return f"{measured / est:.3f}" if est else "-"


def format_memory_table(rows: list[dict[str, Any]]) -> str:
    head = ["profile", "state est/meas MiB", "x", "activations est/meas MiB", "x", "peak est/meas MiB", "x",
            "peak at", "tracker ms/step", "% of step", "step off/on s (overhead)", "peak RSS MiB"]
    lines = []
    for row in rows:
        if row["profile"] == MEMTRACKER:
            continue
        for r in row["ranks"]:
            e, p = r["estimate"], r["peak"]
            lines.append([
                f"{r['profile']} r{r['rank']}", f"{_mib(r['est_model_state'])}/{_mib(r['model_state'])}",
                _ratio(r["model_state"], r["est_model_state"]),
                f"{_mib(r['est_activations'])}/{_mib(r['activations'])}", _ratio(r["activations"], r["est_activations"]),
                f"{_mib(e['peak_total'])}/{_mib(p['total'])}", _ratio(p["total"], e["peak_total"]),
                f"{p['phase']} {p['unit'] or ''}".strip(), f"{1e3 * r['sample_s_per_step']:.1f}",
                f"{100 * r['sample_s_per_step'] / r['step_on']:.2f}",
                f"{r['step_off']:.3f}/{r['step_on']:.3f} ({100 * (r['step_on'] / r['step_off'] - 1):+.1f}%)",
                _mib(r["peak_rss"]),
            ])
    out = []
    if lines:
        out = columns(head, lines)
        out.append("x: measured / estimated. state: parameters, gradients, masters and optimizer state after the "
                   "last step; activations: saved for backward at the end of the last forward; peak: the largest "
                   "accounted sample. tracker ms/step: time inside its samples; step off/on: median step "
                   "untracked / tracked, interleaved.")
    for row in rows:
        if row["profile"] != MEMTRACKER:
            continue
        pairs = {"Parameter": "params", "Buffer": "buffers", "Gradient": "grads", "Activation": "activations",
                 "Optstate": "optimizer_state"}
        cells = [f"{name} {_mib(row['theirs'].get(name, 0))}/{_mib(row['ours'].get(cat, 0))}"
                 f" ({_ratio(row['ours'].get(cat, 0), row['theirs'].get(name, 0))})" for name, cat in pairs.items()]
        out.append("torch MemTracker / memsave tracker at the end of forward, MiB (x ours/theirs): " + "; ".join(cells)
                   + f"; MemTracker's peak {_mib(row['their_peak'].get('Total', 0))} MiB (of it TEMP "
                   f"{_mib(row['their_peak'].get('Temp', 0))}, not a category here), ours "
                   f"{_mib(row['our_peak']['total'])} MiB")
    return "\n".join(out)


def run_command(names_text: str, opts: BenchOptions, json_path: Path | None) -> int:
    names = split_names(names_text)
    for name in names:
        if name != MEMTRACKER:
            load_profile(name)  # a bad name fails now
    return show_results(lambda: run_memory_bench(names, opts), lambda rows: print(format_memory_table(rows)),
                        json_path, opts, schema="memsave.bench-memory/1")
