"""``memsave bench --checkpoint``: ``memsave.save`` / ``memsave.load`` against the disk and against torch DCP's own
checkpointing of FSDP2, on the reference GPT (default ``--size medium``: 4.9M parameters, fp32 AdamW, 59 MB of
model and optimizer state), ``--nproc`` gloo ranks.

Each configuration runs in its own group of fresh processes (its memory figures are its own): a memsave profile
(``zero3``, ``ddp``, ...) wrapped with :func:`memsave.wrap`, or ``fsdp2-dcp`` (FSDP2 with
``get_state_dict`` + ``dcp.save`` / ``dcp.load``; memsave/dist/baselines_ckpt.py). On each rank, after
``--warmup`` untimed steps (so the optimizer holds its state) and the timed training steps:

1. throughput: ``--repeat`` saves, each to a new directory, interleaved with a plain write of the same bytes as
   the rank wrote ([Note: fair disk baseline] in ckpt_io.py: ``fsync`` on both sides, the same directory); then
   as many loads of the last one interleaved with a plain read of the bytes the rank holds, the page cache
   dropped first. An untimed first save warms both up. MiB/s per rank: the bytes that rank wrote (or holds, for
   a load) over its median seconds;
2. async (memsave only): ``--repeat`` rounds of a normal step, the step that ends with ``memsave.save(...,
   async_=True)`` (staging included) and ``OVERLAP`` steps while it writes in the background, then ``wait``;
   each step starts at a barrier;
3. peak RSS: the high-water mark (exact, reset per phase: ckpt_io.PeakRss) over the training steps, over each
   synchronous save, and from issuing an async save to its ``wait`` (the steps it overlaps included).

Beside them, the checkpoint's tensor bytes (DCP's metadata) against the formula: fp32 AdamW keeps
``4 + 4 + 4`` bytes per parameter (the parameter, ``exp_avg``, ``exp_avg_sq``) and one fp32 ``step`` per
parameter tensor (:func:`state_formula_bytes`).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from memsave import dist as mdist
from memsave._launch import spawn_local
from memsave.api import wrap
from memsave.bench.ckpt_io import PeakRss, evict, files_bytes, plain_read, plain_write, random_bytes, rank_files
from memsave.bench.ckpt_report import format_checkpoint_tables
from memsave.bench.common import BenchOptions, run_each, show_results, split_names
from memsave.checkpoint import load, save
from memsave.checkpoint import wait as wait_async
from memsave.dist.dcp import read_metadata
from memsave.memory import account
from memsave.models import GPT, TokenBatches

__all__ = ["BASELINE", "DEFAULT_CONFIGS", "OVERLAP", "run_checkpoint_bench", "run_command", "state_formula_bytes",
           "summarize"]

BASELINE = "fsdp2-dcp"
DEFAULT_CONFIGS = ("zero3", "ddp", BASELINE)
DEFAULT_SIZE = "medium"
OVERLAP = 2  # steps timed while an async save writes in the background


def state_formula_bytes(model: torch.nn.Module) -> int:
    """fp32 AdamW's checkpoint tensors: 12 bytes per parameter (the parameter, ``exp_avg``, ``exp_avg_sq``), a
    4-byte ``step`` per parameter tensor, the persistent buffers; a tied parameter once."""
    buffers = sum(b.numel() * b.element_size() for m in model.modules() for n, b in m.named_buffers(recurse=False)
                  if n not in m._non_persistent_buffers_set)
    return sum(12 * p.numel() + 4 for p in model.parameters()) + buffers  # (a shared parameter once)


def payload_bytes(path: Path) -> int:
    """The tensor bytes of a DCP checkpoint, from its metadata (every saved chunk once)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    total = 0
    for md in read_metadata(path).state_dict_metadata.values():
        if isinstance(md, TensorStorageMetadata):
            item = torch.empty((), dtype=md.properties.dtype).element_size()
            total += sum(item * int(torch.Size(c.sizes).numel()) for c in md.chunks)
    return total


