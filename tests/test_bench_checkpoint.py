"""``memsave bench --checkpoint`` on the tiny GPT: every configuration gives its save and load rows, async and
memory figures; the checkpoint's tensor bytes equal the fp32 AdamW formula (computed here from the model, not
taken from the bench) and the bytes each rank wrote are the files it left. Timings are checked for sanity only
(positive, finite): the targets are for the real sizes (docs/benchmarks.md)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from memsave.bench import checkpoint
from memsave.bench.checkpoint import BASELINE, run_checkpoint_bench, state_formula_bytes
from memsave.bench.ckpt_report import format_checkpoint_tables
from memsave.bench.common import BenchOptions
from memsave.models import GPT

OPTS = BenchOptions(size="tiny", batch_size=2, seq_len=32, steps=2, warmup=1, nproc=2)


def _params_formula() -> int:
    """12 bytes per parameter (fp32 value, exp_avg, exp_avg_sq) and a 4-byte step per parameter tensor."""
    with torch.device("meta"):
        model = GPT(OPTS.model_config())
    return sum(12 * p.numel() + 4 for p in model.parameters())


def test_bench_checkpoint_tiny(tmp_path: Path) -> None:
    rows = run_checkpoint_bench(OPTS, ["zero3", "ddp", BASELINE], directory=tmp_path, repeat=1, timeout_s=120)
    assert [r["name"] for r in rows] == ["zero3", "ddp", BASELINE]
    formula = _params_formula()
    assert state_formula_bytes(GPT(OPTS.model_config())) == formula  # the GPT has no persistent buffers
    for r in rows:
        assert r["formula_bytes"] == formula and r["payload_bytes"] == formula, r["name"]
        for op in ("save", "load"):
            o = r[op]
            assert len(o["bytes"]) == 2 and all(b > 0 for b in o["bytes"])
            for key in ("s", "cpu_s", "mibps", "plain_mibps"):
                assert all(math.isfinite(v) and v > 0 for v in o[key]), (r["name"], op, key, o[key])
        # what the ranks wrote: the tensor bytes plus each record's serialization and the metadata, not less
        assert formula < sum(r["save"]["bytes"]) < formula * 1.5 + 2**20, r["name"]
        assert all(m > 0 for m in r["memory"]["train_peak"] + r["memory"]["save_peak"])
    by = {r["name"]: r for r in rows}
    # zero3 and FSDP2 hold half the state per rank; ddp holds all of it (loaded on every rank)
    assert sum(by["zero3"]["load"]["bytes"]) == pytest.approx(formula, rel=0.02)
    assert by["ddp"]["load"]["bytes"] == [by["ddp"]["load"]["bytes"][0]] * 2
    assert by["ddp"]["load"]["bytes"][0] == pytest.approx(formula, rel=0.02)
    for name in ("zero3", "ddp"):
        a = by[name]["async"]
        assert a["normal_s"] > 0 and a["issue_s"] > 0 and a["during_s"] > 0
        # staged: what each rank writes (zero3: its rows; ddp: its share of the replicated tensors), once in all
        assert sum(a["staged_bytes"]) == formula, (name, a["staged_bytes"])
        assert max(a["staged_bytes"]) < 0.6 * formula, (name, a["staged_bytes"])
        assert by[name]["save"]["x_dcp"] is not None
    assert "async" not in by[BASELINE]
    text = format_checkpoint_tables(rows, OPTS)
    for needle in ("zero3      save", "zero3      load", "ddp        save", f"{BASELINE}  load", "issuing step",
                   "sync save", "formula MiB"):
        assert needle in text, needle


def test_bench_checkpoint_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'nope' is neither 'fsdp2-dcp' nor a profile"):
        run_checkpoint_bench(OPTS, ["nope"])
    with pytest.raises(ValueError, match="repeat=0 is not allowed"):
        run_checkpoint_bench(OPTS, ["zero3"], repeat=0)
    with pytest.raises(ValueError, match="warmup=0 is not allowed"):
        run_checkpoint_bench(BenchOptions(size="tiny", steps=2, warmup=0), ["zero3"])
    with pytest.raises(ValueError, match="dir='/nonexistent/x' is not an existing directory"):
        run_checkpoint_bench(OPTS, ["zero3"], directory="/nonexistent/x")
    with pytest.raises(ValueError, match="name one twice"):
        run_checkpoint_bench(OPTS, ["zero3", "zero3"])
    offload = tmp_path / "params-cpu.toml"
    offload.write_text('[zero]\nstage = 3\n\n[offload]\nparams = "cpu"\n')
    with pytest.raises(NotImplementedError, match="has \\[offload\\] params='cpu'"):
        run_checkpoint_bench(OPTS, [str(offload)])
    assert checkpoint.DEFAULT_CONFIGS == ("zero3", "ddp", BASELINE)
