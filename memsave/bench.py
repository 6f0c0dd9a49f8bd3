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
import importlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from memsave import dist as mdist
from memsave._launch import LaunchError, spawn_local
from memsave.api import wrap
from memsave.config import load_profile
from memsave.memory import account, peak_rss_bytes, rss_bytes
from memsave.models import GPT, TokenBatches, gpt_config
from memsave.optim import Adafactor, build_optimizer

__all__ = ["BenchOptions", "ConfigFailed", "comm_elements", "format_recompute_table", "format_table", "formula_bytes", "precision_label",
           "run_bench", "run_each", "run_recompute_bench"]

DEFAULT_PROFILES = ("ddp", "zero1", "zero2", "zero3")
DEFAULT_BASELINES = ("torch-ddp", "torch-zero1", "fsdp2", "fsdp2-noreshard", "fsdp2+malloc")


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
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """What to run: model size, batch, steps (the first ``warmup`` are not timed), processes."""

    size: str = "bench"
    tie_weights: bool = False
    batch_size: int = 4
    seq_len: int = 256
    steps: int = 8
    warmup: int = 2
    nproc: int = 2
    lr: float = 3e-4
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len", "steps", "nproc"):
            if getattr(self, name) < 1:
                raise ValueError(f"bench option {name}={getattr(self, name)} is not allowed; expected >= 1")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"bench option warmup={self.warmup} is not allowed; expected 0 <= warmup < steps")


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
    cfg = gpt_config(opts.size, tie_weights=opts.tie_weights, block_size=max(opts.seq_len, 8))
    model = GPT(cfg).to(mesh.device)
    psi = sum(p.numel() for p in model.parameters())

    profile = None if is_baseline else load_profile(name)

    def make_opt(params: list) -> torch.optim.Optimizer:
        if profile is not None and profile.optimizer.name != "adamw":  # e.g. zero3-adafactor: the profile's own
            return build_optimizer(params, profile.optimizer)
        return torch.optim.AdamW(params, lr=opts.lr, weight_decay=0.1)

    if is_baseline:
        from memsave.dist.baselines import build_baseline

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


class ConfigFailed(LaunchError):
    """A configuration of the bench failed (after :func:`memsave._launch.spawn_local`'s retries on a taken port).

    Its message names the configuration; ``rows`` are the configurations that finished before it, compared
    among themselves as a full run's rows are.
    """

    def __init__(self, name: str, rows: list[dict[str, Any]], cause: LaunchError) -> None:
        super().__init__(f"configuration {name!r} failed: {cause.summary}", rank=cause.rank,
                         exc_type=cause.exc_type, message=f"configuration {name!r}: {cause.message}",
                         child_traceback=cause.child_traceback)
        self.name = name
        self.rows = rows


