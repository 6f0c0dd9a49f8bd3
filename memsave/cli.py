"""The ``memsave`` command.

``memsave demo`` trains the reference GPT on the embedded corpus with a profile, on local processes (or, started
by ``torchrun`` / ``accelerate launch``, as one rank of theirs, on any number of nodes), and prints the memory
report; ``memsave profiles`` lists the presets. Each subcommand is a pair of functions, one that adds its parser
and one that runs it (``_COMMANDS``), so more subcommands slot in beside these: ``bench``'s are in
``memsave/bench/``, ``estimate``'s in ``memsave/cli_estimate.py``, and the command-line errors and profile
overrides they share in ``memsave/cli_args.py``.

Errors in what the user asked for (a bad profile key or value, an unsupported combination) are printed as
one line and exit with code 2, without a traceback; other failures exit with code 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from memsave import bench, cli_estimate, cli_export, cli_plan
from memsave import dist as mdist
from memsave._launch import LaunchError, spawn_local
from memsave.api import wrap
from memsave.cli_args import ArgumentError, Parser, UsageError, split_overrides
from memsave.config import Profile, list_presets, load_profile
from memsave.estimator import Estimate, estimate
from memsave.models import GPT, TokenBatches, gpt_config
from memsave.models.gpt import GPT_SIZES
from memsave.optim import build_optimizer
from memsave.recompute.plan import PLAN_ATTR
from memsave.trainer import TrainConfig, Trainer, cosine_schedule

__all__ = ["DemoOptions", "main"]

_USER_ERRORS = ("ValueError", "NotImplementedError")


# -- memsave demo --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoOptions:
    """Everything a demo process needs (pickled to each one)."""

    profile: Profile
    size: str
    train: TrainConfig
    estimate: dict[str, Any] | None = None  # memsave.estimate(...) of this run, put beside the measured report


def _demo_worker(opts: DemoOptions) -> dict[str, Any]:
    """One rank of ``memsave demo`` started by :func:`spawn_local`."""
    return _demo_rank(opts, mdist.init(profile=opts.profile))  # [parallel] (--parallel.tp=2) shapes the mesh


def _demo_launched(opts: DemoOptions) -> dict[str, Any] | None:
    """``memsave demo`` started by torchrun / accelerate: this process is one rank of theirs. Says which (global
    rank, and the launcher's rank on this node), trains, and returns the results on rank 0, None on the others."""
    mesh = mdist.init(profile=opts.profile)
    print(f"memsave demo: rank {mesh.rank} of {mesh.world_size}, local rank {mesh.local_rank} on "
          f"{socket.gethostname()} ({mesh.device})", flush=True)
    main_rank = mesh.is_main  # asked before shutdown() ends the process group
    result = _demo_rank(opts, mesh)
    mdist.shutdown()  # the ranks meet, then leave the process group ([Note: gloo at exit])
    return result if main_rank else None


def _demo_rank(opts: DemoOptions, mesh: mdist.Mesh) -> dict[str, Any]:
    """One rank of ``memsave demo``: build, wrap, train, evaluate, report."""
    cfg = opts.train
    torch.manual_seed(cfg.seed)  # the same initial model on every rank (wrap broadcasts rank 0's anyway)
    gpt_cfg = gpt_config(opts.size)
    if cfg.seq_len > gpt_cfg.block_size:
        gpt_cfg = dataclasses.replace(gpt_cfg, block_size=cfg.seq_len)
    model = GPT(gpt_cfg)
    num_params = model.num_parameters()
    opt_cfg = opts.profile.optimizer
    optimizer = build_optimizer(model.parameters(), opt_cfg)
    data = {split: TokenBatches(seq_len=cfg.seq_len, batch_size=cfg.batch_size, dp_rank=mesh.dp_rank,
                                dp_size=mesh.dp_size, split=split, seed=cfg.seed) for split in ("train", "val")}
    # the first micro-batch is what a "budget:<size>" recompute policy (and a time-balanced pipeline) measures on;
    # other profiles get none, so nothing warns that it is unused
    measures = (opts.profile.recompute.policy.startswith("budget:") or opts.profile.parallel.balance == "time")
    wrapped, mopt = wrap(model, optimizer, opts.profile, mesh=mesh,
                         example_inputs=data["train"].batch(0) if measures else None)
    if mesh.is_main:
        layout = f" (dp={mesh.dp_size} x tp={mesh.degree('tp')})" if mesh.degree("tp") > 1 else ""
        if mesh.degree("pp") > 1:
            par = opts.profile.parallel
            layout = (f" (pp={mesh.degree('pp')} x dp={mesh.dp_size}, schedule {par.schedule}"
                      + (f", {par.virtual} stages per rank" if par.virtual > 1 else "") + ")")
        print(f"memsave demo: GPT {opts.size} ({num_params:,} parameters), profile {opts.profile.name}, "
              f"{mesh.world_size} processes on {mesh.device.type}{layout}; {cfg.steps} steps x {cfg.micro_batches} "
              f"micro-batches x {cfg.batch_size} rows x {cfg.seq_len} tokens per rank; {opt_cfg.name} "
              f"lr {opt_cfg.lr:g}", flush=True)
        if mesh.degree("pp") > 1:  # which stage holds which modules
            print(wrapped.memsave_engine.split.to_text(), flush=True)  # type: ignore[union-attr]
        # memsave.recompute.apply leaves its plan on the model it was given (memsave/recompute/plan.py: PLAN_ATTR)
        plan = getattr(model, PLAN_ATTR, None) or getattr(wrapped, PLAN_ATTR, None)
        if plan is not None and plan.policy.kind == "budget":
            print(plan.summary, flush=True)
    trainer = Trainer(
        wrapped, mopt, mesh=mesh, config=cfg, train_data=data["train"], eval_data=data["val"],
        lr_schedule=cosine_schedule(min(opt_cfg.warmup_steps, cfg.steps), cfg.steps, opt_cfg.min_lr_ratio),
        profile=opts.profile.name, estimate=opts.estimate,
    )
    start = time.perf_counter()
    result = trainer.fit()
    train_s = time.perf_counter() - start
    eval_loss = trainer.evaluate()
    return {"losses": result.losses, "eval_loss": eval_loss, "tokens_per_s": result.tokens_per_s,
            "train_s": train_s, "report": result.report, "num_params": num_params}


def _default_nproc() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def _add_demo(sub: Any) -> None:
    p = sub.add_parser(
        "demo", help="train the reference GPT on the embedded corpus and print the memory report",
        description="Train the reference GPT on the embedded corpus (Python's docs, byte tokens) on local "
        "processes with a profile, show the loss falling, and print the memory report. Any profile key can be "
        "overridden as --section.key=value (e.g. --zero.stage=3 --optimizer.lr=1e-3; --parallel.tp=2 sets the "
        "mesh's tp degree).",
    )
    p.add_argument("--profile", default="ddp", help="preset name or path to a TOML file (default: ddp)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (default: 100)")
    p.add_argument("--size", choices=sorted(GPT_SIZES), default="small", help="GPT size (default: small)")
    p.add_argument("--nproc", type=int, default=None,
                   help="local processes (default: the number of GPUs, else 2); under torchrun or accelerate "
                        "launch, each process is one rank of theirs and this is left out")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="gradient accumulation steps; with --parallel.pp=N, the micro-batches of each step's "
                        "pipeline schedule (default: 1)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per process per micro-batch (default: 8)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per row (default: min(block size, 128))")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the profile's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the data (default: 0)")
    p.add_argument("--log-every", type=int, default=None, help="log every N steps (default: steps / 10)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds before the local processes are stopped (not under torchrun or accelerate)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (where stderr is not a terminal, no progress lines)")
    p.add_argument("--progress-every", type=float, default=30.0, metavar="SECONDS",
                   help="where stderr is not a terminal (CI, redirected output), a progress line at most this often "
                        "instead of the bar (default: 30)")
    p.add_argument("--report-json", type=Path, default=None, help="also write the memory report as JSON here")
    p.add_argument("--report-dir", default="runs/memsave-demo",
                   help="each run writes report.json and report.html (the memory report with its timeline and the "
                        "estimate beside it) into a new folder <profile>-<timestamp> under this one, and prints it "
                        "(default: runs/memsave-demo; '' writes none)")
    p.add_argument("--ckpt-dir", default="", help="save checkpoints (memsave.save) under this folder")
    p.add_argument("--save-every", type=int, default=0, metavar="N", help="checkpoint every N steps (0: never)")
    p.add_argument("--keep-last", type=int, default=0, metavar="N", help="keep the N newest checkpoints (0: all)")
    p.add_argument("--resume", nargs="?", const="latest", default="", metavar="PATH",
                   help="resume from the latest committed checkpoint in --ckpt-dir (or PATH); --steps stays the total")
    p.add_argument("--no-track", action="store_true",
                   help="no memory tracking (the report then has the final bytes only, no peaks or timeline)")


