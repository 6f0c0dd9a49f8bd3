"""The memory tracker and the estimator: bytes per category measured at every phase and unit boundary, against
arithmetic, against torch's own MemTracker, and against what ``memsave.estimate`` predicted before the run.

Targets of the issue (the bench GPT figures are in ``memsave bench --memory``): estimated model-state bytes per
rank within 2% of the measured, activations within 10%, the peak within 10%; the tracker within 5% of
MemTracker per category on an unsharded run. On the small GPT the estimate is exact for every profile below
(the test allows the issue's tolerances, and asserts the model state exactly).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import memsave
from memsave.cli import main
from memsave.estimator import estimate
from memsave.memory import MemoryTracker, load_report
from memsave.memory.schema import format_bytes, in_memory_total, peak_step
from memsave.models import GPT, TokenBatches, gpt_config
from memsave.recompute.measure import measure_saved_bytes
from tests.harness import run_ranks

MODEL_STATE = ("params", "grads", "master", "optimizer_state")


def _gpt(size: str = "tiny", **kw: Any) -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_config(size, **kw))


def _step(model: Any, opt: Any, batch: dict[str, torch.Tensor], wrapped: bool) -> float:
    loss = model(**batch).loss
    if wrapped:
        opt.backward(loss)
        opt.clip_grad_norm(1.0)
    else:
        loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def _events(tracker: MemoryTracker, event: str) -> list[dict[str, Any]]:
    return [s for s in tracker.timeline if s["event"] == event]


def test_plain_model_categories_by_arithmetic() -> None:
    """A plain (unwrapped) model: parameters, gradients, Adam's state and the saved activations of one forward,
    each equal to what arithmetic and an independent measurement say, at the boundary where it must be."""
    model = _gpt("tiny", tie_weights=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = TokenBatches(seq_len=32, batch_size=2)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    saved = measure_saved_bytes(lambda: model(**data.batch(0)), list(model.blocks), model=model).total
    out = model(**data.batch(0))
    held = saved + out.logits.numel() * 4 + 4  # and the outputs, logits and loss, while the caller holds them
    del out
    hooks_before = (len(model._forward_hooks), len(model._forward_pre_hooks))
    tracker = MemoryTracker(model, opt)
    for i in range(2):
        _step(model, opt, data.batch(i), wrapped=False)
    fwd_end = _events(tracker, "forward_end")
    assert [s["bytes"]["activations"] for s in fwd_end] == [held, held]
    assert all(s["bytes"]["params"] == param_bytes for s in tracker.timeline)
    back_end = _events(tracker, "backward_end")
    # backward freed every saved tensor; what is left is the loss the caller still holds
    assert all(s["bytes"].get("activations", 0) == 4 for s in back_end), [(s["step"], s["bytes"]) for s in back_end]
    assert all(s["bytes"]["grads"] == param_bytes for s in back_end)
    steps = _events(tracker, "step_end")
    n_params = len(list(model.parameters()))
    assert steps[0]["bytes"]["optimizer_state"] == 2 * param_bytes + 4 * n_params  # m, v and the step scalars
    assert _events(tracker, "zero_grad")[-1]["bytes"].get("grads", 0) == 0
    # the peak is the largest in-memory total over the samples, with its phase and step
    totals = [in_memory_total(s["bytes"]) for s in tracker.timeline]
    assert tracker.peak["total"] == max(totals) == in_memory_total(tracker.peak["bytes"])
    assert tracker.peak["phase"] in ("forward", "backward") and tracker.peak["step"] == 1
    phases = [s["phase"] for s in tracker.timeline if s["step"] == 1]
    runs = [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p]
    assert runs == ["idle", "forward", "backward", "optimizer"]  # zero_grad, then the step's phases in order
    units = {s["unit"] for s in tracker.timeline if s["event"] in ("pre_forward", "pre_backward", "post_backward")}
    assert units == {"blocks.0", "blocks.1"}
    tracker.close()
    assert (len(model._forward_hooks), len(model._forward_pre_hooks)) == hooks_before
    assert "step" not in vars(opt) and not hasattr(model, "memsave_tracker")  # the optimizer's own step again
    samples = len(tracker.timeline)
    _step(model, opt, data.batch(2), wrapped=False)
    assert len(tracker.timeline) == samples  # closed: nothing samples any more


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_report_keeps_the_peak_sample_apart_from_the_maxima_and_zooms_into_its_step(micro_batches: int) -> None:
    """What ``memsave.report`` says of a tracked run: the categories at the peak are the peak sample's and sum to
    it; each category's maximum over the run is the largest over the samples and at least its bytes at the peak
    (without accumulation the gradients are more: they peak after the activations, at the end of backward); the
    zoomed step is the one holding the peak, its phases in the order they ran (forward and backward once per
    micro-batch), and its peak is the run's."""
    model = _gpt("tiny", tie_weights=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = TokenBatches(seq_len=32, batch_size=2)
    tracker = MemoryTracker(model, opt)
    for i in range(3):
        for m in range(micro_batches):
            model(**data.batch(2 * i + m)).loss.backward()
        opt.step()
        opt.zero_grad()
    rep = memsave.report(model, opt, profile="plain")
    tracker.close()
    data_ = rep.to_dict()
    rank = data_["ranks"][0]
    timeline, peak = rank["timeline"], rank["peak"]
    totals = [in_memory_total(s["bytes"]) for s in timeline]
    top = timeline[totals.index(max(totals))]
    assert peak["total"] == max(totals) == sum(peak["bytes"].values())  # no off-device tier here
    assert peak["bytes"] == top["bytes"] and (peak["step"], peak["phase"]) == (top["step"], top["phase"])
    for cat in data_["categories"]:
        assert rank["category_peak"].get(cat, 0) == max(s["bytes"].get(cat, 0) for s in timeline)
        assert rank["category_peak"].get(cat, 0) >= peak["bytes"].get(cat, 0)
    if micro_batches == 1:
        assert rank["category_peak"]["grads"] > peak["bytes"].get("grads", 0)
    (mem,) = rep.ranks
    assert mem.at_peak == peak["bytes"] and mem.max_over_run == rank["category_peak"] and mem.peak_total == peak["total"]
    # the step holding the peak: zero_grad (idle), then forward and backward per micro-batch, then the step
    view = rep.peak_step(0)
    assert view is not None and view["step"] == peak["step"] and view["holds_peak"]
    passes = [(phase, m + 1) for m in range(micro_batches) for phase in ("forward", "backward")]
    assert [(p["phase"], p["repeat"]) for p in view["phases"]] == [("idle", 1), *passes, ("optimizer", 1)]
    assert totals[view["peak"]] == peak["total"]
    assert view["samples"] == [i for i, s in enumerate(timeline) if s["step"] == peak["step"]]
    # and as text: both rows, the step table with the peak marked
    text = rep.to_text()
    assert "at peak" in text and "max over run" in text
    title = next(ln for ln in text.splitlines() if ln.startswith(f"rank 0 step {peak['step']} by phase"))
    assert title.endswith(f"(the step holding the peak): idle -> {'forward -> backward -> ' * micro_batches}"
                          "optimizer; each phase at its first sample (start) and its largest (peak)")
    (marked,) = [ln for ln in text.splitlines() if ln.endswith("<- the rank's peak")]
    assert format_bytes(peak["total"]) in marked
    with pytest.raises(ValueError, match="rank = 3 is not in this report; its ranks are 0"):
        rep.peak_step(3)


def test_agrees_with_torch_memtracker_on_an_unsharded_run() -> None:
    """torch's MemTracker (a dispatch mode) and ours (module and saved-tensor hooks) over the same two steps,
    read at the same instant, the end of each forward: every category both know agrees within 5% (measured: to
    the byte; the forward's outputs count as activations in both). MemTracker's TEMP, backward's temporaries,
    has no category here: it stays in the RSS remainder ("unaccounted")."""
    mem_tracker = importlib.import_module("torch.distributed._tools.mem_tracker").MemTracker
    model = _gpt("small", tie_weights=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = TokenBatches(seq_len=64, batch_size=2)
    _step(model, opt, data.batch(0), wrapped=False)  # optimizer state exists from here on
    theirs: list[dict[str, int]] = []
    with MemoryTracker(model, opt) as ours, mem_tracker() as mt:
        mt.track_external(model, opt)
        # registered after the tracker's root hook (prepended): the same instant as its forward_end sample
        hook = model.register_forward_hook(lambda *_: theirs.append(
            {str(getattr(k, "value", k)): v for k, v in next(iter(mt.get_tracker_snapshot("current").values())).items()}))
        for i in range(1, 3):
            mt.reset_mod_stats()
            _step(model, opt, data.batch(i), wrapped=False)
        hook.remove()
    pairs = {"Parameter": "params", "Optstate": "optimizer_state", "Activation": "activations", "Buffer": "buffers",
             "Gradient": "grads"}
    samples = _events(ours, "forward_end")
    assert len(samples) == len(theirs) == 2
    for mine, snap in zip(samples, theirs):
        for name, cat in pairs.items():
            assert mine["bytes"].get(cat, 0) == pytest.approx(snap.get(name, 0), rel=0.05), (name, mine, snap)
        assert mine["bytes"]["params"] == snap["Parameter"] and mine["bytes"]["optimizer_state"] == snap["Optstate"]


def test_compression_stays_on_under_the_tracker_and_is_counted_compressed() -> None:
    """[Note: composing saved-tensor hooks]: the tracker chains to memsave's compression instead of replacing it:
    the run with the tracker equals the compressed run without it, and the activations it counts are the
    bf16 copies (about half of uncompressed)."""
    def run(track: bool, compress: str) -> tuple[list[float], int]:
        model = _gpt("tiny", dropout=0.0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = memsave.wrap(model, opt, memsave.Profile.load("ddp", [f"recompute.compress={compress!r}"]))
        tracker = MemoryTracker(model, opt) if track else None
        data = TokenBatches(seq_len=64, batch_size=2)
        losses = [_step(model, opt, data.batch(i), wrapped=True) for i in range(3)]
        acts = _events(tracker, "forward_end")[-1]["bytes"]["activations"] if tracker else 0
        return losses, acts

    plain, plain_acts = run(True, "none")
    compressed, _ = run(False, "bf16")
    tracked, tracked_acts = run(True, "bf16")
    assert tracked == compressed and tracked != plain
    assert 0.45 * plain_acts < tracked_acts < 0.62 * plain_acts  # the covered tensors at 2 bytes, not 4


# every preset (the "every profile that exists"), and offload under mixed precision (the fp32 masters move)
PROFILES = (*memsave.list_presets(), 'zero3-infinity:precision.compute="bf16"', "zero3-infinity:offload.fraction=0.5",
            'zero3-infinity:offload.params="disk"',
            'zero2-offload:offload.optimizer="disk",offload.path="tmp",precision.compute="bf16",offload.fraction=0.5')


def _estimate_vs_measured(profiles: tuple[str, ...], offload_dir: str = "") -> list[dict[str, Any]]:
    mesh = memsave.init()
    out = []
    for name in profiles:
        preset, _, overrides = name.partition(":")
        prof = memsave.load_profile(preset, overrides.split(",") if overrides else [])
        if prof.offload.optimizer == "disk":  # keep the test's files in tmp
            prof = memsave.load_profile(prof, [f"offload.path={offload_dir!r}"])
        data = TokenBatches(seq_len=64, batch_size=2, dp_rank=mesh.dp_rank, dp_size=mesh.dp_size)
        with torch.device("meta"):
            meta = GPT(gpt_config("small", dropout=0.0))
        est = estimate(meta, prof, world_size=mesh.dp_size, batch=data.batch(0), device="cpu")
        model = _gpt("small", dropout=0.0)
        opt = memsave.optim.build_optimizer(model.parameters(), prof.optimizer)
        model, opt = memsave.wrap(model, opt, prof, mesh=mesh)
        tracker = MemoryTracker(model, opt)
        for i in range(3):
            _step(model, opt, data.batch(i), wrapped=True)
        end = _events(tracker, "step_end")[-1]["bytes"]
        acts = _events(tracker, "forward_end")[-1]["bytes"]["activations"]
        rep = memsave.report(model, opt, profile=name, estimate=est.to_report_dict())
        tracker.close()
        out.append({"profile": name, "est_state": est.model_state, "state": sum(end.get(c, 0) for c in MODEL_STATE),
                    "est_acts": est.activations, "acts": acts, "est_peak": est.peak_total,
                    "peak": tracker.peak["total"], "report": rep.to_dict()})
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_estimate_matches_the_measurement_for_every_profile(world_size: int, tmp_path: Path) -> None:
    results = run_ranks(_estimate_vs_measured, world_size, PROFILES, str(tmp_path / "offload"), timeout=300)
    for rank_rows in results:
        for r in rank_rows:
            name = r["profile"]
            if "offload.params" in name:  # the shards' residency at the step's end follows their asynchronous
                # write-back; the peak counts the ones read around their use (memsave/estimate_offload.py)
                print(name, r["peak"], r["est_peak"], f"{r['est_peak'] / r['peak'] - 1:+.1%}")
                assert r["peak"] == pytest.approx(r["est_peak"], rel=0.05), (name, r)
                continue
            assert r["state"] == pytest.approx(r["est_state"], rel=0.02), (name, r)
            assert r["acts"] == pytest.approx(r["est_acts"], rel=0.10), (name, r)
            assert r["peak"] == pytest.approx(r["est_peak"], rel=0.10), (name, r)
    # the reports of rank 0 carry both ranks, the estimate, and survive a JSON round trip
    for r in results[0]:
        rep = r["report"]
        assert [x["rank"] for x in rep["ranks"]] == list(range(world_size)) and rep["estimate"] is not None
        for rank in rep["ranks"]:
            assert rank["timeline"] and rank["peak"]["total"] == in_memory_total(rank["peak"]["bytes"])
            assert all(rank["category_peak"].get(c, 0) >= n for c, n in rank["peak"]["bytes"].items())
            # the zoomed step holds the peak, and goes through the training phases in order
            view = peak_step(rank)
            assert view is not None and view["holds_peak"], (r["profile"], view)
            phases = [p["phase"] for p in view["phases"]]
            assert [p for p in phases if p != "idle"] == ["forward", "backward", "optimizer"], (r["profile"], phases)
        path = tmp_path / f"{r['profile']}-{world_size}.json"
        memsave.memory.save_report(rep, path)
        assert path.stat().st_mode & 0o777 == 0o644  # readable as the HTML beside it (mkstemp's 0600 stayed)
        assert load_report(path) == json.loads(json.dumps(rep))


def _late_grads(cases: list[tuple[str, bool]]) -> list[tuple[int, int, int, int]]:
    mesh = memsave.init()
    out = []
    for profile, tied in cases:
        prof = memsave.load_profile(profile, ['recompute.policy="full"'])
        data = TokenBatches(seq_len=16, batch_size=4, dp_rank=mesh.dp_rank, dp_size=mesh.dp_size)
        with torch.device("meta"):
            meta = GPT(gpt_config("tiny", dropout=0.0, tie_weights=tied))
        est = estimate(meta, prof, world_size=mesh.dp_size, batch=data.batch(0), device="cpu")
        model = _gpt("tiny", dropout=0.0, tie_weights=tied)
        model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), prof, mesh=mesh)
        tracker = MemoryTracker(model, opt)
        for i in range(2):
            _step(model, opt, data.batch(i), wrapped=True)
        out.append((est.peak_total, tracker.peak["total"], est.bytes.get("grads", 0), tracker.peak["bytes"]["grads"]))
        tracker.close()
        opt.close()
    return out


def test_estimate_holds_an_untied_heads_gradient_through_backward() -> None:
    """At ZeRO-2/3 the root's gradients are reduced at backward's end, and an untied head's and the final norm's
    exist from its start: with full recomputation the peak is in the first block's backward, with them. Left out,
    the estimate was 3.7% under the tracker (an HF Llama: 6.1%, and profile="auto" chose a configuration it then
    exceeded the budget with: a review)."""
    cases = [("zero2", False), ("zero3", False), ("zero3", True)]  # (tied: its head's weight is the embedding's)
    for rank in run_ranks(_late_grads, 2, cases, timeout=240):
        for (profile, tied), (est, peak, est_grads, grads) in zip(cases, rank):
            assert est == pytest.approx(peak, rel=0.005) and est_grads == grads, (profile, tied, est, peak)


def _vit() -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=128, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, num_labels=5)
    torch.manual_seed(0)
    return ViTForImageClassification(cfg)


