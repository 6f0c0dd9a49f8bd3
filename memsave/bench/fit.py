"""``memsave bench --fit``: the largest reference GPT each configuration trains within a device-memory cap, and
what host offload costs per step (ZeRO-Offload, Ren et al., 2021; ZeRO-Infinity, Rajbhandari et al., 2021).

The cap (``--device-gib``) stands for a smaller device: ``torch.cuda.set_per_process_memory_fraction`` makes
the caching allocator raise ``OutOfMemoryError`` past it, exactly as a device of that size would. The model is
the reference GPT at a fixed width, deepened until a training step no longer fits: the depth doubles (from 4, and
for later configurations from the first one's result) until a trial fails, then is bisected to within 1/8. Each trial is a fresh process (one
rank) that builds the model on the host, wraps it, and trains ``--steps`` steps; it fits when every step ran.
Per configuration the bench reports the largest fitting depth and its parameters, the device peak
(``max_memory_allocated``), the host bytes its offload holds, and the median step time; the first
configuration is the reference: the ratio of parameters, and each other configuration's step time on the
reference's largest model (the overhead of offloading a model that would fit anyway).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from memsave import dist as mdist
from memsave._launch import LaunchError, spawn_local
from memsave.api import wrap
from memsave.bench.common import ConfigFailed, split_names, to_json
from memsave.config import load_profile
from memsave.models import GPT, GPTConfig, TokenBatches

__all__ = ["FIT_VARIANTS", "FitOptions", "format_fit_table", "largest_fitting", "run_command", "run_fit_bench"]

_OFFLOAD = ("offload.optimizer=cpu", "offload.params=cpu", "offload.chunk_mb=16")
_DEVICE = ("offload.step=device",)  # the step on the device: the state streamed to it in chunks
_HOST = ("offload.step=host",)  # the step on the host (ZeRO-Offload): only gradients and parameters cross PCIe
FIT_VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "zero3": ("zero3", ()),
    "zero3-offload": ("zero3-offload", ("offload.chunk_mb=16", *_DEVICE)),  # the optimizer state on the host
    "zero3-offload-params": ("zero3-offload", (*_OFFLOAD, *_DEVICE)),  # the parameter shards too
    "zero3-bf16": ("zero3-bf16", ()),
    "zero3-bf16-offload": ("zero3-bf16", ("offload.optimizer=cpu", "offload.chunk_mb=16", *_DEVICE)),
    "zero3-bf16-offload-params": ("zero3-bf16", (*_OFFLOAD, *_DEVICE)),
    "zero3-bf16-offload-host": ("zero3-bf16", ("offload.optimizer=cpu", "offload.chunk_mb=16", *_HOST)),
    "zero3-bf16-offload-host-params": ("zero3-bf16", (*_OFFLOAD, *_HOST)),
    "zero3-bf16-offload-disk": ("zero3-bf16", ("offload.optimizer=disk", "offload.path=/tmp", "offload.chunk_mb=16")),
}


@dataclasses.dataclass(frozen=True)
class FitOptions:
    device_gib: float = 4.0
    d_model: int = 1024
    n_head: int = 16
    vocab_size: int = 8192
    seq_len: int = 256
    batch_size: int = 4
    steps: int = 3
    start_layers: int = 4
    max_layers: int = 1024
    resolution: int = 8  # the largest depth is found to within 1/resolution of it
    recompute: str = "full"  # the same activation policy for every configuration


def largest_fitting(fits: Callable[[int], dict[str, Any] | None], start: int, most: int, *, resolution: int = 16,
                    ) -> tuple[int, dict[str, Any] | None, int]:
    """The largest ``n`` in ``[1, most]`` with ``fits(n)`` not None (found by doubling from ``start``, then
    bisecting until the gap is at most ``1/resolution`` of it), its result, and the number of trials."""
    trials, lo, best, hi = 0, 0, None, None
    n = max(1, min(start, most))
    while True:  # doubling up, or halving down from a start that does not fit
        trials += 1
        result = fits(n)
        if result is not None:
            lo, best = n, result
            if n >= most or hi is not None:
                break
            n = min(2 * n, most)
        else:
            hi = n
            if lo or n == 1:
                break
            n = max(1, n // 2)
    while hi is not None and hi - lo > max(1, lo // resolution):
        mid = (lo + hi) // 2
        trials += 1
        result = fits(mid)
        if result is not None:
            lo, best = mid, result
        else:
            hi = mid
    return lo, best, trials


# -- one trial, in its own process ------------------------------------------------------------------------------
def _trial(spec: dict[str, Any]) -> dict[str, Any]:
    opts = FitOptions(**spec["opts"])
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, opts.device_gib * 2**30 / total))
    mesh = mdist.init()
    profile = load_profile(spec["profile"], (*spec["overrides"], f'recompute.policy="{opts.recompute}"'))
    cfg = GPTConfig(vocab_size=opts.vocab_size, block_size=opts.seq_len, n_layer=spec["n_layer"],
                    n_head=opts.n_head, d_model=opts.d_model, tie_weights=False)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu")
    model.init_weights()  # on the host: the device only ever sees what wrap puts there
    psi = model.num_parameters()
    out: dict[str, Any] = {"ok": False, "n_layer": spec["n_layer"], "params": psi}
    data = TokenBatches(seq_len=opts.seq_len, batch_size=opts.batch_size, dp_rank=mesh.dp_rank,
                        dp_size=mesh.dp_size, seed=0)
    opt = None
    try:
        opt0 = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        run_model, opt = wrap(model, opt0, profile, mesh=mesh)
        times, losses = [], []
        for step in range(opts.steps):
            batch = {k: v.to(mesh.device) for k, v in data.batch(step).items()}
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = run_model(**batch).loss
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        off = opt.offloaded_bytes() if hasattr(opt, "offloaded_bytes") else {"host": 0, "disk": 0}
        out.update(ok=True, times=times, step_s=statistics.median(times[1:] or times), losses=losses,
                   device_peak=torch.cuda.max_memory_allocated(), device_reserved=torch.cuda.max_memory_reserved(),
                   host_bytes=off["host"])
    except torch.OutOfMemoryError as exc:
        out["error"] = str(exc).splitlines()[0][:200]
    finally:
        if opt is not None and hasattr(opt, "close"):
            try:
                opt.close()
            except torch.OutOfMemoryError:
                pass
    return out


def _run_trial(name: str, n_layer: int, opts: FitOptions, timeout: float) -> dict[str, Any]:
    profile, overrides = FIT_VARIANTS.get(name, (name, ()))
    spec = {"profile": profile, "overrides": list(overrides), "n_layer": n_layer, "opts": dataclasses.asdict(opts)}
    try:
        return spawn_local(_trial, 1, (spec,), timeout_s=timeout)[0]
    except LaunchError as exc:  # a trial that did not fit returns; this one crashed (or its launch failed)
        raise ConfigFailed(f"{name} (n_layer={n_layer})", [], exc) from None


def run_fit_bench(names: list[str], opts: FitOptions, *, timeout: float = 600.0,
                  log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        raise NotImplementedError("memsave bench --fit caps the memory of a CUDA device: it needs one (on a CPU "
                                  "machine the offload bench is `memsave bench --offload`)")
    for name in names:
        profile, overrides = FIT_VARIANTS.get(name, (name, ()))
        load_profile(profile, overrides)  # a bad name fails before any trial
    rows: list[dict[str, Any]] = []
    for name in names:
        def fits(n: int, name: str = name) -> dict[str, Any] | None:
            r = _run_trial(name, n, opts, timeout)
            log(f"  {name}: n_layer={n} ({r['params'] / 1e6:.0f}M params): "
                + (f"fits, peak {r['device_peak'] / 2**30:.2f} GiB, step {r['step_s']:.3f} s" if r["ok"]
                   else f"does not fit ({r.get('error', '')[:80]})"))
            return r if r["ok"] else None

        start = max(opts.start_layers, rows[0]["n_layer"]) if rows else opts.start_layers
        layers, best, trials = largest_fitting(fits, start, opts.max_layers, resolution=opts.resolution)
        rows.append({"name": name, "n_layer": layers, "trials": trials, "best": best})
    ref = rows[0]
    for row in rows[1:]:  # the overhead: this configuration on the reference's largest model
        if ref["best"] is not None and row["best"] is not None:
            same = _run_trial(row["name"], ref["n_layer"], opts, timeout)
            row["at_reference"] = same if same["ok"] else None
    return rows


def format_fit_table(rows: list[dict[str, Any]], opts: FitOptions) -> str:
    ref = rows[0]["best"]
    lines = [f"largest reference GPT (d_model={opts.d_model}, vocab {opts.vocab_size}, batch {opts.batch_size} x "
             f"{opts.seq_len}, recompute {opts.recompute}) training within {opts.device_gib:g} GiB of device memory",
             "| config | n_layer | params | x reference | device peak GiB | host GiB | step s | step s at the "
             "reference's size | x reference step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        b = row["best"]
        if b is None:
            lines.append(f"| {row['name']} | none fits | | | | | | | |")
            continue
        ratio = f"{b['params'] / ref['params']:.2f}" if ref is not None else "-"
        same = row.get("at_reference")
        at_ref = same["step_s"] if same is not None else (b["step_s"] if row is rows[0] else None)
        slow = (f"{at_ref / ref['step_s']:.2f}" if at_ref is not None and ref is not None else "-")
        lines.append(f"| {row['name']} | {row['n_layer']} | {b['params'] / 1e6:,.0f}M | {ratio} | "
                     f"{b['device_peak'] / 2**30:.2f} | {b['host_bytes'] / 2**30:.2f} | {b['step_s']:.3f} | "
                     f"{'-' if at_ref is None else f'{at_ref:.3f}'} | {slow} |")
    return "\n".join(lines)


def run_command(names: str, opts: FitOptions, json_path: Path | None) -> int:
    configs = split_names(names)
    rows = run_fit_bench(configs, opts)
    print(format_fit_table(rows, opts))
    if json_path is not None:
        json_path.write_text(to_json(rows, opts, schema="memsave.bench-fit/1"))
    return 0
