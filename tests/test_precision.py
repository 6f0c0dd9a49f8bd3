"""The dynamic loss scaler and the loss-scaled optimizer on its own (fp16/bf16 with fp32 master weights)."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import nn

import memsave
from memsave.phases import MemoryCategory
from memsave.precision import LossScaler, MixedPrecisionOptimizer
from tests.harness import run_ranks
from tests.toy import ToyLM, toy_batch

# -- the scaler's schedule --------------------------------------------------------------------------------------


def test_scale_grows_after_the_interval_and_backs_off_on_overflow() -> None:
    s = LossScaler(1024.0, growth_interval=3, max_scale=4096.0, min_scale=256.0)
    for _ in range(2):
        s.update(False)
    assert s.scale == 1024.0
    s.update(False)
    assert s.scale == 2048.0  # grown after 3 good steps
    s.update(False)
    s.update(True)
    assert s.scale == 1024.0 and s.good_steps == 0  # halved, and the interval starts over
    for _ in range(3):
        s.update(False)
    for _ in range(3):
        s.update(False)
    assert s.scale == 4096.0  # capped at max_scale
    for _ in range(5):
        s.update(True)
    assert s.scale == 256.0  # floored at min_scale
    assert (s.num_steps, s.num_skipped) == (16, 6)


def test_hysteresis_tolerates_overflows_before_backing_off() -> None:
    s = LossScaler(1024.0, hysteresis=2, growth_interval=100)
    s.update(True)
    assert s.scale == 1024.0 and s.num_skipped == 1  # skipped, scale kept
    s.update(True)
    assert s.scale == 512.0  # the second overflow backs off
    s.update(True)
    assert s.scale == 512.0


def test_fixed_scale_never_moves_but_still_skips() -> None:
    s = LossScaler(128.0, dynamic=False, growth_interval=1)
    for overflow in (False, True, False, False):
        s.update(overflow)
    assert s.scale == 128.0 and s.num_skipped == 1


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"init_scale": 0.0}, "init_scale"), ({"init_scale": math.inf}, "init_scale"),
    ({"growth_factor": 1.0}, "growth_factor"), ({"backoff_factor": 1.0}, "backoff_factor"),
    ({"growth_interval": 0}, "growth_interval"), ({"hysteresis": 0}, "hysteresis"),
    ({"min_scale": 2.0**20}, "min_scale"), ({"max_scale": 1.0}, "max_scale"),
])
def test_bad_scaler_settings_are_refused(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        LossScaler(**kwargs)


def test_unscale_and_check_finds_inf_and_nan() -> None:
    s = LossScaler(4.0)
    grads = [torch.tensor([4.0, 8.0]), torch.tensor([2.0])]
    assert s.unscale_and_check(grads) is False
    assert torch.equal(grads[0], torch.tensor([1.0, 2.0])) and torch.equal(grads[1], torch.tensor([0.5]))
    assert s.unscale_and_check([torch.tensor([1.0, math.nan])]) is True
    assert s.unscale_and_check([torch.tensor([1.0], dtype=torch.float16), torch.tensor([math.inf])]) is True


# -- the loss-scaled optimizer ----------------------------------------------------------------------------------


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0, clip: float | None = None,
           mp: bool = True) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        loss = model(**toy_batch(step, 4)).loss
        losses.append(loss.item())
        if mp:
            opt.backward(loss)  # type: ignore[attr-defined]
            if clip is not None:
                opt.clip_grad_norm(clip)  # type: ignore[attr-defined]
        else:
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses


@pytest.mark.parametrize(("dtype", "scaler", "rtol"), [
    (torch.float16, LossScaler(2.0**12), 2e-2),  # fp16: 11-bit mantissa, activations rounded at every op
    (torch.bfloat16, None, 6e-2),  # bf16: 8-bit mantissa, no scaling needed (fp32's range)
])
def test_low_precision_tracks_fp32(dtype: torch.dtype, scaler: LossScaler | None, rtol: float) -> None:
    """Over 8 steps the losses stay within ``rtol`` (relative) of the fp32 run's, and fall like them."""
    ref = ToyLM(seed=2)
    ref_losses = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), 8, clip=1.0, mp=False)
    model = ToyLM(seed=2).to(dtype)
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), scaler=copy.deepcopy(scaler))
    losses = _train(model, opt, 8, clip=1.0)
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= rtol * abs(b), (step, a, b)
    assert losses[-1] < losses[0] - 1.0
    assert all(p.dtype == dtype for p in model.parameters())
    assert not opt.last_step_skipped


