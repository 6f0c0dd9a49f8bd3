"""``memsave.estimate`` under pipeline parallelism (memsave/estimate_pp.py) against what each rank measures.

Every pipeline rank trains the small GPT (4 blocks, tied embedding and head) under ``model.pipeline_step`` with a
:class:`~memsave.memory.MemoryTracker`; its peak sample per category is compared with its stage's estimate.
Tolerances (issue 20): each model-state category at the peak within 5%, the activation peak within 10%, the peak
total within 10%. Measured: exact for every case here but the mixed-precision one, whose activations are 0.2%
over (bf16 rounding of the meta forward's storages).

Also the activation-memory target of issue 20, from the measurements alone: the first stage's activation peak is
``pp`` micro-batches' worth under 1F1B and ``m`` under GPipe, one micro-batch's worth being what the same rank
holds after its first forward of the run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import memsave
from memsave.estimate_pp import estimate_stages, stage_activations
from memsave.memory import MemoryTracker
from memsave.models import GPT, TokenBatches, gpt_config
from memsave.pp.schedule import build
from memsave.pp.split import plan_split
from tests.harness import run_ranks

MODEL_STATE = ("params", "grads", "master", "optimizer_state")
M = 4  # micro-batches per step
CASES_PP2 = ("ddp:1f1b", "ddp:gpipe", "ddp:zero-bubble", "ddp+full:zero-bubble", "ddp:interleaved", "zero2-bf16:1f1b")
CASES_DP2_PP2 = ("zero1:1f1b", "zero3:1f1b")


def _profile(case: str) -> memsave.Profile:
    preset, schedule = case.split(":")
    preset, _, policy = preset.partition("+")  # "+full": with that recompute policy
    over = ["parallel.pp=2", f"parallel.schedule={schedule!r}"] + ([f"recompute.policy={policy!r}"] if policy else [])
    if schedule == "interleaved":
        over.append("parallel.virtual=2")
    return memsave.load_profile(preset, over)


def _meta() -> GPT:
    with torch.device("meta"):
        return GPT(gpt_config("small", dropout=0.0))


def _measure(cases: tuple[str, ...], m: int = M, rows: int = 2) -> list[dict[str, Any]]:
    out = []
    for case in cases:
        prof = _profile(case)
        mesh = memsave.init(profile=prof)
        torch.manual_seed(0)
        model = GPT(gpt_config("small", dropout=0.0))
        opt = memsave.optim.build_optimizer(model.parameters(), prof.optimizer)
        model, opt = memsave.wrap(model, opt, prof, mesh=mesh)
        data = TokenBatches(seq_len=64, batch_size=rows, dp_rank=mesh.dp_rank, dp_size=mesh.dp_size)
        with MemoryTracker(model, opt) as tracker:
            for step in range(2):
                model.pipeline_step([data.batch(step * m + i) for i in range(m)])
                opt.clip_grad_norm(1.0)
                opt.step()
                opt.zero_grad()
        # one micro-batch's worth: after the first forward of the second step (the first step begins with the
        # pipeline's probe forward)
        first = next(s for s in tracker.timeline if s["event"] == "forward_end" and s["step"] == 1)
        out.append({"case": case, "pp_rank": mesh.axis_rank("pp"), "peak": tracker.peak,
                    "acts": tracker.category_peak.get("activations", 0),
                    "one": first["bytes"].get("activations", 0),
                    "in_flight": model.memsave_engine.runner.max_in_flight})
        model.memsave_engine.remove()
    return out


def _check(results: list[list[dict[str, Any]]], world_size: int) -> list[tuple[str, int, int, int]]:
    batch = TokenBatches(seq_len=64, batch_size=2).batch(0)
    rows = []
    for rank_rows in results:
        for r in rank_rows:
            est = memsave.estimate(_meta(), _profile(r["case"]), world_size=world_size, batch=batch, device="cpu",
                                   micro_batches=M).stages[r["pp_rank"]]
            at_peak = r["peak"]["bytes"]
            for c in MODEL_STATE:
                assert at_peak.get(c, 0) == pytest.approx(est.bytes.get(c, 0), rel=0.05), (r["case"], c, at_peak, est)
            assert r["acts"] == pytest.approx(est.activations, rel=0.10), (r["case"], r, est)
            assert r["peak"]["total"] == pytest.approx(est.peak_total, rel=0.10), (r["case"], r, est)
            rows.append((r["case"], r["pp_rank"], r["acts"], r["one"]))
    return rows


def test_estimate_per_stage_matches_each_rank_at_pp2() -> None:
    rows = _check(run_ranks(_measure, 2, CASES_PP2, timeout=300), 2)
    first = {case: (acts, one) for case, rank, acts, one in rows if rank == 0}
    acts, one = first["ddp:1f1b"]  # 1F1B: the first stage holds pp = 2 micro-batches at once
    assert acts == pytest.approx(2 * one, rel=0.02), (acts, one)
    acts, one = first["ddp:gpipe"]  # GPipe: every micro-batch of the step
    assert acts == pytest.approx(M * one, rel=0.02), (acts, one)


def test_interleaved_chunks_accumulate_gradients_from_their_own_first_backward() -> None:
    """Interleaved with full recomputation, 2 micro-batches of 4 rows (a `memsave bench --plan` row, estimated 8%
    over): rank 1's activation peak comes after the backward of its last chunk and before that of its first, so
    only the last chunk's gradients are there yet."""
    [[r0], [r1]] = run_ranks(_measure, 2, ("ddp+full:interleaved",), 2, 4, timeout=300)
    batch = TokenBatches(seq_len=64, batch_size=4).batch(0)
    est = memsave.estimate(_meta(), _profile("ddp+full:interleaved"), world_size=2, batch=batch, device="cpu",
                           micro_batches=2)
    for r in (r0, r1):
        assert r["peak"]["total"] == pytest.approx(est.stages[r["pp_rank"]].peak_total, rel=0.02), (r, est)


