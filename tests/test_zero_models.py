"""ZeRO on models memsave did not write (Hugging Face GPT-2, nn.Sequential), explicit units, and bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import memsave
from tests.compare import assert_close_norm, assert_same
from tests.harness import run_ranks
from tests.toy import ToyLM, hf_bart, hf_clip, hf_gpt2


def _gpt2() -> nn.Module:
    return hf_gpt2(n_positions=16)


def _sequential() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _train_against_ddp(build, batch_fn, loss_fn, stage: int, world: int, rank: int, mesh, units_fn=None,
                       exact: bool = True) -> None:
    """AdamW, each tensor bitwise equal (see assert_same). ``exact=False``: SGD with momentum, each tensor within
    1e-5 in norm: a weight tied across two units and the root (BART's embedding: encoder, decoder, head) sums its
    three gradients in the order autograd reaches them, which stage 3's hooks on the units' inputs change (an ulp),
    and AdamW's g / sqrt(v) magnifies an ulp of a gradient that is zero in exact arithmetic (a key projection's
    bias, which softmax ignores) to the size of its step."""
    same = assert_same if exact else (lambda a, b, what, world, rtol: assert_close_norm(a, b, what, 1e-5))
    make = ((lambda ps: torch.optim.AdamW(ps, lr=1e-2)) if exact
            else (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)))
    ref = build()
    ddp = DDP(copy.deepcopy(ref))
    ddp_opt = make(ddp.parameters())
    model = copy.deepcopy(ref)
    units = units_fn(model) if units_fn else None
    model, opt = memsave.wrap(model, make(model.parameters()), f"zero{stage}", mesh=mesh, units=units)
    for step in range(4):
        batch = batch_fn(step, rank)
        loss, ref_loss = loss_fn(model, batch), loss_fn(ddp, batch)
        same(loss, ref_loss, f"zero{stage} loss step {step}", world, 1e-6 if step == 0 else 1e-5)
        opt.backward(loss)
        ref_loss.backward()
        opt.step()
        ddp_opt.step()
        opt.zero_grad()
        ddp_opt.zero_grad()
    sd = model.state_dict()
    for k, v in ddp.module.state_dict().items():
        same(sd[k], v, f"zero{stage} {k}", world, 1e-5)


def _hf_batch(step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    return {"input_ids": ids, "labels": ids}


def _bart_batch(step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(3, 64, (2, 12), generator=g)
    return {"input_ids": ids, "labels": ids[:, :6].contiguous()}


def _clip_batch(step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {"input_ids": torch.randint(3, 64, (2, 8), generator=g), "pixel_values": torch.randn(2, 3, 16, 16, generator=g),
            "return_loss": True}


def _clip_gathers(mesh) -> dict:
    """[Note: the units' call order] CLIP under ZeRO-3: the vision tower runs first though registered second. From
    the second step on the units are gathered in the order they run: root + 4 layers in forward, 3 again in backward
    (the last is kept); 12 a step in registration order (the text layers gathered twice in forward, the vision
    layers freed by the text tower's backward and gathered again)."""
    from memsave import dist as mdist

    model, opt = memsave.wrap(m := hf_clip(), torch.optim.SGD(m.parameters(), lr=0.1), "zero3", mesh=mesh)
    calls = []
    for step in range(3):
        with mdist.COMM_STATS.measure() as window:
            opt.backward(model(**_clip_batch(step, mesh.dp_rank)).loss)
        opt.step()
        opt.zero_grad()
        calls.append(window.calls["all_gather"])
    order = [u.name for u in model.memsave_engine.schedule.in_order[1:]]
    return {"gathers": calls, "order": order}


def _seq_batch(step: int, rank: int) -> tuple:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def _cases(world: int) -> str:
    mesh = memsave.init()
    rank = mesh.dp_rank
    for stage in (1, 2, 3):
        # HF GPT-2: keyword arguments, a ModelOutput dataclass, tied wte / lm_head, blocks in transformer.h
        _train_against_ddp(_gpt2, _hf_batch, lambda m, b: m(**b).loss, stage, world, rank, mesh)
        # no nn.ModuleList at all: the Sequential's children by default, then explicit units
        seq_loss = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
        _train_against_ddp(_sequential, _seq_batch, seq_loss, stage, world, rank, mesh)
        _train_against_ddp(_sequential, _seq_batch, seq_loss, stage, world, rank, mesh,
                           units_fn=lambda m: [m[0], m[2], m[4]])
    hf_loss = lambda m, b: m(**b).loss  # noqa: E731
    for stage in (1, 3):  # two layer lists (encoder, decoder); two towers run in another order than registered
        _train_against_ddp(hf_bart, _bart_batch, hf_loss, stage, world, rank, mesh, exact=stage < 3)
        _train_against_ddp(hf_clip, _clip_batch, hf_loss, stage, world, rank, mesh)
    clip = _clip_gathers(mesh)
    assert clip["gathers"] == [12, 8, 8], clip
    assert clip["order"] == [f"{t}_model.encoder.layers.{i}" for t in ("vision", "text") for i in (0, 1)], clip
    return "ok"


@pytest.mark.parametrize("world", [2])
def test_zero_on_foreign_models(world: int) -> None:
    assert run_ranks(_cases, world, world, timeout=300) == ["ok"] * world


def test_default_units_are_the_largest_module_list() -> None:
    model = ToyLM()
    assert memsave.zero.default_units(model) == list(model.blocks)
    seq = _sequential()  # no ModuleList: the Sequential's children that hold parameters
    assert memsave.zero.default_units(seq) == [seq[0], seq[2], seq[4]]


def _errors() -> str:
    mesh = memsave.init()
    model = ToyLM()
    m = copy.deepcopy(model)
    with pytest.raises(ValueError, match="not a parameter of the model"):
        memsave.wrap(m, torch.optim.AdamW(model.parameters()), "zero3", mesh=mesh)
    with pytest.raises(ValueError, match="must not contain the model itself"):
        memsave.wrap(m, torch.optim.AdamW(m.parameters()), "zero3", mesh=mesh, units=[m])
    other = ToyLM()
    m = copy.deepcopy(model)
    with pytest.raises(ValueError, match="not a submodule"):
        memsave.wrap(m, torch.optim.AdamW(m.parameters()), "zero2", mesh=mesh, units=[other.blocks[0]])
    m = copy.deepcopy(model)
    with pytest.raises(NotImplementedError, match="LBFGS"):
        memsave.wrap(m, torch.optim.LBFGS(m.parameters()), "zero3", mesh=mesh)
    # a refused wrap loses nothing: the model is untouched and can be wrapped again
    assert type(m) is ToyLM and torch.equal(m.blocks[0].fc1.weight, model.blocks[0].fc1.weight)
    assert memsave.dist.host_memory_policy() == memsave.dist.HostMemoryPolicy(trim_after_forward=True)
    memsave.wrap(m, torch.optim.AdamW(m.parameters()), "zero3", mesh=mesh)
    # the zero3 preset's host-memory trade (see memsave/dist/host_memory.py) is in force on CPU
    assert memsave.dist.host_memory_policy().mmap_threshold == 8 << 20
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long)).loss.backward()
    opt.step()
    with pytest.raises(ValueError, match="already has state"):
        memsave.wrap(m, opt, "zero2", mesh=mesh)
    m = copy.deepcopy(model)
    with pytest.raises(NotImplementedError, match="units= has no effect"):
        memsave.wrap(m, torch.optim.SGD(m.parameters(), lr=0.1), "ddp", mesh=mesh, units=[m.blocks[0]])
    # stage 1 adds a second synchronizing backward before zero_grad, as torch accumulates (it refused it before)
    m = copy.deepcopy(model)
    m, opt = memsave.wrap(m, torch.optim.SGD(m.parameters(), lr=0.1), "zero1", mesh=mesh)
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.zeros(1, 4, dtype=torch.long)}
    opt.backward(m(**batch).loss)
    once = {k: v.clone() for k, v in opt.full_grads().items() if v is not None}
    opt.backward(m(**batch).loss)
    twice = opt.full_grads()
    for k, v in once.items():
        assert torch.allclose(twice[k], 2 * v, rtol=1e-6, atol=1e-7), k
    return "ok"


def test_bad_input_raises_clear_errors() -> None:
    assert run_ranks(_errors, 1, timeout=120) == ["ok"]
