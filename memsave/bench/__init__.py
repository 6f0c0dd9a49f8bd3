"""``memsave bench``: memsave against torch's own implementations, each configuration in fresh processes.

One mode a run, chosen by the command line (this module is the only one that imports the modes):
- ``steptime`` (the default, ``--configs``): profiles and torch baselines (DDP, ZeroRedundancyOptimizer,
  FSDP2) side by side: step time, peak RSS, model-state bytes against the ZeRO formula, communication, loss;
- ``optimizers`` (``--optimizers``): optimizers alone on one process, state bytes and step time;
- ``recompute`` (``--recompute``): recomputation policies against torch's checkpointing, on one process;
- ``offload`` (``--offload``): optimizer-state offload against the same run in memory;
- ``fit`` (``--fit``, CUDA only): the largest model each configuration trains within a device-memory cap;
- ``memory`` (``--memory``): the memory tracker and the estimator per profile, and torch's ``MemTracker``;
- ``tp`` (``--tp``): memsave's tensor parallelism against the formulas (parameter and activation bytes per rank)
  and against one process and torch's DTensor TP (step time);
- ``pp`` (``--pp``): the pipeline schedules' step time against torch.distributed.pipelining in the same run, and
  their measured idle fraction against the bubble formulas and the simulator fed the runtime's per-action times;
- ``plan`` (``--plan``): the planner's predicted peak and step time against measurement, and its speed;
- ``deferred`` (``--deferred``): the peak RSS of ``wrap`` on a model built under ``memsave.deferred_init()`` against
  its shards + the largest unit, and against the same model built eagerly;
- ``checkpoint`` (``--checkpoint``): ``memsave.save`` / ``load`` against a plain write / read of the same bytes and
  against FSDP2 + torch DCP: throughput, the step that issues an async save, peak RSS while saving.
``common`` holds what they share: :class:`BenchOptions`, :func:`run_each`, :class:`ConfigFailed` and the
results' table and JSON file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memsave.bench import (
    checkpoint,
    deferred,
    fit,
    memory,
    offload,
    optimizers,
    plan,
    pp,
    recompute,
    steptime,
    tp,
)
from memsave.bench.common import BenchOptions, ConfigFailed, run_each, show_results
from memsave.bench.fit import FitOptions
from memsave.bench.optimizers import OPTIMIZERS, format_optim_table, run_optim_bench
from memsave.bench.recompute import (
    DEFAULT_RECOMPUTE,
    RECOMPUTE_BASELINES,
    format_recompute_table,
    run_recompute_bench,
)
from memsave.bench.steptime import (
    BASELINE_NAMES,
    DEFAULT_CONFIGS,
    comm_elements,
    format_table,
    formula_bytes,
    precision_label,
    run_bench,
)

__all__ = [
    "BenchOptions",
    "ConfigFailed",
    "add_parser",
    "comm_elements",
    "format_optim_table",
    "format_recompute_table",
    "format_table",
    "formula_bytes",
    "precision_label",
    "run_bench",
    "run_command",
    "run_each",
    "run_optim_bench",
    "run_recompute_bench",
    "show_results",
]


def add_parser(sub: Any) -> None:
    """The ``bench`` subcommand's parser, added to ``memsave``'s subparsers."""
    p = sub.add_parser(
        "bench", help="profiles and torch baselines side by side",
        description="Run memsave profiles and torch baselines (DDP, ZeroRedundancyOptimizer, FSDP2) on the same "
                    "model and data, each in fresh local processes, and print one table row per configuration.",
    )
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help="comma-separated profiles (names or .toml paths, e.g. zero3-bf16) and baselines "
                        f"({', '.join(BASELINE_NAMES)}; '+malloc' adds memsave's host-memory policy)")
    p.add_argument("--size", default=None,
                   help="reference GPT size (default: bench, 27.4M parameters untied; with --tp and --checkpoint: "
                        "medium)")
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
                   help="instead: optimizer-state offload against the same run in memory (memsave/bench/offload.py), "
                        "e.g. zero3,zero3-offload-disk,zero3-offload-disk-noprefetch,zero3-offload-disk-half")
    p.add_argument("--offload-path", default=None, help="--offload: folder for the disk tier (default: the temp dir)")
    p.add_argument("--repeat", type=int, default=None,
                   help="--offload: run the configurations this many times, round-robin, and report medians (the "
                        "disk and the heap's peak vary from run to run; default 1); --checkpoint: saves, loads and "
                        "async saves timed per configuration (default 5)")
    p.add_argument("--fit", default=None,
                   help="instead, on a CUDA device: the largest reference GPT each configuration trains within "
                        "--device-gib of device memory, and the step-time overhead of offload (memsave/bench/fit.py), "
                        "e.g. zero3-bf16,zero3-bf16-offload,zero3-bf16-offload-params")
    p.add_argument("--device-gib", type=float, default=4.0, help="--fit: the device-memory cap in GiB; --plan on CUDA: the budget "
                   "(default: 4)")
    p.add_argument("--d-model", type=int, default=1024,
                   help="--fit, --deferred, --plan on CUDA: the GPT's width (default: 1024)")
    p.add_argument("--fit-steps", type=int, default=3, help="--fit: steps per trial (default: 3)")
    p.add_argument("--memory", default=None,
                   help="instead: the memory tracker and estimator per profile (memsave/bench/memory.py): estimated "
                        "vs measured state, activations and peak, tracking overhead; 'memtracker' adds torch's "
                        "MemTracker beside ours, e.g. ddp,zero1,zero2,zero3,memtracker")
    p.add_argument("--tp", action="store_true",
                   help="instead: memsave's tensor parallelism, tp = --nproc ranks (memsave/bench/tp.py): parameter "
                        "and activation bytes per rank against the formulas (Korthikanti et al., 2022), step time "
                        "against one process and torch's DTensor TP (default --size medium)")
    p.add_argument("--pp", action="store_true",
                   help="instead: the pipeline schedules, pp = --nproc ranks (memsave/bench/pp.py): step time against "
                        "torch.distributed.pipelining in the same run, measured idle fraction per rank against the "
                        "bubble formulas and memsave.pp.simulate fed the runtime's per-action times, activation "
                        "peak per rank against the tracker, for gpipe, 1f1b, interleaved and zero-bubble at "
                        "m = 4, 8, 16 micro-batches")
    p.add_argument("--plan", action="store_true",
                   help="instead: memsave plan's predictions against measurement (memsave/bench/plan.py): every "
                        "configuration it offers for the reference GPT on --nproc ranks, predicted vs measured peak "
                        "and step time, its choice vs the fastest measured; and the time of a 70B plan")
    p.add_argument("--deferred", action="store_true",
                   help="instead: the peak RSS per rank of wrapping (zero3, --nproc ranks) a GPT built under "
                        "memsave.deferred_init() against its shards + the largest unit, and the same GPT built eagerly "
                        "(memsave/bench/deferred.py; --d-model, --n-layer)")
    p.add_argument("--n-layer", type=int, default=16, help="--deferred, --plan on CUDA: the GPT's blocks (default: 16)")
    p.add_argument("--checkpoint", nargs="?", const=",".join(checkpoint.DEFAULT_CONFIGS), default=None,
                   metavar="CONFIGS",
                   help="instead: memsave.save / load against a plain fsync'd write / read of the same bytes and "
                        f"against FSDP2 + torch DCP (memsave/bench/checkpoint.py; default {','.join(checkpoint.DEFAULT_CONFIGS)}"
                        "): MiB/s per rank, the step that issues an async save, peak RSS while saving (default "
                        "--size medium)")
    p.add_argument("--dir", default=None,
                   help="--checkpoint: where to write (a temporary folder under it, removed after; default: the "
                        "OS temp dir)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")


def run_command(args: Any, extra: Any) -> int:
    """``memsave bench``: the one mode the arguments ask for (``--fit``, ``--tp``, ``--pp``, ``--plan``, ``--deferred``,
    ``--checkpoint``, ``--memory``, ``--offload``, ``--recompute``, ``--optimizers``, in that order; else
    ``--configs``)."""
    if extra:
        raise ValueError(f"memsave bench: unrecognized arguments: {' '.join(extra)}")
    size = args.size or ("medium" if args.tp or args.checkpoint else "bench")
    opts = BenchOptions(size=size, tie_weights=args.tied, batch_size=args.batch_size, seq_len=args.seq_len,
                        steps=args.steps, warmup=args.warmup, nproc=args.nproc)
    if args.fit:
        return fit.run_command(args.fit, FitOptions(device_gib=args.device_gib, d_model=args.d_model,
                                                    n_head=max(1, args.d_model // 64), batch_size=args.batch_size,
                                                    seq_len=args.seq_len, steps=args.fit_steps), args.json)
    if args.tp:
        return tp.run_command(opts, args.json)
    if args.pp:
        return pp.run_command(opts, args.json)
    if args.plan:
        return plan.run_command(opts, args.json, args.device_gib, args.d_model, args.n_layer)
    if args.deferred:
        return deferred.run_command(opts, args.d_model, args.n_layer, args.json)
    if args.checkpoint:
        return checkpoint.run_command(args.checkpoint, opts, args.json, args.dir,
                                      5 if args.repeat is None else args.repeat)
    if args.memory:
        return memory.run_command(args.memory, opts, args.json)
    if args.offload:
        return offload.run_command(args.offload, opts, args.json, args.offload_path,
                                   repeat=1 if args.repeat is None else args.repeat)
    if args.recompute:
        return recompute.run_command(args.recompute, opts, args.json)
    if args.optimizers:
        return optimizers.run_command(args.optimizers, opts, args.json)
    return steptime.run_command(args.configs, opts, args.json)