def test_estimate_per_stage_matches_each_rank_dp2_x_pp2() -> None:
    """ZeRO-1 and ZeRO-3 over the two dp ranks inside each stage."""
    _check(run_ranks(_measure, 4, CASES_DP2_PP2, timeout=300), 4)


# -- in one process: the arithmetic of the schedule and of the split ------------------------------------------------
def _stage_bytes(prof: memsave.Profile, m: int = M) -> Any:
    meta = _meta()
    split = plan_split(meta, prof.parallel.pp * prof.parallel.virtual)
    return stage_activations(meta, split, list(meta.blocks), prof, TokenBatches(seq_len=64, batch_size=2).batch(0),
                             "cpu")


@pytest.mark.parametrize("pp", [2, 4])
def test_in_flight_micro_batches_follow_the_schedule(pp: int) -> None:
    """Per rank r: 1F1B holds pp - r micro-batches (m when fewer), GPipe m, interleaved and zero-bubble what the
    simulator's walk of their action lists says; the last stage adds one micro-batch's outputs (logits)."""
    batch = TokenBatches(seq_len=64, batch_size=2).batch(0)
    for m in (2, 8):
        for schedule, held in (("1f1b", lambda r, m=m: min(pp - r, m)), ("gpipe", lambda r, m=m: m)):
            prof = memsave.load_profile("ddp", [f"parallel.pp={pp}", f"parallel.schedule={schedule!r}"])
            acts = _stage_bytes(prof)
            stages = estimate_stages(_meta(), prof, world_size=pp, batch=batch, micro_batches=m)
            for r, est in enumerate(stages):
                outputs = acts.outputs if r == pp - 1 else 0
                assert est.activations == held(r) * acts.saved[r] + outputs, (schedule, m, r)
    prof = memsave.load_profile("ddp", ["parallel.pp=2", "parallel.schedule='interleaved'", "parallel.virtual=2"])
    acts = _stage_bytes(prof)
    stages = estimate_stages(_meta(), prof, world_size=2, batch=batch, micro_batches=4)
    # rank 0 (stages 0 and 2): F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3: 4 micro-batches of stage 0, 1 of stage 2 (the
    # stages' bytes differ by the ids the embedding saves: more than 3 + 2 after F0.2)
    sched = build("interleaved", 2, 4, 2)
    assert [str(a) for a in sched.actions[0][:7]] == ["F0.0", "F0.1", "F2.0", "F2.1", "F0.2", "B2.0", "F0.3"]
    assert acts.saved[0] > acts.saved[2]
    assert stages[0].activations == 4 * acts.saved[0] + acts.saved[2]


