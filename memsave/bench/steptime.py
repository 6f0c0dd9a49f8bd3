"""``memsave bench``: memsave profiles and torch baselines side by side, on the same model and data.

Every configuration runs in a fresh group of local processes (so each peak RSS is its own), trains the
reference GPT for a few steps on the embedded corpus with the same seed, and reports per configuration: the
median step time, peak RSS (and peak device memory on GPU) per rank, model-state bytes per rank against the
ZeRO formula for its precision, logical communication bytes per step (counted in ``memsave/dist/``; torch's
baselines bypass it, so theirs are left blank), and the final loss with its difference from the ``torch-ddp``
baseline. That difference is rounding-level for fp32 rows and not for bf16 / fp16 ones: they train the same
model in another precision, and the reference stays fp32 DDP.
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
from memsave.bench.common import BenchOptions, columns, mib, run_each, show_results, split_names
from memsave.config import load_profile
from memsave.memory import account, peak_rss_bytes, rss_bytes
from memsave.models import GPT, TokenBatches
from memsave.optim import Adafactor, build_optimizer

__all__ = ["BASELINE_NAMES", "DEFAULT_CONFIGS", "comm_elements", "format_table", "formula_bytes", "precision_label",
           "run_bench", "run_command"]

DEFAULT_PROFILES = ("ddp", "zero1", "zero2", "zero3")
DEFAULT_BASELINES = ("torch-ddp", "torch-zero1", "fsdp2", "fsdp2-noreshard", "fsdp2+malloc")
DEFAULT_CONFIGS = ("torch-ddp", *DEFAULT_PROFILES, *DEFAULT_BASELINES[1:])


@dataclasses.dataclass(frozen=True, kw_only=True)
class _BaselineInfo:
    """What a torch baseline (memsave/dist/baselines.py) is, for the table and its formula.

    stage: the ZeRO stage whose sharding it matches.
    compute / reduce: dtype of forward/backward and of gradient reduction.
    state: the precision its model state follows: FSDP2 keeps fp32 sharded parameters (the master) and fp32
        sharded gradients under any ``MixedPrecisionPolicy``, so its formula is fp32's (see [Note: FSDP2 mixed
        precision] in baselines.py).
    """

    stage: int
    compute: str = "fp32"
    reduce: str = "fp32"
    state: str = "fp32"


_BASELINES = {
    "torch-ddp": _BaselineInfo(stage=0),
    "torch-zero1": _BaselineInfo(stage=1),
    "fsdp2": _BaselineInfo(stage=3),
    "fsdp2-noreshard": _BaselineInfo(stage=3),
    "fsdp2-bf16": _BaselineInfo(stage=3, compute="bf16", reduce="bf16"),
    "fsdp2-bf16-fp32reduce": _BaselineInfo(stage=3, compute="bf16", reduce="fp32"),
}
_TUNED = "+malloc"  # suffix: run a baseline with memsave's host-allocator setting too
BASELINE_NAMES = tuple(_BASELINES)
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _reduce_dtype(compute: str, reduce: str) -> str:
    return compute if reduce == "compute" else reduce


def precision_label(compute: str, reduce: str) -> str:
    """"fp32", "bf16", "fp16", or "bf16/fp32-reduce" when gradients are reduced in another dtype."""
    r = _reduce_dtype(compute, reduce)
    return compute if r == compute else f"{compute}/{r}-reduce"


def formula_bytes(stage: int, psi: int, n: int, *, compute: str = "fp32", reduce: str = "compute") -> float:
    """ZeRO model-state bytes per rank for Adam (Rajbhandari et al., 2020, sec. 3), ``psi`` parameters, ``n``
    data-parallel ranks, no padding.

    fp32 (K = 8: the parameters are their own master copy; 4 + 4 + 8 bytes/param): stage 0 ``16Ψ``, 1
    ``8Ψ + 8Ψ/N``, 2 ``4Ψ + 12Ψ/N``, 3 ``16Ψ/N``.

    Mixed precision, ``compute`` bf16 / fp16 with fp32 masters (K = 12: master, m, v; 2 + 2 + 12 bytes/param):
    stage 0 ``16Ψ``, 1 ``4Ψ + 12Ψ/N``, 2 ``2Ψ + 14Ψ/N``, 3 ``16Ψ/N``. With ``reduce = "fp32"`` the reduced
    gradient is fp32: stage 0 holds full fp32 gradients (``2Ψ + 4Ψ + 12Ψ = 18Ψ``); stage 1 keeps its full
    compute-dtype gradients and adds the fp32 shard the optimizer steps (``4Ψ + 16Ψ/N``); stages 2 and 3 hold
    only the fp32 shard (``2Ψ + 16Ψ/N``, ``18Ψ/N``).
    """
    if compute not in _DTYPE_BYTES:
        raise ValueError(f"compute={compute!r} is not allowed; expected one of {', '.join(_DTYPE_BYTES)}")
    red = _reduce_dtype(compute, reduce)
    if red not in (compute, "fp32"):
        raise ValueError(f"reduce={reduce!r} with compute={compute!r} has no formula; expected \"compute\" or \"fp32\"")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r} is not allowed; expected 0, 1, 2 or 3")
    if compute == "fp32":
        return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]
    p = _DTYPE_BYTES[compute]  # parameters (and the gradients backward produces) in the compute dtype
    g = _DTYPE_BYTES[red]  # the reduced gradient the optimizer reads
    k = 12  # fp32 master, Adam's m and v
    if stage == 0:
        return (p + g + k) * psi
    if stage == 1:
        return (p + p) * psi + (k + (g if red != compute else 0)) * psi / n
    if stage == 2:
        return p * psi + (g + k) * psi / n
    return (p + g + k) * psi / n


def comm_elements(bytes_by_kind: dict[str, float], *, compute: str, reduce: str) -> float:
    """Elements moved, from the logical bytes per collective kind (memsave/dist/collectives.py counts bytes):
    all-gathers and broadcasts carry parameters (compute dtype), reduce-scatters and all-reduces gradients
    (reduce dtype). The few small control all-reduces (int32 flags, an fp32 overflow flag) are counted at the
    gradient element size too; they are a handful of bytes per step."""
    param_size, grad_size = _DTYPE_BYTES[compute], _DTYPE_BYTES[_reduce_dtype(compute, reduce)]
    size_of = {"all_gather": param_size, "broadcast": param_size, "reduce_scatter": grad_size, "all_reduce": grad_size}
    return sum(b / size_of.get(kind, 4) for kind, b in bytes_by_kind.items())


def _base_name(name: str) -> str:
    return name.removesuffix(_TUNED)


def _worker(name: str, opts: BenchOptions) -> dict[str, Any]:
    """One rank of one configuration (runs in a spawned process).

    torch's baselines run as their users run them, with glibc's default allocator behaviour; a name ending in
    ``+malloc`` runs the baseline with the host-allocator policy of memsave's zero3 preset too (a trim at the
    end of each forward and an 8 MiB mmap threshold; see memsave/dist/host_memory.py), to show what memsave
    gains from it and what from its engines.
    """
    is_baseline = _base_name(name) in _BASELINES
    tuned = not is_baseline or name.endswith(_TUNED)
    mesh = mdist.init(host_trim=tuned)
    rss_start = rss_bytes()
    torch.manual_seed(opts.seed)
    model = GPT(opts.model_config()).to(mesh.device)
    psi = sum(p.numel() for p in model.parameters())

    profile = None if is_baseline else load_profile(name)

    def make_opt(params: list) -> torch.optim.Optimizer:
        if profile is not None and profile.optimizer.name != "adamw":  # e.g. zero3-adafactor: the profile's own
            return build_optimizer(params, profile.optimizer)
        return torch.optim.AdamW(params, lr=opts.lr, weight_decay=0.1)

    if is_baseline:
        from memsave.dist.baselines import build_baseline  # here: [Note: baselines import cost]

        info = _BASELINES[_base_name(name)]
        stage, compute, reduce, state_precision = info.stage, info.compute, info.reduce, info.state
        run_model, opt, holder = build_baseline(_base_name(name), model, make_opt, list(model.blocks))
        if tuned:  # the whole policy memsave's zero3 preset uses: trim after forward, 8 MiB mmap threshold
            mdist.configure_host_memory(mmap_threshold=int(load_profile("zero3").zero.host_mmap_threshold_mb * 2**20))
            model.register_forward_hook(lambda *_: mdist.after_forward())
        backward = lambda loss: loss.backward()  # noqa: E731
        holders = [holder]
    else:
        assert profile is not None
        stage = profile.zero.stage
        compute = profile.precision.compute
        reduce = _reduce_dtype(compute, profile.precision.reduce)
        state_precision = compute
        run_model, opt = wrap(model, make_opt(list(model.parameters())), name, mesh=mesh)
        backward = opt.backward
        holders = [opt]
    data = TokenBatches(seq_len=opts.seq_len, batch_size=opts.batch_size, dp_rank=mesh.dp_rank,
                        dp_size=mesh.dp_size, seed=opts.seed)
    times, opt_times, reduce_times, losses, comm_bytes, comm_kinds = [], [], [], [], [], []
    for step in range(opts.steps):
        batch = {k: v.to(mesh.device) for k, v in data.batch(step).items()}
        mdist.barrier()
        mdist.COMM_STATS.reset()
        t0 = time.perf_counter()
        loss = run_model(**batch).loss
        backward(loss)
        t1 = time.perf_counter()
        opt.step()
        if mesh.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        opt_times.append(times[-1] - (t1 - t0))
        inner = getattr(opt, "optimizer", opt)
        reduce_times.append(inner.last_reduce_seconds if isinstance(inner, Adafactor) else 0.0)
        comm_bytes.append(mdist.COMM_STATS.total_bytes())
        comm_kinds.append(dict(mdist.COMM_STATS.bytes))
        if step == opts.steps - 1:
            state = account(holders)  # after the step, before zero_grad: gradients still held
        opt.zero_grad()
        # a bf16 / fp16 model returns its loss in that dtype: average (and print) it in fp32
        avg = loss.detach().to(torch.float32).reshape(1).clone()
        mdist.all_reduce(avg, mesh.dp_group)
        losses.append(avg.item() / mesh.dp_size)
    timed = comm_kinds[opts.warmup :]
    kinds = sorted({k for c in timed for k in c})
    out = {
        "rank": mesh.rank, "stage": stage, "psi": psi, "times": times, "losses": losses,
        "compute": compute, "reduce": reduce, "state_precision": state_precision,
        "optimizer": type(getattr(opt, "optimizer", opt)).__name__, "opt_times": opt_times,
        "reduce_times": reduce_times,
        "model_state_bytes": state.model_state(), "bytes": state.bytes,
        "comm_bytes_per_step": statistics.median(comm_bytes[opts.warmup :]),
        "comm_bytes_by_kind": {k: statistics.median(c.get(k, 0) for c in timed) for k in kinds},
        "peak_rss": peak_rss_bytes(), "rss_start": rss_start,
    }
    if mesh.device.type == "cuda":
        out["device_peak"] = torch.cuda.max_memory_allocated()
    return out


def _bench_row(name: str, opts: BenchOptions, timeout_s: float) -> dict[str, Any]:
    """One configuration in fresh processes: its summary row."""
    ranks = spawn_local(_worker, opts.nproc, (name, opts), timeout_s=timeout_s)
    r0 = ranks[0]
    n = opts.nproc
    per_step = [max(r["times"][s] for r in ranks) for s in range(opts.steps)]  # the slowest rank sets the pace
    # the formula is AdamW's; other optimizers are shown against nothing
    adam = r0["optimizer"] in ("AdamW", "ZeroRedundancyOptimizer")
    formula = formula_bytes(r0["stage"], r0["psi"], n, compute=r0["state_precision"],
                            reduce=r0["reduce"] if r0["state_precision"] != "fp32" else "compute") if adam else None
    w = opts.warmup
    baseline = _base_name(name) in _BASELINES
    return {
        "name": name, "kind": "baseline" if baseline else "memsave", "stage": r0["stage"],
        "precision": precision_label(r0["compute"], r0["reduce"]), "compute": r0["compute"], "reduce": r0["reduce"],
        "nproc": n, "params": r0["psi"],
        "median_step_s": statistics.median(per_step[opts.warmup :]),
        "peak_rss": [r["peak_rss"] for r in ranks],
        "device_peak": [r.get("device_peak", 0) for r in ranks],
        "model_state_bytes": [r["model_state_bytes"] for r in ranks],
        "state_bytes_by_category": [r["bytes"] for r in ranks],
        "formula_bytes": formula,
        "state_vs_formula": None if formula is None else max(r["model_state_bytes"] for r in ranks) / formula,
        "optimizer": r0["optimizer"],
        "median_optimizer_step_s": statistics.median(max(r["opt_times"][s] for r in ranks) for s in range(w, opts.steps)),
        "median_optimizer_reduce_s": statistics.median(max(r["reduce_times"][s] for r in ranks) for s in range(w, opts.steps)),
        "comm_bytes_per_step": None if baseline else r0["comm_bytes_per_step"],
        "comm_bytes_by_kind": None if baseline else r0["comm_bytes_by_kind"],
        "comm_elems_over_psi": None if baseline else comm_elements(
            r0["comm_bytes_by_kind"], compute=r0["compute"], reduce=r0["reduce"]) / r0["psi"],
        "losses": r0["losses"], "final_loss": r0["losses"][-1],
    }


def _compare(rows: list[dict[str, Any]]) -> None:
    """Each row against ``torch-ddp`` (or the first row where it did not run)."""
    ref = next((r for r in rows if r["name"] == "torch-ddp"), rows[0])
    for r in rows:
        r["vs_ref_step_time"] = r["median_step_s"] / ref["median_step_s"]
        r["vs_ref_peak_rss"] = max(r["peak_rss"]) / max(ref["peak_rss"])
        r["final_loss_diff"] = r["final_loss"] - ref["final_loss"]
        r["reference"] = ref["name"]


def run_bench(names: list[str], opts: BenchOptions, *, timeout_s: float = 1800) -> list[dict[str, Any]]:
    """Run every configuration in ``names`` (profiles or baselines); one summary row each. Raises
    :class:`memsave.bench.common.ConfigFailed` with the rows finished so far if one fails."""
    return run_each(names, lambda name: _bench_row(name, opts, timeout_s), _compare)


def format_table(rows: list[dict[str, Any]]) -> str:
    """The human-readable table: one line per configuration."""
    head = ["config", "stage", "precision", "step s", "x ref", "opt step s", "peak RSS MiB/rank", "x ref", "state MiB/rank", "x formula",
            "comm/step (x params)", "final loss", "diff"]
    lines = []
    for r in rows:
        comm = "-" if r["comm_bytes_per_step"] is None else f"{mib(r['comm_bytes_per_step'])} MiB ({r['comm_elems_over_psi']:.2f})"
        lines.append([
            r["name"], str(r["stage"]), r["precision"], f"{r['median_step_s']:.3f}", f"{r['vs_ref_step_time']:.2f}",
            f"{r['median_optimizer_step_s']:.3f}",
            "/".join(mib(x) for x in r["peak_rss"]), f"{r['vs_ref_peak_rss']:.2f}",
            "/".join(mib(x) for x in r["model_state_bytes"]),
            "-" if r["state_vs_formula"] is None else f"{r['state_vs_formula']:.3f}", comm,
            f"{r['final_loss']:.4f}", f"{r['final_loss_diff']:+.2e}",
        ])
    out = columns(head, lines, strip=False)
    r0 = rows[0]
    out.append(f"model: {r0['params']:,} parameters, {r0['nproc']} processes; reference for 'x ref' and 'diff': "
               f"{r0['reference']}")
    return "\n".join(out)


def run_command(spec: str, opts: BenchOptions, json_path: Path | None) -> int:
    """``memsave bench --configs NAMES``: every name checked first, then run; the table and the JSON file."""
    names = split_names(spec)
    for name in names:
        if _base_name(name) not in _BASELINES:
            load_profile(name)  # a bad name fails now, not after the other runs
    return show_results(lambda: run_bench(names, opts), lambda rows: print(format_table(rows)), json_path, opts)
