"""memsave.Trainer: end to end on 1 and 2 ranks, accumulation == large batch, the LR schedule, falling losses,
rank-0-only logging; TrainConfig validation and cosine_schedule in process."""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import memsave
from memsave import MemsaveOptimizer
from memsave.models import GPT, TokenBatches, gpt_config
from memsave.trainer import LogRecord, TrainConfig, Trainer, TrainResult, cosine_schedule
from tests.harness import run_ranks

SEQ = 32


def _tiny(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(gpt_config("tiny"))


def _wrapped(profile: str, mesh: memsave.Mesh, make_opt: Callable[[nn.Module], torch.optim.Optimizer],
             seed: int = 0) -> tuple[nn.Module, MemsaveOptimizer]:
    model = _tiny(seed)
    return memsave.wrap(model, make_opt(model), profile, mesh=mesh)


def _data(mesh: memsave.Mesh, batch_size: int, split: str = "train", seed: int = 0) -> TokenBatches:
    return TokenBatches(seq_len=SEQ, batch_size=batch_size, dp_rank=mesh.dp_rank, dp_size=mesh.dp_size,
                        split=split, seed=seed)


class _MicroBatches:
    """Micro-batch ``m`` of step ``s`` is the ``m``-th slice of rows of ``base.batch(s)``."""

    def __init__(self, base: TokenBatches, micro: int) -> None:
        self.base, self.micro = base, micro

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        step, m = divmod(index, self.micro)
        rows = self.base.batch_size // self.micro
        return {k: v[m * rows : (m + 1) * rows] for k, v in self.base.batch(step).items()}


def case_end_to_end(mesh: memsave.Mesh, profile: str) -> dict:
    """Every profile: 6 steps with accumulation, clipping, periodic evaluation; the result is complete."""
    model, opt = _wrapped(profile, mesh, lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3))
    cfg = TrainConfig(steps=6, micro_batches=2, batch_size=2, seq_len=SEQ, log_every=2, eval_every=3,
                      eval_batches=2, grad_clip=1.0)
    logs: list[LogRecord] = []
    trainer = Trainer(model, opt, mesh=mesh, config=cfg, train_data=_data(mesh, 2),
                      eval_data=_data(mesh, 2, split="val"), on_log=logs.append, profile=profile)
    result = trainer.fit()
    assert isinstance(result, TrainResult)
    assert len(result.losses) == len(result.step_times) == 6 and all(math.isfinite(x) for x in result.losses)
    assert [s for s, _ in result.eval_losses] == [3, 6] and all(math.isfinite(v) for _, v in result.eval_losses)
    assert result.tokens_per_s > 0 and model.training
    assert [r.rank for r in result.report.ranks] == list(range(mesh.world_size))
    assert result.report.profile == profile and result.report.ranks[0].bytes["params"] > 0
    now = memsave.report(model, opt).ranks[mesh.rank].bytes  # (collective)
    if mesh.is_main:
        assert [r.step for r in logs] == [2, 4, 6]
        assert all(r.grad_norm is not None and r.grad_norm > 0 and r.model_state_bytes > 0 for r in logs)
        assert logs[-1].loss == result.losses[-1]
        # the logged model state is the report's (under zero3 it counted each sharded parameter's placeholder)
        assert logs[-1].model_state_bytes == sum(now.get(c, 0) for c in ("params", "grads", "master", "optimizer_state"))
    return {"losses": result.losses, "eval": result.eval_losses}