def test_overflow_skips_the_step_and_leaves_everything_bit_identical() -> None:
    model = ToyLM(seed=3).half()
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  scaler=LossScaler(2.0**10, growth_interval=2))
    _train(model, opt, 2)
    assert opt.loss_scale == 2.0**11  # grown once after 2 good steps
    before = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    opt.backward(model(**toy_batch(5, 4)).loss)
    model.blocks[1].fc1.weight.grad[0, 0] = math.inf  # one overflowed element
    assert opt.clip_grad_norm(1.0).item() == math.inf
    opt.step()
    opt.zero_grad()
    assert opt.last_step_skipped and opt.scaler is not None and opt.scaler.num_skipped == 1
    assert opt.loss_scale == 2.0**10  # halved
    for k, v in before[0].items():
        assert torch.equal(model.state_dict()[k], v), k
    after = opt.state_dict()
    for a, b in zip(after["master_params"], before[1]["master_params"]):
        assert torch.equal(a, b)
    for k, st in before[1]["state"].items():
        for key, v in st.items():
            assert torch.equal(after["state"][k][key], v), (k, key)
    _train(model, opt, 1, start=6)  # and training goes on
    assert not opt.last_step_skipped


def test_clipping_after_unscaling_gives_the_fp32_norm() -> None:
    ref = ToyLM(seed=4)
    model = ToyLM(seed=4).half()
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})  # the same (fp16-rounded) weights
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=LossScaler(2.0**14))
    opt.backward(model(**toy_batch(0, 4)).loss)
    ref(**toy_batch(0, 4)).loss.backward()
    norm = opt.clip_grad_norm(0.5)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    assert abs(norm.item() - ref_norm.item()) <= 1e-2 * ref_norm.item(), (norm, ref_norm)  # fp16 activations
    clipped = torch.cat([m.grad.flatten() for m, _ in opt._pairs if m.grad is not None])
    assert abs(clipped.norm().item() - 0.5) <= 1e-4


def test_state_dict_round_trip_resumes_bit_for_bit() -> None:
    def fresh() -> tuple[nn.Module, MixedPrecisionOptimizer]:
        m = ToyLM(seed=5).half()
        return m, MixedPrecisionOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2),
                                          scaler=LossScaler(2.0**8, growth_interval=2))

    straight, straight_opt = fresh()
    _train(straight, straight_opt, 6)
    model, opt = fresh()
    _train(model, opt, 3)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    assert saved[1]["loss_scaler"]["scale"] == 2.0**9
    resumed, resumed_opt = fresh()
    resumed.load_state_dict(saved[0])
    resumed_opt.load_state_dict(saved[1])
    assert resumed_opt.loss_scale == 2.0**9
    _train(resumed, resumed_opt, 3, start=3)
    for k, v in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k
    assert resumed_opt.state_dict()["loss_scaler"] == straight_opt.state_dict()["loss_scaler"]


def test_bytes_held_are_low_precision_params_plus_fp32_masters() -> None:
    model = ToyLM(seed=6).half()
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), scaler=LossScaler(2.0**8))
    _train(model, opt, 1)
    assert not opt.last_step_skipped
    acct = memsave.memory.account([opt]).bytes
    psi = sum(p.numel() for p in model.parameters())  # tied weights counted once
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_trainable = sum(1 for p in model.parameters() if p.requires_grad)
    assert acct[MemoryCategory.PARAMS.value] == 2 * psi
    assert acct[MemoryCategory.MASTER.value] == 4 * psi  # frozen ones too: they keep their master
    assert acct[MemoryCategory.OPTIMIZER_STATE.value] == 8 * trainable + 4 * n_trainable  # m, v, step


def test_the_default_scale_overflows_fp16_at_first_and_backs_off_until_steps_are_taken() -> None:
    model = ToyLM(seed=6).half()  # loss ~13: 13 * 2^16 is above fp16's max (65504)
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), scaler=LossScaler())
    losses = _train(model, opt, 8)
    assert opt.scaler is not None and 1 <= opt.scaler.num_skipped < 8 and opt.loss_scale < 2.0**16
    assert not opt.last_step_skipped and losses[-1] < losses[0]


def test_wrong_use_is_refused() -> None:
    m = ToyLM().half()
    opt = torch.optim.AdamW(m.parameters())
    with pytest.raises(ValueError, match="LossScaler"):
        MixedPrecisionOptimizer(opt, scaler=2.0**16)  # type: ignore[arg-type]
    _train(m, opt, 1, mp=False)
    with pytest.raises(ValueError, match="already has state"):
        MixedPrecisionOptimizer(opt, scaler=LossScaler())



