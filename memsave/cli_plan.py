"""``memsave plan`` and ``memsave calibrate``: the cheapest configuration that fits, before the first run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from memsave.cli_args import UsageError, split_overrides
from memsave.cli_estimate import _estimate_model
from memsave.config import load_profile
from memsave.memory.schema import OFF_DEVICE, format_bytes
from memsave.models import GPT
from memsave.plan import (
    Candidate,
    PlanError,
    calibrate,
    exact_peak,
    from_hf_config,
    from_module,
    load_hardware,
    price,
    to_toml,
)
from memsave.plan import plan as make_plan
from memsave.plan.search import ANALYTIC_HEADROOM, HEADROOM, at_least
from memsave.plan.spec import CLOSED_FORM_TYPES, from_gpt, meta_model_from_hf_config
from memsave.recompute.policy import parse_size

__all__ = ["add_calibrate_parser", "add_parser", "run_calibrate", "run_command"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan", help="the cheapest configuration that fits a memory budget, with the why",
        description="Enumerate dp x tp x pp, the ZeRO stage, precision, recomputation, offload, the micro-batch "
        "split and the pipeline schedule; price each (bytes per rank by category, step seconds by term, on this "
        "machine's calibrated rates or a vendor's); print the fastest that fit, and why the other families do "
        "not.")
    p.add_argument("--model", default="gpt:bench", metavar="gpt:SIZE | CONFIG.json | MODULE:FUNCTION",
                   help="the reference GPT (gpt:bench,n_layer=48,...), a Hugging Face config.json (no weights), or "
                        "MODULE:FUNCTION returning a model (or (model, batch)), built on the meta device")
    p.add_argument("--world", type=int, default=2, help="devices (default: 2)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="devices per node; tp stays within one (default: 8)")
    p.add_argument("--device-memory", required=False, default=None, metavar="SIZE",
                   help="budget per device, e.g. 16GiB (default: the hardware's memory)")
    p.add_argument("--host-memory", default=None, metavar="SIZE", help="host memory per device for offload")
    p.add_argument("--disk", default="0B", metavar="SIZE", help="disk per device for offload (default: none)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default: 256)")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step (default: 16)")
    p.add_argument("--hardware", default="local", help="local (calibrated here), a100, h100, h200, or a "
                   ".toml/.json file of rates (default: local)")
    p.add_argument("--top", type=int, default=5, help="candidates to print (default: 5)")
    p.add_argument("--exact", choices=("on", "off"), default="on",
                   help="check each candidate's memory with memsave.estimate on the model itself (gpt: and "
                        "MODULE:FUNCTION returning (model, batch), and a config.json of a type without closed forms; "
                        "llama, mistral, qwen2 and gpt2 configs are priced by the closed forms) (default: on)")
    p.add_argument("--write", type=Path, default=None, metavar="PROFILE.toml", help="write the winner as a profile")
    p.add_argument("--explain", default=None, metavar="PROFILE",
                   help="instead of searching: the full breakdown of one profile (with --micro-batch, "
                        "--micro-batches)")
    p.add_argument("--micro-batch", type=int, default=None, help="with --explain: rows per micro-batch")
    p.add_argument("--micro-batches", type=int, default=1, help="with --explain: micro-batches per step")
    p.add_argument("--json", type=Path, default=None, help="also write the plan here")


def add_calibrate_parser(sub: Any) -> None:
    p = sub.add_parser("calibrate", help="measure this machine's rates for memsave plan (cached)",
                       description="Measure matmul FLOP/s, memory, host, disk and collective bandwidth once (a few "
                       "seconds) and cache them for memsave plan --hardware local.")
    p.add_argument("--refresh", action="store_true", help="measure again even if cached")
    p.add_argument("--dir", type=Path, default=None, help="where to measure disk bandwidth (default: temp dir)")


def _size(flag: str, text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(parse_size(text))
    except ValueError as exc:
        if text.strip().startswith("-"):
            raise UsageError(f"{flag} {text!r} is not allowed; expected a positive size such as 16GiB") from None
        raise UsageError(f"{flag} {text!r}: {exc}") from None


def _model(spec: str, seq: int) -> tuple[Any, torch.nn.Module | None, Any]:
    """(ModelSpec, the meta model or None, an example batch or None)."""
    if spec.endswith(".json"):
        path = Path(spec)
        if not path.is_file():
            raise UsageError(f"--model {spec!r}: no such file")
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"--model {spec!r}: not a JSON file ({exc})") from None
        try:
            if not isinstance(cfg, dict) or cfg.get("model_type") in CLOSED_FORM_TYPES:
                return from_hf_config(cfg), None, None
            # any other type: the model transformers builds from it, on the meta device, as MODULE:FUNCTION
            model, batch = meta_model_from_hf_config(cfg, seq)
            print(f"memsave plan: config.json model_type = {cfg['model_type']!r} has no closed forms (those read "
                  f"{', '.join(CLOSED_FORM_TYPES)}): transformers built it on the meta device, and each candidate is "
                  "priced with memsave.estimate on it, as a MODULE:FUNCTION model is")
            return from_module(model, name=spec), model, batch
        except (ValueError, KeyError, NotImplementedError) as exc:
            raise UsageError(f"--model {spec!r}: {exc}") from None
    model, batch = _estimate_model(spec, 1, seq)
    if spec.startswith("gpt:"):
        assert isinstance(model, GPT)
        return from_gpt(model.config, name=spec), model, batch
    try:
        return from_module(model, name=spec), model, batch
    except ValueError as exc:
        raise UsageError(f"--model {spec!r}: {exc}") from None


def _rows(batch: Any, rows: int) -> Any:
    """The example batch with ``rows`` rows (every tensor's first dimension), on the meta device."""
    if isinstance(batch, torch.Tensor):
        return torch.zeros((rows, *batch.shape[1:]), dtype=batch.dtype, device="meta") if batch.dim() else batch
    if isinstance(batch, dict):
        return {k: _rows(v, rows) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_rows(v, rows) for v in batch)
    return batch


def _breakdown(p: Any) -> str:
    dev = ", ".join(f"{k} {format_bytes(int(v))}" for k, v in sorted(p.device.items(), key=lambda kv: -kv[1]) if v)
    off = "".join(f", {k} {format_bytes(int(v))}" for k, v in (("host", p.host), ("disk", p.disk)) if v)
    times = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sorted(p.time.items(), key=lambda kv: -kv[1]))
    return (f"  memory per rank ({'memsave.estimate' if p.exact else 'closed forms'}): {format_bytes(int(p.peak))} = "
            f"{dev}{off}\n"
            f"  step {p.step_time * 1e3:.1f} ms = {times}; bottleneck: {p.bottleneck}")


