"""Tensor parallelism inside pipeline stages (tp = 2 x pp = 2 on 4 ranks): memsave cuts each stage's layers over
its tp group (memsave/tp) and runs the stages with its pipeline schedules (memsave/pp).

Against single-process training on the same global batch (tests/pp_cases.py: losses, clip norms and every
parameter within FP32_TOL): our GPT and an unchanged Hugging Face Llama, tied and untied, and an ``nn.Sequential``
with a ``tp_plan``; under ddp, ZeRO-1/2/3 and sequence parallelism; with 1F1B, zero-bubble and interleaved
schedules; and memsave's Adafactor. The pipeline's sends carry exactly the boundary activation of each micro-batch (a ``1/tp`` sequence
slice of it under sequence parallelism), and a checkpoint saved under tp x pp loads back and exports whole.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

import memsave
from memsave.dist import COMM_STATS
from tests import pp_cases as pc
from tests.harness import run_ranks

SEQ_PLAN = {"0": "colwise", "2": "rowwise", "4": "colwise", "6": "rowwise"}  # Linear-act-Linear pairs
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("gpt", "ddp", {}),
    ("gpt", "zero3", {"schedule": "interleaved", "virtual": 2}),
    ("gpt-untied", "zero2", {"sequence": True}),
    ("llama", "zero3", {"schedule": "zero-bubble"}),
    ("llama-untied", "zero1", {"sequence": True}),
    ("seq", "ddp", {}),
    ("seq", "zero1", {"schedule": "zero-bubble"}),
]


def _profile(base: str, extra: dict[str, Any]) -> Any:
    prof = pc.profile(base, pp=2, schedule=extra.get("schedule", "1f1b"), virtual=extra.get("virtual", 1))
    return dataclasses.replace(prof, parallel=dataclasses.replace(prof.parallel, tp=2,
                                                                  sequence=extra.get("sequence", False)))


def _sent_per_step(sequence: bool) -> dict[str, int]:
    """One more GPT step (after the probe and a first step): the bytes this rank's sends carried."""
    mesh = memsave.init(tp=2, pp=2)
    kind = pc.KINDS["gpt-untied"]
    model = kind.build()
    model, opt = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=pc.LR),
                              _profile("ddp", {"sequence": sequence}), mesh=mesh)
    inputs, _ = pc.micro(kind, kind.data()[0], pc.MICRO)
    model.pipeline_step(inputs)
    opt.step()
    with COMM_STATS.measure() as stats:
        model.pipeline_step(inputs)
    rows, seq = inputs[0]["input_ids"].shape
    return {"sent": stats.bytes.get("pp_send", 0), "rows": rows, "seq": seq, "d": model.config.d_model}


ADAFACTOR = dict(lr=1e-2, relative_step=False, beta1=0.9, weight_decay=0.1, clip_threshold=0.5)


def _adafactor(kind_name: str, base: str, mesh: memsave.Mesh) -> dict[str, float]:
    """memsave's Adafactor (factored statistics summed over tp inside its step) in tp x pp against one process.
    (A Llama: the reference GPT's qkv bias has a key part whose gradient is zero up to rounding, which Adafactor's
    eps = 1e-30 turns into updates of any size, so no two summation orders agree there.)"""
    from memsave.optim import Adafactor

    kind = pc.KINDS[kind_name]
    ref = kind.build()
    ref_opt = Adafactor(ref.parameters(), **ADAFACTOR)
    model = kind.build()
    model, opt = memsave.wrap(model, Adafactor(model.parameters(), **ADAFACTOR), _profile(base, {}), mesh=mesh)
    losses, ref_losses = [], []
    for batch in kind.data():
        inputs, _ = pc.micro(kind, batch, pc.MICRO)
        losses.append(float(model.pipeline_step(inputs)))
        opt.step()
        opt.zero_grad()
        total = 0.0
        for mb in inputs:
            loss = ref(**mb).loss / pc.MICRO
            loss.backward()
            total += float(loss)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(total)
    got = {k: v.detach() for k, v in model.state_dict().items()}
    want = ref.state_dict()
    return {"loss": pc.rel(losses, ref_losses), "param": max(pc.rel(got[k].numpy(), want[k].numpy()) for k in got)}


