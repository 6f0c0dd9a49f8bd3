"""``memsave bench``: the ZeRO formulas per precision and stage, and a tiny run of mixed-precision memsave
profiles beside FSDP2 with a ``MixedPrecisionPolicy`` (model-state bytes against the formula, padding
included; communication counted in elements of the dtype communicated; finite fp32 losses)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from memsave.bench import (
    BenchOptions,
    comm_elements,
    format_recompute_table,
    format_table,
    formula_bytes,
    precision_label,
    run_bench,
    run_recompute_bench,
)
from memsave.models import GPT, gpt_config

PSI, N = 1200, 4


@pytest.mark.parametrize(("stage", "per_param"), [
    (0, 16), (1, 8 + 8 / N), (2, 4 + 12 / N), (3, 16 / N),
])
def test_formula_fp32(stage: int, per_param: float) -> None:
    assert formula_bytes(stage, PSI, N) == pytest.approx(per_param * PSI)
    assert formula_bytes(stage, PSI, N, compute="fp32", reduce="fp32") == pytest.approx(per_param * PSI)


@pytest.mark.parametrize(("stage", "per_param", "per_param_fp32_reduce"), [
    (0, 2 + 2 + 12, 2 + 4 + 12),  # everything replicated; fp32 reduce: full fp32 gradients
    (1, 4 + 12 / N, 4 + 16 / N),  # full bf16 grads kept; fp32 reduce adds the fp32 gradient shard
    (2, 2 + 14 / N, 2 + 16 / N),
    (3, 16 / N, 18 / N),
])
def test_formula_mixed(stage: int, per_param: float, per_param_fp32_reduce: float) -> None:
    for compute in ("bf16", "fp16"):
        assert formula_bytes(stage, PSI, N, compute=compute) == pytest.approx(per_param * PSI)
        assert formula_bytes(stage, PSI, N, compute=compute, reduce=compute) == pytest.approx(per_param * PSI)
    assert formula_bytes(stage, PSI, N, compute="bf16", reduce="fp32") == pytest.approx(per_param_fp32_reduce * PSI)


def test_formula_refuses_what_it_does_not_model() -> None:
    with pytest.raises(ValueError, match="reduce='bf16' with compute='fp32'"):
        formula_bytes(2, PSI, N, compute="fp32", reduce="bf16")
    with pytest.raises(ValueError, match="compute='int8'"):
        formula_bytes(2, PSI, N, compute="int8")
    with pytest.raises(ValueError, match="stage=4"):
        formula_bytes(4, PSI, N)


def test_precision_label_and_comm_elements() -> None:
    assert [precision_label(c, r) for c, r in [("fp32", "compute"), ("bf16", "compute"), ("fp16", "fp16"),
                                               ("bf16", "fp32")]] == ["fp32", "bf16", "fp16", "bf16/fp32-reduce"]
    # all-gathers carry compute-dtype parameters, reductions the reduce dtype
    kinds = {"all_gather": 2 * 300, "reduce_scatter": 4 * 100, "all_reduce": 4 * 10}
    assert comm_elements(kinds, compute="bf16", reduce="fp32") == 300 + 100 + 10
    assert comm_elements(kinds, compute="fp32", reduce="compute") == 150 + 100 + 10


def _padded_psi_per_rank(n: int) -> tuple[int, int]:
    """The tiny GPT's parameters per rank when every parameter is split along dim 0 in ceil(rows / n) rows
    (memsave's layout and FSDP2's), and the number of parameter tensors."""
    model = GPT(gpt_config("tiny", tie_weights=False, block_size=32))
    params = list(model.parameters())
    return sum(math.ceil(p.shape[0] / n) * (p.numel() // p.shape[0]) for p in params), len(params)


def test_bench_tiny_mixed_precision(tmp_path: Path) -> None:
    """zero3 in fp32 and bf16, and FSDP2 bf16 with fp32 reduction under memsave's host policy: each keeps 16
    bytes per parameter / N (zero3-bf16: bf16 shard + bf16 grad + fp32 master + Adam; FSDP2: fp32 shard and
    grad + Adam), moves the same elements, and trains to a finite loss near the fp32 one. A zero2 bf16 profile
    reducing in fp32 keeps 2 + 16/N bytes per parameter and moves 2 elements per parameter in two dtypes."""
    fp32_reduce = tmp_path / "zero2-bf16-fp32reduce.toml"
    fp32_reduce.write_text('[zero]\nstage = 2\n\n[precision]\ncompute = "bf16"\nreduce = "fp32"\n')
    opts = BenchOptions(size="tiny", seq_len=32, batch_size=2, steps=3, warmup=1, nproc=2)
    names = ["zero3", "zero3-bf16", "fsdp2-bf16-fp32reduce+malloc", str(fp32_reduce)]
    rows = {r["name"]: r for r in run_bench(names, opts, timeout_s=120)}
    psi = rows["zero3"]["params"]
    padded, num_tensors = _padded_psi_per_rank(opts.nproc)
    # Padding-aware bound: at most 16 bytes on each padded element, plus AdamW's fp32 ``step`` scalar per
    # tensor. On the tiny GPT with 2 ranks every dim 0 is even, so this is within 0.05% of the formula.
    upper = (16 * padded + 4 * num_tensors) / formula_bytes(3, psi, opts.nproc)
    assert upper < 1.05
    for name, precision in [("zero3", "fp32"), ("zero3-bf16", "bf16"),
                            ("fsdp2-bf16-fp32reduce+malloc", "bf16/fp32-reduce")]:
        r = rows[name]
        assert r["precision"] == precision and r["stage"] == 3
        assert r["formula_bytes"] == formula_bytes(3, psi, opts.nproc)  # FSDP2's state is fp32: 16/N as well
        assert 1.0 <= r["state_vs_formula"] <= upper, (name, r["model_state_bytes"], r["formula_bytes"])
        assert all(math.isfinite(x) for x in r["losses"]) and abs(r["losses"][0] - math.log(256)) < 0.5
        assert abs(r["final_loss_diff"]) < 0.1  # against zero3 fp32 here (no torch-ddp row); rounding only
    assert rows["zero3"]["final_loss_diff"] == 0.0
    # bf16 moves half the bytes of fp32, the same elements (the int32 bookkeeping all-reduce aside)
    fp32, bf16 = rows["zero3"]["comm_bytes_by_kind"], rows["zero3-bf16"]["comm_bytes_by_kind"]
    for kind in ("all_gather", "reduce_scatter"):
        assert bf16[kind] * 2 == fp32[kind]
    assert rows["zero3-bf16"]["comm_elems_over_psi"] == pytest.approx(rows["zero3"]["comm_elems_over_psi"], rel=1e-3)
    assert 2.0 < rows["zero3"]["comm_elems_over_psi"] <= 3.0  # the root is not gathered again for backward
    assert rows["fsdp2-bf16-fp32reduce+malloc"]["comm_elems_over_psi"] is None  # FSDP2 bypasses memsave/dist
    z2 = rows[str(fp32_reduce)]
    assert z2["precision"] == "bf16/fp32-reduce" and z2["formula_bytes"] == (2 + 16 / opts.nproc) * psi
    upper2 = (2 * psi + 16 * padded + 4 * num_tensors) / z2["formula_bytes"]  # params replicated, unpadded
    assert 1.0 <= z2["state_vs_formula"] <= upper2 < 1.05
    assert z2["comm_bytes_by_kind"]["reduce_scatter"] == 2 * z2["comm_bytes_by_kind"]["all_gather"]  # fp32 vs bf16
    assert z2["comm_elems_over_psi"] == pytest.approx(2.0, rel=1e-3)
    table = format_table(list(rows.values()))
    assert "precision" in table.splitlines()[0] and "bf16/fp32-reduce" in table


def test_recompute_bench_tiny(tmp_path: Path) -> None:
    """`memsave bench --recompute` on the tiny GPT: every policy trains to the same losses as no recomputation
    (no dropout), full recomputation keeps only the blocks' inputs like torch's per-block checkpoint, memsave's
    selective keeps what torch's selective checkpointing keeps, and a budget fits its measured activations."""
    opts = BenchOptions(size="tiny", seq_len=64, batch_size=2, steps=2, warmup=1, nproc=1)
    names = ["none", "full", "selective", "budget:700KiB", "torch-full", "torch-selective"]
    rows = {r["name"]: r for r in run_recompute_bench(names, opts, timeout_s=120)}
    none = rows["none"]
    assert none["vs_ref_activations"] == 1.0 and none["reference"] == "none"
    for r in rows.values():
        assert r["final_loss_diff"] == 0.0, r["name"]
        assert r["losses"] == none["losses"], r["name"]
        cats = r["peak_by_category"]
        assert cats["Parameter"] == 4 * r["params"] and cats["Optstate"] >= 8 * r["params"], (r["name"], cats)
        assert r["peak_total"] >= sum(cats[c] for c in ("Parameter", "Optstate")) and r["peak_rss"] > 0
    assert rows["full"]["saved_activation_bytes"] == rows["torch-full"]["saved_activation_bytes"]
    assert rows["selective"]["saved_activation_bytes"] == rows["torch-selective"]["saved_activation_bytes"]
    assert (rows["full"]["saved_activation_bytes"] < rows["budget:700KiB"]["saved_activation_bytes"] <= 700 * 1024
            < rows["selective"]["saved_activation_bytes"] < none["saved_activation_bytes"])
    assert rows["budget:700KiB"]["plan"]["summary"].startswith("recompute policy budget:700KiB")
    assert rows["full"]["peak_by_category"]["Activation"] <= none["peak_by_category"]["Activation"]
    table = format_recompute_table(list(rows.values()))
    assert table.splitlines()[0].startswith("policy") and "torch-selective" in table and "reference" not in table