def test_stage_states_follow_the_split_with_the_tie_on_both_stages() -> None:
    meta = _meta()
    whole = memsave.estimate(meta, "ddp", world_size=1, device="cpu")
    est = memsave.estimate(meta, memsave.load_profile("zero2", ["parallel.pp=2"]), world_size=4, device="cpu")
    stages = est.stages
    assert [s.pp_rank for s in stages] == [0, 1] and est.peak_total == max(s.peak_total for s in stages)
    tied = 4 * meta.wte.weight.numel()  # wte and lm_head share it: held (and counted) on both stages
    assert meta.lm_head.weight is meta.wte.weight
    assert sum(s.bytes["params"] for s in stages) == whole.bytes["params"] + tied
    block = 4 * sum(p.numel() for p in meta.blocks[0].parameters())
    wpe, ln_f = 4 * meta.wpe.weight.numel(), 4 * sum(p.numel() for p in meta.ln_f.parameters())
    assert stages[0].bytes["params"] == tied + wpe + 2 * block
    assert stages[1].bytes["params"] == tied + ln_f + 2 * block
    for s in stages:  # ZeRO-2 over the 2 dp ranks of the stage: Adam's state on half the rows (padded rows aside)
        assert s.bytes["optimizer_state"] == pytest.approx(s.bytes["params"], rel=0.02)


def test_estimate_under_pp_refuses_bad_input() -> None:
    meta = _meta()
    pp2 = memsave.load_profile("ddp", ["parallel.pp=2"])
    with pytest.raises(ValueError, match="world_size = 3 is not divisible by \\[parallel\\] pp = 2"):
        memsave.estimate(meta, pp2, world_size=3)
    with pytest.raises(ValueError, match="schedule 'gpipe' is for pp = 2 and 2 micro-batches"):
        memsave.estimate(meta, pp2, world_size=2, micro_batches=4, schedule=build("gpipe", 2, 2))
    with pytest.raises(ValueError, match="schedule= is for \\[parallel\\] pp > 1 only"):
        memsave.estimate(meta, "ddp", world_size=2, schedule=build("gpipe", 2, 2))
    with pytest.raises(ValueError, match="world_size = 6 is not divisible by pp x tp = 2 x 2"):
        memsave.estimate(meta, memsave.load_profile("ddp", ["parallel.pp=2", "parallel.tp=2"]), world_size=6)
    # tp inside the stages: each stage's matrices cut over tp (measured against the ranks in tests/test_pp_tp.py)
    tp2 = memsave.estimate(meta, memsave.load_profile("ddp", ["parallel.pp=2", "parallel.tp=2"]), world_size=4)
    tp1 = memsave.estimate(meta, pp2, world_size=2)
    for a, b in zip(tp2.stages, tp1.stages, strict=True):
        assert 0.5 * b.bytes["params"] < a.bytes["params"] < 0.75 * b.bytes["params"], (a.bytes, b.bytes)
    # a schedule given as data is estimated as given
    est = memsave.estimate(meta, pp2, world_size=2, micro_batches=2, schedule=build("gpipe", 2, 2),
                           batch=TokenBatches(seq_len=64, batch_size=2).batch(0))
    assert "schedule gpipe, 2 micro-batches: at most 2 micro-batches" in est.stages[0].notes[0]


def test_cli_estimate_prints_one_row_per_pipeline_rank(capsys: pytest.CaptureFixture[str]) -> None:
    from memsave.cli import main

    assert main(["estimate", "--model", "gpt:small", "--profile", "zero1", "--parallel.pp=2", "--world-size", "4",
                 "--micro-batches", "4", "--seq-len", "64", "--batch-size", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.strip().startswith("zero1")]
    assert [r[1:4] for r in rows] == [["4", "pp", "0"], ["4", "pp", "1"]], out
    assert "pipeline rank 0 of 2 (stage 0: wte .. blocks.1" in out and "at most 2 micro-batches" in out
    assert "pipeline rank 1 of 2 (stage 1: blocks.2 .. lm_head" in out and "at most 1 micro-batches" in out


def main() -> None:
    """The table of docs/benchmarks.md (Pipeline parallelism): each rank's measured activation peak in
    micro-batches' worth (one = what it holds after the first forward of a step) against the estimate."""
    print("| schedule | m | rank | measured activation peak | one micro-batch | measured / one | estimated | "
          "estimated / measured |")
    print("|---|---|---|---|---|---|---|---|")
    batch = TokenBatches(seq_len=64, batch_size=2).batch(0)
    for m in (4, 8):
        cases = ("ddp:1f1b", "ddp:gpipe")
        for rows in zip(*run_ranks(_measure, 2, cases, m, timeout=600)):
            for r in rows:
                est = memsave.estimate(_meta(), _profile(r["case"]), world_size=2, batch=batch, device="cpu",
                                       micro_batches=m).stages[r["pp_rank"]]
                print(f"| {r['case'].split(':')[1]} | {m} | {r['pp_rank']} | {r['acts']:,} | {r['one']:,} | "
                      f"{r['acts'] / r['one']:.2f} | {est.activations:,} | {est.activations / r['acts']:.4f} |")


if __name__ == "__main__":
    main()
