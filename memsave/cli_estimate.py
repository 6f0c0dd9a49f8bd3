"""``memsave estimate``: per-rank memory of a model under one profile or every preset, before anything is
allocated (the model is built on the meta device)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from memsave.cli_args import UsageError, split_overrides
from memsave.config import list_presets, load_profile
from memsave.estimator import estimate, format_estimates
from memsave.models import GPT, GPTConfig, gpt_config

__all__ = ["add_parser", "run_command"]


def add_parser(sub: Any) -> None:
    """The ``estimate`` subcommand's parser, added to ``memsave``'s subparsers."""
    p = sub.add_parser(
        "estimate", help="per-rank memory of a model under profiles, before anything is allocated",
        description="Predict per-rank bytes by category (parameters, gradients, masters, optimizer state, "
        "activations, gathered parameters, offloaded tiers) for one profile or all presets. The model is built on "
        "the meta device, so models far bigger than this machine are estimated in seconds. Profile keys can be "
        "overridden as --section.key=value.",
    )
    p.add_argument("--model", default="gpt:bench", metavar="gpt:SIZE | MODULE:FUNCTION",
                   help="the reference GPT at a size (gpt:tiny ... gpt:bench; fields override, e.g. "
                        "gpt:bench,tie_weights=false or gpt:bench,n_layer=48,d_model=4096), or MODULE:FUNCTION returning a model or (model, example batch); it is "
                        "called under torch.device('meta') (default: gpt:bench)")
    p.add_argument("--profile", default=None, help="a preset or TOML path (default: every preset)")
    p.add_argument("--world-size", type=int, default=2, help="ranks: dp x tp, or dp x pp under --parallel.pp=N "
                   "(default: 2)")
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches per optimizer step (gradient "
                   "accumulation; under --parallel.pp=N the schedule's, one row per pipeline rank) (default: 1)")
    p.add_argument("--batch-size", type=int, default=4, help="rows per rank per micro-batch (GPT; default: 4)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per row (GPT; default: 256)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="device kind trained on (default: "
                   "cuda when available)")
    p.add_argument("--json", type=Path, default=None, help="also write the estimates here")


def _gpt_field(spec: str, item: str) -> tuple[str, Any]:
    """One ``key=value`` of ``--model gpt:SIZE,key=value,...``, parsed by the type of that GPTConfig field."""
    # "int", "float" or "bool": the annotation as written (a string under postponed annotations) or its class
    types = {f.name: f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
             for f in dataclasses.fields(GPTConfig)}
    key, eq, value = (part.strip() for part in item.partition("="))
    allowed = ", ".join(types)
    if not eq or not key:
        raise UsageError(f"--model {spec!r}: {item!r} is not key=value (e.g. n_layer=48); the fields are {allowed}")
    if key not in types:
        raise UsageError(f"--model {spec!r}: {key!r} is not a field of the GPT; the fields are {allowed}")
    kind = types[key]
    if kind == "bool":
        if value.lower() not in ("true", "false"):
            raise UsageError(f"--model {spec!r}: {key}={value!r} is not allowed; expected true or false")
        return key, value.lower() == "true"
    try:
        return key, float(value) if kind == "float" else int(value)
    except ValueError:
        what = "a number" if kind == "float" else "an integer"
        raise UsageError(f"--model {spec!r}: {key}={value!r} is not allowed; expected {what}") from None


def _estimate_model(spec: str, batch_size: int, seq_len: int) -> tuple[torch.nn.Module, Any]:
    kind, sep, rest = spec.partition(":")
    if not sep or not rest:
        raise UsageError(f"--model {spec!r} is not gpt:SIZE or MODULE:FUNCTION")
    for flag, value in (("--batch-size", batch_size), ("--seq-len", seq_len)):
        if value < 1:
            raise UsageError(f"{flag} {value} is not allowed; expected a positive integer")
    if kind == "gpt":
        size, *fields = rest.split(",")
        overrides = dict(_gpt_field(spec, f) for f in fields)
        try:
            cfg = gpt_config(size.strip(), **overrides)
        except ValueError as exc:  # GPTConfig's checks: n_layer=-1, d_model not a multiple of n_head, ...
            raise UsageError(f"--model {spec!r}: {exc}") from None
        if seq_len > cfg.block_size:
            cfg = dataclasses.replace(cfg, block_size=seq_len)
        with torch.device("meta"):
            model = GPT(cfg)
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
        return model, {"input_ids": ids, "labels": ids}
    try:
        fn = getattr(importlib.import_module(kind), rest)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"--model {spec!r}: cannot load {rest!r} from module {kind!r} ({exc})") from None
    with torch.device("meta"):
        built = fn()
    model, batch = built if isinstance(built, tuple) else (built, None)
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"--model {spec!r} returned a {type(model).__name__}, not an nn.Module (or (model, batch))")
    return model, batch


def run_command(args: argparse.Namespace, extra: Sequence[str]) -> int:
    """``memsave estimate``: one table of every profile asked for (and the JSON file)."""
    overrides = split_overrides(extra, hint=" and the GPT's fields go in --model, e.g. --model gpt:bench,n_layer=48")
    model, batch = _estimate_model(args.model, args.batch_size, args.seq_len)
    names = [args.profile] if args.profile else list_presets()
    ests = [estimate(model, load_profile(n, overrides), world_size=args.world_size, batch=batch, device=args.device,
                     micro_batches=args.micro_batches) for n in names]
    print(format_estimates(ests))
    if batch is None:
        print("no example batch: activations are not estimated (return (model, batch) from the function)")
    if args.json is not None:
        args.json.write_text(json.dumps({"schema": "memsave.estimate/1", "model": args.model, "estimates": [
            {"profile": e.profile, **e.to_report_dict(), "model_state": e.model_state, "activations": e.activations,
             **({"stages": [{"pp_rank": s.pp_rank, **s.to_report_dict(), "model_state": s.model_state,
                             "activations": s.activations} for s in e.stages]} if e.stages else {})}
            for e in ests]}, indent=1) + "\n")
        print(f"estimates written to {args.json}")
    return 0
