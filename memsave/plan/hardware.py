"""The machine the planner prices a configuration on: measured here by ``memsave calibrate``, or given.

:func:`calibrate` measures this machine once, a second or so per term, and caches the result
(``$MEMSAVE_CACHE_DIR`` or ``~/.cache/memsave``, one file per host, device and torch version):
- matrix-multiply FLOP/s in fp32 and bf16 on the device trained on (on CPU, of one thread: memsave runs one rank
  per core);
- device memory bandwidth (a large copy), which prices the optimizer step;
- host-device bandwidth (pinned copies; on CPU, the memory bandwidth);
- disk write and read bandwidth (a file written with ``fsync``) in the offload folder;
- the collective bus bandwidth of two local ranks (an all-reduce), the data-parallel and tensor-parallel
  link when every rank is on this machine, and each collective kind's latency and bandwidth (all-reduce,
  reduce-scatter, all-gather, a pipeline send): the mean of calls back to back at 16 KiB and 4 MiB;
- a plain AdamW step: the bytes of parameters, gradients and state it goes through per second (``step_bw``);
- a reference GPT's forward and backward: the share of the matmul rate a training step reaches per compute
  dtype (``efficiencies``), the host's fixed cost per layer and micro-batch (``layer_overhead``) and what each
  recomputation policy adds to it (``recompute_overhead``); behind a GPU, the rate of memsave's own host step
  of an offloaded optimizer (``host_step_bw``): memsave/plan/calibrate_step.py;
- each engine family's own cost per step and per byte of parameters and the stretch of its compute, on two local
  ranks at two model widths (memsave/plan/calibrate_engines.py).

For hardware that is not here, :data:`VENDOR` holds A100, H100 and H200 (SXM, 8 per node) from their vendors'
data sheets, labelled as such; a TOML or JSON file with the same keys gives any other
(:func:`load_hardware`). Vendor figures are peaks: a training step reaches a fraction of them, ``efficiency``
and ``bw_efficiency`` (assumptions, stated with the entry).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from memsave.dist import group_size
from memsave.plan.calibrate_step import host_step_rate, step_rates, timed

__all__ = ["VENDOR", "Hardware", "calibrate", "load_hardware"]

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Rates of one device kind and its links, bytes and FLOPs per second (already the achievable figures for
    measured entries; vendor peaks are multiplied by ``efficiency`` in the cost model).

    ``overlap``: the fraction of data-parallel communication the engines hide behind the backward (gradient
    buckets reduced while later layers still compute), from ``memsave bench`` on this hardware."""

    name: str
    source: str
    device: str
    memory: float  # bytes per device
    flops: dict[str, float]  # compute dtype -> FLOP/s
    mem_bw: float
    intra_bw: float  # collective bus bandwidth within a node, per rank
    inter_bw: float  # across nodes, per rank
    host_bw: float  # device <-> host, per direction
    disk_bw: float
    host_memory: float = 0.0
    efficiency: float = 1.0  # of the matmul rate a training step's FLOPs reach
    bw_efficiency: float = 1.0  # of the bandwidths a collective or copy reaches
    overlap: float = 0.5
    latency: float = 20e-6  # per collective
    layer_overhead: float = 0.0  # seconds per layer and micro-batch besides its FLOPs (kernel launches, Python)
    step_bw: float = 0.0  # bytes of parameters, gradients and AdamW state an optimizer step goes through per second
    # measured: compute dtype -> the share of its matmul rate a training step reaches (else ``efficiency``);
    # recomputation policy -> seconds per layer and micro-batch it adds beyond its FLOPs; behind a GPU, memsave's
    # host step of an offloaded optimizer (bytes per second, as ``step_bw``). [Note: the host's cost per layer]
    efficiencies: dict[str, float] = dataclasses.field(default_factory=dict)
    recompute_overhead: dict[str, float] = dataclasses.field(default_factory=dict)
    host_step_bw: float = 0.0
    # collective kind (all_reduce, reduce_scatter, all_gather, p2p) -> (latency s, bytes/s of a rank's share),
    # measured on this machine's two local ranks; absent: ``latency`` and the link's bandwidth
    collectives: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    # engine family (memsave/plan/calibrate_engines.py) -> (seconds per step, seconds per byte of a stage's
    # parameters, the compute's stretch) measured
    engine: dict[str, tuple[float, float, float]] = dataclasses.field(default_factory=dict)

    def rate(self, dtype: str) -> float:
        return self.flops.get(dtype, self.flops.get("fp32", 0.0)) * self.efficiencies.get(dtype, self.efficiency)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_VENDOR_NOTE = ("vendor data sheet (dense tensor-core peak, HBM, NVLink per direction, one 400 Gb/s NIC per GPU); "
                "efficiency 0.5 of the FLOPs and 0.8 of the bandwidths are assumptions, not measurements")
