"""Saving offloaded optimizer state streams it from its tier: the save's memory rise is one state tensor, not the
whole state ([Note: offloaded state streamed] in memsave/checkpoint/state.py)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import memsave
from tests.harness import run_ranks

WIDTH, BLOCKS = 1024, 16  # AdamW: 2 x 4 MiB per block on disk, 128 MiB in all


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _save_rise(folder: str, precision: str) -> dict[str, Any]:
    # torch.distributed.checkpoint's modules load with the first save: loaded here, they are not the save's rise
    importlib.import_module("memsave.dist.dcp_store")
    from memsave.dist.host_memory import trim_host_memory

    mesh = memsave.init()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(BLOCKS)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    over = ['offload.optimizer="disk"', f"precision.compute={precision!r}"]
    prof = memsave.load_profile("zero1", [*over, f"offload.path={folder + '/offload'!r}"])
    model, opt = memsave.wrap(model, opt, prof, mesh=mesh)
    x = torch.randn(4, WIDTH)
    for _ in range(2):
        opt.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
    state = sum(opt.offloaded.offloaded_bytes().values())
    trim_host_memory()
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
    before = _status("VmRSS")
    memsave.save(folder + "/ckpt", model, opt)
    rise = _status("VmHWM") - before
    # and it loads back into a fresh run equal to the state saved
    first = next(iter(opt.offloaded.pieces_of))
    saved = {k: v.clone() for k, v in opt.offloaded.local_state()[first].items() if isinstance(v, torch.Tensor)}
    masters = [m.clone() for m in opt.offloaded.local_masters().values()]
    torch.manual_seed(1)
    fresh = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(BLOCKS)])
    fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    prof2 = memsave.load_profile("zero1", [*over, f"offload.path={folder + '/offload2'!r}"])
    fresh, fopt = memsave.wrap(fresh, fopt, prof2, mesh=mesh)
    memsave.load(folder + "/ckpt", fresh, fopt)
    got = fopt.offloaded.local_state()[next(iter(fopt.offloaded.pieces_of))]
    differ = [k for k, v in saved.items() if not torch.equal(got[k], v)]
    loaded = list(fopt.offloaded.local_masters().values())
    if len(loaded) != len(masters) or not all(torch.equal(a, b) for a, b in zip(loaded, masters)):
        differ.append("masters")
    return {"state": state, "rise": rise, "differ": differ, "masters": len(masters)}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (VmHWM, clear_refs)")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_save_streams_offloaded_state(tmp_path: Path, precision: str) -> None:
    """fp32: AdamW's moments on disk; bf16: the fp32 masters with them. Each tensor spans several 1 MiB chunks."""
    r = run_ranks(_save_rise, 1, str(tmp_path), precision, timeout=120)[0]
    assert r["state"] >= 120 * 2**20 and (r["masters"] == BLOCKS) == (precision == "bf16"), r
    assert r["differ"] == [], r
    # one 4 MiB tensor at a time and a 1 MiB chunk (measured ~20 MiB with the heap), against the 128 MiB whole
    assert r["rise"] < 0.25 * r["state"], r


def _model_only_loads(folder: str) -> list[str]:
    """memsave.load(path, model) without the optimizer, and memsave.load_weights, into a wrapped model; then an
    optimizer step with lr = 0 must leave the loaded weights as they are."""
    from memsave.checkpoint.export import export

    mesh = memsave.init()

    def net(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))

    source = net(0)
    src, _ = memsave.wrap(source, torch.optim.SGD(source.parameters(), lr=0.0), "ddp", mesh=mesh)
    memsave.save(folder + "/model", src)
    if mesh.dp_rank == 0:
        export(folder + "/model", folder + "/export")
    memsave.dist.barrier(None)
    want = {k: v.clone() for k, v in net(0).state_dict().items()}
    wrong = []
    cases = (("zero3-bf16", []), ("zero3-bf16", ['offload.optimizer="disk"']),
             ("zero3-infinity", ['offload.params="disk"']))
    for (preset, over), how in [(c, h) for c in cases for h in ("load", "load_weights")]:
        model = net(1)
        prof = memsave.load_profile(preset, [*over, f"offload.path={folder + '/off'!r}"])
        model, opt = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0), prof, mesh=mesh)
        if how == "load":
            memsave.load(folder + "/model", model)
        else:
            memsave.load_weights(model, folder + "/export")
        x = torch.randn(4, 16)
        opt.backward(model(x.to(next(iter(want.values())).dtype)).float().pow(2).mean())
        opt.step()  # lr = 0: the weights stay (the masters of before the load were cast back over it)
        got = model.state_dict()
        dtype = got["0.weight"].dtype
        if any(not torch.equal(got[k], v.to(dtype)) for k, v in want.items()):
            wrong.append(f"{preset} {over} {how}")
        opt.close()
    return wrong


def test_a_model_only_load_is_kept(tmp_path: Path) -> None:
    """A model-only load into a wrapped model: at zero3 bf16 the fp32 masters kept the old weights, and the next
    step cast them back over the load; with [offload] params = "disk" it read into evicted shards (garbage, or a
    crash), both without the optimizer given, silently."""
    assert run_ranks(_model_only_loads, 2, str(tmp_path), timeout=240) == [[], []]
