"""``memsave bench --deferred``: the memory of ``memsave.wrap`` on a model built under ``memsave.deferred_init()``
against the same model built eagerly, at ZeRO-3 (the issue's target: a model several times one rank's budget wraps
with a peak per rank of at most 1.1 x (its shards + the largest unit)).

Each configuration runs in fresh local processes (``--nproc``), which first build and wrap a tiny GPT both ways (so
that code pages and torch's lazily built state are resident before the measure). Per rank, from the RSS just before
the model is built (heap trimmed, the kernel's high-water mark reset through ``/proc/self/clear_refs``; Linux only)
to the end of ``wrap``: the peak RSS, against the bytes of this rank's shards plus the largest unit, and the model's bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import time
from pathlib import Path
from typing import Any

import torch

from memsave import dist as mdist
from memsave.api import wrap
from memsave.bench.common import BenchOptions, mib, to_json
from memsave.deferred import deferred_init
from memsave.models import GPT, GPTConfig
from memsave.models.units import default_units, unit_parameters

__all__ = ["deferred_config", "run_command", "run_deferred_bench"]

CONFIGS = ("deferred", "eager")


def deferred_config(d_model: int, n_layer: int) -> GPTConfig:
    """Many equal blocks and a small root (a 256-token vocabulary), so that the largest unit is one block."""
    return GPTConfig(n_layer=n_layer, d_model=d_model, n_head=max(1, d_model // 64), vocab_size=256, block_size=64)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _worker(name: str, cfg: GPTConfig, profile: str) -> dict[str, Any]:
    mesh = mdist.init()
    # warm-up: the first construction and wrap page in code and allocate the allocator's and torch's own state
    tiny = deferred_config(64, 2)
    for how in ("deferred", "eager"):
        with deferred_init() if how == "deferred" else contextlib.nullcontext():
            warm = GPT(tiny)
        wrap(warm, torch.optim.AdamW(warm.parameters()), profile, mesh=mesh)
        del warm
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark restarts at the current RSS
    before = _status("VmRSS")
    start = time.perf_counter()
    torch.manual_seed(0)
    if name == "deferred":
        with deferred_init():
            model = GPT(cfg)
    else:
        model = GPT(cfg)
    built = time.perf_counter()
    after_build, build_peak = _status("VmRSS") - before, _status("VmHWM") - before
    groups = unit_parameters(model, default_units(model))
    unit_bytes = [sum(p.numel() * p.element_size() for _, p in g) for g in groups]
    wrapped, _ = wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), profile, mesh=mesh)
    done = time.perf_counter()
    engine: Any = wrapped.memsave_engine
    shards = sum(u.flat_shard.nbytes for u in engine.units) if engine.stage == 3 else sum(unit_bytes)
    return {"config": name, "rank": mesh.rank, "peak": _status("VmHWM") - before, "shards": shards,
            "largest_unit": max(unit_bytes), "model": sum(unit_bytes), "build_s": built - start,
            "wrap_s": done - built, "after_build": after_build, "build_peak": build_peak}


def run_deferred_bench(opts: BenchOptions, cfg: GPTConfig, configs: tuple[str, ...] = CONFIGS,
                       profile: str = "zero3", timeout_s: float = 900) -> list[dict[str, Any]]:
    from memsave._launch import spawn_local

    return [r for name in configs for r in spawn_local(_worker, opts.nproc, (name, cfg, profile), timeout_s=timeout_s)]


def format_deferred_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'config':<9} {'rank':>4} {'model MiB':>9} {'shards MiB':>10} {'unit MiB':>8} {'peak MiB':>8} "
            f"{'peak/(shards+unit)':>18} {'model/peak':>10} {'build s':>7} {'wrap s':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        bound = r["shards"] + r["largest_unit"]
        lines.append(f"{r['config']:<9} {r['rank']:>4} {mib(r['model']):>9} {mib(r['shards']):>10} "
                     f"{mib(r['largest_unit']):>8} {mib(r['peak']):>8} {r['peak'] / bound:>18.2f} "
                     f"{r['model'] / r['peak']:>10.2f} {r['build_s']:>7.2f} {r['wrap_s']:>6.2f}")
    return "\n".join(lines)


def run_command(opts: BenchOptions, d_model: int, n_layer: int, json_path: Path | None) -> int:
    cfg = deferred_config(d_model, n_layer)
    rows = run_deferred_bench(opts, cfg)
    print(f"deferred initialization, zero3, {opts.nproc} ranks, GPT d_model={d_model} n_layer={n_layer}", flush=True)
    print(format_deferred_table(rows), flush=True)
    if json_path is not None:
        json_path.write_text(to_json(rows, opts, schema="memsave.bench.deferred/1"))
    return 0