VENDOR: dict[str, Hardware] = {
    "a100": Hardware(name="A100-SXM4-80GB", source=_VENDOR_NOTE.replace("400 Gb/s", "200 Gb/s"), device="cuda",
                     memory=80 * 2**30, flops={"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}, mem_bw=2039 * GB,
                     intra_bw=300 * GB, inter_bw=25 * GB, host_bw=25 * GB, disk_bw=2 * GB, host_memory=1024 * 2**30,
                     efficiency=0.5, bw_efficiency=0.8, overlap=0.8),
    "h100": Hardware(name="H100-SXM5-80GB", source=_VENDOR_NOTE, device="cuda", memory=80 * 2**30,
                     flops={"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, mem_bw=3350 * GB, intra_bw=450 * GB,
                     inter_bw=50 * GB, host_bw=55 * GB, disk_bw=4 * GB, host_memory=2048 * 2**30, efficiency=0.5,
                     bw_efficiency=0.8, overlap=0.8),
    "h200": Hardware(name="H200-SXM-141GB", source=_VENDOR_NOTE, device="cuda", memory=141 * GB,
                     flops={"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, mem_bw=4800 * GB, intra_bw=450 * GB,
                     inter_bw=50 * GB, host_bw=55 * GB, disk_bw=4 * GB, host_memory=2048 * 2**30, efficiency=0.5,
                     bw_efficiency=0.8, overlap=0.8),
}


def load_hardware(spec: str | Path) -> Hardware:
    """A :data:`VENDOR` name (``a100``, ``h100``, ``h200``), ``local`` (this machine, calibrated or from the cache),
    or a TOML/JSON file with :class:`Hardware`'s keys (each value checked: ValueError naming the key)."""
    if str(spec).lower() in VENDOR:
        return VENDOR[str(spec).lower()]
    if str(spec) == "local":
        return calibrate()
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--hardware {spec!r} is not allowed; expected one of {sorted(VENDOR)}, local, or a "
                         ".toml/.json file")
    try:
        data = tomllib.loads(path.read_text()) if path.suffix == ".toml" else json.loads(path.read_text())
    except ValueError as exc:  # TOMLDecodeError, JSONDecodeError
        raise ValueError(f"{path}: not valid {'TOML' if path.suffix == '.toml' else 'JSON'} ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: holds a {type(data).__name__}, not a table of Hardware's keys")
    fields = {f.name for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown}; allowed are {sorted(fields)}")
    data.setdefault("name", path.stem)
    data.setdefault("source", f"given in {path}")
    missing = sorted(f.name for f in dataclasses.fields(Hardware) if f.name not in data
                     and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    if missing:
        raise ValueError(f"{path}: missing key(s) {missing}")
    return Hardware(**_checked(data, path))


_LIMITS = {**dict.fromkeys(("memory", "mem_bw", "intra_bw", "inter_bw", "host_bw", "disk_bw"), (None, False)),
           **dict.fromkeys(("host_memory", "latency", "layer_overhead", "step_bw", "host_step_bw"), (None, True)),
           "efficiency": (1.0, False), "bw_efficiency": (1.0, False), "overlap": (1.0, True)}  # (at most, 0 allowed)


def _checked(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """A rates file's values checked (ValueError naming the key and the value) and converted: sizes in
    ``memory`` and ``host_memory`` may be strings ("80GiB")."""
    from memsave.recompute.policy import parse_size  # layer 1

    def number(key: str, value: Any, low: float = 0.0, high: float | None = None, zero: bool = False) -> float:
        if key in ("memory", "host_memory") and isinstance(value, str):
            try:
                value = parse_size(value)
            except ValueError:
                pass  # refused below, naming the key
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                value > low or (zero and value == 0)) or (high is not None and value > high):
            want = (("a number >= 0" if zero else "a positive number") if high is None else
                    f"a number in {'[' if zero else '('}{low:g}, {high:g}]")
            raise ValueError(f"{path}: {key} = {value!r} is not allowed; expected {want}"
                             + (' (or a size such as "80GiB")' if "memory" in key else ""))
        return float(value)

    out = dict(data)
    for key in ("name", "source", "device"):
        if not isinstance(out[key], str) or (key == "device" and out[key] not in ("cpu", "cuda")):
            raise ValueError(f"{path}: {key} = {out[key]!r} is not allowed; expected "
                             + ('"cpu" or "cuda"' if key == "device" else "a string"))
    for key, (high, zero) in _LIMITS.items():
        if key in out:
            out[key] = number(key, out[key], 0.0, high, zero)
    flops = out["flops"]
    if not isinstance(flops, dict) or "fp32" not in flops or not set(flops) <= {"fp32", "bf16", "fp16"}:
        raise ValueError(f"{path}: flops = {flops!r} is not allowed; expected a table of FLOP/s per compute dtype "
                         "(fp32, bf16, fp16), fp32 included")
    out["flops"] = {k: number(f"flops.{k}", v) for k, v in flops.items()}
    for key, allowed, high in (("efficiencies", ("fp32", "bf16", "fp16"), 1.0),
                               ("recompute_overhead", ("selective", "full"), None)):
        table = out.get(key, {})
        if not isinstance(table, dict) or not set(table) <= set(allowed):
            raise ValueError(f"{path}: {key} = {table!r} is not allowed; expected a table keyed by "
                             f"{', '.join(allowed)}")
        out[key] = {k: number(f"{key}.{k}", v, 0.0, high, zero=high is None) for k, v in table.items()}
    for key, size in (("collectives", 2), ("engine", 3)):  # [latency, bandwidth]; [per step, per byte, stretch]
        table = out.get(key, {})
        if not isinstance(table, dict) or not all(isinstance(v, (list, tuple)) and len(v) == size
                                                  for v in table.values()):
            raise ValueError(f"{path}: {key} = {table!r} is not allowed; expected {size} numbers per entry")
        out[key] = {k: tuple(number(f"{key}.{k}", x, zero=not (key == "collectives" and i == 1))
                             for i, x in enumerate(v)) for k, v in table.items()}
    return out


def _cache_file(device: str) -> Path:
    root = Path(os.environ.get("MEMSAVE_CACHE_DIR") or Path.home() / ".cache" / "memsave")
    kind = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
    key = f"{platform.node()}-{device}-{kind}-torch{torch.__version__}".replace(" ", "_").replace("/", "_")
    return root / f"calibration-{key}.json"


def _matmul_flops(device: str, dtype: torch.dtype) -> float:
    # a CPU has no 16-bit matmul units: a 1024 one took 1.5 s a call (0.9 GFLOP/s; 256: 1.35 GFLOP/s in 0.3 s)
    n = 4096 if device == "cuda" else 1024 if dtype == torch.float32 else 256
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    return 2 * n**3 / timed(lambda: torch.mm(a, b))


def _copy_rates(device: str) -> tuple[float, float]:
    """(device memory bandwidth, host-device bandwidth): a 128 MiB copy on the device (read + write), and one to
    pinned host memory (on CPU the two are the same memory)."""
    x = torch.empty(32 * 2**20, device=device)
    y = torch.empty_like(x)
    mem_bw = 2 * x.numel() * 4 / timed(lambda: y.copy_(x))
    if device != "cuda":
        return mem_bw, mem_bw
    host = torch.empty(x.numel(), pin_memory=True)
    return mem_bw, x.numel() * 4 / timed(lambda: host.copy_(x))


def _disk(folder: Path, nbytes: int) -> tuple[float, float]:
    data = os.urandom(nbytes)
    with tempfile.NamedTemporaryFile(dir=folder, prefix="memsave-calibrate-") as f:
        t0 = time.perf_counter()
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        write = nbytes / (time.perf_counter() - t0)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # read from the disk, not the page cache
        t0 = time.perf_counter()
        with open(f.name, "rb") as r:
            while r.read(1 << 24):
                pass
        read = nbytes / (time.perf_counter() - t0)
    return write, read


COLLECTIVE_BYTES = (16 * 2**10, 4 * 2**20)  # the two sizes each collective kind is timed at


def _mean_seconds(fn: Any, min_s: float) -> float:
    """Mean seconds per call of ``fn`` called back to back (the mean, not the best: a step pays every call's
    latency, the slow ones too) over about ``min_s``, the same number of calls on every rank (rank 0's count)."""
    from memsave import dist as mdist

    fn()
    mdist.barrier(None)
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    reps = torch.tensor([max(3.0, min(2000.0, min_s * 3 / (time.perf_counter() - t0)))])
    mdist.broadcast(reps, 0, None)
    mdist.barrier(None)
    t0 = time.perf_counter()
    for _ in range(int(reps.item())):
        fn()
    return (time.perf_counter() - t0) / int(reps.item())


def slowest_rank(per_rank: list[dict[str, tuple[float, float]]]) -> tuple[dict[str, tuple[float, float]], float]:
    """Each kind's figures of :func:`_collectives_worker`, the slowest rank's (as a collective ends); the bus apart."""
    kinds = {k: (max(r[k][0] for r in per_rank), min(r[k][1] for r in per_rank)) for k in per_rank[0]}
    return kinds, kinds.pop("bus")[1]


def _collectives_worker(small: int, large: int) -> dict[str, tuple[float, float]]:
    """Run in each of two spawned ranks: for each collective kind memsave's engines issue, (latency in seconds,
    bandwidth in bytes per second of each rank's share) from its mean time at ``small`` and ``large`` bytes
    (all-reduce 2 (n-1)/n of the tensor per rank, reduce-scatter and all-gather (n-1)/n, a pipeline send the
    tensor, timed as half a round trip through :class:`memsave.dist.P2P`). ``bus``: the all-reduce's bus
    bandwidth at ``large``."""
    from memsave import dist as mdist
    from memsave.dist.init import init

    mesh = init()
    n, rank = mdist.group_size(None), mesh.rank
    p2p = mdist.P2P(torch.device("cpu"))
    peer = 1 - rank

    def ping(t: torch.Tensor) -> None:
        if rank == 0:
            p2p.send(t, peer, 0)
            p2p.wait(p2p.recv(t.shape, t.dtype, peer, 1))
        else:
            p2p.wait(p2p.recv(t.shape, t.dtype, peer, 0))
            p2p.send(t, peer, 1)
        p2p.drain()

    out: dict[str, tuple[float, float]] = {}
    for kind, share in (("all_reduce", 2 * (n - 1) / n), ("reduce_scatter", (n - 1) / n),
                        ("all_gather", (n - 1) / n), ("p2p", 1.0)):
        seconds, volume = [], []
        for nbytes in (small, large):
            full = torch.ones(nbytes // 4)
            part = torch.empty(full.numel() // n)
            calls: dict[str, Callable[[], Any]] = {
                "all_reduce": functools.partial(mdist.all_reduce, full, None),
                "reduce_scatter": functools.partial(mdist.reduce_scatter_into, part, full, None),
                "all_gather": functools.partial(mdist.all_gather_into, full, part, None),
                "p2p": functools.partial(ping, full)}
            seconds.append(_mean_seconds(calls[kind], 0.25) / (2 if kind == "p2p" else 1))
            volume.append(share * nbytes)
        bw = (volume[1] - volume[0]) / max(seconds[1] - seconds[0], 1e-9)
        out[kind] = (max(0.0, seconds[0] - volume[0] / bw), bw)
        if kind == "all_reduce":
            out["bus"] = (0.0, volume[1] / seconds[1])
    return out


def _optimizer_rate(device: str) -> float:
    """Bytes per second a plain AdamW step goes through (parameters, gradients and its two moments: 16 bytes
    per fp32 parameter), on 4M parameters in 16 tensors (on CUDA 64M: fewer would measure the kernel launches)."""
    params = [torch.nn.Parameter(torch.randn(4096 if device == "cuda" else 256, 1024, device=device))
              for _ in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    return 16 * sum(p.numel() for p in params) / timed(opt.step)


def _measures_host_step(device: str, collectives: bool) -> bool:
    """Whether :func:`calibrate` measures memsave's own host step, which wraps a model of its own: on CUDA, where
    collectives are measured too (``memsave calibrate``, the bench), in a process of one rank; never from rank 0
    of a job's ``wrap(profile="auto")``, where that wrap's collectives would meet the other ranks' wait for rank
    0's choice (a hang)."""
    return device == "cuda" and collectives and group_size(None) == 1


def calibrate(*, device: str | None = None, folder: str | Path | None = None, refresh: bool = False,
              collectives: bool = True, engine_rounds: int = 3, engine_steps: int = 4) -> Hardware:
    """This machine's :class:`Hardware`, measured or read from the cache. ``collectives=False`` skips the two
    ranks (bus bandwidth = memory bandwidth; cached apart, for such calls, which take the full cache if there is
    one). ``engine_rounds``: passes over the engine families (memsave/plan/calibrate_engines.py), each measuring
    every point again later; ``engine_steps``: timed steps per point and pass."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cache = _cache_file(device)
    alone = cache.with_name(cache.stem + "-one-rank.json")  # collectives=False (wrap(profile="auto")'s rank 0)
    read = cache if cache.is_file() or collectives else alone
    data = json.loads(read.read_text()) if read.is_file() and not refresh else None
    from memsave.plan.calibrate_engines import FAMILIES  # (an older cache's figures are measured again)

    if (data is not None and "collectives" in data and "efficiencies" in data
            and all(len(v) == 3 for v in data.get("engine", {}).values())
            and set(data.get("engine") or FAMILIES) == set(FAMILIES)):
        for key in ("engine", "collectives"):
            data[key] = {k: tuple(v) for k, v in data.get(key, {}).items()}
        return Hardware(**data)
    import psutil

    print(f"memsave calibrate: measuring this machine's rates ({device}; "  # (else a silent minute, or 8 s)
          f"{'about a minute with the two-rank engine costs' if collectives else 'one rank, a few seconds'}), once: "
          f"cached in {cache if collectives else alone}", file=sys.stderr, flush=True)
    # two local ranks: on CPU, or on two GPUs (one GPU cannot host two NCCL ranks); there the step rates are
    # measured with both ranks running (engine_overheads), not here as well
    ranks = collectives and (device == "cpu" or torch.cuda.device_count() >= 2)
    threads = torch.get_num_threads()
    if device == "cpu":  # one rank per core, as memsave's launcher runs CPU ranks: rates of one thread
        torch.set_num_threads(1)
    try:
        flops = {"fp32": _matmul_flops(device, torch.float32), "bf16": _matmul_flops(device, torch.bfloat16)}
        flops["fp16"] = _matmul_flops(device, torch.float16) if device == "cuda" else flops["bf16"]
        rates: dict[str, Any] = (step_rates(device, flops) if not ranks else
                 {"efficiencies": {"fp32": 1.0}, "layer_overhead": 0.0, "recompute_overhead": {}})
        step_bw = _optimizer_rate(device)
    finally:
        torch.set_num_threads(threads)
    mem_bw, host_bw = _copy_rates(device)
    host_step = host_step_rate(host_bw) if _measures_host_step(device, collectives) else 0.0
    memory = float(torch.cuda.get_device_properties(0).total_memory if device == "cuda"
                   else psutil.virtual_memory().total)
    write, _read = _disk(Path(folder or tempfile.gettempdir()), 64 * 2**20)
    bus, kinds = mem_bw, dict[str, tuple[float, float]]()
    if ranks:
        from memsave._launch import spawn_local

        kinds, bus = slowest_rank(spawn_local(_collectives_worker, 2, COLLECTIVE_BYTES, timeout_s=120))
    said = "" if ranks or not collectives else "; one GPU: collectives and engine costs not measured"
    if device == "cuda" and not host_step:
        said += "; the host step's rate not measured (assumed)"
    hw = Hardware(name=f"{platform.node()} ({device})", source=f"measured by memsave calibrate on "
                  f"{time.strftime('%Y-%m-%d')}{said}", device=device, memory=memory, flops=flops, mem_bw=mem_bw,
                  intra_bw=bus, inter_bw=bus, host_bw=host_bw, disk_bw=write,
                  host_memory=float(psutil.virtual_memory().total), efficiency=rates["efficiencies"]["fp32"],
                  efficiencies=rates["efficiencies"], layer_overhead=rates["layer_overhead"],
                  recompute_overhead=rates["recompute_overhead"], step_bw=step_bw, host_step_bw=host_step,
                  overlap=0.0 if device == "cpu" else 0.8,
                  collectives=kinds, latency=kinds["all_reduce"][0] if kinds else Hardware.latency)
    if ranks:  # what each engine pays besides FLOPs and bytes, on two local ranks
        from memsave.plan.calibrate_engines import engine_overheads

        hw = engine_overheads(hw, steps=engine_steps, rounds=engine_rounds)
    target = cache if collectives else alone  # (one without the collectives: read only where none are wanted)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(hw.to_dict(), indent=1) + "\n")
    return hw
