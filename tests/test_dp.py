"""The DP engine (profile ``ddp``) against torch DDP and against single-process large-batch training."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import memsave
from memsave.dist import COMM_STATS
from tests.compare import assert_same
from tests.harness import run_ranks
from tests.toy import ToyLM, param_groups, toy_batch

ROWS = 2  # rows per rank per micro-batch


def _local(batch: dict, rank: int, world: int) -> dict:
    rows = batch["input_ids"].shape[0] // world
    return {k: v[rank * rows : (rank + 1) * rows] for k, v in batch.items()}


def case_matches_ddp(rank: int, world: int, mesh: memsave.Mesh) -> None:
    """Losses, gradients (incl. None for globally unused), clip norms and parameters equal DDP over 6 steps."""
    ref = ToyLM()
    ddp = DDP(copy.deepcopy(ref), find_unused_parameters=True)
    ddp_opt = torch.optim.AdamW(param_groups(ddp.module), lr=1e-2)
    model = copy.deepcopy(ref)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2)
    model, opt = memsave.wrap(model, opt, "ddp", mesh=mesh)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # on the wrapped optimizer
    ddp_sched = torch.optim.lr_scheduler.StepLR(ddp_opt, step_size=2, gamma=0.5)
    assert isinstance(model, ToyLM) and isinstance(model, memsave.MemsaveModule)
    for step in range(6):
        batch = _local(toy_batch(step, ROWS * world), rank, world)
        # step 3: the extra branch is skipped on rank 1 only; step 4: skipped everywhere (grads stay None)
        use_extra = not ((step == 3 and rank == 1) or step == 4)
        out = model(**batch, use_extra=use_extra)
        ref_out = ddp(**batch, use_extra=use_extra)
        assert_same(out.loss, ref_out.loss, f"loss step {step}", world, rtol=1e-6 if step == 0 else 1e-5)
        opt.backward(out.loss)
        ref_out.loss.backward()
        for (name, p), q in zip(model.named_parameters(), ddp.module.parameters()):
            assert_same(p.grad, q.grad, f"grad {name} step {step}", world, rtol=1e-6 if step == 0 else 1e-5)
        norm = opt.clip_grad_norm(0.5)
        ref_norm = torch.nn.utils.clip_grad_norm_([p for p in ddp.parameters() if p.grad is not None], 0.5)
        assert_same(norm, ref_norm, f"grad norm step {step}", world, rtol=1e-6 if step == 0 else 1e-5)
        opt.step()
        ddp_opt.step()
        sched.step()
        ddp_sched.step()
        opt.zero_grad()
        ddp_opt.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ddp.module.parameters()):
            assert_same(p, q, f"param {name} after step {step}", world, rtol=1e-5)
    assert opt.param_groups[0]["lr"] == ddp_opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**3)
    assert model.head.weight is model.embed.weight


def case_accumulation_equals_large_batch(rank: int, world: int, mesh: memsave.Mesh) -> None:
    """2 micro-batches under no_sync (+ the syncing one) equal one single-process step on the global batch."""
    ref = ToyLM(seed=1)
    big = copy.deepcopy(ref)
    big_opt = torch.optim.SGD(big.parameters(), lr=0.1, momentum=0.9)
    model = copy.deepcopy(ref)
    model, opt = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), "ddp", mesh=mesh)
    micro = 3
    with COMM_STATS.measure() as comm:
        for step in range(3):
            batch = toy_batch(step, ROWS * world * micro)
            for m in range(micro):
                mb = _local({k: v[m * ROWS * world : (m + 1) * ROWS * world] for k, v in batch.items()}, rank, world)
                if m < micro - 1:
                    with model.no_sync():
                        opt.backward(model(**mb).loss / micro)
                else:
                    opt.backward(model(**mb).loss / micro)
            opt.step()
            opt.zero_grad()
            big(**batch).loss.backward()
            big_opt.step()
            big_opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), big.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"param {name}: {m}")
    # one all-reduce of all gradients per optimizer step, none for the no_sync micro-batches
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    expected = 0 if world == 1 else 3 * 2 * 4 * (numel + n_params)  # grads + one used-flag per parameter
    assert comm.bytes["all_reduce"] == expected, (comm.snapshot(), expected)


def case_set_to_none_false_and_two_forwards(rank: int, world: int, mesh: memsave.Mesh) -> None:
    """zero_grad(set_to_none=False), a model called twice per step, and state_dict round trips."""
    ref = ToyLM(seed=2)
    ddp = DDP(copy.deepcopy(ref), find_unused_parameters=True)
    ddp_opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    model = copy.deepcopy(ref)
    model, opt = memsave.wrap(model, torch.optim.Adam(model.parameters(), lr=1e-2), "ddp", mesh=mesh)
    for step in range(4):
        b1 = _local(toy_batch(step, ROWS * world), rank, world)
        b2 = _local(toy_batch(100 + step, ROWS * world), rank, world)
        opt.backward(model(**b1).loss + 0.5 * model(**b2).loss)
        # torch's DDP does not take two forwards before one backward on every torch (2.11: "modified by an
        # inplace operation"): the reference runs the module as is and averages its gradients as DDP would
        with ddp.no_sync():
            (ddp.module(**b1).loss + 0.5 * ddp.module(**b2).loss).backward()
        for p in ddp.parameters():
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        ddp_opt.step()
        opt.zero_grad(set_to_none=False)
        ddp_opt.zero_grad(set_to_none=False)
        for (name, p), q in zip(model.named_parameters(), ddp.module.parameters()):
            assert_same(p, q, f"param {name} after step {step}", world, rtol=1e-5)
            if p.requires_grad:
                assert p.grad is not None and not p.grad.any()
    sd = opt.state_dict()
    plain = torch.optim.Adam(ddp.module.parameters(), lr=1e-2)
    plain.load_state_dict(sd)
    for k, v in plain.state_dict()["state"].items():
        assert_same(v["exp_avg"], ddp_opt.state_dict()["state"][k]["exp_avg"], f"exp_avg {k}", world, rtol=1e-5)
    opt.load_state_dict(plain.state_dict())
    assert model.state_dict().keys() == ref.state_dict().keys()


def _all_cases(world: int) -> str:
    mesh = memsave.init()
    assert mesh.dp_size == world
    rank = mesh.dp_rank
    for case in (case_matches_ddp, case_accumulation_equals_large_batch, case_set_to_none_false_and_two_forwards):
        case(rank, world, mesh)
    return "ok"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dp_engine_equivalence(world: int) -> None:
    assert run_ranks(_all_cases, world, world, timeout=180) == ["ok"] * world
