"""The ``ddp`` profile on models memsave did not write, against torch DDP, bitwise at 2 ranks.

A Hugging Face GPT-2 built from a small config (no download): keyword-argument forward, a ``ModelOutput``
dataclass, ``wte`` tied to ``lm_head``, blocks in ``transformer.h``; dropout off so both runs see the same
function. And a model with no ``nn.ModuleList`` at all (``nn.Sequential``).
"""

from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import memsave
from tests.harness import run_ranks
from tests.toy import hf_gpt2

STEPS = 4


gpt2 = hf_gpt2


def sequential() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def gpt2_batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, 64, (2, 16), generator=g)  # (B, T)
    return {"input_ids": ids, "labels": ids}  # GPT-2 shifts the labels itself


def gpt2_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def sequential_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)  # (B, in), (B, out)


def sequential_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def train_against_ddp(build: Callable[[], nn.Module], batch_fn: Callable, loss_fn: Callable, rank: int,
                      mesh: memsave.Mesh) -> nn.Module:
    """Train a copy under memsave's ``ddp`` profile and one under torch DDP, comparing after every step."""
    ref = build()
    ddp = DDP(copy.deepcopy(ref))
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    model = copy.deepcopy(ref)
    model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), "ddp",
                              mesh=mesh)
    assert isinstance(model, type(ref)) and isinstance(model, memsave.MemsaveModule)
    for step in range(STEPS):
        batch = batch_fn(step, rank)
        loss, ref_loss = loss_fn(model, batch), loss_fn(ddp, batch)
        assert torch.equal(loss, ref_loss), f"step {step}: loss {loss.item()} != DDP {ref_loss.item()}"
        opt.backward(loss)
        ref_loss.backward()
        for (name, p), q in zip(model.named_parameters(), ddp.module.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {step}: grad of {name} differs from DDP"
        norm = opt.clip_grad_norm(1.0)
        assert torch.equal(norm, nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)), f"step {step}: grad norm"
        opt.step()
        ddp_opt.step()
        opt.zero_grad()
        ddp_opt.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ddp.module.parameters()):
            assert torch.equal(p, q), f"step {step}: {name} differs from DDP by {(p - q).abs().max().item():.3g}"
    state, ref_state = model.state_dict(), ddp.module.state_dict()
    assert state.keys() == ref_state.keys()
    for key, value in ref_state.items():
        assert torch.equal(state[key], value), key
    return model


def _cases() -> str:
    mesh = memsave.init()
    assert mesh.dp_size == 2
    rank = mesh.dp_rank
    model = train_against_ddp(gpt2, gpt2_batch, gpt2_loss, rank, mesh)
    assert model.lm_head.weight is model.transformer.wte.weight, "wrap must keep the tied embedding tied"
    assert type(model).__name__ == "GPT2LMHeadModel"
    with tempfile.TemporaryDirectory() as folder:  # transformers writes type(model).__name__ into config.json
        model.save_pretrained(folder, is_main_process=rank == 0)
        if rank == 0:
            config = json.loads((Path(folder) / "config.json").read_text())
            assert config["architectures"] == ["GPT2LMHeadModel"], config["architectures"]
    model = train_against_ddp(sequential, sequential_batch, sequential_loss, rank, mesh)
    assert isinstance(model, nn.Sequential) and len(model) == 6
    return "ok"


def test_hf_gpt2_and_sequential_match_ddp_bitwise_on_two_ranks() -> None:
    assert run_ranks(_cases, 2, timeout=120) == ["ok", "ok"]


def test_save_pretrained_of_a_tied_model_under_zero3_writes_the_tie_once(tmp_path: Path) -> None:
    """ZeRO-3's gathered state dict gives a tied weight's names one tensor, as a plain model's shares one storage:
    with two copies Hugging Face's save_pretrained could not see the tie and wrote lm_head.weight as well."""
    from safetensors import safe_open

    keys = {}
    for profile in ("ddp", "zero3"):
        model, _ = memsave.wrap(m := hf_gpt2(), torch.optim.AdamW(m.parameters()), profile)
        model.save_pretrained(tmp_path / profile)
        with safe_open(str(tmp_path / profile / "model.safetensors"), "pt") as f:
            keys[profile] = set(f.keys())
    assert keys["zero3"] == keys["ddp"] and "lm_head.weight" not in keys["zero3"], keys["zero3"] ^ keys["ddp"]
