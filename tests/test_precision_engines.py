"""bf16 / fp16 compute with fp32 master weights inside the DP engine and ZeRO-1/2/3, at 1 and 2 ranks.

Tolerances: a low-precision run cannot equal the fp32 one; over 6 steps of the tiny reference GPT its losses
stay within 3% (bf16: 8-bit mantissa, gradients reduced in bf16 or in fp32) or 1% (fp16 with a fixed scale of
1024: 11 bits) of the fp32 run's, and the first step's gradient norm (clipping after unscaling) within the
same. Loss scaling itself is exact: an fp32 run with a power-of-two scale equals the unscaled run bit for bit.
Overflow handling, bytes held and state dicts are exact.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import memsave
from memsave.models import GPT, TokenBatches, gpt_config
from memsave.phases import MemoryCategory
from tests.harness import run_ranks

PROFILES = ("ddp", "zero1", "zero2", "zero3")
SEQ = 32


def _pair(profile: str, mesh: memsave.Mesh, overrides: tuple[str, ...]) -> tuple:
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    p = memsave.load_profile(profile, list(overrides))
    return memsave.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), p, mesh=mesh)


def _run(profile: str, mesh: memsave.Mesh, overrides: tuple[str, ...], steps: int) -> tuple[list[float], float]:
    model, opt = _pair(profile, mesh, overrides)
    data = TokenBatches(seq_len=SEQ, batch_size=2, dp_rank=mesh.dp_rank, dp_size=mesh.dp_size)
    losses, first_norm = [], math.nan
    for step in range(steps):
        loss = model(**data.batch(step)).loss
        avg = loss.detach().float().reshape(1)
        memsave.dist.all_reduce(avg, mesh.dp_group)
        losses.append(avg.item() / mesh.dp_size)
        opt.backward(loss)
        norm = opt.clip_grad_norm(1.0)
        if step == 0:
            first_norm = float(norm)
        opt.step()
        opt.zero_grad()
    return losses, first_norm


def case_tracks_fp32(profile: str, mesh: memsave.Mesh) -> None:
    ref, ref_norm = _run(profile, mesh, (), 6)
    for overrides, rtol in ((('precision.compute="bf16"',), 3e-2),
                            (('precision.compute="bf16"', 'precision.reduce="fp32"'), 3e-2),
                            (('precision.compute="fp16"', "precision.loss_scale=1024.0"), 1e-2)):
        losses, norm = _run(profile, mesh, overrides, 6)
        for step, (a, b) in enumerate(zip(losses, ref)):
            assert abs(a - b) <= rtol * b, (profile, overrides, step, a, b)
        assert abs(norm - ref_norm) <= rtol * ref_norm, (profile, overrides, norm, ref_norm)
        assert losses[-1] < losses[0] - 0.3, (profile, overrides, losses)
    # a power-of-two scale is exact in fp32: scaling, unscaling and the clipped norm change no bit
    losses, norm = _run(profile, mesh, ("precision.loss_scale=1024.0",), 6)
    assert losses == ref and norm == ref_norm, (profile, losses, ref, norm, ref_norm)


def _snapshot(model: torch.nn.Module, opt: memsave.MemsaveOptimizer) -> tuple[dict, dict]:
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def _assert_same(a: tuple[dict, dict], b: tuple[dict, dict], what: str) -> None:
    for k, v in a[0].items():
        assert torch.equal(b[0][k], v), (what, k)
    for k, st in a[1]["state"].items():
        for key, v in st.items():
            assert torch.equal(b[1]["state"][k][key], v), (what, k, key)
    for x, y in zip(a[1]["master_params"], b[1]["master_params"]):
        assert torch.equal(x, y), what


def case_overflow_on_one_rank(profile: str, mesh: memsave.Mesh) -> None:
    """An inf on one rank only skips the step on every rank, leaves everything bit-identical, halves the scale."""
    model, opt = _pair(profile, mesh, ('precision.compute="fp16"', 'precision.loss_scale="dynamic"'))
    assert opt.scaler is not None
    opt.scaler.scale = 256.0  # below fp16 overflow for this model: steps are taken
    data = TokenBatches(seq_len=SEQ, batch_size=2, dp_rank=mesh.dp_rank, dp_size=mesh.dp_size)
    last = mesh.dp_rank == mesh.dp_size - 1
    for step in range(2):
        opt.backward(model(**data.batch(step)).loss)
        opt.step()
        opt.zero_grad()
    assert opt.scaler.num_skipped == 0
    # (a) an inf produced in backward on one rank
    before = _snapshot(model, opt)
    loss = model(**data.batch(2)).loss
    opt.backward(loss * (1e30 if last else 1.0))
    opt.step()
    opt.zero_grad()
    assert opt.scaler.num_skipped == 1 and opt.scaler.scale == 128.0
    _assert_same(before, _snapshot(model, opt), f"{profile} after a backward overflow")
    # (b) ZeRO: an inf in one rank's gradient *shard* only (after the reduction): the ranks must agree
    if profile != "ddp":
        opt.backward(model(**data.batch(3)).loss)
        if last:
            grad = next(s.grad for _, s in opt.mp._pairs if s.grad is not None and s.grad.numel())
            grad.view(-1)[0] = math.inf
        opt.step()
        opt.zero_grad()
        assert opt.scaler.num_skipped == 2 and opt.scaler.scale == 64.0
        _assert_same(before, _snapshot(model, opt), f"{profile} after a shard overflow")
    opt.backward(model(**data.batch(4)).loss)  # and training goes on
    opt.step()
    assert opt.mp.last_step_skipped is False


def case_bytes_and_state_dict(profile: str, mesh: memsave.Mesh) -> None:
    """Model-state bytes follow 2Ψ + 2Ψ + 12Ψ sharded by stage (fp32 gradients where reduce = "fp32"); the
    scale survives a state dict round trip."""
    data = TokenBatches(seq_len=SEQ, batch_size=2, dp_rank=mesh.dp_rank, dp_size=mesh.dp_size)
    stage = memsave.load_profile(profile).zero.stage
    for reduce in ("compute", "fp32"):
        model, opt = _pair(profile, mesh, ('precision.compute="bf16"', f'precision.reduce="{reduce}"'))
        opt.backward(model(**data.batch(0)).loss)
        opt.step()
        acct = memsave.memory.account([opt]).bytes
        psi = sum(p.numel() for p in model.parameters())
        n = sum(1 for p in model.parameters() if p.requires_grad)
        g = 2 if reduce == "compute" else 4  # bytes per kept gradient element
        if stage == 0:
            own = psi
            expected_params, expected_grads = 2 * psi, g * psi
        else:
            engine = model.memsave_engine
            own = sum(m.numel() for m in opt._opt_full)
            padded_params = sum(u.param_layout.chunk_numel for u in engine.units)
            padded_grads = sum(u.grad_layout.chunk_numel for u in engine.units)
            expected_params = 2 * (padded_params if stage == 3 else psi)
            expected_grads = g * padded_grads if stage >= 2 else 2 * psi + (0 if g == 2 else g * padded_grads)
        what = (profile, reduce, acct)
        assert acct[MemoryCategory.PARAMS.value] == expected_params, what
        assert acct[MemoryCategory.GRADS.value] == expected_grads, what  # fp32 master grads freed
        assert acct[MemoryCategory.MASTER.value] == 4 * own, what
        assert acct[MemoryCategory.OPTIMIZER_STATE.value] == 8 * own + 4 * n, what
    # state dict round trip (fp16 with a grown scale)
    model, opt = _pair(profile, mesh, ('precision.compute="fp16"', 'precision.loss_scale="dynamic"'))
    opt.scaler.scale = 512.0
    opt.backward(model(**data.batch(0)).loss)
    opt.step()
    opt.zero_grad()
    msd, osd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())  # not aliasing live state
    assert osd["loss_scaler"]["scale"] == 512.0 and len(osd["master_params"]) == n
    model2, opt2 = _pair(profile, mesh, ('precision.compute="fp16"', 'precision.loss_scale="dynamic"'))
    model2.load_state_dict(msd)
    opt2.load_state_dict(osd)
    assert opt2.scaler.scale == 512.0
    for m, o in ((model, opt), (model2, opt2)):
        o.backward(m(**data.batch(1)).loss)
        o.step()
    for k, v in model.state_dict().items():
        assert torch.equal(model2.state_dict()[k], v), (profile, k)


def case_recompute_composes(profile: str, mesh: memsave.Mesh) -> None:
    """bf16 compute with full / selective recomputation equals bf16 without it, bit for bit."""
    bf16 = ('precision.compute="bf16"',)
    ref, ref_norm = _run(profile, mesh, bf16, 3)
    for policy in ("full", "selective"):
        losses, norm = _run(profile, mesh, (*bf16, f'recompute.policy="{policy}"'), 3)
        assert losses == ref and norm == ref_norm, (profile, policy, losses, ref)


def _all_cases(world: int) -> str:
    mesh = memsave.init()
    for profile in PROFILES:
        case_recompute_composes(profile, mesh)
        case_tracks_fp32(profile, mesh)
        case_overflow_on_one_rank(profile, mesh)
        case_bytes_and_state_dict(profile, mesh)
    return "ok"


@pytest.mark.parametrize("world", [1, 2])
def test_mixed_precision_in_every_engine(world: int) -> None:
    assert run_ranks(_all_cases, world, world, timeout=300) == ["ok"] * world
