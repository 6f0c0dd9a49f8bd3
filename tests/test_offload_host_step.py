"""The host step of offloaded optimizer state ([Note: host step] in memsave/offload/host_step.py): the chunk logic
(fetch the gradient rows and fp32 parameter rows, step on the host, copy the new rows back) run on a CPU device,
where the copies are synchronous, against the plain optimizer on the whole tensors. The CUDA half (streams, pinned
slots) is tests/test_offload_gpu.py. Also: the settings that place the step are checked before anything moves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import memsave
from memsave.offload import DiskTier, OffloadedState
from memsave.offload.host_step import HostStaging, host_kernel
from memsave.validate import effective_offload

SHAPES = [(7, 5), (3,), (11, 4), (1, 9)]


def _tensors(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def _grads(step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


@pytest.mark.parametrize("masters", [False, True], ids=["fp32", "bf16-masters"])
@pytest.mark.parametrize(("fraction", "prefetch"), [(0.0, 2), (0.0, 0), (1.0, 2), (1.0, 0)],
                         ids=["host-memory", "host-memory-sync", "disk", "disk-sync"])
def test_host_step_equals_the_plain_optimizer(masters: bool, fraction: float, prefetch: int,
                                              tmp_path: Path) -> None:
    """Row pieces of 2-3 rows packed into chunks, stepped with the fused CPU kernel on fetched rows, equal the
    fused optimizer on the whole tensors (AdamW is elementwise; the kernel's vector tail moves with the slicing, so
    the last bit of a moment may differ: 2e-6 relative); the model's rows get the result."""
    low = torch.bfloat16 if masters else torch.float32
    ref = [nn.Parameter(t.float()) for t in _tensors(low)]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    model = _tensors(low)  # the model's rows ("the device")
    stepped = [nn.Parameter(t.float()) for t in model] if masters else [nn.Parameter(t) for t in model]
    opt = torch.optim.AdamW(stepped, lr=1e-2, weight_decay=0.1)  # foreach/fused unset: the host picks fused
    tier = DiskTier(str(tmp_path), rank=0, needed_bytes=1 << 20)
    grads_now: dict[torch.Tensor, torch.Tensor] = {}
    state = OffloadedState(
        opt, tier, group_of=lambda s: f"unit{next(i for i, t in enumerate(stepped) if t is s) // 2}",
        names={s: f"t{i}" for i, s in enumerate(stepped)}, fraction=fraction, prefetch=prefetch,
        chunk_bytes=2 * 5 * 12, bytes_per_element=8, device=torch.device("cpu"),
        masters=dict(zip(stepped, model, strict=True)) if masters else None,
        low_grad=lambda m: grads_now.get(m), staging=HostStaging(torch.device("cpu"), prefetch))
    assert len(state.chunks) > 3 and all(c.offloaded == (fraction == 1.0) for c in state.chunks)
    try:
        for step in range(3):
            grads = _grads(step, low)
            for r, g in zip(ref, grads, strict=True):
                r.grad = g.float()
            ref_opt.step()
            if masters:  # the model's bf16 gradients, cast per chunk
                grads_now.clear()
                grads_now.update(zip(stepped, grads, strict=True))
            else:
                for s, g in zip(stepped, grads, strict=True):
                    s.grad = g
            state.step()
            for s in stepped:
                s.grad = None
            for i, (r, m) in enumerate(zip(ref, model, strict=True)):
                torch.testing.assert_close(m, r.detach().to(low), rtol=2e-6, atol=0, msg=f"{step} {i}")
        local, own = state.local()
        for r, s in zip(ref, stepped, strict=True):
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(local[s][key], ref_opt.state[r][key], rtol=2e-6, atol=0)
            if masters:
                torch.testing.assert_close(own[s], r.detach(), rtol=2e-6, atol=0)
        held = state.offloaded_bytes()
        assert held["host"] > 0 and list(state.memory_tensors()) == []  # nothing on "the device"
        if fraction == 1.0:
            assert held["disk"] >= 8 * sum(t.numel() for t in model)
    finally:
        state.close()


def test_host_kernel_is_fused_for_torch_adam_family_only() -> None:
    p = [nn.Parameter(torch.zeros(2))]
    assert host_kernel(torch.optim.AdamW(p)) == {"fused": True, "foreach": False}
    assert host_kernel(torch.optim.SGD(p, lr=0.1)) == {"fused": True, "foreach": False}
    assert host_kernel(torch.optim.RMSprop(p)) == {}
    assert host_kernel(torch.optim.Adam(p, differentiable=True)) == {}


@pytest.mark.parametrize(("overrides", "match"), [
    (("offload.optimizer=disk", "offload.path=/tmp", "offload.step=device"), 'step = "device" on CUDA'),
    (("offload.optimizer=cpu", "offload.step=host", "offload.fraction=0.5"), "fraction = 0.5"),
    (("offload.optimizer=cpu", "offload.params=cpu", "offload.step=host"), "fp32 compute"),
    (("offload.optimizer=cpu", "offload.overlap=true"), "overlap = true"),
    (("offload.optimizer=cpu", "offload.step=host", "offload.overlap=true"), "slower than the synchronous"),
])
def test_step_placement_refused_on_cuda_before_anything_moves(overrides: tuple[str, ...], match: str) -> None:
    """Checked from the profile alone (no CUDA needed): what the host step does not do raises, naming the key."""
    prof = memsave.load_profile("zero3", overrides)
    with pytest.raises(NotImplementedError, match=match):
        effective_offload(prof, torch.device("cuda"))


def test_step_placement_accepted_on_cuda() -> None:
    """``step = "auto"`` takes the host step wherever it is implemented (what DeepSpeed's users expect), else the
    device step."""
    for overrides, host in [(("offload.optimizer=disk", "offload.path=/tmp"), True),
                            (("offload.optimizer=cpu",), True),
                            (("offload.optimizer=cpu", "offload.params=cpu", 'precision.compute="bf16"'), True),
                            (("offload.optimizer=cpu", "offload.params=cpu"), False),  # fp32: the device step
                            (("offload.optimizer=cpu", "offload.fraction=0.5"), False),
                            (("offload.optimizer=cpu", "offload.step=device"), False)]:
        prof = memsave.load_profile("zero3", overrides)
        assert effective_offload(prof, torch.device("cuda")) is prof.offload
        assert prof.offload.steps_on_host("cuda", mixed=prof.precision.compute != "fp32") is host, overrides
    with pytest.raises(ValueError, match=r"offload\.step"):
        memsave.load_profile("zero3", ("offload.step=host",))
