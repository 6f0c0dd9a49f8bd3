"""Host-tier offload on CUDA with the step on the device (``[offload] step = "device"``: pinned memory, a side
stream): exact against no offload, and the state leaves the device. The host step is test_offload_host_step_gpu.py. Marked ``gpu``: skipped on machines without CUDA (never run on this project's CPU CI)."""

from __future__ import annotations

import pytest
import torch

import memsave
from memsave.offload import HostTier
from memsave.phases import MemoryCategory
from tests.toy import ToyLM, hf_gpt2, param_groups, toy_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _run(overrides: tuple[str, ...], stage: int, steps: int = 4, hf: bool = False, make_opt=None) -> dict:
    mesh = memsave.init()
    assert mesh.device.type == "cuda"
    model = hf_gpt2() if hf else ToyLM(seed=stage, d=64)
    opt = (make_opt or (lambda groups: torch.optim.AdamW(groups, lr=1e-2)))(param_groups(model))
    model, opt = memsave.wrap(model, opt, memsave.load_profile(f"zero{stage}", overrides), mesh=mesh)
    losses = []
    for step in range(steps):
        batch = {k: v.to(mesh.device) for k, v in toy_batch(step, 4, vocab=64 if hf else 32).items()}
        loss = model(**batch).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    if getattr(opt, "param_offload", None) is not None:
        opt.param_offload.drain()
    torch.cuda.synchronize()
    held = memsave.memory.account([opt]).bytes
    return {"held": held, "losses": losses, "params": {k: v.clone() for k, v in model.state_dict().items()},
            "state": opt.state_dict(), "opt": opt, "model": model}


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_host_offload_is_exact_and_pinned(stage: int, prefetch: int) -> None:
    ref = _run((), stage)
    run = _run(("offload.optimizer=cpu", "offload.step=device", "offload.chunk_mb=0.004",
                f"offload.prefetch={prefetch}"), stage)
    for a, b in zip(run["losses"], ref["losses"], strict=True):
        assert torch.equal(a, b)
    for name, v in ref["params"].items():
        assert torch.equal(run["params"][name], v), name
    for i, st in ref["state"]["state"].items():
        for key, v in st.items():
            assert torch.equal(run["state"]["state"][i][key].cpu(), v.cpu()), (i, key)
    opt = run["opt"]
    state = opt.offloaded
    assert isinstance(state.tier, HostTier)
    regions = [r for c in state.chunks for r in c.regions]
    assert regions and all(r.is_pinned() and r.device.type == "cpu" for r in regions)
    own = sum(s.numel() for s in opt._full_of if s.requires_grad)
    assert opt.offloaded_bytes()["host"] >= 8 * own
    held = memsave.memory.account([opt]).bytes.get(MemoryCategory.OPTIMIZER_STATE.value, 0)
    window = sum(b.untyped_storage().nbytes() for b in state._buffers)
    assert all(b.device.type == "cuda" for b in state._buffers)
    assert held - window <= 4 * sum(len(c.pieces) for c in state.chunks)  # only the `step` scalars stay


@pytest.mark.parametrize("stage", [2, 3])
def test_host_offload_moves_the_fp32_masters_under_bf16(stage: int) -> None:
    """[Note: offloaded masters] on the host tier: bf16 compute, the fp32 masters and AdamW's moments in pinned host
    memory (12 bytes per element), the same losses, parameters and masters as bf16 without offload."""
    bf16 = ('precision.compute="bf16"',)
    ref = _run(bf16, stage)
    run = _run((*bf16, "offload.optimizer=cpu", "offload.step=device", "offload.chunk_mb=0.004"), stage)
    for a, b in zip(run["losses"], ref["losses"], strict=True):
        assert torch.equal(a, b)
    for name, v in ref["params"].items():
        assert torch.equal(run["params"][name], v), name
    for a, b in zip(run["state"]["master_params"], ref["state"]["master_params"], strict=True):
        assert a.dtype == torch.float32 and torch.equal(a.cpu(), b.cpu())
    opt = run["opt"]
    own = sum(s.numel() for s in opt._full_of if s.requires_grad)
    assert opt.offloaded_bytes()["host"] >= 12 * own
    assert memsave.memory.account([opt]).bytes.get(MemoryCategory.MASTER.value, 0) == 0


