"""What each engine costs besides FLOPs and bytes, measured: part of ``memsave calibrate``.

A step of memsave's engines pays for more than its matrix multiplies and its collectives' bytes: Python around
every unit's hooks, the gradient buckets, ZeRO's gathers and reshards, the pipeline runner's actions, the
optimizer's loop over its tensors, each collective's latency. :func:`engine_overheads` runs a tiny reference GPT
under each engine family (ddp, zero1, zero2, zero3, tp = 2, pp = 2) on two local ranks at two micro-batch counts,
subtracts what the rest of the cost model predicts for it, and fits the remainder to
``per_step + micro_batches * layers * per_layer`` seconds; the planner adds that ``engine`` term to every
candidate of the family.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch

__all__ = ["FAMILIES", "engine_overheads", "family_of", "train_step"]

# family -> (profile, tp, pp, micro-batch counts measured)
FAMILIES: dict[str, tuple[str, int, int, tuple[int, int]]] = {
    "zero0": ("ddp", 1, 1, (1, 2)), "zero1": ("zero1", 1, 1, (1, 2)), "zero2": ("zero2", 1, 1, (1, 2)),
    "zero3": ("zero3", 1, 1, (1, 2)), "tp": ("ddp", 2, 1, (1, 2)), "pp": ("ddp", 1, 2, (2, 4)),
}
_SEQ, _ROWS = 32, 2


def family_of(tp: int, pp: int, stage: int) -> str:
    return "tp" if tp > 1 else "pp" if pp > 1 else f"zero{stage}"


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


def _worker(steps: int, peak: float) -> dict[str, Any]:
    """In each of two ranks: the step rate of a plain forward and backward while the other rank runs too (the
    ranks share the machine as in training), then the median step seconds of every family at its two
    micro-batch counts."""
    from memsave.api import wrap
    from memsave.config import load_profile
    from memsave.dist import barrier
    from memsave.dist.init import init
    from memsave.models import GPT, TokenBatches, gpt_config
    from memsave.plan.hardware import _step_rates

    out: dict[str, Any] = {}
    device = init().device.type
    barrier(None)
    out["rates"] = _step_rates(device, peak)
    for fam, (profile, tp, pp, counts) in FAMILIES.items():
        mesh = init(tp=tp, pp=pp)
        times = []
        for m in counts:
            torch.manual_seed(0)
            model: Any = GPT(gpt_config("tiny", dropout=0.0))
            opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model, opt = wrap(model, opt, load_profile(profile, [f"parallel.tp={tp}", f"parallel.pp={pp}"]),
                              mesh=mesh)
            data = TokenBatches(seq_len=_SEQ, batch_size=_ROWS, dp_rank=mesh.dp_rank, dp_size=mesh.dp_size)
            seconds = []
            for step in range(2 + steps):
                batches = [data.batch(step * m + j) for j in range(m)]
                barrier(None)
                t0 = time.perf_counter()
                train_step(model, opt, batches)
                barrier(None)
                seconds.append(time.perf_counter() - t0)
            times.append(statistics.median(seconds[2:]))
        out[fam] = times
    return out


def engine_overheads(hw: Any, *, steps: int = 5, timeout_s: float = 300) -> Any:
    """``hw`` with the step rate measured on two ranks at once (``efficiency``, ``layer_overhead``) and ``engine``:
    family -> (seconds per step, seconds per micro-batch and layer) beyond what :func:`memsave.plan.price`
    predicts for it."""
    from memsave._launch import spawn_local
    from memsave.models import gpt_config
    from memsave.plan.cost import Candidate, price
    from memsave.plan.spec import from_gpt

    per_rank = spawn_local(_worker, 2, (steps, hw.flops["fp32"]), timeout_s=timeout_s)
    cfg = gpt_config("tiny", dropout=0.0)
    spec = from_gpt(cfg)
    efficiency = min(r["rates"][0] for r in per_rank)
    overhead = max(r["rates"][1] for r in per_rank)
    hw = dataclasses.replace(hw, engine={}, efficiency=efficiency, layer_overhead=overhead)
    fitted: dict[str, tuple[float, float]] = {}
    for fam, (profile, tp, pp, counts) in FAMILIES.items():
        stage = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}[profile]
        rest = []
        for i, m in enumerate(counts):
            measured = max(r[fam][i] for r in per_rank)
            c = Candidate(dp=2 // (tp * pp), tp=tp, pp=pp, stage=stage, precision="fp32", recompute="none",
                          offload="none", micro_batch=_ROWS, micro_batches=m, sequence=False)
            rest.append(max(0.0, measured - price(spec, c, hw, _SEQ).step_time))
        layers = spec.stage_layers(pp, 0)
        per_layer = max(0.0, (rest[1] - rest[0]) / ((counts[1] - counts[0]) * layers))
        fitted[fam] = (max(0.0, rest[0] - counts[0] * layers * per_layer), per_layer)
    return dataclasses.replace(hw, engine=fitted)