def test_offload_bench_tiny(tmp_path: Path) -> None:
    """`memsave bench --offload` on the tiny GPT, repeated round-robin: every configuration ends at the in-memory
    loss, the state moves to disk (and with fraction 0.5 half of it), and the rows carry every run."""
    from memsave.bench.offload import format_offload_table, run_offload_bench

    opts = BenchOptions(size="tiny", seq_len=32, batch_size=2, steps=3, warmup=1, nproc=1)
    names = ["zero3", "zero3-offload-disk", "zero3-offload-disk-noprefetch", "zero3-offload-disk-half"]
    rows = {r["name"]: r for r in run_offload_bench(names, opts, path=str(tmp_path), timeout_s=120, repeat=2)}
    state = max(rows["zero3"]["state_in_memory"])
    for name, r in rows.items():
        assert r["final_loss_diff"] == 0.0 and len(r["runs_step_s"]) == 2, (name, r)
    assert max(rows["zero3-offload-disk"]["state_on_disk"]) >= 0.99 * state  # all but the scalar `step`s
    assert 0 < max(rows["zero3-offload-disk-half"]["state_on_disk"]) < state
    assert "predicted_step_s" in rows["zero3-offload-disk-half"]
    table = format_offload_table(list(rows.values()))
    assert "prefetch on vs off" in table and "runs: step s" in table
    assert not list(tmp_path.glob("memsave-offload-*"))
