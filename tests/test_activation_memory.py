"""Saved-activation memory beyond recomputation: compression (``[recompute] compress``, Gist-like) and offload
to pinned host memory (``[offload] activations = "cpu"``).

Compression is not exact by design. On the tiny GPT (B=2, T=64, d=64, 2 blocks) over 6 AdamW steps (lr 1e-2)
bf16 keeps every loss within 2% of uncompressed training (measured: 2.2e-4 relative at most; 5.3e-4 with
full recomputation) and the first step's gradients within 2e-2 relative (max-abs difference over max-abs
gradient, per parameter; measured 4.2e-3); fp8 within 5% / 1e-1 (measured 1.9e-3 / 4.2e-2). Saved bytes are counted by a pack hook wrapped around the compressor's: the covered
tensors keep exactly half their bytes in bf16, a quarter plus 4 bytes per tensor in fp8.

Offload moves nothing on CPU (said once) and is checked bit for bit; on CUDA (``gpu`` marker) bit for bit
and by the device memory it frees.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memsave
from memsave import _logging, recompute
from memsave.models import GPT, gpt_config
from memsave.offload import forward_under, module_storages, offload_saved
from memsave.recompute import SavedTensorCompressor, compress_saved
from tests.harness import LogRecords, run_ranks

B, T, STEPS = 2, 64, 6
LOSS_RTOL = {"bf16": 0.02, "fp8": 0.05}
GRAD_RTOL = {"bf16": 2e-2, "fp8": 1e-1}


def _gpt(dropout: float = 0.1) -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", dropout=dropout))


def _batch(step: int, rows: int = B) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 256, (rows, T + 1), generator=g)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def _train(model: nn.Module, kind: str = "none", steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of every step and the gradients of the first; forward under compression of ``kind``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    losses: list[float] = []
    first: dict[str, torch.Tensor] = {}
    for step in range(steps):
        opt.zero_grad()
        if kind == "none":
            loss = model(**_batch(step)).loss
        else:
            with compress_saved(kind, model):
                loss = model(**_batch(step)).loss
        loss.backward()
        if step == 0:
            first = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        losses.append(loss.item())
    return losses, first


def _assert_close(run: tuple, ref: tuple, kind: str, what: str) -> None:
    (losses, grads), (ref_losses, ref_grads) = run, ref
    for i, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(a - b) <= LOSS_RTOL[kind] * abs(b), f"{what}: loss of step {i}: {a} vs {b}"
    assert grads.keys() == ref_grads.keys()
    for n, g in grads.items():
        err = (g - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-12)
        assert err <= GRAD_RTOL[kind], f"{what}: gradient of {n} off by {err:.3g} (relative to its max)"


# -- single process: compression ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_compressed_training_stays_close(kind: str) -> None:
    ref = _train(_gpt())
    _assert_close(_train(_gpt(), kind), ref, kind, kind)
    # composes with full recomputation: only the checkpoints' inputs are compressed, the rest recomputed
    model = _gpt()
    recompute.apply(None, "full", model=model)
    _assert_close(_train(model, kind), ref, kind, f"{kind} + recompute full")


class _Counter:
    """A pack hook around the compressor's: bytes in and out of every tensor it compressed (once per packed
    object), and what it let through."""

    def __init__(self, compressor: SavedTensorCompressor) -> None:
        self.c = compressor
        self.covered: dict[int, tuple[int, int]] = {}
        self.passed: list[torch.Tensor] = []
        self.keep: list[object] = []

    def pack(self, t: torch.Tensor) -> object:
        packed = self.c.pack(t)
        if packed is t:
            self.passed.append(t)
        else:
            self.keep.append(packed)  # ids stay unique while we count
            stored = sum(x.numel() * x.element_size() for x in packed if isinstance(x, torch.Tensor))
            self.covered[id(packed)] = (t.numel() * t.element_size(), stored)
        return packed


def _count(kind: str, model: nn.Module) -> _Counter:
    counter = _Counter(SavedTensorCompressor(kind, exclude=module_storages(model)))
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.c.unpack):
        loss = model(**_batch(0)).loss
    loss.backward()
    return counter


def test_compressed_saved_bytes_and_what_passes_through() -> None:
    model = _gpt()
    bf16, fp8 = _count("bf16", model), _count("fp8", model)
    for counter, expect in ((bf16, 0.5), (fp8, 0.25)):
        covered = sum(b for b, _ in counter.covered.values())
        stored = sum(s for _, s in counter.covered.values())
        assert covered > 1_000_000  # the tiny GPT's logits alone: 2*64*256*4 = 128 KiB; all of it ~1.25 MiB
        assert stored / covered == pytest.approx(expect, rel=0.01), (counter.c.kind, stored, covered)
        assert (counter.c.stats.covered, counter.c.stats.stored) == (covered, stored)  # its own count agrees
        for t in counter.passed:  # parameters (and views of them), integer/bool tensors and small ones
            root = t._base if t._base is not None else t
            assert (isinstance(root, nn.Parameter) or t.dtype != torch.float32 or t.numel() < 1024
                    or t.untyped_storage().data_ptr() in counter.c.exclude), (t.dtype, tuple(t.shape))
        kinds = {(isinstance(t._base if t._base is not None else t, nn.Parameter), t.dtype) for t in counter.passed}
        assert (True, torch.float32) in kinds and (False, torch.int64) in kinds  # weights, labels
    print(f"\ntiny GPT saved activations compressed: bf16 {bf16.c.stats}, fp8 {fp8.c.stats}")
    # a fp32 leaf that requires grad and a module buffer pass through; a non-fp32 activation too
    buf = nn.Module()
    buf.register_buffer("table", torch.randn(64, 64))
    x = torch.randn(64, 64, requires_grad=True)
    with compress_saved("bf16", buf) as c:
        y = (x * buf.table).sum() + (x.double() * 2).exp().sum() + (x * 2).tanh().sum()
    y.backward()
    assert c.stats.num_tensors == 1  # tanh's output only; x, the buffer and the float64 exp are kept as they are


def test_compress_checks_and_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    assert recompute.check_compress("fp8") is torch.float8_e4m3fn
    with pytest.raises(ValueError, match=r"'int4'.*'bf16', 'fp8'"):
        recompute.check_compress("int4")
    monkeypatch.setitem(recompute.compress.COMPRESS_DTYPES, "fp8", torch.bits8)  # a dtype this torch cannot cast to
    with pytest.raises(NotImplementedError, match='compress = "fp8" is not implemented on cpu'):
        recompute.check_compress("fp8")


# -- offload: CPU no-op ---------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU no-op")
def test_offload_context_on_cpu_warns_once_and_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_logging, "_warned", set())
    records = LogRecords()
    _logging.get_logger().addHandler(records)
    try:
        ref = _train(_gpt())
        model = _gpt()
        handle = forward_under(model, lambda: offload_saved(model))
        run = _train(model)
        handle.remove()
    finally:
        _logging.get_logger().removeHandler(records)
    assert run[0] == ref[0] and run[1].keys() == ref[1].keys()
    assert all(torch.equal(run[1][n], g) for n, g in ref[1].items())  # bit for bit
    assert [m for m in records.messages if "already live in host memory" in m] == [
        '[offload] activations = "cpu" on a CPU device: saved activations already live in host memory, nothing is moved']


# -- under memsave.wrap: DDP and ZeRO-3 on 2 ranks ------------------------------------------------------------
def _wrapped_run(profile: str, overrides: tuple[str, ...], rank: int, world: int, model: nn.Module) -> dict:
    mesh = memsave.init()
    model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                              memsave.load_profile(profile, overrides), mesh=mesh)
    torch.manual_seed(10 + rank)
    losses, first = [], {}
    for step in range(STEPS):
        batch = {k: v.chunk(world)[rank] for k, v in _batch(step, rows=2 * world).items()}
        loss = model(**batch).loss
        opt.backward(loss)
        if step == 0:
            first = (opt.full_grads() if profile != "ddp" else
                     {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": {k: v.numpy() for k, v in first.items() if v is not None}}


WRAP_CASES = {
    ("ddp", "none"): (), ("ddp", "bf16"): ('recompute.compress="bf16"',),
    ("ddp", "offload"): ('offload.activations="cpu"',),
    ("zero3", "none"): (), ("zero3", "bf16"): ('recompute.compress="bf16"',),
    ("zero3", "fp8"): ('recompute.compress="fp8"',),
    ("zero3", "full"): ('recompute.policy="full"',),
    ("zero3", "full bf16"): ('recompute.policy="full"', 'recompute.compress="bf16"'),
}


def _wrap_cases(world: int) -> dict:
    rank = memsave.init().dp_rank
    records = LogRecords()
    _logging.get_logger().addHandler(records)
    gpt = _gpt()
    out: dict = {case: _wrapped_run(case[0], overrides, rank, world, copy.deepcopy(gpt))
                 for case, overrides in WRAP_CASES.items()}
    _wrapped_run("ddp", ('offload.activations="cpu"',), rank, world, copy.deepcopy(gpt))  # a second time: no warning
    out["warnings"] = [m for m in records.messages if "already live in host memory" in m]
    # a torch that cannot cast to fp8 on this device: refused at wrap time, the model left as it was
    recompute.compress.COMPRESS_DTYPES["fp8"] = torch.bits8
    model = copy.deepcopy(gpt)
    try:
        memsave.wrap(model, torch.optim.AdamW(model.parameters()),
                     memsave.load_profile("zero3", ['recompute.compress="fp8"']), mesh=memsave.init())
        out["fp8 refusal"] = "no error"
    except NotImplementedError as exc:
        out["fp8 refusal"] = str(exc)
        out["fp8 untouched"] = type(model) is GPT and not model._forward_pre_hooks and not model._forward_hooks
    finally:
        recompute.compress.COMPRESS_DTYPES["fp8"] = torch.float8_e4m3fn
    return out


@pytest.fixture(scope="module")
def wrapped() -> list[dict]:
    return run_ranks(_wrap_cases, 2, 2, timeout=150)


def _run(result: dict) -> tuple:
    return result["losses"], {k: torch.from_numpy(v) for k, v in result["grads"].items()}


@pytest.mark.parametrize("case", [c for c in WRAP_CASES if c[1] not in ("none", "offload", "full")])
def test_wrap_compress_close_to_uncompressed(wrapped: list[dict], case: tuple[str, str]) -> None:
    kind = case[1].split()[-1]
    reference = (case[0], "full") if "full" in case[1] else (case[0], "none")
    for rank, result in enumerate(wrapped):
        run, ref = _run(result[case]), _run(result[reference])
        _assert_close(run, ref, kind, f"rank {rank} {case}")
        assert not all(torch.equal(g, ref[1][n]) for n, g in run[1].items()), f"{case}: nothing was compressed"


def test_wrap_offload_on_cpu_is_a_noop_said_once(wrapped: list[dict]) -> None:
    for result in wrapped:
        run, ref = _run(result["ddp", "offload"]), _run(result["ddp", "none"])
        assert run[0] == ref[0]
        assert all(torch.equal(g, ref[1][n]) for n, g in run[1].items())
        assert len(result["warnings"]) == 1 and "'ddp'" in result["warnings"][0]


def test_wrap_refuses_fp8_where_torch_cannot_cast(wrapped: list[dict]) -> None:
    for result in wrapped:
        assert 'compress = "fp8" is not implemented on cpu' in result["fp8 refusal"], result["fp8 refusal"]
        assert result["fp8 untouched"], "a refused wrap must leave the model as it was"


# -- offload on CUDA ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_on_cuda_is_exact_and_frees_device_memory() -> None:
    device = torch.device("cuda")
    ref_model, model = _gpt(dropout=0.0).to(device), _gpt(dropout=0.0).to(device)
    batch = {k: v.repeat(8, 1).to(device) for k, v in _batch(0).items()}  # B=16: activations well above params

    def forward(m: nn.Module, offload: bool) -> tuple[torch.Tensor, int, int]:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        if offload:
            with offload_saved(m) as off:
                loss = m(**batch).loss
            assert off is not None
            moved = off.offloaded_bytes
        else:
            loss, moved = m(**batch).loss, 0
        torch.cuda.synchronize()
        torch.empty(1, device=device)  # lets the allocator retire blocks freed with record_stream
        return loss, torch.cuda.memory_allocated() - before, moved

    for step in range(3):
        ref_loss, ref_held, _ = forward(ref_model, False)
        loss, held, moved = forward(model, True)
        assert torch.equal(loss, ref_loss), (step, loss.item(), ref_loss.item())
        assert moved > 0 and ref_held - held >= 0.5 * moved, (ref_held, held, moved)
        ref_loss.backward()
        loss.backward()
        for (n, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), n
            with torch.no_grad():
                p.sub_(0.01 * p.grad)
                q.sub_(0.01 * q.grad)
            p.grad = q.grad = None