def _scaler_loop(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> list[float]:
    """The usual torch AMP loop: autocast, GradScaler, unscale_ before clipping."""
    scaler, losses = torch.amp.GradScaler("cpu", init_scale=2.0**4), []
    for step in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**toy_batch(step, 4)).loss.float()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        clip = getattr(opt, "clip_grad_norm", None)
        clip(0.5) if clip is not None else torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def test_grad_scaler_trains_under_fp32_and_is_refused_under_a_half_profile() -> None:
    """torch's AMP loop (autocast + GradScaler) under an fp32 ZeRO-3 profile equals plain torch; on a bf16 profile
    (which scales by itself) GradScaler is refused by name at its step, not torch's bare "No inf checks"."""
    ref = ToyLM(seed=3)
    want = _scaler_loop(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2))
    model, opt = memsave.wrap(m := ToyLM(seed=3), torch.optim.AdamW(m.parameters(), lr=1e-2), "zero3")
    assert _scaler_loop(model, opt) == pytest.approx(want, rel=1e-6)
    got = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)
    half = memsave.load_profile("zero2", ["precision.compute='bf16'"])
    for which in ("returned", "kept"):  # scaler.step on the optimizer object built before wrap: refused alike
        kept = torch.optim.AdamW((m := ToyLM(seed=3)).parameters(), lr=1e-2)
        model, opt = memsave.wrap(m, kept, half)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(NotImplementedError, match="GradScaler on a model wrapped with a bf16/fp16 profile"):
            if which == "returned":
                _scaler_loop(model, opt, 1)
            else:  # (torch's clip over the model's parameters would refuse first: straight to the step)
                scaler = torch.amp.GradScaler("cpu")
                scaler.scale(model(**toy_batch(0, 4)).loss.float()).backward()
                scaler.step(kept)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing stepped

def _scaler_overflow_ranks() -> dict[str, Any]:
    """GradScaler under each fp32 profile at 2 ranks, an inf in one gradient element of rank 1 at step 1."""
    mesh = memsave.init()
    out: dict[str, Any] = {}
    for profile in ("ddp", "zero1", "zero2", "zero3", "zero2 (the optimizer object built before wrap)"):
        kept = torch.optim.AdamW((m := ToyLM(seed=3)).parameters(), lr=1e-2)
        model, opt = memsave.wrap(m, kept, profile.split()[0], mesh=mesh)
        stepped = kept if "before wrap" in profile else opt  # scaler.step(optimizer) with the old name
        scaler, scales, skipped = torch.amp.GradScaler("cpu", init_scale=2.0**4), [], []
        for step in range(3):
            hook = (model.embed.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([3]), math.inf))
                    if step == 1 and mesh.dp_rank == 1 else None)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(**toy_batch(10 * step + mesh.dp_rank, 2)).loss.float()
            scaler.scale(loss).backward()
            if hook is not None:
                hook.remove()
            if step == 2:
                scaler.unscale_(stepped)  # the user's unscale_ (before clipping), then the step
            scaler.step(stepped)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
            skipped.append(opt.step_was_skipped)
        out[profile] = (scales, skipped, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()})
    return out


def test_grad_scaler_skips_an_overflow_on_every_rank_alike() -> None:
    """[Note: one skip decision for GradScaler] Under ZeRO an inf in one rank's rows made GradScaler skip the step
    there only: the ranks diverged (a control-flow error, or a collective timeout) and their scales would have.
    Now every rank skips and backs off alike, and the parameters equal ddp's (torch DDP's, bit for bit)."""
    results = run_ranks(_scaler_overflow_ranks, 2, timeout=240)
    ddp = results[0]["ddp"]
    assert ddp[0] == [16.0, 8.0, 8.0] and ddp[1] == [False, True, False], ddp[:2]
    for rank, out in enumerate(results):
        for profile, (scales, skipped, state) in out.items():
            assert (scales, skipped) == (ddp[0], ddp[1]), (rank, profile, scales, skipped)
            for k, v in ddp[2].items():
                torch.testing.assert_close(torch.from_numpy(state[k]), torch.from_numpy(v), rtol=1e-5, atol=1e-6,
                                           msg=f"{rank} {profile} {k}")


# -- agreement across ranks -------------------------------------------------------------------------------------


def _overflow_on_one_rank(world: int) -> tuple[float, int, bool]:
    mesh = memsave.init()
    model = ToyLM(seed=7).half()  # each rank its own copy, own data: gradients differ between ranks
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), scaler=LossScaler(2.0**10),
                                  group=mesh.dp_group)
    before = copy.deepcopy(model.state_dict())
    opt.backward(model(**toy_batch(mesh.dp_rank, 4)).loss)
    if mesh.dp_rank == world - 1:
        model.embed.weight.grad[3, 0] = math.nan
    opt.step()
    unchanged = all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert opt.scaler is not None
    return opt.loss_scale, opt.scaler.num_skipped, unchanged


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank() -> None:
    assert run_ranks(_overflow_on_one_rank, 2, 2, timeout=120) == [(2.0**9, 1, True)] * 2


