"""``memsave bench --tp``'s comparisons and table (the runs are in memsave/bench/tp.py).

:func:`summarize` adds to each configuration's row its figures against the formulas and the other rows;
:func:`checks` turns the rows into the lines of the table, each a measured figure, what it is compared with,
the ratio and whether it meets the target; :func:`format_tp_table` prints them.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from memsave.bench.common import columns

__all__ = ["ACTIVATION_TOLERANCE", "MEMSAVE_VS_TORCH", "TP_VS_SINGLE", "checks", "format_tp_table", "notes", "summarize"]

TP_VS_SINGLE = 0.60  # memsave's tp step time / one process's, at most (tp = 2)
MEMSAVE_VS_TORCH = 0.90  # memsave's tp step time / torch DTensor TP's, at most
ACTIVATION_TOLERANCE = 0.10  # measured activations per layer within 10% of the adapted formula
LOSS_TOLERANCE = 1e-4  # largest |loss - one process's loss| over the steps (fp32: rounding)

Formula = Callable[[int, int, int, int, int, bool], float]


def _layer_figure(per_block: list[int]) -> int:
    """One layer's activations: the median over the blocks after the first (the first block's input differs:
    under SP it is cut there), the only block if there is one."""
    return int(statistics.median(per_block[1:] if len(per_block) > 1 else per_block))


def summarize(rows: list[dict[str, Any]], shape: dict[str, Any], paper: Formula, adapted: Formula) -> None:
    """Each row's figures against the formulas (``shape``: s, b, h, a, t) and against the ``single`` and torch
    rows of the same run, in place."""
    by_name = {r["name"]: r for r in rows}
    single = by_name.get("single")
    for r in rows:
        r["shape"] = shape
        ranks = r["ranks"]
        t = 1 if r["name"] == "single" else shape["t"]
        r["param_bytes"] = max(x["param_bytes"] for x in ranks)
        if "formula_param_bytes" in ranks[0]:
            r["param_bytes_per_rank"] = [x["param_bytes"] for x in ranks]
            r["formula_param_bytes"] = ranks[0]["formula_param_bytes"]
            r["estimated_param_bytes"] = ranks[0]["estimated_param_bytes"]
        if "block_activations" in ranks[0]:
            r["activations_per_layer"] = max(_layer_figure(x["block_activations"]) for x in ranks)
            args = (shape["s"], shape["b"], shape["h"], shape["a"], t, r["sequence"])
            r["paper_activation_bytes"] = paper(*args)
            r["adapted_activation_bytes"] = adapted(*args)
        r["min_step_s"] = min(r["timed_step_s"])
        if single is not None:
            r["vs_single_step_time"] = r["median_step_s"] / single["median_step_s"]
            r["vs_single_min_step_time"] = r["min_step_s"] / min(single["timed_step_s"])
            r["max_loss_diff_vs_single"] = max(abs(a - b) for a, b in zip(r["losses"], single["losses"]))
        torch_row = by_name.get("torch-sp" if r["sequence"] else "torch")
        if r["name"].startswith("memsave") and torch_row is not None:
            r["vs_torch_step_time"] = r["median_step_s"] / torch_row["median_step_s"]
            r["vs_torch_min_step_time"] = r["min_step_s"] / min(torch_row["timed_step_s"])


def _mib(n: float) -> str:
    return f"{n / 2**20:,.3f} MiB"


def _verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def checks(rows: list[dict[str, Any]]) -> list[list[str]]:
    """The table's lines: ``[figure, measured, against, ratio, pass/fail]``."""
    lines: list[list[str]] = []
    for r in rows:
        if "formula_param_bytes" not in r:
            continue
        exact = all(b == r["formula_param_bytes"] for b in r["param_bytes_per_rank"])
        lines.append([f"{r['name']}: parameter bytes / rank", f"{r['param_bytes']:,} B",
                      f"plan: {r['formula_param_bytes']:,} B (exact)", f"{r['param_bytes'] / r['formula_param_bytes']:.4f}",
                      _verdict(exact)])
        est = r["estimated_param_bytes"]
        lines.append([f"{r['name']}: parameter bytes / rank", f"{r['param_bytes']:,} B",
                      f"memsave.estimate: {est:,} B", f"{r['param_bytes'] / est:.4f}", _verdict(r["param_bytes"] == est)])
    for r in rows:
        if "activations_per_layer" not in r:
            continue
        what = "t=1" if r["name"] == "single" else f"t={r['shape']['t']}" + (" SP" if r["sequence"] else "")
        m = r["activations_per_layer"]
        lines.append([f"{r['name']}: activations / layer / rank ({what})", _mib(m),
                      f"paper (fp16, dropout): {_mib(r['paper_activation_bytes'])}",
                      f"{m / r['paper_activation_bytes']:.3f}", "-"])
        ratio = m / r["adapted_activation_bytes"]
        lines.append([f"{r['name']}: activations / layer / rank ({what})", _mib(m),
                      f"adapted (fp32, no dropout, flash): {_mib(r['adapted_activation_bytes'])}", f"{ratio:.3f}",
                      _verdict(abs(ratio - 1) <= ACTIVATION_TOLERANCE)])
    for r in rows:
        if "vs_single_step_time" in r and r["name"] != "single":
            x2 = r["name"] == "single-x2"
            target = TP_VS_SINGLE if r["name"].startswith("memsave") else None
            what = "step time vs single" + (" (2 at once, no comm)" if x2 else "")
            lines.append([f"{r['name']}: {what}", f"{r['median_step_s']:.3f} s",
                          "single" + (f" x <= {target:.2f}" if target else ""),
                          f"{r['vs_single_step_time']:.3f} (min {r['vs_single_min_step_time']:.3f})",
                          _verdict(r["vs_single_step_time"] <= target) if target else "-"])
        if "vs_torch_step_time" in r:
            lines.append([f"{r['name']}: step time vs torch TP", f"{r['median_step_s']:.3f} s",
                          f"torch{'-sp' if r['sequence'] else ''} x <= {MEMSAVE_VS_TORCH:.2f}",
                          f"{r['vs_torch_step_time']:.3f} (min {r['vs_torch_min_step_time']:.3f})",
                          _verdict(r["vs_torch_step_time"] <= MEMSAVE_VS_TORCH)])
    for r in rows:
        if r["name"] not in ("single", "single-x2") and "max_loss_diff_vs_single" in r:
            d = r["max_loss_diff_vs_single"]
            lines.append([f"{r['name']}: losses vs single", f"{d:.1e}", f"|diff| <= {LOSS_TOLERANCE:.0e}", "-",
                          _verdict(d <= LOSS_TOLERANCE)])
    return lines