def case_accumulation_equals_large_batch(mesh: memsave.Mesh) -> None:
    """micro_batches=2 of 2 rows gives the parameters of micro_batches=1 of 4 rows (SGD, within 1e-5)."""
    params = []
    for micro in (2, 1):
        model, opt = _wrapped("ddp", mesh, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), seed=1)
        cfg = TrainConfig(steps=4, micro_batches=micro, batch_size=4 // micro, seq_len=SEQ, log_every=4,
                          grad_clip=None)
        Trainer(model, opt, mesh=mesh, config=cfg, train_data=_MicroBatches(_data(mesh, 4), micro),
                on_log=lambda r: None).fit()
        params.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def case_lr_schedule(mesh: memsave.Mesh) -> None:
    """The multiplier scales every group's initial LR, step by step; a zero multiplier leaves parameters alone."""
    def two_groups(m: nn.Module) -> torch.optim.Optimizer:
        matrices = [p for p in m.parameters() if p.ndim >= 2]
        rest = [p for p in m.parameters() if p.ndim < 2]
        return torch.optim.SGD([{"params": matrices, "lr": 0.1}, {"params": rest, "lr": 0.01}])

    model, opt = _wrapped("zero2", mesh, two_groups)
    schedule = cosine_schedule(2, 6, 0.1)
    logs: list[LogRecord] = []
    cfg = TrainConfig(steps=6, batch_size=2, seq_len=SEQ, log_every=1)
    Trainer(model, opt, mesh=mesh, config=cfg, train_data=_data(mesh, 2), lr_schedule=schedule,
            on_log=logs.append).fit()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1 * schedule(5), 0.01 * schedule(5)])
    if mesh.is_main:
        assert [r.lr for r in logs] == pytest.approx([0.1 * schedule(s) for s in range(6)])

    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(model, opt, mesh=mesh, config=cfg, train_data=_data(mesh, 2), lr_schedule=lambda s: 0.0,
                      on_log=lambda r: None, eval_fn=lambda m: float(not m.training))
    assert trainer.evaluate() == 1.0 and model.training  # eval_fn runs in eval mode; train mode after
    assert trainer.initial_lrs == pytest.approx([0.1 * schedule(5), 0.01 * schedule(5)])
    trainer.fit()
    result = trainer.fit()  # continues from step 6: every step's loss is reduced and the last one logged
    assert trainer.step == 12 and len(result.losses) == 6
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def case_losses_fall(mesh: memsave.Mesh) -> list[float]:
    """30 AdamW steps on the corpus: the loss falls well below its start (ln 256 = 5.55)."""
    model, opt = _wrapped("zero3", mesh, lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3))
    cfg = TrainConfig(steps=30, batch_size=4, seq_len=SEQ, log_every=10)
    result = Trainer(model, opt, mesh=mesh, config=cfg, train_data=_data(mesh, 4),
                     on_log=lambda r: None).fit()
    first, last = sum(result.losses[:3]) / 3, sum(result.losses[-5:]) / 5
    assert first > 5.0 and last < min(4.0, first - 1.2), result.losses
    return result.losses


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def case_logging(mesh: memsave.Mesh) -> dict:
    """Default logging prints a line per interval on rank 0 only; so does progress: the tqdm bar on a terminal,
    plain lines where stderr is not one (here every step: progress_every_s=0)."""
    model, opt = _wrapped("ddp", mesh, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    out: dict[str, Any] = {}
    for name, err in (("terminal", _Terminal()), ("pipe", io.StringIO())):
        stdout = io.StringIO()
        cfg = TrainConfig(steps=5, batch_size=2, seq_len=SEQ, log_every=2, progress=True, grad_clip=None,
                          progress_every_s=0)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(err):
            result = Trainer(model, opt, mesh=mesh, config=cfg, train_data=_data(mesh, 2)).fit()
        out[name] = {"stdout": stdout.getvalue(), "stderr": err.getvalue(), "logs": len(result.logs)}
    return out


def case_errors(mesh: memsave.Mesh) -> None:
    """A plain optimizer, eval_every without eval data, and data of the wrong shape are refused."""
    plain = _tiny()
    with pytest.raises(ValueError, match=r"memsave\.wrap"):
        Trainer(plain, torch.optim.SGD(plain.parameters(), lr=0.1), mesh=mesh, config=TrainConfig(),  # type: ignore[arg-type]
                train_data=_data(mesh, 8))
    model, opt = _wrapped("ddp", mesh, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="eval_every=2 needs eval_data"):
        Trainer(model, opt, mesh=mesh, config=TrainConfig(eval_every=2), train_data=_data(mesh, 8))
    trainer = Trainer(model, opt, mesh=mesh, config=TrainConfig(steps=1, batch_size=3, seq_len=SEQ),
                      train_data=_data(mesh, 2))
    with pytest.raises(ValueError, match=r"shape \(2, 32\) but TrainConfig says batch_size=3"):
        trainer.fit()


def case_fp16_scale_is_logged(mesh: memsave.Mesh) -> None:
    """fp16 with a dynamic scale: overflowed steps are skipped on every rank, and each log line says so."""
    model, opt = _wrapped("zero2-fp16", mesh, lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3))
    assert opt.scaler is not None
    opt.scaler.scale = 2.0**18  # overflows fp16 gradients: the first steps must be skipped, the scale halved
    logs: list[LogRecord] = []
    cfg = TrainConfig(steps=8, batch_size=2, seq_len=SEQ, log_every=1, grad_clip=1.0)
    Trainer(model, opt, mesh=mesh, config=cfg, train_data=_data(mesh, 2), on_log=logs.append).fit()
    if not mesh.is_main:  # logs go to rank 0; the scaler must agree everywhere
        assert opt.scaler.num_skipped >= 1
        return
    scales = [r.loss_scale for r in logs]
    skipped = [r.skipped_steps for r in logs]
    assert skipped[0] == 1 and skipped == sorted(skipped) and skipped[-1] < 8, skipped
    assert all(s is not None for s in scales) and scales[0] == 2.0**17, scales
    assert opt.scaler.num_skipped == skipped[-1] and opt.scaler.scale == scales[-1]
    assert "scale" in logs[0].format() and "skipped" in logs[0].format()


