"""Optimizer-state offload inside pipeline stages: each stage's ZeRO shards stream from disk, and a pipeline step
trains exactly as the same pipeline with the state in memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import memsave
from memsave.models import GPT, TokenBatches, gpt_config
from tests.harness import run_ranks


def _losses(folder: str) -> dict[str, list[float]]:
    mesh = memsave.init(pp=2)
    out = {}
    for name, extra in (("memory", []), ("disk", ['offload.optimizer="disk"', "offload.overlap=false",
                                                  f"offload.path={folder + '/' + str(mesh.rank)!r}"])):
        torch.manual_seed(0)
        model = GPT(gpt_config("small", dropout=0.0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        prof = memsave.load_profile("zero1", ["parallel.pp=2", *extra])
        model, opt = memsave.wrap(model, opt, prof, mesh=mesh)
        data = TokenBatches(seq_len=32, batch_size=2)
        losses = []
        for step in range(3):
            losses.append(float(model.pipeline_step([data.batch(4 * step + i) for i in range(4)])))
            opt.step()
            opt.zero_grad()
        out[name] = losses
        if name == "disk":
            out["offloaded_bytes"] = [float(sum(opt.offloaded.offloaded_bytes().values()))]
    with pytest.raises(NotImplementedError, match="overlap = true with"):
        model = GPT(gpt_config("small", dropout=0.0))
        memsave.wrap(model, torch.optim.AdamW(model.parameters()), memsave.load_profile(
            "zero3-infinity", ["parallel.pp=2", f"offload.path={folder + '/x' + str(mesh.rank)!r}"]), mesh=mesh)
    return out


def test_offloaded_state_in_pipeline_stages_trains_equal(tmp_path: Path) -> None:
    for rank in run_ranks(_losses, 2, str(tmp_path), timeout=180):
        assert rank["disk"] == rank["memory"], rank
        assert rank["offloaded_bytes"][0] > 0
