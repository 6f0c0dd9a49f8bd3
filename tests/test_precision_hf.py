"""Mixed precision on a model memsave did not write: a Hugging Face GPT-2 (keyword forward, ``ModelOutput``,
``wte`` tied to ``lm_head``), at 2 ranks.

- ``ddp-bf16`` equals, bit for bit, the user's own path: the same bf16 model under torch DDP with the
  standalone :class:`MixedPrecisionOptimizer` (torch DDP all-reduces the bf16 gradients the way memsave does).
- ``zero2-fp16`` (dynamic scale) and ``zero3-bf16`` (with fp32 gradient reduction) track the fp32 DDP run's
  losses within 3% over 4 steps, keep the tied weight tied and stored once, and leave buffers in their dtype.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import memsave
from memsave.precision import LossScaler, MixedPrecisionOptimizer
from tests.harness import run_ranks
from tests.test_hf import gpt2_batch
from tests.toy import hf_gpt2

STEPS = 4


def _fp32_losses(rank: int) -> list[float]:
    model = DDP(hf_gpt2())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = model(**gpt2_batch(step, rank)).loss
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses


def _ddp_bf16_equals_torch_ddp_with_the_standalone_optimizer(rank: int, mesh: memsave.Mesh) -> None:
    ref = hf_gpt2().to(torch.bfloat16)
    ddp = DDP(copy.deepcopy(ref))
    ddp_opt = MixedPrecisionOptimizer(torch.optim.AdamW(ddp.parameters(), lr=1e-2))
    model = hf_gpt2()  # fp32: memsave.wrap casts it
    model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "ddp-bf16", mesh=mesh)
    for step in range(STEPS):
        batch = gpt2_batch(step, rank)
        loss, ref_loss = model(**batch).loss, ddp(**batch).loss
        assert torch.equal(loss, ref_loss), (step, loss, ref_loss)  # HF upcasts logits for the loss
        opt.backward(loss)
        ddp_opt.backward(ref_loss)
        assert torch.equal(opt.clip_grad_norm(1.0), ddp_opt.clip_grad_norm(1.0)), step
        opt.step()
        ddp_opt.step()
        opt.zero_grad()
        ddp_opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ddp.module.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q), name
    for a, b in zip(opt.state_dict()["master_params"], ddp_opt.state_dict()["master_params"]):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def _tracks_fp32(profile: str, overrides: list[str], rank: int, mesh: memsave.Mesh, ref: list[float]) -> None:
    model = hf_gpt2()
    buffers = {n: b.dtype for n, b in model.named_buffers()}
    model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                              memsave.load_profile(profile, overrides), mesh=mesh)
    compute = {"zero2-fp16": torch.float16, "zero3-bf16": torch.bfloat16}[profile]
    assert model.lm_head.weight is model.transformer.wte.weight, "the tied weight must stay tied"
    assert {n: b.dtype for n, b in model.named_buffers()} == buffers, "buffers keep their dtype"
    if profile == "zero2-fp16":
        assert isinstance(opt.scaler, LossScaler)
        opt.scaler.scale = 1024.0  # no overflow at step 1, so every step counts
    n_unique = len({id(p) for p in model.parameters()})
    assert len(opt.state_dict()["master_params"]) == n_unique  # the tied weight has one master
    for step in range(STEPS):
        out = model(**gpt2_batch(step, rank))
        assert out.logits.dtype == compute
        loss = out.loss
        assert abs(loss.item() - ref[step]) <= 3e-2 * ref[step], (profile, step, loss.item(), ref[step])
        opt.backward(loss)
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
    assert opt.mp is not None and not opt.mp.last_step_skipped
    state = model.state_dict()
    assert all(v.dtype == compute for k, v in state.items() if "weight" in k or k.endswith(".bias")), profile


def _cases() -> str:
    mesh = memsave.init()
    rank = mesh.dp_rank
    _ddp_bf16_equals_torch_ddp_with_the_standalone_optimizer(rank, mesh)
    ref = _fp32_losses(rank)
    _tracks_fp32("zero2-fp16", [], rank, mesh, ref)
    _tracks_fp32("zero3-bf16", ['precision.reduce="fp32"'], rank, mesh, ref)
    return "ok"


def test_hf_gpt2_mixed_precision_on_two_ranks() -> None:
    assert run_ranks(_cases, 2, timeout=180) == ["ok", "ok"]


def test_standalone_optimizer_keeps_a_frozen_part_and_fp32_parameters() -> None:
    """A user's own mixed model: a frozen bf16 part gets no master, an fp32 norm is its own master."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1))
    model[0].to(torch.bfloat16).requires_grad_(False)
    model[2].to(torch.bfloat16)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = MixedPrecisionOptimizer(torch.optim.SGD(trainable, lr=0.1), scaler=LossScaler(64.0))
    masters = opt.state_dict()["master_params"]
    assert [m.dtype for m in masters] == [torch.float32] * 4
    norm_w = model[1].weight
    assert any(m is norm_w for g in opt.param_groups for m in g["params"]), "an fp32 parameter is its own master"
    x = torch.randn(4, 8)
    before = model[0].weight.clone()
    for _ in range(3):
        h = model[1](model[0](x.bfloat16()).float())
        loss = model[2](h.bfloat16()).float().pow(2).mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    assert torch.equal(model[0].weight, before) and model[0].weight.grad is None
    assert model[2].weight.dtype == torch.bfloat16 and not opt.last_step_skipped
