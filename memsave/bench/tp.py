"""``memsave bench --tp``: memsave's tensor parallelism (memsave/tp/) on the reference GPT, against the formulas
and against torch's own DTensor TP, in one run.

tp = ``--nproc`` ranks (dp = 1, gloo on CPU, one thread each), the reference GPT of ``--size`` (default
``medium``), one global batch of ``--batch-size`` x ``--seq-len`` on every configuration, fp32 AdamW. Every
configuration is built side by side in one group of fresh processes and their steps are interleaved, so that
the drift of a shared machine falls on all of them alike:

- ``single``: the plain GPT on the first process alone, the others waiting (the t = 1 reference);
- ``single-x2``: the plain GPT on every process at once, with no communication: what running tp processes
  costs the machine by itself (shared cores, caches, memory bandwidth, other load), the floor of any tp step;
- ``memsave``, ``memsave-sp``: ``memsave.wrap`` with ``[parallel] tp``, without and with ``sequence``;
- ``torch``, ``torch-sp``: ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` (and
  ``SequenceParallel``) and ``loss_parallel()`` on an unwrapped copy (memsave/dist/baselines_tp.py).

It reports:
1. parameter bytes per rank, measured on the wrapped model, against ``(split parameters) / tp + replicated ones``
   computed from the plan (:func:`plan_param_bytes`, exact) and against ``memsave.estimate``;
2. activation bytes per layer per rank, measured by memsave's tracker (the activations it counts at a block's
   forward end less those at its start), against Korthikanti et al. (2022, "Reducing Activation Recomputation
   in Large Transformer Models", Table 2; :func:`paper_activation_bytes`) and against the same derivation adapted
   to this run (:func:`adapted_activation_bytes`);
3. the median step time (forward, backward, optimizer step; the slowest rank) against one process and against
   torch's TP, and every configuration's losses against one process (the same trajectory).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from memsave import dist as mdist
from memsave._launch import spawn_local
from memsave.api import wrap
from memsave.bench.common import BenchOptions, show_results
from memsave.bench.tp_report import format_tp_table, summarize
from memsave.config import load_profile
from memsave.estimator import estimate
from memsave.memory import MemoryTracker
from memsave.models import GPT, TokenBatches
from memsave.tp import gpt_plan, match_plan
from memsave.tp.apply import expert_dim

__all__ = ["CONFIGS", "adapted_activation_bytes", "paper_activation_bytes", "plan_param_bytes", "run_command",
           "run_tp_bench"]

CONFIGS = ("single", "single-x2", "memsave", "memsave-sp", "torch", "torch-sp")
_COLUMN = ("colwise", "packed_colwise", "colwise_gather_output", "loss_parallel")


def plan_param_bytes(model: nn.Module, tp: int, plan: Mapping[str, str] | None = None) -> int:
    """Parameter bytes one tp rank holds under ``plan`` (default: the GPT's), from the plan alone: a parameter
    the plan splits counts ``ceil(size / tp)`` of its split dim (a vocabulary padded to a multiple of tp), every
    other one whole; a tied parameter once. Works on a meta-device model."""
    split: dict[int, int] = {}  # id(param) -> the dim the plan splits
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    for name, (style, _) in match_plan(model, plan if plan is not None else gpt_plan()).items():
        if name not in modules:  # a fused expert tensor
            split[id(params[name])] = expert_dim(params[name], style)
            continue
        m = modules[name]
        if style in _COLUMN:  # output rows (a packed block's rows divide by blocks x tp: the same count)
            dims = {"weight": 0, "bias": 0}
        elif style in ("rowwise", "rowwise_split_input"):  # input columns; the bias is added whole after the reduction
            dims = {"weight": 1}
        elif style == "vocab_embedding":
            dims = {"weight": 0}
        else:
            dims = {}
        for pn, dim in dims.items():
            p = getattr(m, pn, None)
            if isinstance(p, torch.Tensor):
                split[id(p)] = dim
    total = 0
    for p in model.parameters():  # a tied parameter once
        numel = p.numel()
        if id(p) in split:
            d = p.shape[split[id(p)]]
            numel = -(-d // tp) * (numel // d)
        total += numel * p.element_size()
    return total


def paper_activation_bytes(s: int, b: int, h: int, a: int, t: int, sequence: bool) -> float:
    """Korthikanti et al. (2022), Table 2: activation bytes per transformer layer, 16-bit activations and 1-byte
    dropout masks: t = 1 ``sbh(34 + 5as/h)``; TP ``sbh(10 + 24/t + 5as/(ht))``; TP + SP ``sbh(34 + 5as/h)/t``."""
    if t == 1 or sequence:
        return s * b * h * (34 + 5 * a * s / h) / t
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def adapted_activation_bytes(s: int, b: int, h: int, a: int, t: int, sequence: bool) -> float:
    """The paper's per-term derivation (section 4.1) for this run: fp32 activations (4 bytes where it counts 2),
    no dropout (the reference GPT's is 0: no masks, and attention keeps no dropout output), and torch's
    fused CPU attention (``scaled_dot_product_attention``'s flash kernel), which keeps no ``s x s`` scores.

    Per layer, in 4-byte elements, term by term against the paper's 16-bit bytes:
    - replicated under TP without SP (paper 10): the two LayerNorm inputs ``2sbh`` (paper 4), the qkv input
      ``sbh`` (2), the first MLP linear's input ``sbh`` (2); the two dropout masks (2) are gone: ``4sbh``;
    - split over t (paper 24): Q, K ``2sbh`` (4) and V ``sbh`` (2), which here are one ``3sbh`` qkv output; the
      output projection's input ``sbh`` (2), which is also the attention kernel's output; the GELU input ``4sbh``
      (8) and output ``4sbh`` (8): ``12sbh``;
    - attention core (paper ``5as^2b``: softmax output 2, its dropout mask 1, dropout output 2): the flash
      kernel keeps only the log-sum-exp per row and head, ``asb``;
    - not in the paper: each LayerNorm's mean and 1/std per token, ``4sb``.
    So ``4 * (4sbh + 12sbh/t + asb/t + 4sb)`` bytes, i.e. ``sbh(16 + 48/t + 4a/(ht)) + 16sb``; under SP every
    term is cut along the sequence: ``(sbh(64 + 4a/h) + 16sb)/t``; t = 1: ``sbh(64 + 4a/h) + 16sb``.
    """
    replicated, split, core, stats = 4 * s * b * h, 12 * s * b * h, a * s * b, 4 * s * b
    if t == 1 or sequence:
        return 4 * (replicated + split + core + stats) / t
    return 4 * (replicated + split / t + core / t + stats)


# -- the run: one group of tp processes, every configuration's steps interleaved -----------------------------
def _gpt(opts: BenchOptions, device: str = "cpu") -> GPT:
    torch.manual_seed(opts.seed)
    with torch.device(device):
        return GPT(opts.model_config())


def _block_activations(model: nn.Module, holders: list[object], run: Callable[[], Any]) -> list[int]:
    """Per block, the activation bytes memsave's tracker counts at its forward end less those at its start: what
    the block's forward saved for backward, on this rank. ``run`` is one training step."""
    blocks = list(cast(nn.ModuleList, model.blocks))
    tracker = MemoryTracker(model, *holders, units=blocks)
    try:
        run()
    finally:
        tracker.close()
    names = {id(b): n for n, b in model.named_modules() if b in blocks}
    out = []
    for block in blocks:
        at = {s["event"]: s["bytes"].get("activations", 0) for s in tracker.timeline
              if s["unit"] == names[id(block)] and s["phase"] == "forward"}
        out.append(at["post_forward"] - at["pre_forward"])
    return out


class _Config:
    """One configuration on this rank: its model and a step (forward, backward, optimizer step; the loss), or
    nothing to run (``single`` on every rank but the first)."""

    def __init__(self, name: str, opts: BenchOptions, mesh: mdist.Mesh) -> None:
        # here, not at the top: [Note: baselines import cost] in memsave/dist/baselines.py
        from memsave.dist import baselines_tp

        self.tt = baselines_tp
        self.name, self.runs = name, name != "single" or mesh.rank == 0
        self.model: nn.Module | None = None
        self.opt: Any = None  # memsave's optimizer or torch's AdamW
        self.facts: dict[str, Any] = {}
        if not self.runs:
            return
        self.model = model = _gpt(opts)
        if name.startswith("memsave"):
            prof = load_profile("ddp", [f"parallel.tp={opts.nproc}", f"parallel.sequence={str(name.endswith('-sp')).lower()}"])
            meta = _gpt(opts, "meta")
            self.facts["formula_param_bytes"] = plan_param_bytes(meta, opts.nproc)
            self.facts["estimated_param_bytes"] = estimate(meta, prof, world_size=opts.nproc, device="cpu").bytes["params"]
            self.model, self.opt = wrap(model, torch.optim.AdamW(model.parameters(), lr=opts.lr), prof, mesh=mesh)
            self.backward: Callable[[torch.Tensor], None] = self.opt.backward
        else:
            if name.startswith("torch"):
                baselines_tp.torch_tp_gpt(model, mesh.device.type, opts.nproc, sequence=name.endswith("-sp"))
            self.opt = torch.optim.AdamW(model.parameters(), lr=opts.lr)
            self.backward = lambda loss: loss.backward()
        self.facts["param_bytes"] = sum(baselines_tp.local(p).numel() * p.element_size() for p in self.model.parameters())

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        assert self.model is not None
        with self.tt.loss_parallel() if self.name.startswith("torch") else contextlib.nullcontext():
            loss = self.model(**batch).loss
            self.backward(loss)  # torch's loss_parallel: backward inside the context too
        self.opt.step()
        return float(self.tt.local(loss).detach())


def _worker(opts: BenchOptions, names: tuple[str, ...]) -> dict[str, Any]:
    """Every configuration of ``names`` built side by side on this rank, then their steps interleaved (step ``i``
    of each, in an order that rotates with ``i``): the machine's drift and other load fall on all of them alike.
    Each step starts at a barrier; ``zero_grad`` runs after the clock. Then the tracker's activations per block.
    A shared machine's other load only adds time, so the fastest step is reported beside the median."""
    torch.set_num_threads(1)
    # the host allocator's trim after each forward is process-wide: interleaved, memsave's would make every other
    # configuration fault its pages in again; off for all (its cost is in the steptime bench)
    mesh = mdist.init(profile=load_profile("ddp", [f"parallel.tp={opts.nproc}"]), host_trim=False)
    configs = [_Config(n, opts, mesh) for n in names]
    data = TokenBatches(seq_len=opts.seq_len, batch_size=opts.batch_size, seed=opts.seed)  # dp = 1: every rank
    times: dict[str, list[float | None]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    for i in range(opts.steps):
        batch = data.batch(i)
        for c in configs[i % len(configs):] + configs[: i % len(configs)]:
            mdist.barrier()
            t0 = time.perf_counter()
            if c.runs:
                losses[c.name].append(c.step(batch))
            times[c.name].append(time.perf_counter() - t0 if c.runs else None)
            if c.runs:
                c.opt.zero_grad()
    acts = {}
    for c in configs:
        if c.name.startswith("memsave"):  # the collectives of one step, by kind ([Note: TP traffic kinds])
            with mdist.COMM_STATS.measure() as window:
                c.step(data.batch(opts.steps))
            c.opt.zero_grad()
            c.facts["collectives_per_step"] = window.snapshot()
        if c.model is not None and not c.name.startswith("torch") and c.name != "single-x2":
            acts[c.name] = _block_activations(c.model, [c.opt], functools.partial(c.step, data.batch(opts.steps)))
    return {"rank": mesh.rank, "times": times, "losses": losses, "block_activations": acts,
            "facts": {c.name: c.facts for c in configs}}


def _rows(ranks: list[dict[str, Any]], names: tuple[str, ...], opts: BenchOptions) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        mine = [r for r in ranks if r["times"][name][0] is not None]  # the ranks that ran it
        per_step = [max(r["times"][name][i] for r in mine) for i in range(opts.steps)]  # the slowest rank
        rows.append({"name": name, "nproc": len(mine), "sequence": name.endswith("-sp"),
                     "median_step_s": statistics.median(per_step[opts.warmup :]), "step_s": per_step,
                     "timed_step_s": per_step[opts.warmup :],
                     "losses": mine[0]["losses"][name],
                     "ranks": [{"rank": r["rank"], **r["facts"][name],
                                **({"block_activations": r["block_activations"][name]}
                                   if name in r["block_activations"] else {})} for r in mine]})
    return rows


def run_tp_bench(opts: BenchOptions, names: tuple[str, ...] = CONFIGS, *, timeout_s: float = 1800) -> list[dict[str, Any]]:
    """Every configuration of ``names`` in one group of ``opts.nproc`` fresh processes, their steps interleaved;
    one row each, with the comparisons of :func:`memsave.bench.tp_report.summarize`."""
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise ValueError(f"memsave bench --tp: configurations {unknown or names!r}; expected some of {', '.join(CONFIGS)}")
    cfg = opts.model_config()
    with torch.device("meta"):
        params = GPT(cfg).num_parameters()
    shape = {"s": opts.seq_len, "b": opts.batch_size, "h": cfg.d_model, "a": cfg.n_head, "t": opts.nproc,
             "layers": cfg.n_layer, "params": params, "timed": opts.steps - opts.warmup}
    rows = _rows(spawn_local(_worker, opts.nproc, (opts, tuple(names)), timeout_s=timeout_s), tuple(names), opts)
    summarize(rows, shape, paper_activation_bytes, adapted_activation_bytes)
    return rows


def run_command(opts: BenchOptions, json_path: Path | None) -> int:
    """``memsave bench --tp``: every configuration, the table and the JSON file."""
    if opts.nproc < 2:
        raise ValueError(f"memsave bench --tp: --nproc {opts.nproc} is the tp degree; expected >= 2")
    return show_results(lambda: run_tp_bench(opts), lambda rows: print(format_tp_table(rows)), json_path, opts,
                        schema="memsave.bench-tp/1")