def _vit_estimate_vs_measured() -> list[tuple[str, int, int]]:
    mesh = memsave.init()
    g = torch.Generator().manual_seed(mesh.dp_rank)
    batch = {"pixel_values": torch.randn(16, 3, 16, 16, generator=g), "labels": torch.randint(0, 5, (16,), generator=g)}
    cases = (("zero3", ()), ("zero3-recompute", ()), ("zero2", ('recompute.policy="full"',)))
    return _estimates_and_peaks(mesh, _vit, batch, cases, steps=2)


def _estimates_and_peaks(mesh: memsave.Mesh, build: Callable[[], torch.nn.Module], batch: dict,
                         cases: tuple[tuple[str, tuple[str, ...]], ...], steps: int) -> list[tuple[str, int, int]]:
    """(profile, estimated peak, the tracker's peak over ``steps`` steps) per case; ``build()`` runs on the meta
    device for the estimate."""
    out = []
    for name, overrides in cases:
        profile = memsave.load_profile(name, list(overrides))
        with torch.device("meta"):
            meta = build()
        est = estimate(meta, profile, world_size=mesh.dp_size, batch=batch, device="cpu")
        model, opt = memsave.wrap(m := build(), torch.optim.AdamW(m.parameters(), lr=1e-3), profile, mesh=mesh)
        tracker = MemoryTracker(model, opt)
        for _ in range(steps):
            opt.backward(model(**batch).loss)
            opt.step()
            opt.zero_grad()
        out.append((f"{name} {' '.join(overrides)}".strip(), est.peak_total, tracker.peak["total"]))
        tracker.close()
    return out


