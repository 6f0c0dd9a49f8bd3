"""ZeRO on models memsave did not write (Hugging Face GPT-2, nn.Sequential), explicit units, and bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import memsave
from tests.compare import assert_same
from tests.harness import run_ranks
from tests.toy import ToyLM, hf_gpt2


def _gpt2() -> nn.Module:
    return hf_gpt2(n_positions=16)


def _sequential() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _train_against_ddp(build, batch_fn, loss_fn, stage: int, world: int, rank: int, mesh, units_fn=None) -> None:
    ref = build()
    ddp = DDP(copy.deepcopy(ref))
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    model = copy.deepcopy(ref)
    units = units_fn(model) if units_fn else None
    model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), f"zero{stage}",
                              mesh=mesh, units=units)
    for step in range(4):
        batch = batch_fn(step, rank)
        loss, ref_loss = loss_fn(model, batch), loss_fn(ddp, batch)
        assert_same(loss, ref_loss, f"zero{stage} loss step {step}", world, 1e-6 if step == 0 else 1e-5)
        opt.backward(loss)
        ref_loss.backward()
        opt.step()
        ddp_opt.step()
        opt.zero_grad()
        ddp_opt.zero_grad()
    sd = model.state_dict()
    for k, v in ddp.module.state_dict().items():
        assert_same(sd[k], v, f"zero{stage} {k}", world, 1e-5)


def _hf_batch(step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    return {"input_ids": ids, "labels": ids}


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
