"""``memsave bench --offload``: optimizer-state offload against the same run in memory (ZeRO-Offload, Ren et al.,
2021; ZeRO-Infinity, Rajbhandari et al., 2021).

Each configuration trains the reference GPT in fresh local processes, like ``memsave bench``, and reports per
configuration: the median step time and its optimizer part, peak RSS per rank, the optimizer state held in
memory (the window buffers and the chunks kept there included) and on disk, the I/O time the tier spent and
the part of it the step waited for (the rest was hidden behind compute), and the final loss (equal to the
in-memory run's: offload is exact). Against the first configuration (in memory): the step-time ratio and the
RSS reduction as a share of the optimizer state's bytes. Rows with part of the state offloaded are compared
with ``memsave.estimate``'s prediction: the peak RSS of the in-memory run less the bytes the estimator moves
off, and a step time between the two ends in proportion to those bytes.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from memsave import dist as mdist
from memsave._launch import LaunchError, spawn_local
from memsave.api import wrap
from memsave.bench.common import BenchOptions, ConfigFailed, columns, mib, split_names, to_json
from memsave.config import load_profile
from memsave.estimator import estimate
from memsave.memory import account, peak_rss_bytes
from memsave.models import GPT, TokenBatches

__all__ = ["DEFAULT_OFFLOAD", "VARIANTS", "format_offload_table", "run_command", "run_offload_bench", "variant"]

_DISK = ("offload.optimizer=disk",)
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "zero3": ("zero3", ()),
    "zero3-offload-disk": ("zero3-infinity", ()),  # prefetch 2, the step overlapped with the next forward
    "zero3-offload-disk-nooverlap": ("zero3-infinity", ("offload.overlap=false",)),  # prefetch within the step
    "zero3-offload-disk-noprefetch": ("zero3-infinity", ("offload.prefetch=0", "offload.overlap=false")),
    "zero3-offload-disk-half": ("zero3-infinity", ("offload.fraction=0.5",)),
    "zero3-offload-disk-buffered": ("zero3-infinity", ("offload.direct=false",)),
    "zero3-offload-disk-params": ("zero3-infinity", ("offload.params=disk",)),
    "zero3-offload-disk-params-noprefetch": ("zero3-infinity", ("offload.params=disk", "offload.prefetch=0",
                                                                "offload.overlap=false")),
    # on CUDA (one process): the step on the device against the host step (ZeRO-Offload), and the disk on CUDA
    "zero3-bf16": ("zero3-bf16", ()),
    "zero3-bf16-offload-device": ("zero3-bf16", ("offload.optimizer=cpu", "offload.step=device",
                                                 "offload.chunk_mb=16")),
    "zero3-bf16-offload-host": ("zero3-bf16", ("offload.optimizer=cpu", "offload.step=host", "offload.chunk_mb=16")),
    "zero3-offload-host": ("zero3", ("offload.optimizer=cpu", "offload.step=host", "offload.chunk_mb=16")),
    "zero3-bf16-offload-host-64": ("zero3-bf16", ("offload.optimizer=cpu", "offload.step=host",
                                                  "offload.chunk_mb=64")),
    "zero3-bf16-offload-host-4": ("zero3-bf16", ("offload.optimizer=cpu", "offload.step=host", "offload.chunk_mb=4")),
    "zero3-bf16-offload-disk": ("zero3-bf16", (*_DISK, "offload.path=memsave-offload", "offload.chunk_mb=16")),
    "zero3-bf16-offload-disk-noprefetch": ("zero3-bf16", (*_DISK, "offload.path=memsave-offload",
                                                          "offload.chunk_mb=16", "offload.prefetch=0")),
    "zero2": ("zero2", ()),
    "zero2-offload-disk": ("zero2", (*_DISK, "offload.path=memsave-offload")),
    "zero1-offload-disk": ("zero1", (*_DISK, "offload.path=memsave-offload")),
}
DEFAULT_OFFLOAD = ("zero3", "zero3-offload-disk", "zero3-offload-disk-nooverlap", "zero3-offload-disk-noprefetch",
                   "zero3-offload-disk-half",
                   "zero3-offload-disk-buffered", "zero3-offload-disk-params", "zero3-offload-disk-params-noprefetch")


def variant(name: str, path: str) -> tuple[str, tuple[str, ...]]:
    """``(profile, overrides)`` of a configuration: a name in :data:`VARIANTS` or any profile; the disk tier
    goes under ``path``."""
    profile, overrides = VARIANTS.get(name, (name, ()))
    prof = load_profile(profile, overrides)  # a bad name fails here
    if prof.offload.optimizer == "disk":
        overrides = (*overrides, f"offload.path={json.dumps(path)}")
    return profile, overrides


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _worker(name: str, path: str, opts: BenchOptions) -> dict[str, Any]:
    mesh = mdist.init()
    torch.manual_seed(opts.seed)
    model = GPT(opts.model_config()).to(mesh.device)
    psi = sum(p.numel() for p in model.parameters())
    profile_name, overrides = variant(name, path)
    profile = load_profile(profile_name, overrides)
    opt0 = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=0.1)
    run_model, opt = wrap(model, opt0, profile, mesh=mesh)
    data = TokenBatches(seq_len=opts.seq_len, batch_size=opts.batch_size, dp_rank=mesh.dp_rank,
                        dp_size=mesh.dp_size, seed=opts.seed)
    offloaded = getattr(opt, "offloaded", None)
    times, opt_times, waits, ios, losses = [], [], [], [], []
    for step in range(opts.steps):
        batch = {k: v.to(mesh.device) for k, v in data.batch(step).items()}
        mdist.barrier()
        _sync(mesh.device)
        wait0 = offloaded.wait_seconds if offloaded is not None else 0.0
        io0 = offloaded.tier.io_seconds if offloaded is not None else 0.0
        t0 = time.perf_counter()
        loss = run_model(**batch).loss
        opt.backward(loss)
        t1 = time.perf_counter()
        opt.step()
        _sync(mesh.device)  # CUDA: the step's kernels and copies counted (an overlapped step's rest: next forward)
        times.append(time.perf_counter() - t0)
        opt_times.append(times[-1] - (t1 - t0))
        waits.append((offloaded.wait_seconds - wait0) if offloaded is not None else 0.0)
        ios.append((offloaded.tier.io_seconds - io0) if offloaded is not None else 0.0)
        if step == opts.steps - 1:
            held = account([opt]).bytes
        opt.zero_grad()
        avg = loss.detach().float().reshape(1).clone()
        mdist.all_reduce(avg, mesh.dp_group)
        losses.append(avg.item() / mesh.dp_size)
    off_bytes = opt.offloaded_bytes() if hasattr(opt, "offloaded_bytes") else {"host": 0, "disk": 0}
    w = opts.warmup
    out = {
        "rank": mesh.rank, "psi": psi, "profile": profile_name, "overrides": list(overrides),
        "times": times, "opt_times": opt_times, "wait_s": statistics.median(waits[w:]),
        "io_s": statistics.median(ios[w:]), "losses": losses, "peak_rss": peak_rss_bytes(),
        "state_in_memory": held.get("optimizer_state", 0), "state_on_disk": off_bytes["disk"],
        "state_on_host": off_bytes["host"], "bytes": held,
        "direct": getattr(getattr(offloaded, "tier", None), "direct", None),
    }
    if hasattr(opt, "close"):
        opt.close()
    return out


def _row(name: str, ranks: list[dict[str, Any]], opts: BenchOptions) -> dict[str, Any]:
    w = opts.warmup
    per_step = [max(r["times"][s] for r in ranks) for s in range(opts.steps)]
    r0 = ranks[0]
    return {
        "name": name, "profile": r0["profile"], "overrides": r0["overrides"], "params": r0["psi"],
        "nproc": opts.nproc, "median_step_s": statistics.median(per_step[w:]),
        "median_optimizer_step_s": statistics.median(max(r["opt_times"][s] for r in ranks)
                                                     for s in range(w, opts.steps)),
        "io_s": max(r["io_s"] for r in ranks), "wait_s": max(r["wait_s"] for r in ranks),
        "peak_rss": [r["peak_rss"] for r in ranks],
        "state_in_memory": [r["state_in_memory"] for r in ranks],
        "state_on_disk": [r["state_on_disk"] for r in ranks], "direct": r0["direct"],
        "losses": r0["losses"], "final_loss": r0["losses"][-1],
    }


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from repeated runs of a configuration: the median of each timing and of each rank's peak RSS, with
    every run's step time and largest peak kept beside them."""
    out = dict(runs[len(runs) // 2])
    for key in ("median_step_s", "median_optimizer_step_s", "io_s", "wait_s"):
        out[key] = statistics.median(r[key] for r in runs)
    out["peak_rss"] = [statistics.median(r["peak_rss"][i] for r in runs) for i in range(len(runs[0]["peak_rss"]))]
    out["runs_step_s"] = [r["median_step_s"] for r in runs]
    out["runs_peak_rss"] = [max(r["peak_rss"]) for r in runs]
    if any(r["final_loss"] != out["final_loss"] for r in runs):
        raise RuntimeError(f"{out['name']}: repeated runs ended at different losses "
                           f"{[r['final_loss'] for r in runs]}; the bench's runs are deterministic")
    return out


def run_offload_bench(names: list[str], opts: BenchOptions, *, path: str | None = None,
                      timeout_s: float = 1800, repeat: int = 1) -> list[dict[str, Any]]:
    """Every configuration in fresh processes, ``repeat`` times round-robin (medians); the first is the in-memory
    reference."""
    if repeat < 1:
        raise ValueError(f"bench option repeat={repeat} is not allowed; expected >= 1")
    folder = path or tempfile.gettempdir()
    for name in names:
        variant(name, folder)  # a bad name fails before any run
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for _ in range(repeat):
        for name in names:
            try:
                ranks = spawn_local(_worker, opts.nproc, (name, folder, opts), timeout_s=timeout_s)
            except LaunchError as exc:  # no rows: they are medians over every repeat, compared with the first
                raise ConfigFailed(name, [], exc) from None
            runs[name].append(_row(name, ranks, opts))
    rows = [_median_row(runs[name]) for name in names]
    _estimates(rows, opts)
    ref = rows[0]
    # the other end: the run with everything offloaded and prefetch on (the preset's own settings)
    full = next((r for r in rows if r["name"] == "zero3-offload-disk"), None)
    state = max(ref["state_in_memory"])
    for r in rows:
        r["reference"] = ref["name"]
        r["vs_ref_step_time"] = r["median_step_s"] / ref["median_step_s"]
        r["rss_reduction"] = max(ref["peak_rss"]) - max(r["peak_rss"])
        r["rss_reduction_vs_state"] = r["rss_reduction"] / max(state, 1)
        r["final_loss_diff"] = r["final_loss"] - ref["final_loss"]
        r["hidden_io_share"] = 1 - r["wait_s"] / r["io_s"] if r["io_s"] > 0 else None
        moved, moved_full = r["estimated_offloaded"], full["estimated_offloaded"] if full else 0
        if full is not None and 0 < moved < moved_full:  # the estimator's bytes, between the two ends
            share = moved / moved_full
            r["predicted_peak_rss"] = max(ref["peak_rss"]) - moved
            r["predicted_step_s"] = ref["median_step_s"] + share * (full["median_step_s"] - ref["median_step_s"])
    return rows


def _estimates(rows: list[dict[str, Any]], opts: BenchOptions) -> None:
    """``memsave.estimate`` of each row's profile on the bench GPT: the optimizer-state bytes it moves off."""
    with torch.device("meta"):
        model = GPT(opts.model_config())
    batch = TokenBatches(seq_len=opts.seq_len, batch_size=opts.batch_size, seed=opts.seed).batch(0)
    for r in rows:
        est = estimate(model, load_profile(r["profile"], r["overrides"]), world_size=opts.nproc, batch=batch,
                       device="cpu")
        r["estimated_offloaded"] = est.bytes.get("offload_disk", 0)
        r["estimated_peak"] = est.peak_total


def format_offload_table(rows: list[dict[str, Any]]) -> str:
    head = ["config", "step s", "x ref", "opt step s", "I/O s", "waited s", "peak RSS MiB/rank", "state MiB mem/disk",
            "RSS cut % of state", "loss diff", "predicted (RSS MiB, step s)"]
    lines = []
    for r in rows:
        pred = (f"{mib(r['predicted_peak_rss'])}, {r['predicted_step_s']:.3f}" if "predicted_step_s" in r else "-")
        lines.append([
            r["name"], f"{r['median_step_s']:.3f}", f"{r['vs_ref_step_time']:.2f}",
            f"{r['median_optimizer_step_s']:.3f}", f"{r['io_s']:.3f}", f"{r['wait_s']:.3f}",
            "/".join(mib(x) for x in r["peak_rss"]),
            f"{mib(max(r['state_in_memory']))}/{mib(max(r['state_on_disk']))}",
            f"{100 * r['rss_reduction_vs_state']:.0f}%", f"{r['final_loss_diff']:+.1e}", pred,
        ])
    out = columns(head, lines)
    ratios = []
    on = {r["name"]: r for r in rows}
    r0 = rows[0]

    def cost(r: dict[str, Any]) -> float:  # what offload adds to the in-memory step
        return r["median_step_s"] - r0["median_step_s"]

    for name, other, what in (("zero3-offload-disk", "zero3-offload-disk-noprefetch", "prefetch on vs off"),
                              ("zero3-offload-disk", "zero3-offload-disk-nooverlap", "overlap on vs off"),
                              ("zero3-offload-disk-params", "zero3-offload-disk-params-noprefetch",
                               "prefetch on vs off")):
        if name in on and other in on:
            a, b = on[name], on[other]
            line = (f"{name}: {what}: step {b['median_step_s'] / a['median_step_s']:.2f}x faster, optimizer step "
                    f"{b['median_optimizer_step_s'] / a['median_optimizer_step_s']:.2f}x faster")
            if cost(a) > 0 and cost(b) > 0:
                line += f", offload's cost per step {cost(b):.3f} s -> {cost(a):.3f} s ({cost(b) / cost(a):.2f}x)"
            ratios.append(line)
    for r in rows:
        if len(r.get("runs_step_s", ())) > 1:
            ratios.append(f"{r['name']}: runs: step s " + ", ".join(f"{x:.3f}" for x in r["runs_step_s"])
                          + "; peak RSS MiB " + ", ".join(mib(x) for x in r["runs_peak_rss"]))
    out.append(f"model: {r0['params']:,} parameters, {r0['nproc']} processes, fp32 AdamW; 'x ref' and 'RSS cut' "
               f"against {r0['reference']} (its optimizer state: {mib(max(r0['state_in_memory']))} MiB/rank); "
               "I/O s: time the tier's threads spent per step, waited s: the part the training loop waited for "
               "(in the step, or with overlap in the next forward); medians over runs where repeated")
    return "\n".join(out + ratios)


def run_command(spec: str, opts: BenchOptions, json_path: Path | None, path: str | None, *, repeat: int = 1) -> int:
    """``memsave bench --offload NAMES``: run, print the table, write the JSON."""
    names = split_names(spec) or list(DEFAULT_OFFLOAD)
    rows = run_offload_bench(names, opts, path=path, repeat=repeat)
    print(format_offload_table(rows))
    if json_path is not None:
        json_path.write_text(to_json(rows, opts, schema="memsave.bench-offload/1"))
        print(f"results written to {json_path}")
    return 0
