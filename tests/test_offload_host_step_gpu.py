"""The offloaded step on the host while training on CUDA ([Note: host step] in memsave/offload/host_step.py):
``[offload] step = "host"`` with the state in host memory or on disk, stages 2-3, fp32 and bf16 (masters on the
host), parameters in pinned memory; a state dict round trip and the
model's weights loaded after wrap. The CPU kernel and the device's differ in the last bits, so the reference (no
offload, the step on the device) is matched to a tolerance; two host-step runs match each other bit for bit.
Marked ``gpu``: skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import memsave
from memsave.phases import MemoryCategory
from tests.test_offload_gpu import _run
from tests.toy import ToyLM, param_groups, toy_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HOST = ("offload.optimizer=cpu", "offload.step=host", "offload.chunk_mb=0.004")
BF16 = ('precision.compute="bf16"',)


def _close(run: dict, ref: dict, bf16: bool) -> None:
    for a, b in zip(run["losses"], ref["losses"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for name, v in ref["params"].items():  # bf16: a master a few ulp apart may round to the next bf16 value
        torch.testing.assert_close(run["params"][name].float(), v.float(), rtol=1 / 64 if bf16 else 1e-4,
                                   atol=1e-5, msg=name)


def _equal(a: dict, b: dict) -> None:
    for x, y in zip(a["losses"], b["losses"], strict=True):
        assert torch.equal(x, y)
    for name, v in a["params"].items():
        assert torch.equal(b["params"][name], v), name


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("compute", ["fp32", "bf16"])
def test_host_step_trains_like_the_device_step_and_leaves_nothing_on_the_device(stage: int, compute: str) -> None:
    prec = BF16 if compute == "bf16" else ()
    ref = _run(prec, stage)
    run = _run((*prec, *HOST), stage)
    _close(run, ref, compute == "bf16")
    opt = run["opt"]
    assert opt.offloaded._staging is not None and list(opt.offloaded.memory_tensors()) == []
    own = sum(s.numel() for s in opt._full_of if s.requires_grad)
    assert opt.offloaded_bytes()["host"] >= (8 if compute == "fp32" else 12) * own
    held = run["held"]
    assert held.get(MemoryCategory.OPTIMIZER_STATE.value, 0) == 0, held
    assert held.get(MemoryCategory.MASTER.value, 0) == 0, held
    again = _run((*prec, *HOST), stage)
    _equal(run, again)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_disk_offload_on_cuda_steps_on_the_host(prefetch: int, tmp_path: Path) -> None:
    """``optimizer = "disk"`` on CUDA: the files are read into host window buffers (step "auto" = host)."""
    ref = _run(BF16, 3)
    over = (*BF16, "offload.optimizer=disk", f"offload.path={tmp_path}", "offload.chunk_mb=0.004",
            f"offload.prefetch={prefetch}")
    run = _run(over, 3)
    _close(run, ref, True)
    opt = run["opt"]
    own = sum(s.numel() for s in opt._full_of if s.requires_grad)
    assert opt.offloaded_bytes()["disk"] >= 12 * own
    assert run["held"].get(MemoryCategory.OPTIMIZER_STATE.value, 0) == 0
    opt.close()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("memsave-offload-")], list(tmp_path.iterdir())


def test_host_step_with_parameters_in_pinned_memory() -> None:
    ref = _run(BF16, 3)
    run = _run((*BF16, *HOST, "offload.params=cpu"), 3)
    _close(run, ref, True)
    shards = [u for u in run["opt"].param_offload.units if u.flat_shard.numel()]
    assert shards and all(u.flat_shard.untyped_storage().nbytes() == 0 for u in shards)


@pytest.mark.parametrize("compute", ["fp32", "bf16"])
def test_host_step_round_trips_a_state_dict_and_follows_loaded_weights(compute: str) -> None:
    """A checkpoint loads into another host-step run and both continue alike; then ``model.load_state_dict`` of
    other weights after wrap: the next step starts from them (the host masters follow), as without offload."""
    prec = BF16 if compute == "bf16" else ()
    first = _run((*prec, *HOST), 3, steps=2)
    second = _run((*prec, *HOST), 3, steps=1)
    second["model"].load_state_dict(first["params"])
    second["opt"].load_state_dict(first["state"])
    ref = _run(prec, 3, steps=2)  # no offload: the same two steps, then the same load and step
    fresh = _run(prec, 3, steps=0)["params"]
    runs = [(first["model"], first["opt"]), (second["model"], second["opt"]), (ref["model"], ref["opt"])]
    out = []
    for model, opt in runs:
        model.load_state_dict(fresh)  # every run restarts from the initial weights (its moments kept)
        batch = {k: v.cuda() for k, v in toy_batch(7, 4).items()}
        loss = model(**batch).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        out.append({k: v.clone() for k, v in model.state_dict().items()})
    for name, v in out[0].items():
        assert torch.equal(out[1][name], v), name
        torch.testing.assert_close(v.float(), out[2][name].float(), rtol=1 / 64 if compute == "bf16" else 1e-4,
                                   atol=1e-5, msg=name)


@pytest.mark.parametrize("tier", ["cpu", "disk", "cpu-device-step"])
def test_adafactor_with_host_and_disk_offload_on_cuda(tier: str, tmp_path: Path) -> None:
    """memsave's Adafactor steps whole shards in one call on the host ([Note: whole-shard offload]), its fp32
    masters and first moment off the device; it trains like Adafactor without offload."""
    from memsave.optim import Adafactor

    def make(groups: list) -> Adafactor:
        return Adafactor(groups, lr=1e-2, relative_step=False, beta1=0.9, weight_decay=0.1)

    over = {"cpu": ("offload.optimizer=cpu",), "disk": ("offload.optimizer=disk", f"offload.path={tmp_path}"),
            "cpu-device-step": ("offload.optimizer=cpu", "offload.step=device")}[tier]
    ref = _run(BF16, 3, make_opt=make)
    run = _run((*BF16, *over, "offload.chunk_mb=0.004"), 3, make_opt=make)
    _close(run, ref, True)
    opt = run["opt"]
    assert opt.offloaded._whole and (opt.offloaded._staging is None) == (tier == "cpu-device-step")
    own = sum(s.numel() for s in opt._full_of if s.requires_grad)
    assert opt.offloaded_bytes()["disk" if tier == "disk" else "host"] >= 8 * own
    assert run["held"].get(MemoryCategory.MASTER.value, 0) == 0


def _user_loop(overrides: tuple[str, ...], steps: int = 5) -> dict:
    """A user's loop: fp16 with a dynamic loss scale (the first steps overflow and are skipped), gradient
    clipping, ``model.zero_grad()``, a ``no_grad`` evaluation pass between backward and step, and an EMA copy of
    the weights updated after each step."""
    mesh = memsave.init()
    model = ToyLM(seed=5, d=64)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2)
    prof = memsave.load_profile("zero3", ('precision.compute="fp16"', 'precision.loss_scale="dynamic"', *overrides))
    model, opt = memsave.wrap(model, opt, prof, mesh=mesh)
    ema = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    losses, norms, skipped = [], [], []
    for step in range(steps):
        batch = {k: v.cuda() for k, v in toy_batch(step, 4).items()}
        loss = model(**batch).loss
        opt.backward(loss)
        with torch.no_grad():
            model(**{k: v.cuda() for k, v in toy_batch(100 + step, 2).items()})
        norms.append(float(opt.clip_grad_norm(0.5)))
        opt.step()
        skipped.append(opt.mp.last_step_skipped)
        model.zero_grad()
        with torch.no_grad():
            for k, v in model.state_dict().items():
                ema[k].mul_(0.9).add_(v.float(), alpha=0.1)
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "skipped": skipped, "ema": ema,
            "params": {k: v.float().clone() for k, v in model.state_dict().items()}}


def test_host_step_in_a_users_fp16_loop() -> None:
    ref = _user_loop(())
    run = _user_loop(HOST)
    assert run["skipped"] == ref["skipped"] and not all(ref["skipped"]), ref["skipped"]
    torch.testing.assert_close(run["losses"], ref["losses"], rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(run["norms"], ref["norms"], rtol=1e-3, atol=1e-4)
    for name, v in ref["params"].items():  # fp16: a master a few ulp apart may round to the next fp16 value
        torch.testing.assert_close(run["params"][name], v, rtol=1 / 256, atol=1e-4, msg=name)
        torch.testing.assert_close(run["ema"][name], ref["ema"][name], rtol=1 / 256, atol=1e-4, msg=name)