class _Run:
    """One configuration on this rank: the model, its optimizer, a training step, and its save / load."""

    def __init__(self, name: str, opts: BenchOptions) -> None:
        self.name, self.opts = name, opts
        self.baseline = name == BASELINE
        self.mesh = mdist.init(host_trim=not self.baseline)
        torch.manual_seed(opts.seed)
        model = GPT(opts.model_config())
        opt = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=0.1)
        if self.baseline:
            from memsave.dist import baselines, baselines_ckpt  # here: [Note: baselines import cost]

            self.tt = baselines_ckpt
            self.model, self.opt, _ = baselines.build_baseline(
                "fsdp2", model, lambda ps: torch.optim.AdamW(ps, lr=opts.lr, weight_decay=0.1), list(model.blocks))
            self.backward = lambda loss: loss.backward()
        else:
            self.model, self.opt = wrap(model, opt, name, mesh=self.mesh)
            self.backward = self.opt.backward
        self.data = TokenBatches(seq_len=opts.seq_len, batch_size=opts.batch_size, dp_rank=self.mesh.dp_rank,
                                 dp_size=self.mesh.dp_size, seed=opts.seed)
        self.i = 0

    def step(self) -> float:
        """One training step, from a barrier; its seconds."""
        batch = self.data.batch(self.i)
        self.i += 1
        mdist.barrier()
        t0 = time.perf_counter()
        self.backward(self.model(**batch).loss)
        self.opt.step()
        self.opt.zero_grad()
        return time.perf_counter() - t0

    def save(self, path: Path) -> float:
        mdist.barrier()
        t0 = time.perf_counter()
        if self.baseline:
            self.tt.dcp_save(path, self.model, self.opt)
        else:
            save(path, self.model, self.opt)
        return time.perf_counter() - t0

    def load(self, path: Path) -> float:
        mdist.barrier()
        t0 = time.perf_counter()
        if self.baseline:
            self.tt.dcp_load(path, self.model, self.opt)
        else:
            load(path, self.model, self.opt)
        return time.perf_counter() - t0

    def held_bytes(self) -> int:
        """The model and optimizer state this rank holds (what a load fills)."""
        if self.baseline:
            return int(self.tt.local_state_bytes(self.model, self.opt))
        return account([self.model, self.opt]).model_state()


def _worker(name: str, opts: BenchOptions, root: str, repeat: int) -> dict[str, Any]:
    run = _Run(name, opts)
    rank = run.mesh.rank
    where = Path(root) / name
    where.mkdir(parents=True, exist_ok=True)
    peak = PeakRss()
    out: dict[str, Any] = {"rank": rank, "peak_exact": peak.exact}
    for _ in range(opts.warmup):
        run.step()
    peak.reset()
    out["train_step_s"] = [run.step() for _ in range(opts.steps - opts.warmup)]
    out["train_peak"] = peak.read()

    # 1. save: an untimed first save (its bytes size the plain write), then saves and plain writes interleaved
    first = where / "warm"
    run.save(first)
    mine = rank_files(first, rank, memsave=not run.baseline)
    out["save_bytes"] = files_bytes(mine)
    out["save_files"] = [f.name for f in mine]
    if rank == 0:
        out["payload_bytes"] = payload_bytes(first)
    data = random_bytes(out["save_bytes"])
    out["save_s"], out["plain_write_s"], out["save_peak"] = [], [], 0
    for k in range(repeat):
        for op in (("plain", "ckpt") if k % 2 == 0 else ("ckpt", "plain")):
            if op == "plain":
                mdist.barrier()
                out["plain_write_s"].append(plain_write(where / f"plain{k}.rank{rank}", data))
            else:
                peak.reset()
                out["save_s"].append(run.save(where / f"save{k}"))
                out["save_peak"] = max(out["save_peak"], peak.read())
    del data
    # 2. load the last save (what the model holds now), interleaved with plain reads of the bytes the rank holds
    last = where / f"save{repeat - 1}"
    out["load_bytes"] = run.held_bytes()
    read_file = where / f"read.rank{rank}"
    plain_write(read_file, random_bytes(out["load_bytes"]))
    into = bytearray(out["load_bytes"])
    out["load_s"], out["plain_read_s"] = [], []
    for k in range(repeat):
        for op in (("ckpt", "plain") if k % 2 == 0 else ("plain", "ckpt")):
            evict([last, read_file])
            mdist.barrier()
            if op == "plain":
                out["plain_read_s"].append(plain_read(read_file, into))
            else:
                out["load_s"].append(run.load(last))
    del into
    # 3. async saves: a normal step, the step that issues the save, steps while it writes
    if not run.baseline:
        out["async"] = _async_rounds(run, where, repeat, peak)
    peak.close()
    mdist.barrier()
    return out


def _async_rounds(run: _Run, where: Path, repeat: int, peak: PeakRss) -> dict[str, Any]:
    res: dict[str, Any] = {"normal_s": [], "issue_s": [], "during_s": [], "staged_bytes": 0, "stage_s": [],
                           "write_s": [], "peak": 0}
    for k in range(repeat):
        res["normal_s"].append(run.step())
        peak.reset()
        batch = run.data.batch(run.i)
        run.i += 1
        mdist.barrier()
        t0 = time.perf_counter()
        run.backward(run.model(**batch).loss)
        run.opt.step()
        run.opt.zero_grad()
        handle = save(where / f"async{k}", run.model, run.opt, async_=True)
        res["issue_s"].append(time.perf_counter() - t0)
        res["during_s"] += [run.step() for _ in range(OVERLAP)]
        handle.wait()
        res["peak"] = max(res["peak"], peak.read())
        res["staged_bytes"] = handle.staged_bytes
        res["stage_s"].append(handle.stage_s)
        res["write_s"].append(handle.write_s)
    wait_async()
    return res


