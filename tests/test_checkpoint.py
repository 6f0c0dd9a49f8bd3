"""``memsave.save`` / ``memsave.load`` (issue 21): resharding, safety of loading, crash safety.

One chain of spawned groups, many cases each (the outcome of each case goes to one pytest test):
1 rank (saves a single-process checkpoint) -> 2 ranks (loads it: 1 -> 2; the reshard matrix between ZeRO stages,
tp degrees, optimizers, precisions, offload and models; tampered, corrupt and missing files; full disk,
unwritable path, interrupted saves, keep_last) -> 1 rank (2 -> 1) -> 4 ranks (2 -> 4, and dp=2 x tp=2).

Each reshard case trains 2 steps, saves, trains 3 more (the uninterrupted losses), then a fresh model with other
initial weights under the target layout loads and trains the same 3 steps: bit for bit when the layout is the
same (dropout on: the RNG states are restored), else within FP32_TOL relative.
"""

from __future__ import annotations

import os
import pickle
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import memsave
from tests.ckpt_cases import FP32_TOL, Layout, rel, resume_run, save_run
from tests.harness import run_ranks

Z3, Z2, Z1, DDP = Layout("zero3"), Layout("zero2"), Layout("zero1"), Layout("ddp")
TP2 = Layout("ddp", tp=2)
PARAMS_DISK = Layout('zero3-infinity:offload.params="disk"')  # the parameter shards on disk too
AF = {n: Layout(p, tp=t, opt="adafactor") for n, p, t in (("z2", "zero2", 1), ("z3", "zero3", 1), ("tp2", "ddp", 2),
                                                            ("ddp", "ddp", 1))}
# name: (saved under, loaded into, dropout); same layout -> bit for bit
RESHARD_2 = {
    "zero3 -> zero3 (dropout)": (Z3, Z3, 0.1),
    "zero3 -> ddp": (Z3, DDP, 0.0),
    "zero1 -> zero3": (Z1, Z3, 0.0),
    "zero2 -> zero1": (Z2, Z1, 0.0),
    "tp2 -> dp2 zero3": (TP2, Z3, 0.0),
    "dp2 zero2 -> tp2": (Z2, TP2, 0.0),
    "tp2 -> tp2 (dropout)": (TP2, TP2, 0.1),
    "adafactor zero2 -> zero3": (AF["z2"], AF["z3"], 0.0),
    "adafactor zero3 -> tp2": (AF["z3"], AF["tp2"], 0.0),
    "adafactor tp2 -> ddp": (AF["tp2"], AF["ddp"], 0.0),
    "bf16 zero2 -> zero2 (dropout)": (Layout("zero2-bf16"), Layout("zero2-bf16"), 0.1),
    "bf16 zero2 -> zero3": (Layout("zero2-bf16"), Layout("zero3-bf16"), 0.0),
    "disk offload zero3 -> zero3": (Layout("zero3-infinity"), Layout("zero3-infinity"), 0.0),
    "disk offload zero3 -> zero2": (Layout("zero3-infinity"), Z2, 0.0),
    "zero2 -> disk offload zero3": (Z2, Layout("zero3-infinity"), 0.0),
    "disk offload params zero3 -> zero3": (PARAMS_DISK, PARAMS_DISK, 0.0),
    "disk offload params zero3 -> zero1": (PARAMS_DISK, Z1, 0.0),
    "zero2 -> disk offload params zero3": (Z2, PARAMS_DISK, 0.0),
    "llama tied zero3 -> tp2": (Layout("zero3", model="llama"), Layout("ddp", tp=2, model="llama"), 0.0),
    "llama untied tp2 -> zero2": (Layout("ddp", tp=2, model="llama-untied"), Layout("zero2", model="llama-untied"),
                                  0.0),
    "sequential zero3 -> zero1": (Layout("zero3", model="seq"), Layout("zero1", model="seq"), 0.0),
    "mixtral experts cut over tp2 -> zero3": (Layout("ddp", tp=2, model="mixtral"), Layout("zero3", model="mixtral"),
                                              0.0),
}
# saved by the 1-rank group, loaded by the 2-rank one; saved by the 2-rank group, loaded by 1 and 4 ranks
CROSS = {
    "1 -> 2 zero3": ("one", DDP, Z3),
    "2 -> 1": ("two", Z3, DDP),
    "2 -> 4 zero1": ("two", Z3, Z1),
    "2 -> 4 dp2 x tp2": ("two", Z3, Layout("zero2", tp=2)),
    "2 tp2 -> 4 zero3": ("two-tp", TP2, Z3),
}
SAME = {name for name, (src, dst, _) in RESHARD_2.items() if src == dst}


