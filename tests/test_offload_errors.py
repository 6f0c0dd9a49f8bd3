"""Offload's failure modes, in one process: unwritable or full disks refused before training, a crashed run's
files never read (and cleaned up), a failed write or read stops the step with every chunk's parameters and
state agreeing, refusals of what cannot be streamed, O_DIRECT's fallback said once, files gone on close/gc."""

from __future__ import annotations

import copy
import gc
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import memsave
from memsave import _logging
from memsave.offload import tiers
from memsave.offload.tiers import DiskTier, check_disk_path
from memsave.optim import Adafactor
from tests.toy import ToyLM, param_groups, toy_batch


def _wrap(overrides: tuple[str, ...], *, stage: int = 3, opt: Any = None, model: Any = None) -> tuple[Any, Any]:
    model = model if model is not None else ToyLM(seed=1)
    opt = opt if opt is not None else torch.optim.AdamW(param_groups(model), lr=1e-2)
    name = f"zero{stage}" if stage else "ddp"
    return memsave.wrap(model, opt, memsave.load_profile(name, overrides), mesh=memsave.init())


def _disk(path: Path, *more: str) -> tuple[str, ...]:
    return ("offload.optimizer=disk", f'offload.path="{path}"', "offload.chunk_mb=0.001", *more)


def _step(model: Any, opt: Any, step: int) -> torch.Tensor:
    loss = model(**toy_batch(step, 2)).loss
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _params(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _records() -> tuple[list[str], logging.Handler]:
    out: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: out.append(r.getMessage())  # type: ignore[method-assign]
    _logging.get_logger().addHandler(handler)
    return out, handler


# -- before training ------------------------------------------------------------------------------------------
def test_unwritable_or_full_disk_is_refused_before_anything_changes(tmp_path: Path, monkeypatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    model = ToyLM(seed=1)
    before = _params(model)
    with pytest.raises(ValueError, match=r"'offload.path' = .*a-file/sub.* is not a writable folder"):
        _wrap(_disk(blocker / "sub"), model=model)
    assert type(model) is ToyLM and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    free = type("Usage", (), {"free": 8192, "total": 8192, "used": 0})()
    monkeypatch.setattr(tiers.shutil, "disk_usage", lambda _p: free)
    with pytest.raises(ValueError, match=r"'offload.path' = .* has 0.0 MiB free, and offloading needs 0.1 MiB"):
        _wrap(_disk(tmp_path))
    assert not list(tmp_path.glob("memsave-offload-*"))


def test_refusals(tmp_path: Path) -> None:
    model = ToyLM(seed=1)
    with pytest.raises(NotImplementedError, match=r"Adafactor and params = 'disk'.* steps whole shards"):
        _wrap(_disk(tmp_path, "offload.params=disk"), model=model, opt=Adafactor(model.parameters()))
    assert type(model) is ToyLM  # refused before the model was touched
    with pytest.raises(NotImplementedError, match=r"with zero\.stage = 0 is not implemented"):
        _wrap(_disk(tmp_path), stage=0)
    with pytest.raises(NotImplementedError, match=r'params = "disk" is not implemented with optimizer = .none.*needs optimizer = "disk"'):
        _wrap(("offload.params=disk", f'offload.path="{tmp_path}"'))
    with pytest.raises(NotImplementedError, match=r"fraction = 0\.5"):
        _wrap((*_disk(tmp_path), "offload.params=disk", "offload.fraction=0.5"))
    with pytest.raises(NotImplementedError, match="LBFGS"):
        m = ToyLM(seed=1)
        _wrap(_disk(tmp_path), model=m, opt=torch.optim.LBFGS(m.parameters()))
    for bad, match in (("offload.chunk_mb=0", "chunk_mb"), ("offload.prefetch=-1", "prefetch"),
                       ("offload.fraction=1.5", "fraction")):
        with pytest.raises(ValueError, match=match):
            memsave.load_profile("zero3-infinity", [bad])
    with pytest.raises(ValueError, match=r"offload\.path"):
        memsave.load_profile("zero3", ["offload.optimizer=disk"])
    for preset in ("zero2-offload", "zero3-offload", "zero3-infinity"):
        assert memsave.load_profile(preset).offload.optimizer in ("cpu", "disk")
    assert not list(tmp_path.glob("memsave-offload-*"))


# -- leftovers, cleanup ---------------------------------------------------------------------------------------
def test_a_crashed_runs_files_are_never_read_and_are_cleaned_up(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    crashed = tmp_path / f"memsave-offload-{socket.gethostname()}-{dead_pid}-deadbeef-rank0"
    foreign = tmp_path / "memsave-offload-otherhost-1-cafebabe-rank0"  # another host's: not ours to judge
    for folder, host in ((crashed, socket.gethostname()), (foreign, "otherhost")):
        folder.mkdir()
        (folder / "OWNER").write_text(json.dumps({"host": host, "pid": dead_pid}))
        for k in range(4):  # garbage where a run would look for unit files
            (folder / f"unit{k}.state").write_bytes(os.urandom(1 << 16))
    ref_model, ref_opt = _wrap(())
    model, opt = _wrap(_disk(tmp_path))
    assert not crashed.exists() and foreign.exists()
    for step in range(3):
        assert torch.equal(_step(model, opt, step), _step(ref_model, ref_opt, step))
    ref = _params(ref_model)
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())
    folder = opt.offloaded.tier.folder
    del opt
    gc.collect()  # weakref.finalize removes the files when the optimizer goes
    assert not folder.exists() and foreign.exists()


def test_direct_io_fallback_is_said_once(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(_logging, "_warned", set())
    real_open = os.open

    def no_direct(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(tiers.os, "open", no_direct)
    said, handler = _records()
    try:
        a = DiskTier(str(tmp_path), rank=0, needed_bytes=0)
        b = DiskTier(str(tmp_path), rank=1, needed_bytes=0)
    finally:
        _logging.get_logger().removeHandler(handler)
    assert not a.direct and not b.direct
    assert len([m for m in said if "does not take O_DIRECT" in m]) == 1, said
    a.close()
    b.close()
    assert not list(tmp_path.glob("memsave-offload-*"))


def test_an_offload_path_memsave_made_goes_with_its_last_folder(tmp_path: Path) -> None:
    """zero3-infinity's relative default path left an empty memsave-offload/ behind every run: a path memsave
    created goes with the last folder in it; one that existed, or holds anything else, stays."""
    made = tmp_path / "made" / "here"
    tiers_ = [DiskTier(str(made), rank=r, needed_bytes=0) for r in range(2)]
    tiers_[0].close()
    assert made.exists()  # rank 1's folder is still in it
    tiers_[1].close()
    assert not made.exists() and (tmp_path / "made").exists()  # only the folder the path names was made for it
    existing = tmp_path / "mine"
    existing.mkdir()
    DiskTier(str(existing), rank=0, needed_bytes=0).close()
    assert existing.exists() and not list(existing.iterdir())
    made_then_used = tmp_path / "shared"
    tier = DiskTier(str(made_then_used), rank=0, needed_bytes=0)
    (made_then_used / "notes.txt").write_text("the user's")
    tier.close()
    assert (made_then_used / "notes.txt").exists()


def test_an_offload_path_removed_by_another_rank_mid_open_is_made_again(tmp_path: Path, monkeypatch) -> None:
    """Ranks share the path and drift apart (wrap, close, wrap): one rank's close removed the path between
    another's check of it and its folder (FileNotFoundError in CI). Both steps make it again, still memsave's."""
    from memsave.offload import folders

    root = tmp_path / "off"
    check_disk_path(str(root), 0)  # rank 1 checks (and makes) the path ...
    folders.remove_made(root)  # ... rank 0 closes its last folder and removes it ...
    assert not root.exists()
    folder = folders.new_folder(root, 1)  # ... rank 1 opens its folder all the same
    folders.remove_live_folder(folder)
    assert not root.exists()  # and the path it made again goes with it
    check_disk_path(str(root), 0)  # a folder comes in between a removal's look and its rmdir: the mark is put back
    folder = folders.new_folder(root, 1)
    monkeypatch.setattr(Path, "iterdir", lambda self: iter([self / folders.MADE]))  # what it saw a moment before
    folders.remove_made(root)
    monkeypatch.undo()
    assert (root / folders.MADE).exists()
    folders.remove_live_folder(folder)
    assert not root.exists()


# -- failed I/O in the middle of a step -----------------------------------------------------------------------
class _Faults:
    """Make the ``n``-th read or write (from now) fail as a full disk (after writing half) / a bad sector would."""

    def __init__(self, monkeypatch) -> None:
        self.kind, self.countdown = "", -1
        real = tiers._full_io

        def io(fn: Any, fd: int, view: memoryview, offset: int) -> None:
            if (fn is os.pwritev) == (self.kind == "write") and self.kind:
                self.countdown -= 1
                if self.countdown == 0:
                    if self.kind == "write":  # a disk that fills up half way through the write
                        real(fn, fd, view[: len(view) // 2], offset)
                    raise OSError(28 if self.kind == "write" else 5, "injected")
            real(fn, fd, view, offset)

        monkeypatch.setattr(tiers, "_full_io", io)

    def arm(self, kind: str, n: int) -> None:
        self.kind, self.countdown = kind, n


def _piece_agrees(opt: Any, before: dict, after: dict, state_before: dict, state_after: dict) -> tuple[int, int]:
    """Every piece's parameters and state (``exp_avg``, ``exp_avg_sq`` on disk; the fp32 master under mixed
    precision) are either all before or all after the step, as its ``step`` count says."""
    shards = [s for g in opt.optimizer.param_groups for s in g["params"]]
    live = opt.offloaded.local_state()
    masters = opt.offloaded.local_masters()
    counts = [0, 0]
    for chunk in opt.offloaded.chunks:
        for p in chunk.pieces:
            index = next(i for i, s in enumerate(shards) if s is p.shard)
            name = opt.offloaded.names[p.shard]
            done = int(p.scalars["step"].item()) == 3
            ref, ref_state = (after, state_after) if done else (before, state_before)
            assert torch.equal(p.visible, ref[name].reshape(p.shard.shape)[p.start : p.stop]), (name, done)
            if p.low is not None:
                master = ref_state["master_params"][index][p.start : p.stop]
                assert torch.equal(masters[p.shard][p.start : p.stop], master), (name, "master", done)
            for key in ("exp_avg", "exp_avg_sq"):
                mine = live[p.shard][key][p.start : p.stop]
                assert torch.equal(mine, ref_state["state"][index][key][p.start : p.stop]), (name, key, done)
            counts[done] += 1
    return counts[0], counts[1]


@pytest.mark.parametrize(("prefetch", "prec"), [(0, "fp32"), (2, "fp32"), (2, "bf16")])
@pytest.mark.parametrize("kind", ["write", "read"])
def test_failed_io_stops_the_step_and_every_chunk_agrees(tmp_path: Path, monkeypatch, kind: str,
                                                         prefetch: int, prec: str) -> None:
    faults = _Faults(monkeypatch)
    mixed = (f'precision.compute="{prec}"',)
    ref_model, ref_opt = _wrap(mixed, stage=1)
    model, opt = _wrap((*mixed, *_disk(tmp_path, f"offload.prefetch={prefetch}")), stage=1)
    before, state_before, after, state_after = _up_to_the_third_step(model, opt, ref_model, ref_opt)
    faults.arm(kind, 3)
    with pytest.raises(OSError, match=r"offload: (writing|reading) .*/unit\d\.state failed: injected"):
        opt.step()
    undone, done = _piece_agrees(opt, before, after, state_before, state_after)
    assert undone > 0, "the failed chunk (and, synchronously, every later one) keeps the state before the step"
    if prefetch == 0 and kind == "write":  # synchronous: chunks 0 and 1 went through, chunk 2's write failed
        assert done > 0
    if prefetch == 0 and kind == "read":  # synchronous: the third read failed, two chunks stepped
        assert done > 0
    faults.arm("", -1)
    _resumes(model, opt, ref_model, ref_opt, before, state_before, after)
    opt.close()
    assert not list(tmp_path.glob("memsave-offload-*"))


def _up_to_the_third_step(model: Any, opt: Any, ref_model: Any, ref_opt: Any) -> tuple[dict, dict, dict, dict]:
    """Two steps on both, then the third backward on both and the reference's third step: the parameters and
    state before and after that step."""
    for step in range(2):
        _step(model, opt, step)
        _step(ref_model, ref_opt, step)
    before, state_before = _params(model), copy.deepcopy(opt.state_dict())
    opt.backward(model(**toy_batch(2, 2)).loss)
    ref_opt.backward(ref_model(**toy_batch(2, 2)).loss)
    ref_opt.step()
    return before, state_before, _params(ref_model), copy.deepcopy(ref_opt.state_dict())


def _resumes(model: Any, opt: Any, ref_model: Any, ref_opt: Any, before: dict, state_before: dict,
             after: dict) -> None:
    """The state kept after a failure is readable and consistent: a fresh start from it (the third step again,
    with its gradients still there) equals the reference, and so do two more steps."""
    opt.load_state_dict(state_before)
    model.load_state_dict(before)
    opt.step()
    opt.zero_grad()
    ref_opt.zero_grad()
    assert all(torch.equal(v, after[k]) for k, v in model.state_dict().items())
    for step in range(3, 5):
        assert torch.equal(_step(model, opt, step), _step(ref_model, ref_opt, step))


# -- what the memory tracker reads ----------------------------------------------------------------------------
def test_the_tracker_sees_the_disk_tier(tmp_path: Path) -> None:
    from memsave.memory.tracker import MemoryTracker

    model, opt = _wrap(_disk(tmp_path, "offload.params=disk"))
    tracker = MemoryTracker(model, opt)
    try:
        _step(model, opt, 0)
        opt.param_offload.drain()
        tracker.sample("check")
        now = tracker.current
    finally:
        tracker.close()
    own = sum(s.numel() for s in opt._full_of if s.requires_grad)
    padded = sum(u.param_layout.chunk_numel for u in opt.engine.units)
    assert now["offload_disk"] == opt.offloaded_bytes()["disk"] >= 8 * own + 4 * padded, now
    assert now.get("params", 0) == 0, now  # every parameter shard is on disk between uses
    opt.close()


def test_a_subclass_of_a_torch_optimizer_is_offloaded_and_a_closed_one_refuses_to_step(tmp_path: Path) -> None:
    """A user's ``class MyAdamW(torch.optim.AdamW)`` (logging, a small tweak) was refused by disk offload by its
    name; it trains bit for bit as AdamW. A class merely named like one of torch's is still refused. And a step
    after ``close()`` raises, where an overlapped step returned and failed later ("cannot schedule new futures
    after shutdown"), or never."""
    class MyAdamW(torch.optim.AdamW):
        pass

    runs = []
    for cls in (torch.optim.AdamW, MyAdamW):
        model = ToyLM(seed=1)
        model, opt = _wrap(_disk(tmp_path, "offload.overlap=true"), opt=cls(param_groups(model), lr=1e-2), model=model)
        runs.append(([_step(model, opt, i) for i in range(2)], _params(model)))
        opt.close()
        with pytest.raises(RuntimeError, match=r"step\(\) after optimizer.close\(\)"):
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    assert all(torch.equal(v, runs[1][1][k]) for k, v in runs[0][1].items())

    class Adam(torch.optim.Optimizer):  # not torch's: its update is unknown
        def __init__(self, params: Any) -> None:
            super().__init__(params, {})

    class NormedAdamW(torch.optim.AdamW):  # a step of its own: it may read every row (here the global norm)
        def step(self, closure: Any = None) -> Any:
            return super().step(closure)

    for refused in (Adam, NormedAdamW):
        model = ToyLM(seed=1)
        with pytest.raises(NotImplementedError, match="exact only for elementwise optimizers"):
            _wrap(_disk(tmp_path), opt=refused(model.parameters()), model=model)
