"""``memsave bench --tp``: the formulas it checks against, and a tiny run of one process, memsave's TP with
sequence parallelism and torch's, whose parameter bytes per rank equal the plan's formula exactly."""

from __future__ import annotations

import pytest
import torch

from memsave.bench import BenchOptions
from memsave.bench.tp import adapted_activation_bytes, paper_activation_bytes, plan_param_bytes, run_tp_bench
from memsave.bench.tp_report import checks, format_tp_table
from memsave.models import GPT, gpt_config


def test_paper_formulas() -> None:
    s, b, h, a = 256, 4, 256, 8
    sbh = s * b * h
    assert paper_activation_bytes(s, b, h, a, 1, False) == sbh * (34 + 5 * a * s / h)
    assert paper_activation_bytes(s, b, h, a, 2, False) == sbh * (10 + 24 / 2 + 5 * a * s / (h * 2))
    assert paper_activation_bytes(s, b, h, a, 2, True) == sbh * (34 + 5 * a * s / h) / 2
    # fp32, no dropout, flash attention: sbh(16 + 48/t + 4a/(ht)) + 16sb; under SP all of it / t
    assert adapted_activation_bytes(s, b, h, a, 1, False) == sbh * (64 + 4 * a / h) + 16 * s * b
    assert adapted_activation_bytes(s, b, h, a, 2, False) == sbh * (16 + 48 / 2 + 4 * a / (h * 2)) + 16 * s * b
    assert adapted_activation_bytes(s, b, h, a, 2, True) == (sbh * (64 + 4 * a / h) + 16 * s * b) / 2


def test_plan_param_bytes_splits_what_the_plan_splits() -> None:
    with torch.device("meta"):
        model = GPT(gpt_config("tiny", vocab_size=251, tie_weights=False))  # 251 rows: padded to 252 over tp=2
    whole = {n: p.numel() * 4 for n, p in model.named_parameters()}
    replicated = sum(v for n, v in whole.items() if "ln" in n or n == "wpe.weight" or n.endswith("proj.bias"))
    vocab = whole["wte.weight"] + whole["lm_head.weight"]
    rest = sum(whole.values()) - replicated - vocab
    assert plan_param_bytes(model, 2) == rest // 2 + replicated + 2 * 126 * 64 * 4
    assert plan_param_bytes(model, 1) == sum(whole.values())


def test_bench_tp_tiny() -> None:
    opts = BenchOptions(size="tiny", seq_len=32, batch_size=2, steps=2, warmup=1, nproc=2)
    rows = run_tp_bench(opts, ("single", "memsave-sp", "torch-sp"), timeout_s=120)
    by_name = {r["name"]: r for r in rows}
    assert set(by_name) == {"single", "memsave-sp", "torch-sp"}
    ms = by_name["memsave-sp"]
    # parameter bytes per rank: measured on the wrapped model == the plan's formula == the estimator, exactly
    assert ms["param_bytes_per_rank"] == [ms["formula_param_bytes"]] * 2
    assert ms["estimated_param_bytes"] == ms["formula_param_bytes"]
    assert ms["formula_param_bytes"] < by_name["single"]["param_bytes"]
    # activations per layer follow the adapted formula, one process's and memsave SP's; both formulas are there
    single = by_name["single"]
    assert single["activations_per_layer"] == pytest.approx(single["adapted_activation_bytes"], rel=0.1)
    assert ms["activations_per_layer"] < single["activations_per_layer"]
    assert ms["activations_per_layer"] == pytest.approx(ms["adapted_activation_bytes"], rel=0.1)  # the regathered
    assert ms["paper_activation_bytes"] > 0  # shards counted too (saved through autograd)
    # the same trajectory as one process, memsave's and torch's
    for name in ("memsave-sp", "torch-sp"):
        assert by_name[name]["max_loss_diff_vs_single"] < 1e-4
        assert by_name[name]["median_step_s"] > 0
    assert "vs_torch_step_time" in ms
    # one step's collectives by kind: under SP each block's two column inputs are regathered in backward, and the head's
    calls = ms["ranks"][0]["collectives_per_step"]["calls"]
    assert calls["tp_regather"] == 2 * 2 + 1 and calls["tp_loss"] == 2
    lines = checks(rows)
    assert all(len(line) == 5 and line[4] in ("pass", "FAIL", "-") for line in lines)
    figures = [line[0] for line in lines]
    assert figures.count("memsave-sp: parameter bytes / rank") == 2
    assert any(f.startswith("memsave-sp: activations / layer / rank (t=2 SP)") for f in figures)
    assert "memsave-sp: step time vs torch TP" in figures
    table = format_tp_table(rows)
    assert "plan:" in table and "memsave.estimate:" in table and "paper (fp16, dropout)" in table