def _case(out: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    import torch.distributed as dist

    try:
        out[name] = fn()
    except Exception:
        out[name] = "FAILED\n" + traceback.format_exc()[-2500:]
    dist.barrier()


def _reshard(out: dict[str, Any], root: Path, name: str, src: Layout, dst: Layout, dropout: float) -> None:
    path = root / name.replace(" ", "_").replace(">", "")

    def run() -> tuple[list[float], list[float]]:
        ref = save_run(src, path, dropout=dropout)
        return ref, resume_run(dst, path, dropout=dropout)

    _case(out, name, run)


def _save_for_later(out: dict[str, Any], root: Path, tag: str, layout: Layout) -> None:
    _case(out, f"save {tag}", lambda: save_run(layout, root / f"cross-{tag}"))


def _load_cross(out: dict[str, Any], root: Path, which: str) -> None:
    for name, (tag, _src, dst) in CROSS.items():
        if which == name.split(" -> ")[1].split()[0]:
            _case(out, name, lambda tag=tag, dst=dst: resume_run(dst, root / f"cross-{tag}"))


def _one_rank_first(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _save_for_later(out, Path(root), "one", DDP)
    return out


def _two_ranks(root: str) -> dict[str, Any]:
    from tests import ckpt_faults

    out: dict[str, Any] = {}
    base = Path(root)
    _load_cross(out, base, "2")
    for name, (src, dst, dropout) in RESHARD_2.items():
        _reshard(out, base, name, src, dst, dropout)
    _save_for_later(out, base, "two", Z3)
    _save_for_later(out, base, "two-tp", TP2)
    for name, fn in ckpt_faults.CASES.items():
        _case(out, name, lambda fn=fn: fn(base / "faults"))
    _case(out, "buffers of rank 0", lambda: _buffers_of_rank_0(base / "buffers"))
    return out


def _buffers_of_rank_0(path: Path) -> str:
    """A replicated buffer that differs between ranks (BatchNorm's running statistics: each rank's forward
    updates its own) is saved from rank 0, as ``model.state_dict()`` there gives it; the deduplication alone
    saved rank 1's here."""
    import torch.distributed as dist

    import memsave

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))

    def wrapped() -> tuple[Any, Any]:
        model = build()
        return memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), "zero2", mesh=memsave.init())

    model, opt = wrapped()
    model(torch.randn(8, 4) + 10.0 * dist.get_rank()).sum().backward()  # other statistics on each rank
    opt.step()
    expected = [model[1].running_mean.clone()]
    dist.broadcast_object_list(expected, 0)
    memsave.save(path, model, opt)
    fresh, fresh_opt = wrapped()
    memsave.load(path, fresh, fresh_opt)
    assert torch.equal(fresh[1].running_mean, expected[0]), (fresh[1].running_mean, expected[0])
    return "ok"