def _trainer_logs_scale() -> tuple[list[float], list[tuple[float | None, int]]]:
    from memsave.models import GPT, TokenBatches, gpt_config
    from memsave.trainer import LogRecord, TrainConfig, Trainer

    mesh = memsave.init()
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny")).half()
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), scaler=LossScaler())
    logs: list[LogRecord] = []
    cfg = TrainConfig(steps=8, batch_size=4, seq_len=32, log_every=4, grad_clip=1.0)
    result = Trainer(model, opt, mesh=mesh, config=cfg, train_data=TokenBatches(seq_len=32, batch_size=4),
                     on_log=logs.append).fit()
    return result.losses, [(r.loss_scale, r.skipped_steps) for r in logs]


def test_the_trainer_runs_the_loss_scaled_optimizer_and_logs_its_scale() -> None:
    [(losses, logged)] = run_ranks(_trainer_logs_scale, 1, timeout=120)
    assert losses[-1] < losses[0] and all(math.isfinite(x) for x in losses)
    assert [scale is not None and scale <= 2.0**16 for scale, _ in logged] == [True, True]
    assert logged[-1][1] >= logged[0][1]  # skipped steps only accumulate


def test_float_inputs_in_a_dataclass_or_a_batch_encoding_are_cast() -> None:
    """A bf16 profile casts the float tensors among the forward's inputs inside dataclasses and a tokenizer's
    BatchEncoding too (torch's pytree took them for opaque leaves: fp32 met the bf16 weights and raised), leaving
    the user's batch as it was."""
    import dataclasses

    from transformers import BatchEncoding

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        n: int = 0

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

        def forward(self, batch: object) -> torch.Tensor:
            h = batch.x if isinstance(batch, Batch) else batch["x"]  # type: ignore[index]
            for b in self.blocks:
                h = b(h)
            return h.float().pow(2).mean()

    model = Net()
    model, _ = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), "ddp-bf16")
    x = torch.randn(3, 4)
    want = model({"x": x})
    for batch in (Batch(x, n=2), BatchEncoding({"x": x}), [{"x": x}][0]):
        assert torch.equal(model(batch), want), type(batch).__name__
    assert x.dtype == torch.float32


@pytest.mark.parametrize("profile", ["ddp-bf16", "zero2-bf16", "zero3-bf16"])
def test_batchnorm_and_spectral_norm_train_under_bf16_and_copy_back_to_fp32(profile: str) -> None:
    """BatchNorm's running statistics and spectral_norm's power-iteration vectors (both forms) are cast with their
    weights: torch's kernels refuse bf16 weights with fp32 statistics ("expected scalar type BFloat16 but found
    Float", "addmv input tensors must have the same dtype"). The model trains close to fp32 training, every
    other buffer keeps its dtype, and ``copy.deepcopy`` (an EMA copy) gets the fp32 dtypes of both back."""
    def build() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                              nn.utils.parametrizations.spectral_norm(nn.Linear(4 * 6 * 6, 8)),
                              nn.utils.spectral_norm(nn.Linear(8, 8)), nn.BatchNorm1d(8, affine=False),
                              nn.Linear(8, 5))
        model.register_buffer("scale", torch.ones(()))
        return model

    def train(model: nn.Module, opt: torch.optim.Optimizer) -> list[float]:
        losses = []
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)
            loss = nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    ref = build()
    ref_losses = train(ref, torch.optim.SGD(ref.parameters(), lr=0.1))
    model = build()
    model, opt = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), profile, mesh=memsave.init())
    losses = train(model, opt)
    assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < 0.05, (losses, ref_losses)
    assert model[1].running_mean.dtype == torch.bfloat16 and model[1].num_batches_tracked.item() == 3
    assert model[6].running_mean.dtype == torch.float32 and model.scale.dtype == torch.float32  # no weight beside
    assert model[4].parametrizations.weight[0]._u.dtype == torch.bfloat16 and model[5].weight_u.dtype == torch.bfloat16
    # an EMA copy (torch cannot deep-copy the old hook-based spectral_norm: a model without it)
    small = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    small, _ = memsave.wrap(small, torch.optim.SGD(small.parameters(), lr=0.1), profile, mesh=memsave.init())
    small(torch.randn(4, 3)).float().sum().backward()
    ema = copy.deepcopy(small)
    assert all(t.dtype == torch.float32 for t in [*ema.parameters(), *ema.buffers()] if t.is_floating_point())
    assert ema.eval()(torch.randn(2, 3)).isfinite().all()