def _row(name: str, ranks: list[dict[str, Any]], formula: int) -> dict[str, Any]:
    med = statistics.median
    row: dict[str, Any] = {"name": name, "kind": "baseline" if name == BASELINE else "memsave",
                           "formula_bytes": formula, "payload_bytes": ranks[0]["payload_bytes"],
                           "peak_exact": all(r["peak_exact"] for r in ranks), "ranks": ranks}
    for op, plain in (("save", "plain_write"), ("load", "plain_read")):
        row[op] = {"bytes": [r[f"{op}_bytes"] for r in ranks],
                   "s": [med(r[f"{op}_s"]) for r in ranks],
                   "mibps": [r[f"{op}_bytes"] / med(r[f"{op}_s"]) / 2**20 for r in ranks],
                   "plain_mibps": [r[f"{op}_bytes"] / med(r[f"{plain}_s"]) / 2**20 for r in ranks]}
        row[op]["x_plain"] = min(a / b for a, b in zip(row[op]["mibps"], row[op]["plain_mibps"]))
    train_peak = [r["train_peak"] for r in ranks]
    row["memory"] = {"train_peak": train_peak, "save_peak": [r["save_peak"] for r in ranks],
                     "x_save": max(r["save_peak"] / r["train_peak"] for r in ranks)}
    if "async" in ranks[0]:
        steps = {k: [max(r["async"][k][i] for r in ranks) for i in range(len(ranks[0]["async"][k]))]
                 for k in ("normal_s", "issue_s", "during_s")}  # each step: its slowest rank
        a = {k: med(v) for k, v in steps.items()}
        row["async"] = {**a, "x_issue": a["issue_s"] / a["normal_s"], "x_during": a["during_s"] / a["normal_s"],
                        "staged_bytes": [r["async"]["staged_bytes"] for r in ranks],
                        "stage_s": max(med(r["async"]["stage_s"]) for r in ranks),
                        "write_s": max(med(r["async"]["write_s"]) for r in ranks), "steps": steps}
        row["memory"]["async_peak"] = [r["async"]["peak"] for r in ranks]
        row["memory"]["x_async"] = max(r["async"]["peak"] / r["train_peak"] for r in ranks)
    return row


def summarize(rows: list[dict[str, Any]]) -> None:
    """Each row's throughput against the DCP baseline's (its slowest rank's MiB/s over the baseline's), if run."""
    base = next((r for r in rows if r["name"] == BASELINE), None)
    for r in rows:
        for op in ("save", "load"):
            r[op]["x_dcp"] = min(r[op]["mibps"]) / min(base[op]["mibps"]) if base is not None else None


def run_checkpoint_bench(opts: BenchOptions, names: list[str] | None = None, *, directory: str | Path | None = None,
                         repeat: int = 3, timeout_s: float = 900) -> list[dict[str, Any]]:
    """Every configuration of ``names`` (memsave profiles and ``fsdp2-dcp``) in its own group of ``opts.nproc``
    fresh processes, checkpointing into a new temporary directory under ``directory`` (default: the OS temp
    directory), removed at the end; one row each."""
    names = list(names or DEFAULT_CONFIGS)
    if not names:
        raise ValueError("memsave bench --checkpoint: no configuration; expected profiles and/or " + BASELINE)
    if repeat < 1:
        raise ValueError(f"memsave bench --checkpoint: repeat={repeat} is not allowed; expected >= 1")
    if opts.warmup < 1:
        raise ValueError(f"memsave bench --checkpoint: warmup={opts.warmup} is not allowed; expected >= 1 (the "
                         "optimizer state exists after the first step)")
    if directory is not None and not Path(directory).is_dir():
        raise ValueError(f"memsave bench --checkpoint: dir={str(directory)!r} is not an existing directory")
    with torch.device("meta"):
        formula = state_formula_bytes(GPT(opts.model_config()))
    root = Path(tempfile.mkdtemp(prefix="memsave-ckbench-", dir=directory))
    try:
        rows = run_each(names, lambda n: _row(n, spawn_local(_worker, opts.nproc, (n, opts, str(root), repeat),
                                                             timeout_s=timeout_s), formula), summarize)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def run_command(configs: str | None, opts: BenchOptions, json_path: Path | None, directory: str | None,
                repeat: int) -> int:
    names = split_names(configs) if configs else list(DEFAULT_CONFIGS)
    return show_results(lambda: run_checkpoint_bench(opts, names, directory=directory, repeat=repeat),
                        lambda rows: print(format_checkpoint_tables(rows, opts)), json_path, opts,
                        schema="memsave.bench-checkpoint/1")