def _one_rank_last(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _load_cross(out, Path(root), "1")
    return out


def _four_ranks(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _load_cross(out, Path(root), "4")
    return out


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("ckpt"))
    out: dict[str, Any] = {}
    out.update(run_ranks(_one_rank_first, 1, root, timeout=120)[0])
    out.update(run_ranks(_two_ranks, 2, root, timeout=300)[0])
    out.update(run_ranks(_one_rank_last, 1, root, timeout=120)[0])
    out.update(run_ranks(_four_ranks, 4, root, timeout=200)[0])
    return out


def _ok(outcomes: dict[str, Any], name: str) -> Any:
    value = outcomes.get(name)
    assert value is not None, f"case {name!r} did not run"
    assert not (isinstance(value, str) and value.startswith("FAILED")), value
    return value


@pytest.mark.parametrize("name", list(RESHARD_2))
def test_continued_training_after_load_equals_the_uninterrupted_run(outcomes: dict[str, Any], name: str) -> None:
    ref, got = _ok(outcomes, name)
    if name in SAME:
        assert got == ref, f"{name}: same layout must continue bit for bit: {got} vs {ref}"
    else:
        assert rel(got, ref) <= FP32_TOL, f"{name}: {got} vs {ref} (rel {rel(got, ref):.2e})"


@pytest.mark.parametrize("name", list(CROSS))
def test_a_checkpoint_loads_at_another_world_size(outcomes: dict[str, Any], name: str) -> None:
    tag = CROSS[name][0]
    ref = _ok(outcomes, f"save {tag}")
    got = _ok(outcomes, name)
    assert rel(got, ref) <= FP32_TOL, f"{name}: {got} vs {ref} (rel {rel(got, ref):.2e})"


def test_fault_cases(outcomes: dict[str, Any]) -> None:
    from tests import ckpt_faults

    for name in ckpt_faults.CASES:
        assert _ok(outcomes, name) == "ok", name
    assert _ok(outcomes, "buffers of rank 0") == "ok"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process, as meant
def test_a_folder_of_torchs_dcp_save_is_refused_with_the_route(tmp_path: Path) -> None:
    """memsave.load of a folder torch's own dcp.save wrote (no memsave manifest) names what it is and the way in,
    not "an interrupted save"."""
    import torch.distributed.checkpoint as dcp

    from memsave.dist.dcp import CheckpointFormatError

    plain = nn.Linear(4, 4)
    dcp.save(plain.state_dict(), checkpoint_id=str(tmp_path / "torch"), no_dist=True)
    model, opt = memsave.wrap(m := nn.Linear(4, 4), torch.optim.AdamW(m.parameters()), "ddp")
    with pytest.raises(CheckpointFormatError, match=r"torch.distributed.checkpoint folder without memsave's manifest"
                                                    r".*dcp.load.*model.load_state_dict"):
        memsave.load(tmp_path / "torch", model, opt)


def test_read_metadata_refuses_a_pickle_that_would_run_code(tmp_path: Path) -> None:
    """The allow-list unpickler alone (no process group): a payload that would create a file is refused before
    anything is called."""
    from memsave.dist.dcp import CheckpointFormatError, read_metadata

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": Payload()}))
    with pytest.raises(CheckpointFormatError, match=r"refusing to unpickle posix\.system"):
        read_metadata(tmp_path)
    assert not marker.exists()
    (tmp_path / ".metadata").write_bytes(b"\x80\x05garbage")
    with pytest.raises(CheckpointFormatError, match="cannot be read as DCP metadata"):
        read_metadata(tmp_path)


# -- pipeline parallelism: pp=2 <-> pp=1 --------------------------------------------------------------------------------
def _pp_run(mode: str, pp: int, path: str) -> list[float]:
    """The tied HF Llama of tests/pp_cases.py, 4 micro-batches a step, AdamW: ``save``: one step, save, one more;
    ``load``: load, then that second step. Under pp a stage holds the tied embedding / LM head under its own
    module's name; the checkpoint keeps it under the whole model's first name and merges the stages' optimizers."""
    from tests import pp_cases as pc

    kind = pc.KINDS["llama"]
    model = kind.build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mesh = memsave.init(pp=pp) if pp > 1 else memsave.init()
    model, mopt = memsave.wrap(model, opt, memsave.load_profile("ddp", [f"parallel.pp={pp}"]), mesh=mesh)
    data = kind.data()

    def step(batch: torch.Tensor) -> float:
        mbs, _ = pc.micro(kind, batch, 4)
        if pp > 1:
            loss = float(model.pipeline_step(mbs))
        else:
            loss = 0.0
            for mb in mbs:
                part = model(**mb).loss / len(mbs)
                mopt.backward(part)
                loss += float(part)
        mopt.step()
        mopt.zero_grad()
        return loss

    if mode == "save":
        step(data[0])
        memsave.save(path, model, mopt)
    else:
        memsave.load(path, model, mopt)
    return [step(data[1])]


def test_a_pipeline_checkpoint_loads_at_another_pp(tmp_path: Path) -> None:
    """pp=2 -> pp=1 and pp=1 -> pp=2: the next step's loss equals the uninterrupted run's (fp32, 1e-6)."""
    a, b = str(tmp_path / "pp2"), str(tmp_path / "pp1")
    uninterrupted = run_ranks(_pp_run, 2, "save", 2, a, timeout=120)[0]
    assert run_ranks(_pp_run, 1, "load", 1, a, timeout=120)[0] == pytest.approx(uninterrupted, rel=1e-6)
    assert run_ranks(_pp_run, 1, "save", 1, b, timeout=120)[0] == pytest.approx(uninterrupted, rel=1e-6)
    assert run_ranks(_pp_run, 2, "load", 2, b, timeout=120)[0] == pytest.approx(uninterrupted, rel=1e-6)


def test_a_record_is_read_without_the_readers_record_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11's zip reader has no ``get_record_size`` (measured on the GPU machine: every ``memsave.load``
    raised AttributeError there): the raw path steps aside and torch.load reads the record, the same tensor."""
    import io

    from memsave.dist import dcp_io

    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    buf = io.BytesIO()
    torch.save(t, buf)
    data = buf.getvalue()
    real = torch._C.PyTorchFileReader
    if hasattr(real, "get_record_size"):
        assert torch.equal(dcp_io.raw_record(data, (3, 4), torch.float32), t)
    else:  # this torch is the old reader
        assert dcp_io.raw_record(data, (3, 4), torch.float32) is None

    class OldReader:  # the 2.11 reader: everything but get_record_size
        def __init__(self, f: Any) -> None:
            self._r = real(f)

        def __getattr__(self, name: str) -> Any:
            if name == "get_record_size":
                raise AttributeError(name)
            return getattr(self._r, name)

    monkeypatch.setattr(dcp_io.torch._C, "PyTorchFileReader", OldReader)
    assert dcp_io.raw_record(data, (3, 4), torch.float32) is None
    assert torch.equal(torch.load(io.BytesIO(data), weights_only=True), t)  # what load_rects then does