def _demo_options(args: argparse.Namespace, extra: Sequence[str],
                  launched: dict[str, str] | None = None) -> tuple[DemoOptions, int]:
    """What every rank runs, and how many ranks; ``launched``: the environment of a launcher that started this
    process (then its WORLD_SIZE is the number of ranks)."""
    overrides = split_overrides(extra)
    if args.lr is not None:
        overrides.append(f"optimizer.lr={args.lr!r}")
    profile = load_profile(args.profile, overrides)  # ValueError names the key, the value and what is allowed
    nproc = args.nproc if args.nproc is not None else _default_nproc()
    if launched is not None:
        if args.nproc is not None and args.nproc != int(launched["WORLD_SIZE"]):
            raise UsageError(f"--nproc {args.nproc} is not allowed under a launcher that started "
                             f"WORLD_SIZE={launched['WORLD_SIZE']} processes; leave --nproc out")
        nproc = int(launched["WORLD_SIZE"])
    if nproc < 1:
        raise UsageError(f"--nproc {nproc} is not allowed; expected a positive number of processes")
    mdist.validate_degrees(nproc, dp=None, tp=profile.parallel.tp, pp=profile.parallel.pp)  # before any launch
    seq_len = args.seq_len if args.seq_len is not None else min(GPT_SIZES[args.size].block_size, 128)
    train = TrainConfig(
        steps=args.steps, micro_batches=args.micro_batches, batch_size=args.batch_size, seq_len=seq_len,
        log_every=args.log_every or max(1, args.steps // 10), grad_clip=1.0, progress=not args.no_progress,
        progress_every_s=args.progress_every, seed=args.seed, track_memory=not args.no_track,
        ckpt_dir=args.ckpt_dir, save_every=args.save_every, keep_last=args.keep_last, resume=args.resume,
    )
    est = _demo_estimate(profile, args.size, train, nproc)
    return DemoOptions(profile=profile, size=args.size, train=train, estimate=est.to_report_dict()), nproc


def new_run_dir(parent: Path, profile: str) -> Path:
    """A new folder ``parent/<profile>-<YYYYmmdd-HHMMSS>`` for one run's report, created here; a second run in
    the same second (or a concurrent one) gets ``-2``, ``-3``... since creating it is what claims the name."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = f"{re.sub(r'[^A-Za-z0-9._+-]+', '_', profile) or 'profile'}-{stamp}"
    parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        path = parent / (base if n == 1 else f"{base}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise UsageError(f"--report-dir {str(parent)!r}: 9999 runs of {profile!r} in one second; clean the folder")


def _demo_estimate(profile: Profile, size: str, train: TrainConfig, nproc: int) -> Estimate:
    """What ``memsave.estimate`` predicts for the demo's model and batch (meta device: nothing allocated)."""
    gpt_cfg = gpt_config(size)
    if train.seq_len > gpt_cfg.block_size:
        gpt_cfg = dataclasses.replace(gpt_cfg, block_size=train.seq_len)
    with torch.device("meta"):
        model = GPT(gpt_cfg)
    batch = TokenBatches(seq_len=train.seq_len, batch_size=train.batch_size, seed=train.seed).batch(0)
    return estimate(model, profile, world_size=nproc, batch=batch, device="cuda" if torch.cuda.is_available() else "cpu",
                    micro_batches=train.micro_batches)


def _demo_memory_note(extra: Sequence[str], opts: DemoOptions, nproc: int) -> str:
    """What to run after a rank ran out of memory: this run's estimate, and the command that compares profiles."""
    peak = (opts.estimate or {}).get("peak_total")
    command = " ".join(["memsave estimate", f"--model gpt:{opts.size}", f"--world-size {nproc}",
                        f"--batch-size {opts.train.batch_size}", f"--seq-len {opts.train.seq_len}", *extra])
    said = (f"memsave estimate predicted {peak / 2**20:,.1f} MiB of tensors per rank for this run (profile "
            f"{opts.profile.name}); " if peak else "")
    return f"{said}compare every preset with `{command}` and pick one that fits, or lower --batch-size"


def _run_demo(args: argparse.Namespace, extra: Sequence[str]) -> int:
    # torchrun / accelerate started this process as one rank (a MASTER_ADDR left in a shell's environment is not
    # a launch: the local launcher sets its own)
    launched = mdist.launch_env() if {"RANK", "WORLD_SIZE"} <= os.environ.keys() else None
    opts, nproc = _demo_options(args, extra, launched)
    # the report folder is made by the process that writes it: the local launcher, or the launcher's global rank 0
    # (not every node's local rank 0)
    writes = launched is None or launched["RANK"] == "0"
    run_dir = new_run_dir(Path(args.report_dir), opts.profile.name) if args.report_dir and writes else None
    if run_dir is not None:
        opts = dataclasses.replace(opts, train=dataclasses.replace(opts.train, report_dir=str(run_dir)))
    start = time.perf_counter()
    try:
        if launched is None:
            r0 = spawn_local(_demo_worker, nproc, (opts,), timeout_s=args.timeout)[0]
        else:
            r0 = _demo_launched(opts)
    except BaseException as exc:
        if run_dir is not None and not any(run_dir.iterdir()):
            run_dir.rmdir()  # a failed run leaves no empty folder behind
        if isinstance(exc, LaunchError) and exc.out_of_memory:
            raise exc.with_note(_demo_memory_note(extra, opts, nproc)) from None
        raise
    wall = time.perf_counter() - start
    if r0 is None:  # a launcher's rank other than 0: rank 0 prints
        return 0
    rep = r0["report"]
    print()
    print(rep.to_text())
    if args.report_json is not None:
        args.report_json.parent.mkdir(parents=True, exist_ok=True)
        args.report_json.write_text(rep.to_json() + "\n")
        print(f"memory report written to {args.report_json}")
    if run_dir is not None:
        print(f"memory report (JSON, and a page with the timeline: open it in a browser) written to "
              f"{run_dir / 'report.json'} and {run_dir / 'report.html'}")
        print(f"report directory of this run: {run_dir}")
    losses = r0["losses"]
    if not losses:  # --resume of a run that already reached --steps
        print(f"\nnothing to train: the checkpoint is at --steps {opts.train.steps} already", flush=True)
        return 0
    print(f"\nloss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps (val loss {r0['eval_loss']:.4f}); "
          f"{r0['tokens_per_s']:,.0f} tokens/s over {nproc} process{'es' if nproc > 1 else ''}; training {r0['train_s']:.1f} s, "
          f"wall {wall:.1f} s", flush=True)
    return 0


# -- memsave profiles ----------------------------------------------------------------------------------------
def _add_profiles(sub: Any) -> None:
    sub.add_parser("profiles", help="list the preset profiles", description="List the preset profiles.")


def _run_profiles(args: argparse.Namespace, extra: Sequence[str]) -> int:
    if extra:
        raise UsageError(f"unrecognized arguments: {' '.join(extra)}")
    names = list_presets()
    width = max(len(n) for n in names)
    for name in names:
        print(f"{name.ljust(width)}  {load_profile(name).description}")
    return 0


# -- memsave report ------------------------------------------------------------------------------------------
def _add_report(sub: Any) -> None:
    p = sub.add_parser(
        "report", help="print saved memory reports and render them as one HTML page",
        description="Load memory report JSON files (memsave.report/2, or /1 converted), validate them, print "
        "each as a text table and, with --html, write one self-contained page (timelines, tables and, for "
        "several files, a comparison of their peaks).",
    )
    p.add_argument("files", nargs="+", type=Path, metavar="FILE", help="report JSON files")
    p.add_argument("--html", type=Path, default=None, metavar="OUT.html", help="write the HTML page here")
    p.add_argument("--json", type=Path, default=None, metavar="OUT.json",
                   help="write the (validated, v2) report here; one FILE only")
    p.add_argument("--text", action="store_true", help="print the text tables (the default without --html/--json)")
    p.add_argument("--title", default="memsave memory report", help="title of the HTML page")


def _run_report(args: argparse.Namespace, extra: Sequence[str]) -> int:
    from memsave.memory.html import write_html
    from memsave.memory.schema import format_text, load_report, save_report

    if extra:
        raise UsageError(f"unrecognized arguments: {' '.join(extra)}")
    if args.json is not None and len(args.files) != 1:
        raise UsageError(f"--json writes one report; {len(args.files)} files were given")
    for f in args.files:
        if not f.is_file():
            raise UsageError(f"{f}: no such file")
    reports = [load_report(f) for f in args.files]  # ValueError names the file and the field
    if args.text or (args.html is None and args.json is None):
        print("\n\n".join(format_text(r) for r in reports))
    if args.json is not None:
        save_report(reports[0], args.json)
        print(f"memory report written to {args.json}")
    if args.html is not None:
        write_html(reports, args.html, title=args.title)
        print(f"HTML report ({len(reports)} run{'s' if len(reports) > 1 else ''}) written to {args.html}")
    return 0


Command = tuple[str, Callable[[Any], None], Callable[[argparse.Namespace, Sequence[str]], int]]
_COMMANDS: list[Command] = [
    ("demo", _add_demo, _run_demo),
    ("bench", bench.add_parser, bench.run_command),
    ("profiles", _add_profiles, _run_profiles),
    ("report", _add_report, _run_report),
    ("estimate", cli_estimate.add_parser, cli_estimate.run_command),
    ("export", cli_export.add_parser, cli_export.run_command),
    ("plan", cli_plan.add_parser, cli_plan.run_command),
    ("calibrate", cli_plan.add_calibrate_parser, cli_plan.run_calibrate),
]


def build_parser() -> argparse.ArgumentParser:
    from memsave import __version__

    parser = Parser(prog="memsave", description="Train PyTorch models that do not fit.")
    parser.add_argument("--version", action="version", version=f"memsave {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for _name, add, _run in _COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``memsave`` console script; returns the exit code."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except ArgumentError as exc:
        print(f"{exc.prog}: error: {exc} (see {exc.prog} --help)", file=sys.stderr)
        return 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    run = {name: run for name, _, run in _COMMANDS}[args.command]
    try:
        return run(args, extra)
    except (UsageError, ValueError, NotImplementedError) as exc:
        print(f"memsave {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except LaunchError as exc:
        if exc.exc_type in _USER_ERRORS:
            print(f"memsave {args.command}: error: {exc.message}", file=sys.stderr)
            return 2
        print(f"memsave {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM during a launch (LaunchInterrupted): all stopped by now
        signum = getattr(exc, "signum", signal.SIGINT)
        how = "interrupted" if signum == signal.SIGINT else f"terminated by {signal.Signals(signum).name}"
        print(f"memsave {args.command}: {how}", file=sys.stderr)
        return 128 + int(signum)


if __name__ == "__main__":
    sys.exit(main())
