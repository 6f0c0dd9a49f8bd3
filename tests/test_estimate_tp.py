"""The estimator under tensor parallelism: per-rank model-state bytes equal what a wrapped tp rank holds."""

from __future__ import annotations

import torch

import memsave
from memsave.estimator import estimate
from memsave.models.gpt import GPT, gpt_config
from tests.harness import run_ranks


def _held(profile_name: str) -> dict[str, int]:
    profile = memsave.load_profile(profile_name, ["parallel.tp=2"])
    mesh = memsave.init(profile=profile)
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", vocab_size=250))  # 250 rows: 125 per rank, no padding; ties wte and lm_head
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = memsave.wrap(model, opt, profile, mesh=mesh)
    x = torch.randint(0, 250, (2, 16))
    opt.backward(model(x, labels=x).loss)
    opt.step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(t.numel() * t.element_size() for s in opt.optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))  # adam: exp_avg, exp_avg_sq and the step scalar
    return {"params": params, "optimizer_state": state}


def test_estimate_per_tp_rank_equals_the_wrapped_rank() -> None:
    with torch.device("meta"):
        meta = GPT(gpt_config("tiny", vocab_size=250))
    est = estimate(meta, memsave.load_profile("ddp", ["parallel.tp=2"]), world_size=2, device="cpu")
    held = run_ranks(_held, 2, "ddp", timeout=120)
    for rank in held:  # both tp ranks hold the same bytes (the vocabulary divides by tp)
        assert rank["params"] == est.bytes["params"]
        assert rank["optimizer_state"] == est.bytes["optimizer_state"]
    assert any("tensor parallel:" in n and "replicated over tp" in n for n in est.notes)
    # the tp split is exact: (split parameters) / tp + replicated ones
    with torch.device("meta"):
        whole = GPT(gpt_config("tiny", vocab_size=250))
    one = estimate(whole, "ddp", world_size=1, device="cpu").bytes["params"]
    replicated = 4 * sum(p.numel() for n, p in whole.named_parameters() if "ln" in n or n == "wpe.weight"
                         or n.endswith("attn_proj.bias") or n.endswith("mlp_proj.bias"))
    assert est.bytes["params"] == (one - replicated) // 2 + replicated
