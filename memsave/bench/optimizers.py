"""``memsave bench --optimizers``: optimizers alone on one process, their state bytes and step time.

Each optimizer runs in a fresh single-thread process on the reference GPT: one real forward and backward for
its gradients, then timed steps; the table compares each with the first (AdamW by default).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from memsave import dist as mdist
from memsave._launch import spawn_local
from memsave.bench.common import BenchOptions, run_each, show_results, split_names
from memsave.models import GPT, TokenBatches
from memsave.optim import Adafactor

__all__ = ["OPTIMIZERS", "format_optim_table", "run_command", "run_optim_bench"]
OPTIMIZERS = ("adamw", "torch-adafactor", "adafactor", "adafactor-bf16m", "adafactor-per-tensor")


def _make_optimizer(name: str, params: list, lr: float) -> torch.optim.Optimizer:
    if name == "adamw":  # torch's default on CPU: the foreach implementation
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, foreach=True)
    if name == "torch-adafactor":  # as its users get it (its default is the per-tensor loop)
        return torch.optim.Adafactor(params, lr=1e-2)
    if name == "torch-adafactor-foreach":
        return torch.optim.Adafactor(params, lr=1e-2, foreach=True)
    if name == "adafactor":
        return Adafactor(params)
    if name == "adafactor-bf16m":  # with a first moment stored in bfloat16
        return Adafactor(params, beta1=0.9, momentum_dtype=torch.bfloat16)
    if name == "adafactor-per-tensor":
        return Adafactor(params, foreach=False)
    raise ValueError(f"optimizer {name!r} is not known; expected one of {', '.join(OPTIMIZERS)}, "
                     "torch-adafactor-foreach")


def _optim_worker(name: str, opts: BenchOptions) -> dict[str, Any]:
    """One optimizer on the reference GPT: gradients from one real backward, then timed steps (one thread,
    as the issue's figures were taken)."""
    torch.set_num_threads(1)
    mdist.init()
    torch.manual_seed(opts.seed)
    model = GPT(opts.model_config())
    batch = TokenBatches(seq_len=opts.seq_len, batch_size=opts.batch_size, seed=opts.seed).batch(0)
    model(**batch).loss.backward()
    opt = _make_optimizer(name, list(model.parameters()), opts.lr)
    times = []
    for _ in range(opts.steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    state = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                if isinstance(v, torch.Tensor))
    return {"name": name, "median_step_s": statistics.median(times[opts.warmup :]), "state_bytes": state,
            "params": sum(p.numel() for p in model.parameters())}


def run_optim_bench(names: list[str], opts: BenchOptions, *, timeout_s: float = 1800) -> list[dict[str, Any]]:
    """Each optimizer in a fresh single-thread process; state and step time against the first (AdamW)."""

    def compare(rows: list[dict[str, Any]]) -> None:
        for r in rows:
            r["vs_ref_state"] = r["state_bytes"] / max(rows[0]["state_bytes"], 1)
            r["vs_ref_step_time"] = r["median_step_s"] / rows[0]["median_step_s"]
            r["reference"] = rows[0]["name"]

    return run_each(names, lambda name: spawn_local(_optim_worker, 1, (name, opts), timeout_s=timeout_s)[0], compare)


def format_optim_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'optimizer':<24}{'state MiB':>12}{'x ref':>10}{'step s':>10}{'x ref':>8}"]
    for r in rows:
        lines.append(f"{r['name']:<24}{r['state_bytes'] / 2**20:>12.2f}{r['vs_ref_state']:>10.4f}"
                     f"{r['median_step_s']:>10.3f}{r['vs_ref_step_time']:>8.2f}")
    lines.append(f"model: {rows[0]['params']:,} parameters, one process, one thread; reference: {rows[0]['reference']}")
    return "\n".join(lines)


def run_command(spec: str, opts: BenchOptions, json_path: Path | None) -> int:
    """``memsave bench --optimizers NAMES``: every name checked first, then run; the table and the JSON file."""
    names = split_names(spec)
    for name in names:
        _make_optimizer(name, [torch.zeros(1, requires_grad=True)], 1e-3)  # a bad name fails now
    return show_results(lambda: run_optim_bench(names, opts), lambda rows: print(format_optim_table(rows)),
                        json_path, opts, schema="memsave.bench-optim/1")