def _check_flags(args: argparse.Namespace) -> None:
    """Flag values the plan cannot use, refused naming the flag (before anything is printed)."""
    for flag, value in (("--world", args.world), ("--gpus-per-node", args.gpus_per_node), ("--top", args.top),
                        ("--seq-len", args.seq_len), ("--global-batch", args.global_batch),
                        ("--micro-batches", args.micro_batches), ("--micro-batch", args.micro_batch)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} {value} is not allowed; expected a positive integer")
    for flag, path in (("--write", args.write), ("--json", args.json)):  # before the plan, not after it printed
        if path is not None and not path.parent.is_dir():
            raise UsageError(f"{flag} {str(path)!r}: the folder {str(path.parent)!r} does not exist")


def _explain(args: argparse.Namespace, overrides: Sequence[str], spec: Any, hw: Any, budget: float,
             exact: Any) -> Any:
    """``--explain PROFILE``: its candidate priced (memsave.estimate on the model where the search would use it),
    judged with the search's headroom."""
    prof = load_profile(args.explain, overrides)
    tp, pp = prof.parallel.tp, prof.parallel.pp
    if args.world % (tp * pp):
        raise ValueError(f"--explain {args.explain}: tp {tp} x pp {pp} does not divide --world {args.world}")
    if spec.heads and spec.heads % tp:
        raise ValueError(f"--explain {args.explain}: tp {tp} does not divide the model's {spec.heads} heads")
    if pp > spec.layers:
        raise ValueError(f"--explain {args.explain}: pp {pp} > the model's {spec.layers} layers")
    dp = args.world // (tp * pp)
    mb = args.micro_batch or max(1, args.global_batch // (dp * args.micro_batches))
    if args.micro_batch and mb * dp * args.micro_batches != args.global_batch:
        raise ValueError(f"--explain {args.explain}: --micro-batch {mb} x --micro-batches {args.micro_batches} x dp "
                         f"{dp} = {mb * dp * args.micro_batches} sequences a step, not --global-batch "
                         f"{args.global_batch}; give sizes whose product is the global batch")
    off = ("none" if prof.offload.optimizer == "none" else "optimizer"
           + ("+params" if prof.offload.params != "none" else "")
           + (":disk" if prof.offload.optimizer == "disk" else ""))
    c = Candidate(dp=dp, tp=tp, pp=pp, stage=prof.zero.stage, precision=prof.precision.compute,
                  recompute=prof.recompute.policy, offload=off, micro_batch=mb, micro_batches=args.micro_batches,
                  schedule=prof.parallel.schedule, virtual=prof.parallel.virtual, sequence=prof.parallel.sequence,
                  optimizer=prof.optimizer.name)
    p = price(spec, c, hw, args.seq_len, gpus_per_node=args.gpus_per_node)
    note = ""
    try:
        held = exact(c) if exact is not None else None
    except Exception as exc:  # as the search: said, and the closed forms instead
        held, note = None, f"  memsave.estimate failed ({type(exc).__name__}: {exc}); closed forms used\n"
    if held is not None:
        p = dataclasses.replace(p, device={k: float(v) for k, v in held.items() if k not in OFF_DEVICE},
                                host=held.get("offload_host", 0) or p.host, disk=held.get("offload_disk", 0) or p.disk,
                                exact=True)
    return c, p, note


def run_command(args: argparse.Namespace, extra: Sequence[str]) -> int:
    overrides = split_overrides(extra, hint="")
    _check_flags(args)
    if overrides and not args.explain:
        raise UsageError(f"profile overrides ({' '.join(extra)}) apply to --explain PROFILE only: the plan "
                         "searches every configuration itself (to price one, pass it with --explain)")
    spec, model, batch = _model(args.model, args.seq_len)
    try:
        hw = load_hardware(args.hardware)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    given = _size("--device-memory", args.device_memory)
    if given is not None and not given > 0:
        raise UsageError(f"--device-memory {args.device_memory!r} is not allowed; expected a positive size")
    budget = hw.memory if given is None else given
    host_budget, disk_budget = _size("--host-memory", args.host_memory), _size("--disk", args.disk) or 0.0
    exact = None
    if model is not None and batch is not None and args.exact != "off":
        meta = model
        cache: dict[Candidate, dict[str, int]] = {}

        def exact(c: Candidate) -> dict[str, int]:  # the whole candidate is the key: schedules differ in memory
            if c not in cache:
                cache[c] = exact_peak(meta, c, _rows(batch, c.micro_batch), device=hw.device)
            return cache[c]
    explained = _explain(args, overrides, spec, hw, budget, exact) if args.explain else None
    print(f"memsave plan: {spec.name}, {spec.num_params:,} parameters; {args.world} device(s) of {hw.name} "
          f"({hw.source}); budget {format_bytes(int(budget))} per device; {args.global_batch} x {args.seq_len} "
          "tokens per step")
    if explained is not None:
        c, p, note = explained
        margin = HEADROOM if p.exact else ANALYTIC_HEADROOM
        need = p.peak * (1 + margin)
        print(f"{args.explain}: {c.label()}\n{note}{_breakdown(p)}")
        shown = (at_least(need), format_bytes(int(budget)))
        if shown[0] == shown[1]:  # alike at 0.1: the bytes
            shown = (f"{math.ceil(need):,} B", f"{int(budget):,} B")
        print(("fits" if need <= budget else "does not fit") + f": {at_least(p.peak)} + {margin:.0%} "
              f"headroom ({'of an exact figure' if p.exact else 'of a closed-form figure'}, as the search keeps) "
              f"= {shown[0]} {'<=' if need <= budget else '>'} {shown[1]}")
        return 0
    try:
        result = make_plan(spec, hw, world=args.world, global_batch=args.global_batch, seq=args.seq_len,
                           budget=budget, host_budget=host_budget, disk_budget=disk_budget,
                           gpus_per_node=args.gpus_per_node, exact=exact)
    except PlanError as exc:
        print(f"memsave plan: {exc}")
        return 1
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(f"{result.considered} configurations considered, {len(result.ranked)} fit; the fastest:")
    for i, p in enumerate(result.ranked[: args.top]):
        print(f"{i + 1}. {p.candidate.label()}\n{_breakdown(p)}")
    print(f"binding constraint of the choice: {result.binding()}")
    for fam, why in result.rejected.items():
        print(f"rejected {fam}: {why}")
    by_reason: dict[str, list[str]] = {}  # one estimator error is usually every mesh's: said once
    for mesh, why in result.unpriced.items():
        by_reason.setdefault(why, []).append(mesh)
    for why, meshes in by_reason.items():
        print(f"memory of {', '.join(meshes)}: {why}")
    if args.write is not None:
        args.write.write_text(to_toml(result.best.candidate, why=f"binding: {result.binding()}", seq=args.seq_len,
                                      model=args.model, path=args.write))
        print(f"profile written to {args.write}")
    if args.json is not None:
        args.json.write_text(json.dumps({"schema": "memsave.plan/1", "model": args.model, "hardware": hw.to_dict(),
                                         "budget": budget, "ranked": [p.to_dict() for p in result.ranked[:50]],
                                         "rejected": result.rejected, "binding": result.binding()}, indent=1) + "\n")
    return 0


def run_calibrate(args: argparse.Namespace, extra: Sequence[str]) -> int:
    if extra:
        raise UsageError(f"memsave calibrate: unexpected arguments {list(extra)}")
    hw = calibrate(folder=args.dir, refresh=args.refresh)
    rates = hw.to_dict()
    print(f"{hw.name}: {hw.source}")
    for k in ("flops", "mem_bw", "intra_bw", "host_bw", "disk_bw", "memory"):
        print(f"  {k}: {rates[k]}")
    return 0
