"""What each engine costs besides FLOPs and collectives, measured: part of ``memsave calibrate``.

A step of memsave's engines pays for more than its matrix multiplies and its collectives (whose latency and
bandwidth ``memsave calibrate`` measures per kind): its compute runs slower than one rank's plain forward and
backward alone (two ranks share the machine's memory bandwidth and cores with the collectives' threads; tensor
parallelism's halves of each matmul run at a lower rate), and it touches every parameter byte outside the
matmuls (gradient buckets and ZeRO's flat staging copies, the norm for clipping, the first touch of freshly
allocated pages). :func:`engine_overheads` runs a reference GPT under each engine family (ddp, zero1, zero2,
zero3, tp = 2, pp = 2) on two local ranks at two widths and two micro-batch shapes, and fits, per family, the
measured step less the collectives the cost model counts to ``stretch * compute + per_byte * parameter bytes +
per_step`` (least squares on the relative error, no coefficient negative); the planner applies the family's
figures to every candidate of it ([Note: the planner's time model] in memsave/plan/cost.py).

[Note: tensor parallelism's cost per collective] Tensor parallelism's ``per_step`` is a cost per TP collective
(:func:`engine_units`): its custom autograd functions, the slicing and joining around each all-gather,
reduce-scatter and all-reduce, and the wait for the slower rank at each of them come per block and
micro-batch, not per step. Calibrated at 2 blocks, a per-step figure priced the 4-block bench GPT's tp2 rows
23-25% low; measured on this machine (GPT d 128, 8 rows of 64 tokens, sequence parallelism) against the cost
model: per step -9.6% at 4 blocks, -9.9% at 8, -18.1% at 2 micro-batches, -19.3% under full recomputation;
per collective +6.9%, +19.2%, +9.1%, +0.1% (both +3.0% at 2 blocks, where they are the same figure).

[Note: no stretch below one] The stretch is fitted as 1 plus a non-negative part: an engine's compute cannot run
faster than a plain forward and backward measured with both ranks running. Free, four points per family on
this machine gave stretches of 0.70 (zero2), 0.86 (zero3) and 0.90 (tp) in one calibration, 1.43, 1.24 and
1.18 in the one before: the noise of the points, which then priced every ZeRO-2/3 and tp row of
``memsave bench --plan`` 12-27% low (2026-11-27).
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["FAMILIES", "engine_overheads", "engine_units", "family_of", "fit_nonnegative", "train_step"]

# family -> (profile, tp, pp, the (rows per micro-batch, micro-batches) measured): the compute grows fourfold
# between the two shapes while the parameters stay, so the fit can tell a cost per token from one per byte
_SHAPES = ((2, 1), (8, 1))
FAMILIES: dict[str, tuple[str, int, int, tuple[tuple[int, int], ...]]] = {
    "zero0": ("ddp", 1, 1, _SHAPES), "zero1": ("zero1", 1, 1, _SHAPES), "zero2": ("zero2", 1, 1, _SHAPES),
    "zero3": ("zero3", 1, 1, _SHAPES), "tp+sp": ("ddp", 2, 1, _SHAPES), "pp": ("ddp", 1, 2, ((2, 2), (4, 4))),
}
_SEQ, _LAYERS = 64, 2
_WIDTHS = (64, 192)  # d_model of the two calibration models (heads of 32 columns)


def family_of(tp: int, pp: int, stage: int) -> str:
    return "tp+sp" if tp > 1 else "pp" if pp > 1 else f"zero{stage}"


def engine_units(counts: dict[str, int], tp: int) -> float:
    """What a family's ``per_step`` is paid per: a step, or with tensor parallelism each of its collectives
    (``counts``: memsave.plan.cost's terms of the candidate; [Note: tensor parallelism's cost per collective])."""
    if tp <= 1:
        return 1.0
    return float(counts["tp gathers"] + counts["tp scatters"] + counts["tp all-reduces"])


def train_step(model: Any, optimizer: Any, batches: list[Any]) -> None:
    """One optimizer step of a wrapped model over ``batches`` (its micro-batches, each the model's keyword
    arguments): the pipeline schedule under pp, else gradient accumulation (``no_sync`` but for the last)."""
    if getattr(model, "pipeline_step", None) is not None:
        model.pipeline_step(batches)
    else:
        for j, b in enumerate(batches):
            with model.no_sync() if j < len(batches) - 1 else torch.enable_grad():
                optimizer.backward(model(**b).loss / len(batches))
    optimizer.step()
    optimizer.zero_grad()


def _config(width: int) -> Any:
    from memsave.models import gpt_config

    return gpt_config("small", dropout=0.0, d_model=width, n_head=width // 32, n_layer=_LAYERS)


def _candidate(fam: str, rows: int, m: int) -> Any:
    from memsave.plan.cost import Candidate

    profile, tp, pp, _ = FAMILIES[fam]
    stage = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}[profile]
    return Candidate(dp=2 // (tp * pp), tp=tp, pp=pp, stage=stage, precision="fp32", recompute="none",
                     offload="none", micro_batch=rows, micro_batches=m, sequence=tp > 1)


def _worker(steps: int, flops: dict[str, float], rounds: int) -> dict[str, Any]:
    """In each of two ranks: the step rate of a plain forward and backward while the other rank runs too (the
    ranks share the machine as in training), then the median step seconds of every family (its profile as the
    planner writes it) at each width and micro-batch count, over ``rounds`` passes through all of them (the
    machine's speed drifts: each point is measured at several moments)."""
    from memsave.api import wrap
    from memsave.dist import barrier
    from memsave.dist.init import init
    from memsave.models import GPT, TokenBatches
    from memsave.optim import build_optimizer
    from memsave.plan.calibrate_step import step_rates
    from memsave.plan.hardware import COLLECTIVE_BYTES, _collectives_worker
    from memsave.plan.profile import to_profile

    out: dict[str, Any] = {}
    device = init().device.type
    barrier(None)
    out["rates"] = step_rates(device, flops)
    seconds: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for fam, (_profile, tp, pp, shapes) in FAMILIES.items():
            mesh = init(tp=tp, pp=pp)
            for i, (width, (rows, m)) in enumerate(itertools.product(_WIDTHS, shapes)):
                c = _candidate(fam, rows, m)
                torch.manual_seed(0)
                model: Any = GPT(_config(width))
                prof = to_profile(c)
                opt: Any = build_optimizer(model.parameters(), prof.optimizer)
                model, opt = wrap(model, opt, prof, mesh=mesh)
                data = TokenBatches(seq_len=_SEQ, batch_size=rows, dp_rank=mesh.dp_rank, dp_size=mesh.dp_size)
                for step in range(2 + steps):
                    batches = [data.batch(step * m + j) for j in range(m)]
                    barrier(None)
                    t0 = time.perf_counter()
                    train_step(model, opt, batches)
                    barrier(None)
                    if step >= 2:
                        seconds.setdefault((fam, i), []).append(time.perf_counter() - t0)
    for (fam, _point), got in seconds.items():
        out.setdefault(fam, []).append(statistics.median(got))
    out["collectives"] = _collectives_worker(*COLLECTIVE_BYTES)  # [Note: collectives measured twice]
    return out


def _faster(first: dict[str, tuple[float, float]], second: dict[str, tuple[float, float]]
            ) -> dict[str, tuple[float, float]]:
    """[Note: collectives measured twice] Per kind, the lower latency and the higher bandwidth of two
    measurements about a minute apart (the first before the engine families, the second after them). Each is a
    mean over calls back to back, which a busy moment of a shared machine multiplies: one calibration here
    measured the all-reduce at 8.1 ms + 1.6 GB/s where four others had 2.0-2.2 ms + 0.9-1.1 GB/s, and with it
    priced every ZeRO and tp row of ``memsave bench --plan`` 27-99% high (2026-11-27)."""
    return {k: (min(first[k][0], second[k][0]), max(first[k][1], second[k][1])) for k in first}


def fit_nonnegative(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> tuple[float, ...]:
    """The coefficients ``x >= 0`` of ``rows @ x ~ targets`` with the least squared relative error: the best
    unconstrained least squares over every subset of the columns whose solution has no negative entry."""
    import numpy as np

    a, b = np.asarray(rows, dtype=float), np.asarray(targets, dtype=float)
    weight = 1.0 / np.maximum(np.abs(b), 1e-9)
    best: tuple[float, Any] | None = None
    for mask in itertools.product((False, True), repeat=a.shape[1]):
        cols = [i for i, on in enumerate(mask) if on]
        if not cols:
            continue
        x, *_ = np.linalg.lstsq(a[:, cols] * weight[:, None], b * weight, rcond=None)
        if (x < 0).any():
            continue
        full = np.zeros(a.shape[1])
        full[cols] = x
        err = float(np.sum(((a @ full - b) * weight) ** 2))
        if best is None or err < best[0]:
            best = (err, full)
    return tuple(float(v) for v in best[1]) if best is not None else (0.0,) * a.shape[1]


def engine_overheads(hw: Any, *, steps: int = 4, rounds: int = 2, timeout_s: float = 300) -> Any:
    """``hw`` with the step rates measured on two ranks at once (``efficiencies``, ``layer_overhead``,
    ``recompute_overhead``: memsave/plan/calibrate_step.py) and ``engine``:
    family -> (seconds per step, seconds per byte of a stage's parameters, the compute's stretch) beyond what
    :func:`memsave.plan.price` predicts for it without them (module docstring)."""
    from memsave._launch import spawn_local
    from memsave.plan.cost import _count_terms, price
    from memsave.plan.hardware import slowest_rank
    from memsave.plan.spec import from_gpt

    per_rank = spawn_local(_worker, 2, (steps, hw.flops, rounds), timeout_s=timeout_s)
    if hw.collectives:  # [Note: collectives measured twice]
        again, bus = slowest_rank([r["collectives"] for r in per_rank])
        bus = max(hw.intra_bw, bus)
        kinds = _faster(hw.collectives, again)
        hw = dataclasses.replace(hw, collectives=kinds, latency=kinds["all_reduce"][0], intra_bw=bus, inter_bw=bus)
    rates = [r["rates"] for r in per_rank]
    efficiencies = {k: min(r["efficiencies"][k] for r in rates) for k in rates[0]["efficiencies"]}
    hw = dataclasses.replace(hw, engine={}, efficiency=efficiencies["fp32"], efficiencies=efficiencies,
                             layer_overhead=max(r["layer_overhead"] for r in rates),
                             # the mean of the two ranks' (both measured the same dispatch at once)
                             recompute_overhead={k: statistics.mean(r["recompute_overhead"][k] for r in rates)
                                                 for k in rates[0]["recompute_overhead"]})
    fitted: dict[str, tuple[float, float, float]] = {}
    for fam, (_profile, tp, pp, shapes) in FAMILIES.items():
        rows, targets = [], []
        for i, (width, (micro, m)) in enumerate(itertools.product(_WIDTHS, shapes)):
            spec = from_gpt(_config(width))
            measured = max(r[fam][i] for r in per_rank)
            c = _candidate(fam, micro, m)
            t = price(spec, c, hw, _SEQ).time
            param_bytes = 4 * max(spec.stage_params(pp, s, tp) for s in range(pp))
            rows.append((engine_units(_count_terms(spec, c), tp), param_bytes, t["compute"]))
            targets.append(measured - sum(t.values()))  # beyond a stretch of 1 ([Note: no stretch below one])
        per_step, per_byte, more = fit_nonnegative(rows, targets)
        fitted[fam] = (per_step, per_byte, 1.0 + more)
    return dataclasses.replace(hw, engine=fitted)