def _all_cases(profiles: tuple[str, ...]) -> dict[str, Any]:
    mesh = memsave.init()
    out: dict[str, Any] = {"end_to_end": {p: case_end_to_end(mesh, p) for p in profiles}}
    case_accumulation_equals_large_batch(mesh)
    case_lr_schedule(mesh)
    out["losses_fall"] = case_losses_fall(mesh)
    out["logging"] = case_logging(mesh)
    case_errors(mesh)
    case_fp16_scale_is_logged(mesh)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_trainer(world: int) -> None:
    profiles = ("ddp", "zero1", "zero2", "zero3")
    results = run_ranks(_all_cases, world, profiles, timeout=180)
    for r in results[1:]:  # losses are dp-averaged, so every rank has the same numbers
        assert r["end_to_end"] == results[0]["end_to_end"] and r["losses_fall"] == results[0]["losses_fall"]
    # the profiles train the same trajectory (fp32 on CPU), up to reduction-order rounding
    ref = results[0]["end_to_end"]["ddp"]["losses"]
    for p in profiles:
        assert results[0]["end_to_end"][p]["losses"] == pytest.approx(ref, rel=1e-5), p
    for name in ("terminal", "pipe"):
        main_log = results[0]["logging"][name]
        assert main_log["logs"] == 3 and main_log["stdout"].count("step ") == 3 and "loss" in main_log["stdout"]
        for r in results[1:]:
            assert r["logging"][name] == {"stdout": "", "stderr": "", "logs": 0}
    bar = results[0]["logging"]["terminal"]["stderr"]
    assert "5/5" in bar and "\r" in bar and "step/s" in bar  # the tqdm bar
    plain = results[0]["logging"]["pipe"]["stderr"]
    assert "\r" not in plain and "step/s" not in plain, plain  # no bar frames in a log file
    lines = plain.splitlines()
    assert [line.split(" |")[0] for line in lines] == [f"train {s}/5 ({100 * s // 5}%)" for s in range(1, 6)], lines
    assert lines[0].split(" | ")[1] == "loss -"  # nothing logged yet after step 1
    assert re.fullmatch(r"train 5/5 \(100%\) \| loss \d\.\d{4} \| [\d,]+ tok/s \| [\d.]+ steps/s \| elapsed "
                        r"00:\d\d, left 00:00", lines[-1]), lines[-1]


def test_resume_with_a_new_learning_rate_uses_it(tmp_path: Any) -> None:
    """A learning rate set anew for the resumed run wins over the checkpoint's, on the saved schedule's position,
    with and without a schedule (the saved one silently replaced it)."""
    mesh = memsave.init()
    for schedule in (cosine_schedule(1, 4, 0.1), None):
        ckpt = tmp_path / ("sched" if schedule else "const")
        lrs: list[float] = []
        for lr, steps in ((1e-3, 2), (1e-4, 4)):  # the second run resumes at step 2 with a tenth of the lr
            model, opt = _wrapped("ddp", mesh, lambda m, lr=lr: torch.optim.AdamW(m.parameters(), lr=lr))
            cfg = TrainConfig(steps=steps, batch_size=2, seq_len=SEQ, ckpt_dir=str(ckpt), save_every=2, log_every=1,
                              resume="latest", progress=False, track_memory=False)
            Trainer(model, opt, mesh=mesh, train_data=_data(mesh, 2), config=cfg, lr_schedule=schedule,
                    on_log=lambda r, lrs=lrs: lrs.append(r.lr)).fit()
        want = [1e-3 * schedule(s) for s in (0, 1)] + [1e-4 * schedule(s) for s in (2, 3)] if schedule else (
            [1e-3, 1e-3, 1e-4, 1e-4])
        assert lrs == pytest.approx(want, rel=1e-9), (schedule, lrs, want)


def test_train_config_validation() -> None:
    TrainConfig(steps=1, grad_clip=None, eval_every=0)
    for field, value in [("steps", 0), ("micro_batches", 0), ("batch_size", -1), ("log_every", 0),
                         ("eval_every", -1), ("grad_clip", 0.0), ("grad_clip", True), ("steps", 2.5),
                         ("progress", 1), ("seed", -1), ("progress_every_s", -1.0), ("progress_every_s", True),
                         ("keep_last", 3)]:  # keep_last without save_every: nothing to prune
        with pytest.raises(ValueError, match=rf"TrainConfig\.{field}={value!r} .*expected"):
            kwargs: dict[str, Any] = {field: value}
            TrainConfig(**kwargs)
    with pytest.raises(ValueError, match=r"TrainConfig has no key 'grad_accum' \(given 4\); allowed: steps, micro_b"):
        TrainConfig(steps=2, grad_accum=4)  # type: ignore[call-arg]


def test_cosine_schedule() -> None:
    f = cosine_schedule(4, 20, 0.1)
    assert [f(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    after = [f(s) for s in range(4, 20)]
    assert after[0] == pytest.approx(1.0) and after[-1] == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(after))
    assert f(12) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 8 / 15)))
    assert cosine_schedule(0, 1, 0.5)(0) == 1.0
    for args in [(5, 4, 0.1), (-1, 4, 0.1), (0, 0, 0.1), (0, 4, 1.5)]:
        with pytest.raises(ValueError, match="cosine_schedule"):
            cosine_schedule(*args)
