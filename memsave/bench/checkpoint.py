"""``memsave bench --checkpoint``: ``memsave.save`` / ``memsave.load`` against the disk and against torch DCP's own
checkpointing of FSDP2, on the reference GPT (default ``--size medium``: 4.9M parameters, fp32 AdamW, 59 MB of
model and optimizer state), ``--nproc`` gloo ranks.

The configurations are memsave profiles (``zero3``, ``ddp``, ...: :func:`memsave.wrap`) and ``fsdp2-dcp``
(FSDP2 with ``get_state_dict`` + ``dcp.save`` / ``dcp.load``; memsave/dist/baselines_ckpt.py). Timing runs every
configuration side by side in one group of ``--nproc`` fresh processes, their operations interleaved round by
round in a rotated order (a shared machine's drift falls on all alike), each from a barrier:

1. throughput: ``--repeat`` saves per configuration, each into a new directory, each beside a plain write of the
   bytes the rank wrote ([Note: fair disk baseline] in ckpt_io.py: ``fsync`` on both sides, the same directory;
   an untimed first save sizes it); then as many loads of the last save, each beside a plain read of the bytes
   the rank holds, the page cache dropped for both first. MiB/s per rank: those bytes over its median seconds;
2. async (memsave only): ``--repeat`` rounds of a normal step, the step that ends by issuing ``memsave.save(...,
   async_=True)`` (staging included), ``OVERLAP`` steps while it writes in the background, then ``wait``.

Memory: each configuration alone in its own group (as its users run it): the peak RSS (ckpt_io.PeakRss: the
kernel's high-water mark, reset per phase) over the training steps, over a synchronous save, and from issuing an
async save to its ``wait`` (the steps it overlaps included).

Beside them, the checkpoint's tensor bytes (DCP's metadata) against the formula: fp32 AdamW keeps
``4 + 4 + 4`` bytes per parameter (the parameter, ``exp_avg``, ``exp_avg_sq``) and one fp32 ``step`` per
parameter tensor (:func:`state_formula_bytes`).
"""

from __future__ import annotations

import math
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
from memsave.bench.ckpt_io import (
    PeakRss,
    evict,
    files_bytes,
    plain_read,
    plain_write,
    random_bytes,
    rank_files,
)
from memsave.bench.ckpt_report import format_checkpoint_tables
from memsave.bench.common import BenchOptions, run_each, show_results, split_names
from memsave.checkpoint import load, save
from memsave.checkpoint import wait as wait_async
from memsave.config import load_profile
from memsave.dist.dcp import read_metadata, tensor_keys
from memsave.memory import account
from memsave.models import GPT, TokenBatches
from memsave.phases import MemoryCategory

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
    """The tensor bytes of a DCP checkpoint, from its metadata: every tensor's global shape and dtype."""
    return sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size()
               for shape, dtype in tensor_keys(read_metadata(path)).values())


class _Run:
    """One configuration on this rank: the model, its optimizer, a training step, and its save / load."""

    def __init__(self, name: str, opts: BenchOptions, mesh: mdist.Mesh) -> None:
        self.name, self.opts, self.mesh = name, opts, mesh
        self.baseline = name == BASELINE
        torch.manual_seed(opts.seed)
        model = GPT(opts.model_config())
        if self.baseline:
            from memsave.dist import baselines, baselines_ckpt  # here: [Note: baselines import cost]

            self.tt = baselines_ckpt
            self.model, self.opt, _ = baselines.build_baseline(
                "fsdp2", model, lambda ps: torch.optim.AdamW(ps, lr=opts.lr, weight_decay=0.1), list(model.blocks))
            self.backward = lambda loss: loss.backward()
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=0.1)
            self.model, self.opt = wrap(model, opt, name, mesh=mesh)
            self.backward = self.opt.backward
        self.data = TokenBatches(seq_len=opts.seq_len, batch_size=opts.batch_size, dp_rank=mesh.dp_rank,
                                 dp_size=mesh.dp_size, seed=opts.seed)
        self.i = 0

    def step(self, then: Any = None) -> float:
        """One training step from a barrier (and ``then()`` at its end, inside the clock); its seconds."""
        batch = self.data.batch(self.i)
        self.i += 1
        mdist.barrier()
        t0 = time.perf_counter()
        self.backward(self.model(**batch).loss)
        self.opt.step()
        self.opt.zero_grad()
        if then is not None:
            then()
        return time.perf_counter() - t0

    def save(self, path: Path) -> tuple[float, float]:
        """Save into ``path`` from a barrier: (seconds, this process's CPU seconds)."""
        mdist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        if self.baseline:
            self.tt.dcp_save(path, self.model, self.opt)
        else:
            save(path, self.model, self.opt)
        return time.perf_counter() - t0, time.process_time() - c0

    def load(self, path: Path) -> tuple[float, float]:
        """Load ``path`` from a barrier: (seconds, this process's CPU seconds)."""
        mdist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        if self.baseline:
            self.tt.dcp_load(path, self.model, self.opt)
        else:
            load(path, self.model, self.opt)
        return time.perf_counter() - t0, time.process_time() - c0

    def held_bytes(self) -> int:
        """The model and optimizer state this rank holds (what a load fills: no gradients, nothing gathered)."""
        if self.baseline:
            return int(self.tt.local_state_bytes(self.model, self.opt))
        held = account([self.model, self.opt]).bytes
        return sum(held.get(c.value, 0) for c in (MemoryCategory.PARAMS, MemoryCategory.BUFFERS,
                                                  MemoryCategory.MASTER, MemoryCategory.OPTIMIZER_STATE))

    def async_round(self, path: Path, rec: dict[str, Any]) -> None:
        """A normal step, the step that ends by issuing ``save(path, async_=True)``, ``OVERLAP`` steps while it
        writes, then its ``wait``; into ``rec``."""
        rec["normal_s"].append(self.step())
        handle: list[Any] = []
        rec["issue_s"].append(self.step(lambda: handle.append(save(path, self.model, self.opt, async_=True))))
        rec["during_s"] += [self.step() for _ in range(OVERLAP)]
        handle[0].wait()
        rec["staged_bytes"] = handle[0].staged_bytes
        rec["stage_s"].append(handle[0].stage_s)
        rec["write_s"].append(handle[0].write_s)