def run_each(names: list[str], run_one: Callable[[str], dict[str, Any]],
             compare: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """``run_one(name)`` for each configuration in order, then ``compare(rows)``; a configuration that fails
    raises :class:`ConfigFailed` naming it and carrying the finished rows, compared."""
    rows: list[dict[str, Any]] = []
    for name in names:
        try:
            rows.append(run_one(name))
        except LaunchError as exc:
            if rows:
                compare(rows)
            raise ConfigFailed(name, rows, exc) from None
    compare(rows)
    return rows


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
    :class:`ConfigFailed` with the rows finished so far if one fails."""
    return run_each(names, lambda name: _bench_row(name, opts, timeout_s), _compare)


# -- optimizers alone: state bytes and step time on one process ----------------------------------------------
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
    cfg = gpt_config(opts.size, tie_weights=opts.tie_weights, block_size=max(opts.seq_len, 8))
    model = GPT(cfg)
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


# -- activation recomputation: step time and memory per policy on one process ---------------------------------
RECOMPUTE_BASELINES = ("torch-full", "torch-selective")
DEFAULT_RECOMPUTE = ("none", "full", "every:2", "selective", "budget:150MiB", *RECOMPUTE_BASELINES)
_TRACKED_CATEGORIES = ("Parameter", "Gradient", "Activation", "Temp", "Optstate")


def _torch_save_ops() -> list[Any]:
    """What ``torch-selective`` saves: the matmuls and attention kernels of memsave's selective policy, passed to
    ``create_selective_checkpoint_contexts`` as a plain op list (torch's own policy: no exception for random ops;
    the bench model has no dropout)."""
    from memsave.recompute import DEFAULT_SAVE_OPS

    return sorted(DEFAULT_SAVE_OPS, key=str)


def _torch_checkpoint_blocks(blocks: list[torch.nn.Module], selective: bool) -> None:
    """``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` around each block's forward, as users write it;
    with ``selective``, torch's selective checkpointing contexts saving :func:`_torch_save_ops`."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from memsave.recompute.measure import note_saved

    save = frozenset(_torch_save_ops())

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in save:
            if not ctx.is_recompute:  # only so that the saved-bytes measurement sees torch's cache too
                note_saved(getattr(ctx, "op_output", None))
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
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
    # torch's MemTracker is a single-process memory tool (a dispatch mode and module hooks; no communication)
    # that happens to live under torch.distributed._tools; the bench measures with it as the issue asks. It is
    # loaded by name so that the rule "torch.distributed only under memsave/dist/" (tests/test_init.py), which is
    # about collectives, keeps meaning that.
    MemTracker = importlib.import_module("torch.distributed._tools.mem_tracker").MemTracker

    from memsave import recompute
    from memsave.recompute.measure import measure_saved_bytes

    torch.set_num_threads(1)
    mdist.init()
    torch.manual_seed(opts.seed)
    cfg = gpt_config(opts.size, tie_weights=opts.tie_weights, block_size=max(opts.seq_len, 8))
    model = GPT(cfg)
    blocks = list(model.blocks)
    data = TokenBatches(seq_len=opts.seq_len, batch_size=opts.batch_size, seed=opts.seed)
    plan = None
    if name in RECOMPUTE_BASELINES:
        _torch_checkpoint_blocks(blocks, selective=name == "torch-selective")
    else:
        plan = recompute.apply(blocks, name, model=model,
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
    with MemTracker() as mt:
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
    from memsave.recompute import parse_policy

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
            _mib(r["saved_activation_bytes"]), f"{r['vs_ref_activations']:.2f}",
            _mib(r["peak_total"]), f"{r['vs_ref_peak']:.2f}",
            *(_mib(cats.get(c, 0)) for c in _TRACKED_CATEGORIES),
            _mib(r["peak_rss"]), f"{r['final_loss_diff']:+.1e}", chosen,
        ])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip()]
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    out.append(f"model: {rows[0]['params']:,} parameters, one process, one thread, fp32 AdamW; 'x ref' against "
               f"{rows[0]['reference']}; activations: bytes saved for backward by one forward "
               "(memsave.recompute.measure; a budget:<size> constrains this); peak and its categories: torch's "
               "MemTracker over two steps")
    return "\n".join(out)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The human-readable table: one line per configuration."""
    head = ["config", "stage", "precision", "step s", "x ref", "opt step s", "peak RSS MiB/rank", "x ref", "state MiB/rank", "x formula",
            "comm/step (x params)", "final loss", "diff"]
    lines = []
    for r in rows:
        comm = "-" if r["comm_bytes_per_step"] is None else f"{_mib(r['comm_bytes_per_step'])} MiB ({r['comm_elems_over_psi']:.2f})"
        lines.append([
            r["name"], str(r["stage"]), r["precision"], f"{r['median_step_s']:.3f}", f"{r['vs_ref_step_time']:.2f}",
            f"{r['median_optimizer_step_s']:.3f}",
            "/".join(_mib(x) for x in r["peak_rss"]), f"{r['vs_ref_peak_rss']:.2f}",
            "/".join(_mib(x) for x in r["model_state_bytes"]),
            "-" if r["state_vs_formula"] is None else f"{r['state_vs_formula']:.3f}", comm,
            f"{r['final_loss']:.4f}", f"{r['final_loss_diff']:+.2e}",
        ])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines]
    r0 = rows[0]
    out.append(f"model: {r0['params']:,} parameters, {r0['nproc']} processes; reference for 'x ref' and 'diff': "
               f"{r0['reference']}")
    return "\n".join(out)


def to_json(rows: list[dict[str, Any]], opts: Any, *, schema: str = "memsave.bench/1",
            failed: str | None = None) -> str:
    """The results file: the options and the rows (and, after a failure, the configuration that failed)."""
    out: dict[str, Any] = {"schema": schema, "options": dataclasses.asdict(opts), "rows": rows}
    if failed is not None:
        out["failed"] = failed
    return json.dumps(out, indent=2)


def show_results(run: Callable[[], list[dict[str, Any]]], show: Callable[[list[dict[str, Any]]], None],
                 json_path: Path | None, opts: Any, *, schema: str = "memsave.bench/1") -> int:
    """``show(run())`` and the JSON file. When a configuration fails (:class:`ConfigFailed`), the rows that
    finished are shown and written all the same, with a line naming the failed one, before the error goes on to
    ``memsave``'s handler."""
    try:
        rows = run()
    except ConfigFailed as exc:
        if exc.rows:
            show(exc.rows)
        print(f"{len(exc.rows)} configuration{'' if len(exc.rows) == 1 else 's'} finished; {exc.name!r} failed "
              "and the rest did not run", flush=True)
        if json_path is not None and exc.rows:
            json_path.write_text(to_json(exc.rows, opts, schema=schema, failed=exc.name))
            print(f"finished results written to {json_path}", flush=True)
        raise
    show(rows)
    if json_path is not None:
        json_path.write_text(to_json(rows, opts, schema=schema))
        print(f"results written to {json_path}")
    return 0


# -- the `memsave bench` subcommand ----------------------------------------------------------------------------
def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench", help="profiles and torch baselines side by side",
        description="Run memsave profiles and torch baselines (DDP, ZeroRedundancyOptimizer, FSDP2) on the same "
                    "model and data, each in fresh local processes, and print one table row per configuration.",
    )
    p.add_argument("--configs", default=",".join(("torch-ddp", *DEFAULT_PROFILES, *DEFAULT_BASELINES[1:])),
                   help="comma-separated profiles (names or .toml paths, e.g. zero3-bf16) and baselines "
                        f"({', '.join(_BASELINES)}; '+malloc' adds memsave's host-memory policy)")
    p.add_argument("--size", default="bench", help="reference GPT size (default: bench, 27.4M parameters untied)")
    p.add_argument("--tied", action="store_true", help="tie the embedding and the head")
    p.add_argument("--batch-size", type=int, default=4, help="micro-batch per rank")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--optimizers", default=None,
                   help=f"instead: time optimizers alone on one process ({', '.join(OPTIMIZERS)}, "
                        "torch-adafactor-foreach); the first is the reference")
    p.add_argument("--recompute", default=None,
                   help="instead: recompute policies on one process (memsave: none, full, every:K, selective, "
                        f"budget:<size>; torch: {', '.join(RECOMPUTE_BASELINES)}); the first is the reference, e.g. "
                        f"{','.join(DEFAULT_RECOMPUTE)}")
    p.add_argument("--offload", default=None,
                   help="instead: optimizer-state offload against the same run in memory (memsave/bench_offload.py), "
                        "e.g. zero3,zero3-offload-disk,zero3-offload-disk-noprefetch,zero3-offload-disk-half")
    p.add_argument("--offload-path", default=None, help="--offload: folder for the disk tier (default: the temp dir)")
    p.add_argument("--repeat", type=int, default=1,
                   help="--offload: run the configurations this many times, round-robin, and report medians (the "
                        "disk and the heap's peak vary from run to run)")
    p.add_argument("--fit", default=None,
                   help="instead, on a CUDA device: the largest reference GPT each configuration trains within "
                        "--device-gib of device memory, and the step-time overhead of offload (memsave/bench_fit.py), "
                        "e.g. zero3-bf16,zero3-bf16-offload,zero3-bf16-offload-params")
    p.add_argument("--device-gib", type=float, default=4.0, help="--fit: the device-memory cap in GiB (default: 4)")
    p.add_argument("--d-model", type=int, default=1024, help="--fit: the GPT's width (default: 1024)")
    p.add_argument("--fit-steps", type=int, default=3, help="--fit: steps per trial (default: 3)")
    p.add_argument("--memory", default=None,
                   help="instead: the memory tracker and estimator per profile (memsave/bench_memory.py): estimated "
                        "vs measured state, activations and peak, tracking overhead; 'memtracker' adds torch's "
                        "MemTracker beside ours, e.g. ddp,zero1,zero2,zero3,memtracker")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")


def run_command(args: Any, extra: Any) -> int:
    if extra:
        raise ValueError(f"memsave bench: unrecognized arguments: {' '.join(extra)}")
    opts = BenchOptions(size=args.size, tie_weights=args.tied, batch_size=args.batch_size, seq_len=args.seq_len,
                        steps=args.steps, warmup=args.warmup, nproc=args.nproc)
    if args.fit:
        from memsave.bench_fit import FitOptions
        from memsave.bench_fit import run_command as run_fit

        return run_fit(args.fit, FitOptions(device_gib=args.device_gib, d_model=args.d_model,
                                            n_head=max(1, args.d_model // 64), batch_size=args.batch_size,
                                            seq_len=args.seq_len, steps=args.fit_steps), args.json)
    if args.memory:
        from memsave.bench_memory import run_command as run_memory

        return run_memory(args.memory, opts, args.json)
    if args.offload:
        from memsave.bench_offload import run_command as run_offload

        return run_offload(args.offload, opts, args.json, args.offload_path, repeat=args.repeat)
    if args.recompute:
        from memsave.recompute import parse_policy

        rc_names = [n.strip() for n in args.recompute.split(",") if n.strip()]
        for name in rc_names:
            if name not in RECOMPUTE_BASELINES:
                parse_policy(name)  # a bad policy fails now

        def show_recompute(rows: list[dict[str, Any]]) -> None:
            print(format_recompute_table(rows))
            for r in rows:
                if r["plan"] is not None and r["name"].startswith("budget:"):
                    print(r["plan"]["summary"])

        return show_results(lambda: run_recompute_bench(rc_names, opts), show_recompute, args.json, opts,
                            schema="memsave.bench-recompute/1")
    if args.optimizers:
        opt_names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
        for name in opt_names:
            _make_optimizer(name, [torch.zeros(1, requires_grad=True)], 1e-3)  # a bad name fails now
        return show_results(lambda: run_optim_bench(opt_names, opts), lambda rows: print(format_optim_table(rows)),
                            args.json, opts, schema="memsave.bench-optim/1")
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    for name in names:
        if _base_name(name) not in _BASELINES:
            load_profile(name)  # a bad name fails now, not after the other runs
    return show_results(lambda: run_bench(names, opts), lambda rows: print(format_table(rows)), args.json, opts)