def test_estimate_of_a_vision_model_under_recomputation() -> None:
    """A Hugging Face ViT classifier on 2 ranks: its tiny logits no longer hide the backward's peak, which under
    recomputation holds the patch convolution's pixels (saved before the first unit, kept to the end of backward)
    and, at stage 3, a unit still gathered while its reduce-scatter is launched. The estimate missed both: 12-20%
    under the tracker (from a review); now within 1%."""
    for rank_rows in run_ranks(_vit_estimate_vs_measured, 2, timeout=300):
        for profile, est, peak in rank_rows:
            print(profile, est, peak, f"{est / peak - 1:+.2%}")
            assert est == pytest.approx(peak, rel=0.01), (profile, est, peak)


def test_report_without_a_tracker_counts_what_the_tracker_counts() -> None:
    """``memsave.report(model, optimizer)`` with no tracker (README's first snippet) accounts the engine for the
    model as the tracker does: it counted the model's placeholders too, one element per parameter more under
    ZeRO-2/3."""
    for profile in ("zero2", "zero3"):
        model, opt = memsave.wrap(m := _gpt(), torch.optim.AdamW(m.parameters(), lr=1e-3), profile)
        batch = TokenBatches(seq_len=32, batch_size=2).batch(0)
        opt.backward(model(**batch).loss)
        opt.step()  # gradients kept: every category present
        alone = memsave.report(model, opt).to_dict()["ranks"][0]["current"]
        tracker = MemoryTracker(model, opt)
        tracked = memsave.report(model, opt).to_dict()["ranks"][0]["current"]
        tracker.close()
        assert alone == tracked and alone["grads"] > 0, (profile, alone, tracked)
        assert memsave.report(model, opt).to_text().startswith(f"memory report ({profile}):")  # the model's profile


