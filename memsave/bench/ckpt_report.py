"""The tables of ``memsave bench --checkpoint`` (memsave/bench/checkpoint.py): throughput against the disk and
DCP, async step time, peak memory, and the checkpoint's bytes against the formula."""

from __future__ import annotations

from typing import Any

from memsave.bench.common import BenchOptions, columns, mib

__all__ = ["TARGETS", "format_checkpoint_tables"]

# issue 21's targets: throughput >= 80% of a plain write and >= DCP's; async issue step <= 1.05x a normal
# step; peak RSS while saving <= 1.1x the training peak
TARGETS = {"x_plain": 0.8, "x_dcp": 1.0, "x_issue": 1.05, "x_peak": 1.1}


def _per_rank(values: list[float], fmt: str = "{:.1f}") -> str:
    return " / ".join(fmt.format(v) for v in values)


def _ok(value: float | None, target: float, *, at_most: bool = False) -> str:
    if value is None:
        return "-"
    met = value <= target if at_most else value >= target
    return f"{value:.2f}" + ("" if met else " (miss)")


def format_checkpoint_tables(rows: list[dict[str, Any]], opts: BenchOptions) -> str:
    out = [f"memsave bench --checkpoint: GPT {opts.size}, {opts.nproc} ranks (gloo, one thread each), fp32 AdamW; "
           "medians per rank (r0 / r1 ...); MiB/s = bytes the rank wrote (save) or holds (load) / its seconds", ""]
    lines = []
    for r in rows:
        for op in ("save", "load"):
            o = r[op]
            lines.append([r["name"], op, _per_rank([b / 2**20 for b in o["bytes"]]), f"{max(o['s']):.3f}",
                          _per_rank(o["cpu_s"], "{:.3f}"),
                          _per_rank(o["mibps"]), _per_rank(o["plain_mibps"]),
                          _ok(o["x_plain"], TARGETS["x_plain"]),
                          "-" if r["kind"] == "baseline" else _ok(o.get("x_dcp"), TARGETS["x_dcp"])])
    out += columns(["config", "op", "MiB/rank", "s (slowest)", "CPU s per rank", "MiB/s per rank", "plain MiB/s", "x plain",
                    "x dcp"], lines)
    lines = []
    for r in rows:
        if "async" not in r:
            continue
        a = r["async"]
        lines.append([r["name"], f"{a['normal_s']:.3f}", f"{a['issue_s']:.3f}",
                      _ok(a["x_issue"], TARGETS["x_issue"], at_most=True), f"{a['during_s']:.3f}",
                      f"{a['x_during']:.2f}", _per_rank([b / 2**20 for b in a["staged_bytes"]]),
                      f"{a['stage_s']:.3f}", f"{a['write_s']:.3f}"])
    if lines:
        out += ["", "async save (async_=True): step seconds, median over rounds, slowest rank per step"]
        out += columns(["config", "normal step", "issuing step", "x", "step while writing", "x",
                        "staged MiB/rank", "staging s", "background write s"], lines)
    lines = []
    for r in rows:
        m = r["memory"]
        lines.append([r["name"], _per_rank([b / 2**20 for b in m["train_peak"]]),
                      _per_rank([b / 2**20 for b in m["save_peak"]]), _ok(m["x_save"], TARGETS["x_peak"], at_most=True),
                      _per_rank([b / 2**20 for b in m["async_peak"]]) if "async_peak" in m else "-",
                      _ok(m.get("x_async"), TARGETS["x_peak"], at_most=True)])
    exact = all(r["peak_exact"] for r in rows)
    out += ["", "peak RSS, MiB per rank (" + ("kernel high-water mark, reset per phase" if exact else
                                               "sampled every 2 ms") + "); x = the worst rank's save peak / its "
            "training peak"]
    out += columns(["config", "training", "sync save", "x", "async save (+ steps)", "x"], lines)
    lines = [[r["name"], mib(r["payload_bytes"]), mib(r["formula_bytes"]),
              "yes" if r["payload_bytes"] == r["formula_bytes"] else "NO",
              mib(sum(r["save"]["bytes"]))] for r in rows]
    out += ["", "checkpoint tensor bytes (DCP metadata) against 12 B/param + 4 B/param tensor (fp32 AdamW)"]
    out += columns(["config", "tensor MiB", "formula MiB", "equal", "files MiB (all ranks)"], lines)
    return "\n".join(out)