def _rotated(items: list[Any], k: int) -> list[Any]:
    return items[k % len(items):] + items[: k % len(items)]


def _timing_worker(names: list[str], opts: BenchOptions, root: str, repeat: int) -> dict[str, Any]:
    """Every configuration side by side on this rank, their saves, loads and async rounds interleaved (each
    round in a rotated order, the plain write / read beside each) so that a shared machine's drift falls on all
    alike. The host allocator's trim is off for all (it is process-wide)."""
    mesh = mdist.init(host_trim=False)
    rank = mesh.rank
    runs = [_Run(n, opts, mesh) for n in names]
    out: dict[str, dict[str, Any]] = {}
    for run in runs:
        for _ in range(opts.warmup):
            run.step()
        where = Path(root) / run.name
        where.mkdir(parents=True, exist_ok=True)
        run.save(where / "warm")  # untimed: its bytes size the plain write
        mine = rank_files(where / "warm", rank, memsave=not run.baseline)
        o = out[run.name] = {"rank": rank, "save_bytes": files_bytes(mine), "save_files": [f.name for f in mine],
                             "load_bytes": run.held_bytes(), "save_s": [], "save_cpu_s": [], "plain_write_s": [],
                             "load_s": [], "load_cpu_s": [], "plain_read_s": []}
        if rank == 0:
            o["payload_bytes"] = payload_bytes(where / "warm")
        plain_write(where / f"read.rank{rank}", random_bytes(o["load_bytes"]))
    items = [(run, op) for run in runs for op in ("ckpt", "plain")]
    for k in range(repeat):  # 1. saves and plain writes of the same bytes
        for run, op in _rotated(items, k):
            o, where = out[run.name], Path(root) / run.name
            if op == "plain":
                data = random_bytes(o["save_bytes"])
                mdist.barrier()
                o["plain_write_s"].append(plain_write(where / f"plain{k}.rank{rank}", data))
            else:
                wall, cpu = run.save(where / f"save{k}")
                o["save_s"].append(wall)
                o["save_cpu_s"].append(cpu)
    for k in range(repeat):  # 2. loads of the last save and plain reads of the bytes the rank holds, cold
        for run, op in _rotated(items, k):
            o, where = out[run.name], Path(root) / run.name
            read_file = where / f"read.rank{rank}"
            evict([where / f"save{repeat - 1}", read_file])
            mdist.barrier()
            if op == "plain":
                into = bytearray(o["load_bytes"])
                o["plain_read_s"].append(plain_read(read_file, into))
            else:
                wall, cpu = run.load(where / f"save{repeat - 1}")
                o["load_s"].append(wall)
                o["load_cpu_s"].append(cpu)
    async_runs = [run for run in runs if not run.baseline]
    for run in async_runs:
        out[run.name]["async"] = {"normal_s": [], "issue_s": [], "during_s": [], "staged_bytes": 0, "stage_s": [],
                                  "write_s": []}
    for k in range(repeat):  # 3. async rounds
        for run in _rotated(async_runs, k) if async_runs else []:
            run.async_round(Path(root) / run.name / f"async{k}", out[run.name]["async"])
    wait_async()
    mdist.barrier()
    return out


def _memory_worker(name: str, opts: BenchOptions, root: str) -> dict[str, Any]:
    """One configuration alone in its processes, as its users run it (memsave's host-allocator policy on for a
    memsave profile): peak RSS over the training steps, over a synchronous save, and from issuing an async save
    to its wait."""
    mesh = mdist.init(host_trim=name != BASELINE)
    run = _Run(name, opts, mesh)
    where = Path(root) / f"memory-{name}"
    where.mkdir(parents=True, exist_ok=True)
    peak = PeakRss()
    for _ in range(opts.warmup):
        run.step()
    peak.reset()
    for _ in range(opts.steps - opts.warmup):
        run.step()
    out = {"rank": mesh.rank, "peak_exact": peak.exact, "train_peak": peak.read()}
    peak.reset()
    run.save(where / "sync")
    out["save_peak"] = peak.read()
    if not run.baseline:
        peak.reset()
        run.async_round(where / "async", {"normal_s": [], "issue_s": [], "during_s": [], "stage_s": [],
                                          "write_s": []})
        out["async_peak"] = peak.read()
    peak.close()
    mdist.barrier()
    return out