def test_zero3_gathered_parameters_are_not_activations() -> None:
    """ZeRO-3 saves views of the gathered weights for backward; they are gathered parameters (freed and
    re-gathered by the engine), never activations, and the tracker sees the gather and the reshard per unit."""
    results = run_ranks(_estimate_vs_measured, 2, ("zero3",), timeout=120)
    rep = results[0][0]["report"]
    samples = rep["ranks"][0]["timeline"]
    gathered = {(s["event"], s["unit"]): s["bytes"].get("params_gathered", 0) for s in samples if s["step"] == 2}
    # a unit is freed once all of its backward ran (its inputs' gradients too): never more than the root and one
    # block gathered in backward, nothing once it ended
    one_block = gathered[("pre_forward", "blocks.0")]
    back = [s for s in samples if s["step"] == 2 and s["phase"] == "backward"]
    assert back and all(s["bytes"].get("params_gathered", 0) <= one_block for s in back)
    assert gathered[("backward_end", None)] == 0 < gathered[("post_forward", "blocks.0")]
    # the prefetch window: when a unit starts its forward, the next unit's gather is in flight (its staging)
    prefetching = [s["bytes"].get("comm", 0) for s in samples if s["event"] == "pre_forward" and s["step"] == 2]
    assert prefetching[0] > 0 and prefetching[-1] == 0  # the last unit has nothing after it to prefetch
    back_end = [s for s in samples if s["event"] == "backward_end"]
    assert back_end and all(s["bytes"].get("activations", 0) == 4 for s in back_end)  # the loss the caller holds


