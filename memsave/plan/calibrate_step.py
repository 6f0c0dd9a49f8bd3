"""What one rank's forward and backward cost besides matmul FLOPs, and the host's optimizer rate: part of
``memsave calibrate``.

[Note: the host's cost per layer] A micro-batch costs its FLOPs over the achieved rate plus a fixed cost per
layer on the host (Python, memsave's and torch's hooks, kernel launches) and what its recomputation policy adds
to that (selective recomputation's dispatch mode sees every op in forward and again in the replay; full
recomputation dispatches the forward again). On a CPU the two run one after the other. On a GPU they could
overlap, the host queueing kernels while the device runs earlier ones, but measured on an H100 (torch 2.11,
memsave-wrapped GPTs of width 256 to 2,048, 4 and 8 blocks, 1 to 8 rows of 1,024 tokens, fp32 and bf16, every
recomputation policy: 54 shapes) the sum predicted the forward and backward within 20% for 43 of them and the
longer of the two for 17. So the cost model (memsave/plan/cost.py) adds them on every device, and
:func:`step_rates` measures:

- the achieved rate per compute dtype (``efficiencies``, of the matmul peak): on CUDA from the difference of two
  shapes (a width-1024 GPT at 2,048 and 8,192 tokens in fp32, 8,192 and 32,768 in bf16: the fixed cost
  cancels, and the device's time is well above it), the parameters cast as a 16-bit
  profile casts them; on a CPU (fp32) from 1 and 8 rows of a small GPT, with the fixed cost fitted beside;
- on CUDA, the host's cost per layer and micro-batch (``layer_overhead``) from a model too small for the device to
  matter (2 and 6 blocks of 8 tokens, the difference per block), and what each recomputation policy adds to it
  (``recompute_overhead``) the same way, on a CPU too (the median of three passes).

[Note: recomputation's cost per layer on CPU] The CPU calibration first took each policy's time beyond its
FLOPs at the FLOP-bound shape (1 row of 128 tokens, width 256). There the policy's FLOPs were most of a
difference of two noisy times: full recomputation came out at 7.0 ms a layer in one calibration, and the bench's
rows with it were predicted 15-67% high (one run, 2026-11-27). On blocks of 8 tokens the FLOPs are nothing: this
machine measured 1.7-2.9 ms a layer for full and 4.9-7.7 ms for selective (its dispatch mode sees every op twice).

Behind a GPU, an offloaded optimizer steps on the host ([Note: host step] in memsave/offload/host_step.py);
:func:`host_step_rate` measures memsave's own step there.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

__all__ = ["host_step_rate", "step_rates", "timed"]


def timed(fn: Any, min_s: float = 0.3) -> float:
    """Seconds per call of ``fn``: the best of repeated calls over at least ``min_s`` (the device synchronized)."""
    fn()
    best, spent = float("inf"), 0.0
    while spent < min_s:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return best


def _gpt(device: str, dtype: torch.dtype, recompute: str, **shape: Any) -> tuple[Any, Any]:
    from memsave.models import GPT, gpt_config  # layer 0
    from memsave.recompute import apply  # layer 1

    cfg = gpt_config("small", dropout=0.0, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg).to(dtype)
    if recompute != "none":
        apply(None, recompute, model=model)
    return model, cfg


def _seconds(model: Any, cfg: Any, device: str, rows: int, min_s: float) -> float:
    ids = torch.randint(0, cfg.vocab_size, (rows, cfg.block_size), device=device)

    def step() -> None:
        model(ids, labels=ids).loss.backward()

    return timed(step, min_s=min_s)


def step_rates(device: str, flops: dict[str, float]) -> dict[str, Any]:
    """``efficiencies`` (compute dtype -> share of ``flops[dtype]`` a forward and backward reaches),
    ``layer_overhead`` (seconds per layer and micro-batch) and ``recompute_overhead`` (policy -> seconds per layer
    and micro-batch beyond it and the policy's FLOPs), measured as [Note: the host's cost per layer] says."""
    from memsave.plan.formulas import gpt_step_flops

    def fl(cfg: Any, rows: int, recompute: str = "none") -> float:
        return gpt_step_flops(rows, cfg.block_size, cfg.n_layer, cfg.d_model, cfg.vocab_size, recompute=recompute)

    out: dict[str, Any] = {"efficiencies": {}, "recompute_overhead": {}}
    if device == "cuda":
        big = {"d_model": 1024, "n_head": 16, "n_layer": 2, "block_size": 512, "vocab_size": 8192}
        # the rows at which the device's time is well above the host's 3 ms: the difference is the FLOPs' alone
        for name, dtype, rows in (("fp32", torch.float32, (4, 16)), ("bf16", torch.bfloat16, (16, 64))):
            model, cfg = _gpt(device, dtype, "none", **big)
            t = [_seconds(model, cfg, device, n, 0.3) for n in rows]
            rate = (fl(cfg, rows[1]) - fl(cfg, rows[0])) / max(t[1] - t[0], 1e-9)
            out["efficiencies"][name] = min(1.0, rate / flops[name])
            del model
        out["efficiencies"]["fp16"] = out["efficiencies"]["bf16"]
        per_layer = _per_layer(device, torch.bfloat16, reps=1)
        out["layer_overhead"] = per_layer["none"]
        out["recompute_overhead"] = {k: max(0.0, v - per_layer["none"]) for k, v in per_layer.items() if k != "none"}
        torch.cuda.empty_cache()  # the largest shape's blocks (about 4 GiB in bf16) back to the device
        return out
    # a CPU: one thread's rate and its fixed cost ([Note: the host's cost per layer])
    small = {"n_layer": 2, "d_model": 256, "n_head": 4}
    model, cfg = _gpt(device, torch.float32, "none", **small)
    t = [_seconds(model, cfg, device, rows, 0.5) for rows in (1, 8)]
    rate = (fl(cfg, 8) - fl(cfg, 1)) / max(t[1] - t[0], 1e-9)
    overhead = max(0.0, (t[0] - fl(cfg, 1) / rate) / cfg.n_layer)
    out["efficiencies"]["fp32"] = min(1.0, rate / flops["fp32"])
    out["layer_overhead"] = overhead
    # as on CUDA, not at the FLOP-bound shape above ([Note: recomputation's cost per layer on CPU])
    per_layer = _per_layer(device, torch.float32, reps=3)
    out["recompute_overhead"] = {k: max(0.0, v - per_layer["none"]) for k, v in per_layer.items() if k != "none"}
    return out


def _per_layer(device: str, dtype: torch.dtype, reps: int) -> dict[str, float]:
    """Seconds per layer and micro-batch of a forward and backward under each recomputation policy: the slope
    between 2 and 6 blocks of a width-64 GPT on 8 tokens, where the FLOPs are nothing and the host's dispatch
    is all; the median of ``reps`` passes over the policies (the machine's speed drifts between them)."""
    got: dict[str, list[float]] = {"none": [], "selective": [], "full": []}
    for _ in range(reps):
        for recompute, times in got.items():
            t = []
            for layers in (2, 6):
                model, cfg = _gpt(device, dtype, recompute, d_model=64, n_head=2, n_layer=layers, block_size=8,
                                  vocab_size=256)
                t.append(_seconds(model, cfg, device, 1, 0.2))
            times.append(max(0.0, (t[1] - t[0]) / 4))
    return {k: statistics.median(v) for k, v in got.items()}


def host_step_rate(host_bw: float) -> float:
    """Bytes per second of memsave's own host step behind a GPU (ZeRO-1, bf16, ``[offload] optimizer = "cpu"``:
    [Note: host step] in memsave/offload/host_step.py), in the cost model's accounting (memsave/plan/cost.py: the
    state, the fp32 masters and gradients, 18 bytes per parameter), its PCIe copies at ``host_bw`` taken out (the
    cost model prices them apart). Measured on a 67M-parameter GPT: torch's fused CPU AdamW alone reached 84-115
    GB/s on an H100 host's 16 cores, while the whole step (the gradients' casts, the chunks' copies and
    synchronization, the masters cast back) came to about a quarter of that."""
    from memsave.api import wrap  # layer 5
    from memsave.config import Profile
    from memsave.models import GPT, gpt_config
    from memsave.optim import build_optimizer

    cfg = gpt_config("small", dropout=0.0, d_model=1024, n_head=16, n_layer=4, block_size=64, vocab_size=8192)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model: Any = GPT(cfg)
    profile = Profile.from_dict({"zero": {"stage": 1}, "precision": {"compute": "bf16"},
                                 "offload": {"optimizer": "cpu"}}, name="calibrate-host-step")
    optimizer: Any = build_optimizer(model.parameters(), profile.optimizer)
    model, optimizer = wrap(model, optimizer, profile)
    ids = torch.randint(0, cfg.vocab_size, (1, cfg.block_size), device="cuda")
    best = float("inf")
    for i in range(4):
        optimizer.backward(model(ids, labels=ids).loss)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        optimizer.step()
        torch.cuda.synchronize()
        if i:  # the first step allocates the state
            best = min(best, time.perf_counter() - t0)
        optimizer.zero_grad()
    psi = sum(p.numel() for p in model.parameters())
    close = getattr(optimizer, "close", None)
    if close is not None:
        close()
    return 18 * psi / max(best - 4 * psi / host_bw, best / 2)