def _row(name: str, timing: list[dict[str, Any]], memory: list[dict[str, Any]], formula: int) -> dict[str, Any]:
    med = statistics.median
    ranks = [t[name] for t in timing]
    row: dict[str, Any] = {"name": name, "kind": "baseline" if name == BASELINE else "memsave",
                           "formula_bytes": formula, "payload_bytes": ranks[0]["payload_bytes"],
                           "peak_exact": all(m["peak_exact"] for m in memory), "ranks": ranks, "memory_ranks": memory}
    for op, plain in (("save", "plain_write"), ("load", "plain_read")):
        row[op] = {"bytes": [r[f"{op}_bytes"] for r in ranks],
                   "s": [med(r[f"{op}_s"]) for r in ranks], "cpu_s": [med(r[f"{op}_cpu_s"]) for r in ranks],
                   "mibps": [r[f"{op}_bytes"] / med(r[f"{op}_s"]) / 2**20 for r in ranks],
                   "plain_mibps": [r[f"{op}_bytes"] / med(r[f"{plain}_s"]) / 2**20 for r in ranks]}
        row[op]["x_plain"] = min(a / b for a, b in zip(row[op]["mibps"], row[op]["plain_mibps"]))
    row["memory"] = {"train_peak": [m["train_peak"] for m in memory], "save_peak": [m["save_peak"] for m in memory],
                     "x_save": max(m["save_peak"] / m["train_peak"] for m in memory)}
    if "async" in ranks[0]:
        steps = {k: [max(r["async"][k][i] for r in ranks) for i in range(len(ranks[0]["async"][k]))]
                 for k in ("normal_s", "issue_s", "during_s")}  # each step: its slowest rank
        a = {k: med(v) for k, v in steps.items()}
        row["async"] = {**a, "x_issue": a["issue_s"] / a["normal_s"], "x_during": a["during_s"] / a["normal_s"],
                        "staged_bytes": [r["async"]["staged_bytes"] for r in ranks],
                        "stage_s": max(med(r["async"]["stage_s"]) for r in ranks),
                        "write_s": max(med(r["async"]["write_s"]) for r in ranks), "steps": steps}
        row["memory"]["async_peak"] = [m["async_peak"] for m in memory]
        row["memory"]["x_async"] = max(m["async_peak"] / m["train_peak"] for m in memory)
    return row


def summarize(rows: list[dict[str, Any]]) -> None:
    """Each row's throughput against the DCP baseline's (its slowest rank's MiB/s over the baseline's), if run."""
    base = next((r for r in rows if r["name"] == BASELINE), None)
    for r in rows:
        for op in ("save", "load"):
            r[op]["x_dcp"] = min(r[op]["mibps"]) / min(base[op]["mibps"]) if base is not None else None


def run_checkpoint_bench(opts: BenchOptions, names: list[str] | None = None, *, directory: str | Path | None = None,
                         repeat: int = 5, timeout_s: float = 900) -> list[dict[str, Any]]:
    """Every configuration of ``names`` (memsave profiles and ``fsdp2-dcp``) in its own group of ``opts.nproc``
    fresh processes, checkpointing into a new temporary directory under ``directory`` (default: the OS temp
    directory), removed at the end; one row each."""
    names = list(names or DEFAULT_CONFIGS)
    for n in names:
        if n == BASELINE:
            continue
        try:
            prof = load_profile(n)
        except ValueError as exc:
            raise ValueError(f"memsave bench --checkpoint: configuration {n!r} is neither {BASELINE!r} nor a "
                             f"profile ({exc})") from None
        if prof.offload.params != "none":
            raise NotImplementedError(f"memsave bench --checkpoint: profile {n!r} has [offload] params="
                                      f"{prof.offload.params!r}, which memsave.save does not checkpoint yet")
        if prof.parallel.tp > 1 or prof.parallel.pp > 1:
            raise NotImplementedError(f"memsave bench --checkpoint: profile {n!r} has tp={prof.parallel.tp}, "
                                      f"pp={prof.parallel.pp}; the bench runs data parallelism only (tp = pp = 1)")
    if len(set(names)) != len(names):
        raise ValueError(f"memsave bench --checkpoint: configurations {names} name one twice")
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
        timing = spawn_local(_timing_worker, opts.nproc, (names, opts, str(root), repeat), timeout_s=timeout_s)
        rows = run_each(names, lambda n: _row(n, timing, spawn_local(_memory_worker, opts.nproc, (n, opts, str(root)),
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