def test_estimate_refuses_bad_input_and_leaves_the_model_alone() -> None:
    model = _gpt("tiny")
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="world_size = 0"):
        estimate(model, "zero3", world_size=0)
    with pytest.raises(ValueError, match="device = 'tpu'"):
        estimate(model, "zero3", device="tpu")
    est = estimate(model, "zero3", world_size=4, batch=TokenBatches(seq_len=16, batch_size=2).batch(0))
    assert est.activations > 0 and est.bytes["params"] < sum(p.numel() * 4 for p in model.parameters()) / 3
    assert all(p.device.type == "cpu" and torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not any(hasattr(m, "memsave_recompute_plan") for m in model.modules())


def test_estimate_a_model_too_big_for_this_machine() -> None:
    """A 100B-parameter GPT on the meta device: nothing allocated, the ZeRO-3 arithmetic per rank."""
    with torch.device("meta"):
        big = GPT(gpt_config("bench", n_layer=96, d_model=9216, n_head=72, vocab_size=50304, block_size=2048))
    psi = sum(p.numel() for p in big.parameters())
    est = estimate(big, "zero3-bf16", world_size=1024, batch=None)
    assert psi > 9e10 and est.model_state == pytest.approx(16 * psi / 1024, rel=0.01)


def test_cli_estimate(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "est.json"
    assert main(["estimate", "--model", "gpt:tiny", "--profile", "zero3", "--seq-len", "32", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "zero3" in text and "params_gathered" in text and "activations" in text
    data = json.loads(out.read_text())
    assert data["estimates"][0]["profile"] == "zero3" and data["estimates"][0]["activations"] > 0
    assert main(["estimate", "--model", "gpt:tiny", "--seq-len", "32"]) == 0  # every preset
    assert len([ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("zero")]) >= 5
    assert main(["estimate", "--model", "nosuchmodule:build"]) == 2
    assert "cannot load 'build'" in capsys.readouterr().err


def test_trainer_writes_the_tracked_report(tmp_path: Path) -> None:
    mesh = memsave.init()
    model = _gpt("tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = memsave.wrap(model, opt, "zero2", mesh=mesh)
    cfg = memsave.TrainConfig(steps=3, batch_size=2, seq_len=32, track_memory=True, report_dir=str(tmp_path))
    result = memsave.Trainer(model, opt, mesh=mesh, config=cfg, train_data=TokenBatches(seq_len=32, batch_size=2),
                             profile="zero2").fit()
    data = load_report(tmp_path / "report.json")
    assert data == result.report.to_dict() or data["run"] == result.report.to_dict()["run"]
    assert len({s["step"] for s in data["ranks"][0]["timeline"]}) == 4  # steps 0-2, and the report's sample
    assert (tmp_path / "report.html").read_text().startswith("<!DOCTYPE html>")
    assert not hasattr(model, "memsave_tracker")  # the trainer's tracker is gone: no hooks left


def _accumulating(profiles: tuple[str, ...]) -> list[tuple[str, int, int]]:
    mesh = memsave.init()
    out = []
    for name in profiles:
        data = TokenBatches(seq_len=64, batch_size=2, dp_rank=mesh.dp_rank, dp_size=mesh.dp_size)
        with torch.device("meta"):
            meta = GPT(gpt_config("small", dropout=0.0))
        est = estimate(meta, name, world_size=mesh.dp_size, batch=data.batch(0), device="cpu", micro_batches=2)
        model = _gpt("small", dropout=0.0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = memsave.wrap(model, opt, name, mesh=mesh)
        with MemoryTracker(model, opt) as tracker:
            for i in range(3):
                with model.no_sync():
                    opt.backward(model(**data.batch(2 * i)).loss)
                opt.backward(model(**data.batch(2 * i + 1)).loss)
                opt.step()
                opt.zero_grad()
        out.append((name, est.peak_total, tracker.peak["total"]))
    return out


def test_estimate_with_gradient_accumulation() -> None:
    """Under model.no_sync() the full gradients accumulate locally until the synchronizing backward (at stage 0
    beside the buckets): the estimate with micro_batches=2 follows the measured peak (measured: exact)."""
    for name, est, measured in run_ranks(_accumulating, 2, ("ddp", "zero1", "zero2", "zero3"), timeout=180)[0]:
        assert measured == pytest.approx(est, rel=0.02), (name, est, measured)


def test_estimate_host_offload_on_cuda_moves_state_masters_and_parameters() -> None:
    """zero3-bf16 with ``optimizer = "cpu"`` and ``params = "cpu"`` on a CUDA device: the 12 bytes per element of
    fp32 masters and AdamW moments, and the bf16 parameter shards, go to pinned host memory, but for the shards
    resident around their use (estimated on the meta device; nothing is allocated)."""
    with torch.device("meta"):
        model = GPT(gpt_config("bench", n_layer=12))
    psi = sum(p.numel() for p in model.parameters())
    plain = estimate(model, "zero3-bf16", world_size=8, batch=None, device="cuda")
    over = memsave.load_profile("zero3-bf16", ("offload.optimizer=cpu", "offload.params=cpu"))
    est = estimate(model, over, world_size=8, batch=None, device="cuda")
    assert est.bytes["offload_host"] == pytest.approx((12 + 2) * psi / 8, rel=0.02), est.bytes
    # on the device: no masters; of the parameters, the shards read in around their use (the unit gathered and
    # the ``prefetch`` after it: the largest, the root with the embeddings, and two blocks)
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    units = sorted([psi - sum(blocks), *blocks], reverse=True)
    resident = 2 * sum(units[: over.offload.prefetch + 1]) / 8
    assert est.bytes["params"] == pytest.approx(resident, rel=0.01) and est.bytes.get("master", 0) == 0
    assert est.model_state < plain.model_state / 4, (est.model_state, plain.model_state)
    # the host step (step "auto" here): no window on the device; the device step streams through one
    assert est.bytes.get("optimizer_state", 0) < 1024, est.bytes  # the `step` counters
    dev = estimate(model, memsave.load_profile("zero3-bf16", ("offload.optimizer=cpu", "offload.params=cpu",
                                                              "offload.step=device")),
                   world_size=8, batch=None, device="cuda")
    assert dev.bytes["optimizer_state"] >= 4 * 2**20 and dev.bytes["offload_host"] == est.bytes["offload_host"]
    from memsave.validate import effective_offload  # what wrap refuses on CUDA, before anything changes

    assert effective_offload(over, torch.device("cuda")) is over.offload
    for bad in (("offload.params=cpu",), ("offload.optimizer=cpu", "offload.params=cpu", "offload.fraction=0.5")):
        with pytest.raises(NotImplementedError, match='params = "cpu" on a CUDA device is not implemented with'):
            effective_offload(memsave.load_profile("zero3-bf16", bad), torch.device("cuda"))
    with pytest.raises(ValueError, match=r"needs zero\.stage = 3"):  # the profile itself is refused
        memsave.load_profile("zero2", ("offload.optimizer=cpu", "offload.params=cpu"))


def _clip_estimate_vs_measured() -> list[tuple[str, int, int]]:
    from tests.toy import hf_clip

    mesh = memsave.init()
    g = torch.Generator().manual_seed(mesh.dp_rank)
    batch = {"input_ids": torch.randint(3, 64, (8, 8), generator=g), "pixel_values": torch.randn(8, 3, 16, 16, generator=g),
             "return_loss": True}
    return _estimates_and_peaks(mesh, hf_clip, batch, (("zero3", ()), ("zero3-recompute", ()), ("zero2", ())), steps=3)


def test_estimate_of_two_towers_run_in_another_order_than_registered() -> None:
    """A Hugging Face CLIP on 2 ranks: the vision tower runs before the text tower, registered first. The engine
    gathers and reduces in the order the forward calls the units ([Note: the units' call order]), and the text
    tower's embeddings, first used after the vision tower's units, have their full gradients from the middle of
    backward. The estimate followed registration order and counted those gradients at backward's end: here 6.3%
    under the tracker with full recomputation (13% at zero3 with d 256, 6 + 6 layers); now within 2%."""
    for rank_rows in run_ranks(_clip_estimate_vs_measured, 2, timeout=300):
        for profile, est, peak in rank_rows:
            print(profile, est, peak, f"{est / peak - 1:+.2%}")
            assert est == pytest.approx(peak, rel=0.02), (profile, est, peak)
