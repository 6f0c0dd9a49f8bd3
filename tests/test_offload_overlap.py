"""``[offload] overlap`` ([Note: overlapped step] in memsave/offload/state.py): the offloaded optimizer step runs in
the background while zero_grad and the next forward go on; a unit's gather waits for that unit's rows only, the
post-hooks run once the step is complete, and a failed transfer surfaces at the next wait with every chunk
consistent. Exactness against the synchronous step at 1 and 2 ranks is in tests/test_offload.py."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import memsave
from tests.test_offload_errors import (
    _Faults,
    _params,
    _piece_agrees,
    _resumes,
    _step,
    _up_to_the_third_step,
    _wrap,
)
from tests.toy import toy_batch

OVERLAP = ("offload.optimizer=disk", "offload.chunk_mb=0.001", "offload.overlap=true")


def _overlap(path: Path, *more: str) -> tuple[str, ...]:
    return (*OVERLAP, f'offload.path="{path}"', *more)


def test_the_step_runs_behind_the_next_forward(tmp_path: Path) -> None:
    """The step of the last unit's chunks is held until the forward has reached the unit before it: step() and
    zero_grad() return, units 0-2 are gathered with their stepped rows, unit 3 is not done yet; then the forward
    completes, the post-hook has run once, and everything equals the synchronous step."""
    gate, blocked = threading.Event(), threading.Event()
    gate.set()
    ref_model, ref_opt = _wrap(())
    model, opt = _wrap(_overlap(tmp_path))
    real = opt.offloaded._step_one

    def step_one(chunk: Any, *args: Any) -> Any:
        if chunk.group_file == "unit3":
            blocked.set()
            assert gate.wait(timeout=60), "the forward never released the last unit"
        return real(chunk, *args)

    opt.offloaded._step_one = step_one
    calls: list[int] = []
    opt.optimizer.register_step_post_hook(lambda *_: calls.append(1))
    for step in range(2):
        _step(ref_model, ref_opt, step)
        _step(model, opt, step)
    assert len(calls) == 1  # the first step's (the second forward waited for it); the second step's is pending
    opt.settle()
    assert len(calls) == 2
    gate.clear()
    state = opt.offloaded
    seen: dict[str, Any] = {}

    def before_last(module: Any, args: Any) -> None:  # runs before the engine issues unit 3's gather
        run = state._run
        seen["done"] = {f: e.is_set() for f, e in run.done.items()} if run is not None else None
        seen["calls"] = len(calls)
        gate.set()

    units = opt.engine.units
    # the unit whose forward issues the last unit's gather ([Note: collective order]: zero.prefetch units ahead)
    block = units[len(units) - 1 - opt.engine.config.prefetch].module
    _step(ref_model, ref_opt, 2)
    opt.backward(model(**toy_batch(2, 2)).loss)
    handle = block.register_forward_pre_hook(before_last, prepend=True)  # for the next forward only
    try:
        blocked.clear()
        opt.step()
        assert blocked.wait(timeout=60) and state._run is not None and not state._run.future.done()
        opt.zero_grad()  # set_to_none: does not wait
        assert state._run is not None
        out = model(**toy_batch(3, 2)).loss
    finally:
        gate.set()
        handle.remove()
    assert seen["done"] == {"unit0": True, "unit1": True, "unit2": True, "unit3": False}, seen
    assert seen["calls"] == 2 and len(calls) == 3  # the post-hook ran when the forward's end settled the step
    ref_out = ref_model(**toy_batch(3, 2)).loss
    assert torch.equal(out, ref_out)
    opt.backward(out)
    ref_opt.backward(ref_out)
    for o in (opt, ref_opt):
        o.step()
        o.zero_grad()
    assert all(torch.equal(v, _params(ref_model)[k]) for k, v in model.state_dict().items())
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    for i, st in ref_sd["state"].items():
        for key, v in st.items():
            assert torch.equal(sd["state"][i][key], v), (i, key)
    opt.close()
    assert not list(tmp_path.glob("memsave-offload-*"))


@pytest.mark.parametrize("kind", ["write", "read"])
def test_a_failed_transfer_surfaces_in_the_next_forward(tmp_path: Path, monkeypatch, kind: str) -> None:
    faults = _Faults(monkeypatch)
    ref_model, ref_opt = _wrap(())
    model, opt = _wrap(_overlap(tmp_path))
    before, state_before, after, state_after = _up_to_the_third_step(model, opt, ref_model, ref_opt)
    faults.arm(kind, 3)
    opt.step()  # returns: the failure happens in the background
    with pytest.raises(OSError, match=r"offload: (writing|reading) .*/unit\d\.state failed: injected"):
        model(**toy_batch(3, 2))
    undone, done = _piece_agrees(opt, before, after, state_before, state_after)
    assert undone > 0
    if kind == "write":  # chunks 0 and 1 were written; a failed read may come before any chunk stepped (prefetch)
        assert done > 0
    faults.arm("", -1)
    _resumes(model, opt, ref_model, ref_opt, before, state_before, after)
    opt.close()
    assert not list(tmp_path.glob("memsave-offload-*"))


def test_overlap_is_refused_where_it_cannot_work(tmp_path: Path) -> None:
    for stage in (1, 2):
        with pytest.raises(NotImplementedError, match=rf"overlap = true .*zero\.stage = {stage}"):
            _wrap(_overlap(tmp_path), stage=stage)
    with pytest.raises(ValueError, match=r"'offload.overlap' = True .*optimizer = \"none\""):
        memsave.load_profile("zero3", ["offload.overlap=true"])
    assert memsave.load_profile("zero3-infinity").offload.overlap
    assert not list(tmp_path.glob("memsave-offload-*"))


def _foreign(world: int, path: str) -> str:
    """Models memsave did not write: Hugging Face GPT-2 (keyword arguments, a ModelOutput, tied wte / lm_head) and
    an nn.Sequential (no ModuleList: one root unit), under zero3-infinity (disk, overlap) against zero3 in memory,
    fp32 and (GPT-2) bf16: the same losses and parameters, bit for bit."""
    from tests.test_zero_models import _gpt2, _hf_batch, _seq_batch, _sequential

    mesh = memsave.init()
    seq_loss = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    bf16 = ('precision.compute="bf16"',)
    for build, batch_fn, loss_fn, precs in ((_gpt2, _hf_batch, lambda m, b: m(**b).loss, ((), bf16)),
                                            (_sequential, _seq_batch, seq_loss, ((),))):  # (fp32 inputs)
        for prec in precs:
            runs = []
            for name, over in (("zero3", prec), ("zero3-infinity", (*prec, f'offload.path="{path}"',
                                                                   "offload.chunk_mb=0.002"))):
                model = build()
                model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                          memsave.load_profile(name, over), mesh=mesh)
                losses = []
                for step in range(3):
                    loss = loss_fn(model, batch_fn(step, mesh.dp_rank))
                    opt.backward(loss)
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.detach())
                runs.append((losses, {k: v.clone() for k, v in model.state_dict().items()}))
                if name == "zero3-infinity":
                    assert opt.overlap and opt.offloaded_bytes()["disk"] > 0
                    opt.close()
            (ref_losses, ref_params), (losses, params) = runs
            assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True)), (build, prec)
            assert all(torch.equal(params[k], v) for k, v in ref_params.items()), (build, prec)
    return "ok"


def test_foreign_models_train_the_same_with_overlapped_offload(tmp_path: Path) -> None:
    from tests.harness import run_ranks

    assert run_ranks(_foreign, 2, 2, str(tmp_path), timeout=300) == ["ok", "ok"]
    assert not list(tmp_path.glob("memsave-offload-*"))