def _cases(root: str) -> dict[str, Any]:
    mesh = memsave.init(tp=2, pp=2)
    out: dict[str, Any] = {}
    for name, base, extra in CASES:
        kind = pc.KINDS[name]
        run, _, _ = pc.pipelined(kind, mesh, _profile(base, extra), tp_plan=SEQ_PLAN if name == "seq" else None)
        out[f"{name} {base} {extra}"] = {k: v[0] for k, v in pc.compare(run, pc.reference(kind)).items()}
    for name, base in (("llama", "zero1"), ("llama-untied", "zero3")):
        out[f"adafactor {name} {base}"] = _adafactor(name, base, mesh)
    for sequence in (False, True):
        out[f"sent sequence={sequence}"] = _sent_per_step(sequence)
    out["checkpoint"] = _checkpoint(Path(root), mesh)
    kind = pc.KINDS["llama-untied"]  # memsave.estimate under tp x pp: this rank's parameter bytes
    model = kind.build()
    prof = _profile("zero1", {})
    with torch.device("meta"):
        meta = kind.build()
    est = memsave.estimate(meta, prof, world_size=4).stages[mesh.axis_rank("pp")]
    model, opt = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=pc.LR), prof, mesh=mesh)
    out["estimate"] = (est.bytes.get("params", 0), memsave.memory.account([model, opt]).bytes.get("params", 0))
    return out


def _checkpoint(root: Path, mesh: memsave.Mesh) -> dict[str, Any]:
    """Save after a step under tp x pp (zero3), load into a fresh wrap; both take the next step alike. `memsave
    export` writes the whole model, equal to the gathered state dict."""
    kind = pc.KINDS["llama-untied"]
    prof = _profile("zero3", {})
    batches = [pc.micro(kind, b, pc.MICRO)[0] for b in kind.data()]
    model = kind.build()
    model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), prof, mesh=mesh)
    model.pipeline_step(batches[0])
    opt.step()
    opt.zero_grad()
    memsave.save(root / "ckpt", model, opt)
    whole = {k: v.clone() for k, v in model.state_dict().items()}  # this rank's stages, gathered over tp
    other = kind.build()
    torch.manual_seed(123)
    for p in other.parameters():  # other values: only the load makes them equal
        p.data.normal_()
    other, other_opt = memsave.wrap(other, torch.optim.AdamW(other.parameters(), lr=1e-2), prof, mesh=mesh)
    memsave.load(root / "ckpt", other, other_opt)
    losses = []
    for m, o in ((model, opt), (other, other_opt)):
        losses.append(float(m.pipeline_step(batches[1])))
        o.step()
    after = [{k: v.clone() for k, v in m.state_dict().items()} for m in (model, other)]
    if mesh.rank == 0:
        from memsave.cli import main

        assert main(["export", str(root / "ckpt"), str(root / "model.safetensors")]) == 0
    torch.distributed.barrier()
    from safetensors.torch import load_file

    exported = load_file(root / "model.safetensors")
    return {"losses": losses, "same_after": all(torch.equal(after[0][k], after[1][k]) for k in after[0]),
            "keys": sorted(whole), "exported": sorted(exported),
            "exported_equal": sorted(k for k, v in whole.items() if k in exported and torch.equal(exported[k], v))}


def test_tp_inside_pipeline_stages(tmp_path: Path) -> None:
    results = run_ranks(_cases, 4, str(tmp_path), timeout=600)
    for rank, res in enumerate(results):
        for name, base, extra in CASES:
            worst = res[f"{name} {base} {extra}"]
            assert all(v <= pc.FP32_TOL for v in worst.values()), (rank, name, base, extra, worst)
        for name, base in (("llama", "zero1"), ("llama-untied", "zero3")):
            worst = res[f"adafactor {name} {base}"]
            assert all(v <= pc.FP32_TOL for v in worst.values()), (rank, name, base, worst)
        for sequence in (False, True):
            s = res[f"sent sequence={sequence}"]
            # stage 0 sends each micro-batch's activation forward, stage 1 its gradient back: rows x seq x d fp32,
            # a 1/tp slice of the sequence under sequence parallelism
            assert s["sent"] == pc.MICRO * s["rows"] * s["seq"] * s["d"] * 4 // (2 if sequence else 1), (rank, s)
        est, measured = res["estimate"]
        assert est == measured, (rank, est, measured)  # the stage's parameters, cut over tp
        ck = res["checkpoint"]
        assert ck["losses"][0] == ck["losses"][1] and ck["same_after"], (rank, ck["losses"])
    # every stage's parameters are in the export, equal to what the ranks holding them gathered
    exported = set(results[0]["checkpoint"]["exported"])
    held = {k for r in results for k in r["checkpoint"]["keys"]}
    assert held == exported, (sorted(held - exported), sorted(exported - held))
    for rank, res in enumerate(results):
        assert res["checkpoint"]["exported_equal"] == res["checkpoint"]["keys"], rank