def notes(rows: list[dict[str, Any]]) -> list[str]:
    """What the figures mean where a reader would ask: the floor two processes put under a tp step on this
    machine, and activations the tracker does not see, in units of a sequence shard."""
    out = []
    by_name = {r["name"]: r for r in rows}
    x2 = by_name.get("single-x2")
    if x2 is not None and "vs_single_step_time" in x2:
        out.append(f"single-x2: two processes at once each step {x2['vs_single_step_time']:.2f}x as long as one alone "
                   f"here, so even a tp=2 step with half the work per rank and no communication would take "
                   f"~{x2['vs_single_step_time'] / 2:.2f}x single on this machine")
    for r in rows:
        comm = r["ranks"][0].get("collectives_per_step")
        if comm:
            kinds = ", ".join(f"{k} {n} ({comm['bytes'][k] / 2**20:.2f} MiB)" for k, n in sorted(comm["calls"].items()))
            out.append(f"{r['name']}: collectives per step on rank 0, by kind (calls, logical bytes): {kinds}")
    for r in rows:
        if "activations_per_layer" in r and r["sequence"]:
            gap = r["adapted_activation_bytes"] - r["activations_per_layer"]
            sh = r["shape"]
            shard = 4 * sh["s"] * sh["b"] * sh["h"] / sh["t"]  # one fp32 [s/t, b, h] sequence shard
            if abs(gap) >= shard / 2:
                out.append(f"{r['name']}: the tracker counts {gap:,.0f} B per layer fewer than the formula, "
                           f"{gap / shard:.2f} fp32 [s/t, b, h] shards: the sequence shards a column-parallel linear "
                           "keeps by reference (not through saved-tensor hooks) to all-gather again in backward "
                           "([Note: sequence-parallel input regathered], memsave/tp/layers.py), which the tracker "
                           "does not see")
    return out


def format_tp_table(rows: list[dict[str, Any]]) -> str:
    """The step times of every configuration, then the checks table and a line on the model and the run."""
    shape = rows[0]["shape"]
    out = columns(["config", "processes", "median step s", "min-max s", "x single", "final loss"], [
        [r["name"], str(r["nproc"]), f"{r['median_step_s']:.3f}",
         f"{min(r['timed_step_s']):.3f}-{max(r['timed_step_s']):.3f}",
         f"{r['vs_single_step_time']:.2f}" if "vs_single_step_time" in r else "-", f"{r['losses'][-1]:.4f}"]
        for r in rows])
    out.append("")
    out += columns(["figure", "measured", "against", "ratio", "pass"], checks(rows))
    out.append(f"model: {shape['layers']} layers, h={shape['h']}, a={shape['a']} heads, {shape['params']:,} "
               f"parameters; batch b={shape['b']} x s={shape['s']} (the same global batch everywhere); tp=t="
               f"{shape['t']} on gloo, one thread per process; fp32 AdamW; step: forward, backward, optimizer step, the "
               f"slowest rank, median over {shape['timed']} timed steps (min: the fastest of them, against the fastest), "
               "every configuration's steps interleaved; pass/fail on the medians. "
               "activations: bytes memsave's tracker "
               "counts for one block's forward (median over blocks 2..L), the larger rank")
    out += notes(rows)
    return "\n".join(out)
