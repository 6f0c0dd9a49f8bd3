"""Recomputation inside pipeline stages under every backward shape: full B (1F1B) and the zero-bubble split (I,
then W over the same graph, which selective recomputation's cache must survive). A unit is rebuilt once per
backward pass: once per micro-batch under 1F1B, twice under zero-bubble (I and W), not once per group of weights
([Note: one recomputation per weight pass] in memsave/pp/split_backward.py)."""

from __future__ import annotations

import torch

import memsave
from memsave.models import GPT, TokenBatches, gpt_config
from tests.harness import run_ranks


def _losses() -> dict[str, list[float]]:
    mesh = memsave.init(pp=2)
    out = {}
    for sched in ("1f1b", "zero-bubble"):
        for rec in ("none", "selective", "full"):
            torch.manual_seed(0)
            model = GPT(gpt_config("small", dropout=0.0))
            calls = [0]  # forwards of the MLP's first Linear in this rank's blocks, rebuilds included
            for block in model.blocks:
                block.mlp_fc.register_forward_hook(lambda *_, c=calls: c.__setitem__(0, c[0] + 1))
            prof = memsave.load_profile("ddp", ["parallel.pp=2", f"parallel.schedule={sched!r}",
                                                f"recompute.policy={rec!r}"])
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            model, opt = memsave.wrap(model, opt, prof, mesh=mesh)
            data = TokenBatches(seq_len=32, batch_size=1)
            losses = []
            for step in range(3):
                if step == 2:  # past the pipeline's probe
                    calls[0] = 0
                loss = model.pipeline_step([data.batch(4 * step + i) for i in range(4)])
                opt.step()
                opt.zero_grad()
                losses.append(float(loss) if loss is not None else float("nan"))
            out[f"{sched}/{rec}"] = losses
            out[f"calls {sched}/{rec}"] = [calls[0] / (4 * len(model.memsave_engine.runner.local_stages))]
    return out


def test_recompute_under_every_backward_shape_is_exact() -> None:
    """Losses bit-equal to the same schedule without recomputation, and 1F1B equal to zero-bubble."""
    for rank, last in enumerate(run_ranks(_losses, 2, timeout=180)):
        # per block and micro-batch: the forward, and a rebuild per backward pass (the first stage has no input to
        # send a gradient to: its I is empty, and W is its whole backward)
        blocks = 2
        for sched, passes in (("1f1b", 1), ("zero-bubble", 2 if rank else 1)):
            assert last.pop(f"calls {sched}/none") == [blocks]
            for rec in ("selective", "full"):
                assert last.pop(f"calls {sched}/{rec}") == [blocks * (1 + passes)], (sched, rec)
    ref = last["1f1b/none"]  # the rank with the loss
    for key, losses in last.items():
        assert losses == ref, (key, losses, ref)
