"""A NaN loss on one rank: the step is skipped on every rank at every precision and engine (issue 24, item 2).

Before, under ddp, zero3, zero3-bf16 and zero3-infinity every parameter and optimizer moment became NaN on every
rank, ``clip_grad_norm`` returned ``nan`` without a word and training went on. Each case here runs the same loop
twice on 2 gloo ranks: once with rank 1's loss made NaN at step 1, once skipping ``optimizer.step()`` at step 1 by
hand. The two must end bit for bit alike, with every parameter finite.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import memsave
from tests.harness import run_ranks
from tests.toy import ToyLM, toy_batch

STEPS = 4
BAD = 1  # the step whose loss is NaN on rank 1


def _profile(spec: str, offload_dir: str) -> memsave.Profile:
    preset, _, overrides = spec.partition(":")
    more = [o for o in overrides.split(",") if o]
    if preset == "zero3-infinity":
        more.append(f"offload.path={offload_dir!r}")
    return memsave.load_profile(preset, more)


def _run(spec: str, mesh: Any, offload_dir: str, *, nan_at: set[int], skip_at: set[int], clip: bool) -> dict:
    model = ToyLM(n_blocks=2)
    model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _profile(spec, offload_dir),
                              mesh=mesh)
    for step in range(STEPS):
        b = toy_batch(step, 2, seed=50 + mesh.dp_rank)
        loss = model(**b).loss
        if step in nan_at and mesh.dp_rank == 1:
            loss = loss * math.nan
        opt.backward(loss)
        if clip:
            norm = opt.clip_grad_norm(1.0)
            if "fp16" not in spec:  # (fp16's first steps overflow at a scale of 2^16: inf, and skipped, by design)
                assert math.isfinite(norm) != (step in nan_at), (spec, step, norm)  # agreed: nan on both ranks
        if step not in skip_at:
            opt.step()
        opt.zero_grad()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if hasattr(opt, "close"):
        opt.close()
    return sd


def _cases(world: int, offload_dir: str) -> str:
    mesh = memsave.init()
    for spec in ("ddp", "zero1", "zero2", "zero3", "ddp-bf16", "zero3-bf16", "zero3-infinity",
                 "zero2:precision.compute=fp16,precision.loss_scale=dynamic"):
        for clip in (False, True):
            got = _run(spec, mesh, offload_dir, nan_at={BAD}, skip_at=set(), clip=clip)
            want = _run(spec, mesh, offload_dir, nan_at=set(), skip_at={BAD}, clip=clip)
            for k, v in want.items():
                assert torch.isfinite(got[k]).all(), f"{spec} clip={clip}: {k} is not finite"
                if "fp16" not in spec:  # (fp16: the skipped step also halved the loss scale)
                    assert torch.equal(got[k], v), f"{spec} clip={clip}: {k} differs from skipping the step"
    # [precision] nonfinite = "raise": the first non-finite step raises, naming it; the parameters stay as before
    with pytest.raises(RuntimeError, match=rf"step {BAD + 1} is not applied"):
        _run("zero3:precision.nonfinite=raise", mesh, offload_dir, nan_at={BAD}, skip_at=set(), clip=False)
    # max_skipped consecutive skips raise, naming them; fp16 with a scale that cannot fall counts as stuck
    for spec in ("zero2:precision.max_skipped=3",
                 "zero2:precision.compute=fp16,precision.loss_scale=1024,precision.max_skipped=3"):
        with pytest.raises(RuntimeError, match=r"3 consecutive steps \(2 to 4\) were skipped"):
            _run(spec, mesh, offload_dir, nan_at={1, 2, 3}, skip_at=set(), clip=False)
    return "ok"


def test_a_nan_loss_on_one_rank_skips_the_step_everywhere(tmp_path) -> None:
    assert run_ranks(_cases, 2, 2, str(tmp_path), timeout=400) == ["ok"] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.complex64])
def test_the_check_finds_one_nan_or_inf_element(dtype: torch.dtype) -> None:
    """One process (no group): the check's CPU path (each gradient's min and max, memsave/precision/nonfinite.py)
    finds one NaN, inf or -inf element among finite ones, in any floating dtype and in a complex gradient, and
    passes values near the dtype's largest (a sum of squares, a 2-norm, would overflow there)."""
    from memsave.precision import NonfiniteGuard

    big = torch.finfo(torch.float32 if dtype.is_complex else dtype).max
    for bad in (math.nan, math.inf, -math.inf, None):
        for where in (0, 2):  # a large gradient (min and max) or a small one (the small ones' foreach max-norm)
            grads = [torch.full((64, 33), big / 2, dtype=dtype), torch.zeros(0, dtype=dtype),
                     torch.randn(1000, dtype=torch.float32).to(dtype), None]
            if bad is not None:
                grads[where].view(-1)[517] = bad
            assert NonfiniteGuard().found(grads, None) == (bad is not None), (dtype, bad, where)


def test_nonfinite_keys_are_checked() -> None:
    with pytest.raises(ValueError, match=r"precision.nonfinite' = 'ignore'"):
        memsave.load_profile("zero1", ["precision.nonfinite=ignore"])
    with pytest.raises(ValueError, match=r"precision.max_skipped' = 0"):
        memsave.load_profile("zero1", ["precision.max_skipped=0"])


class _Batches:
    def batch(self, step: int) -> dict[str, torch.Tensor]:
        return toy_batch(step, 2)


def test_the_trainer_says_how_many_steps_it_skipped() -> None:
    from memsave.trainer import TrainConfig, Trainer

    model = ToyLM(n_blocks=2)
    calls = {"n": 0}

    def poison(module: torch.nn.Module, args: Any, kwargs: Any, out: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:  # the second step's batch
            out.loss = out.loss * math.nan
        return out

    model.register_forward_hook(poison, with_kwargs=True)
    model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "zero2")
    logs: list[str] = []
    trainer = Trainer(model, opt, mesh=memsave.init(), config=TrainConfig(steps=4, log_every=2, batch_size=2,
                                                                           seq_len=8),
                      train_data=_Batches(), on_log=lambda r: logs.append(r.format()))
    result = trainer.fit()
    assert result.skipped_steps == 1, result.skipped_steps
    assert "| 1 skipped" in logs[-1], logs
    assert all(torch.isfinite(p).all() for p in model.parameters())