def test_host_tier_orders_copies_on_its_side_stream() -> None:
    tier = HostTier(torch.device("cuda"))
    region = tier.allocate("unit0", 1 << 20)
    region.copy_(torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8))
    buf = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    tier.read_async(region, buf).wait()  # the compute stream waits on the copy's event
    doubled = buf * 2  # queued on the compute stream after the wait
    buf.copy_(doubled)
    tier.write_async(region, buf)  # the side stream waits for the compute stream's work first
    tier.drain()
    expected = (torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8) * 2).to(torch.uint8)
    assert torch.equal(region, expected)


@pytest.mark.parametrize("hf", [False, True])
@pytest.mark.parametrize("compute", ["fp32", "bf16"])
def test_params_in_pinned_host_memory_are_exact_and_leave_the_device(compute: str, hf: bool) -> None:
    """``params = "cpu"`` on CUDA (stage 3): each unit's shard lives in pinned host memory between uses, copied
    in ahead of its gathers and its step; the same losses and parameters as zero3 without offload, and no
    parameter shard left on the device after the step."""
    prec = () if compute == "fp32" else ('precision.compute="bf16"',)
    ref = _run(prec, 3, hf=hf)
    run = _run((*prec, "offload.optimizer=cpu", "offload.step=device", "offload.params=cpu",
                "offload.chunk_mb=0.004"), 3, hf=hf)
    for a, b in zip(run["losses"], ref["losses"], strict=True):
        assert torch.equal(a, b)
    for name, v in ref["params"].items():
        assert torch.equal(run["params"][name], v), name
    opt = run["opt"]
    offload = opt.param_offload
    assert isinstance(offload.tier, HostTier)
    shards = [u for u in offload.units if u.flat_shard.numel()]
    assert shards and all(u.flat_shard.untyped_storage().nbytes() == 0 for u in shards)
    padded = sum(u.param_layout.chunk_numel * u.flat_shard.element_size() for u in shards)
    assert opt.offloaded_param_bytes() == padded
    assert opt.offloaded_bytes()["host"] >= padded + (8 if compute == "fp32" else 12) * sum(
        s.numel() for s in opt._full_of if s.requires_grad) // 2  # at least the parameters and most of the state
    assert run["held"].get(MemoryCategory.PARAMS.value, 0) == 0, run["held"]
    assert ref["held"].get(MemoryCategory.PARAMS.value, 0) >= padded


def test_params_on_host_round_trip_a_state_dict() -> None:
    """A checkpoint of a params-offloaded run loads into another and both continue alike (the loaded shards are
    written to the host tier)."""
    over = ("offload.optimizer=cpu", "offload.step=device", "offload.params=cpu", "offload.chunk_mb=0.004")
    first = _run(over, 3, steps=2)
    second = _run(over, 3, steps=1)
    second_model = second["model"]
    second_model.load_state_dict(first["params"])
    second["opt"].load_state_dict(first["state"])
    for model, opt in ((first["model"], first["opt"]), (second_model, second["opt"])):
        batch = {k: v.cuda() for k, v in toy_batch(7, 4).items()}
        loss = model(**batch).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    a, b = first["model"].state_dict(), second_model.state_dict()
    for name, v in a.items():
        assert torch.equal(b[name], v), name


def test_host_offload_never_holds_the_fp32_masters_on_the_device() -> None:
    """bf16 with the optimizer on the host (the host step, step "auto"): the fp32 masters are made on the host and
    stay there;
    the device peak of wrap and a step stays far below the 4 bytes per parameter the masters would add."""
    mesh = memsave.init()
    model = ToyLM(seed=0, d=256)
    psi = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    over = ('precision.compute="bf16"', "offload.optimizer=cpu", "offload.params=cpu", "offload.chunk_mb=0.05")
    model, opt = memsave.wrap(model, opt, memsave.load_profile("zero3", over), mesh=mesh)
    wrap_peak = torch.cuda.max_memory_allocated() - base
    # the bf16 model, its bf16 gradient shards and a unit's staging: about 5 bytes per parameter; the fp32
    # masters made on the device would add 4 more
    assert wrap_peak < 7 * psi, (wrap_peak, psi)
    assert all(m.device.type == "cuda" and m.untyped_storage().nbytes() == 0 for m in opt.offloaded.masters)
    batch = {k: v.cuda() for k, v in toy_batch(0, 4).items()}
    opt.backward(model(**batch).loss)
    opt.step()
    opt.zero_grad()
    opt.param_offload.drain()
    torch.cuda.synchronize()
    # between steps: the bf16 gradient shards (2 bytes per parameter) and the window; no parameter, master or state
    assert torch.cuda.memory_allocated() - base < 3 * psi
    opt.close()
