"""The memory report file format, ``memsave.report/2``: load (v1 converted), save, print as text, and find the
step holding the peak (:func:`peak_step`, the zoomed view of the text and the page). Its fields, their checks
(:func:`validate_report`) and the v1 conversion are memsave/memory/validation.py, re-exported here, so this
module stays the one import for the format.

A report is a plain JSON-serializable dict (the schema is documented in docs/memory.md, "Memory reports").

Two figures per category are easy to mix up, and the file keeps them apart: ``peak.bytes``, each category *at*
the peak sample (they sum to ``peak.total``), and ``category_peak``, each category's own maximum over the run
("max over run" in the text and the page), reached at different times; so each maximum is at least the
category's bytes at the peak, which the validator checks.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memsave.memory.validation import (
    CATEGORIES,
    OFF_DEVICE,
    PHASES,
    SCHEMA,
    SCHEMA_V1,
    convert_v1,
    in_memory_total,
    validate_report,
)

__all__ = [
    "CATEGORIES",
    "OFF_DEVICE",
    "PHASES",
    "SCHEMA",
    "SCHEMA_V1",
    "convert_v1",
    "format_bytes",
    "format_text",
    "in_memory_total",
    "load_report",
    "peak_step",
    "save_report",
    "validate_report",
]


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``: binary units, one decimal."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# -- files -----------------------------------------------------------------------------------------------------
def load_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a report JSON file and validate it; a ``memsave.report/1`` file comes back converted to v2."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not a memsave report: not JSON ({exc})") from None
    if isinstance(data, dict) and data.get("schema") == SCHEMA_V1:
        mtime = datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.UTC)
        try:
            return convert_v1(data, name=path.stem, created=mtime.isoformat(timespec="seconds"))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    try:
        validate_report(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return data


def save_report(data: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Validate ``data`` and write it as JSON (atomically: a reader never sees half a file)."""
    validate_report(data)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.chmod(tmp, 0o644)  # readable as the HTML beside it (mkstemp makes a file the owner's alone)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# -- the step holding the peak --------------------------------------------------------------------------------
def peak_step(rank: Mapping[str, Any]) -> dict[str, Any] | None:
    """One training step of a rank's timeline, phase by phase: the step holding the rank's peak (a whole run of
    steps looks like a comb; one step shows its phases). ``None`` without a timeline.

    Returns ``{"step": n, "samples": [i, ...], "peak": i, "holds_peak": bool, "phases": [{"phase": name,
    "repeat": k, "samples": [i, ...], "peak": i}, ...]}``: indices into ``rank["timeline"]``; ``phases`` are the
    runs of consecutive samples of one phase in timeline order (``repeat`` counts a phase's runs from 1: under
    gradient accumulation forward and backward come once per micro-batch); a run's first sample is its start and
    ``peak`` its largest (in-memory total, the first of equals). ``holds_peak``: the step's largest sample is the
    rank's peak (``rank["peak"]``), false only when the timeline lost it (e.g. edited). The step is
    ``rank["peak"]["step"]``, or, when no sample carries it, the step of the largest sample.
    """
    timeline = rank["timeline"]
    if not timeline:
        return None
    totals = [in_memory_total(s["bytes"]) for s in timeline]
    step = rank["peak"]["step"]
    if not any(s["step"] == step for s in timeline):
        step = timeline[max(range(len(timeline)), key=totals.__getitem__)]["step"]
    samples = [i for i, s in enumerate(timeline) if s["step"] == step]
    phases: list[dict[str, Any]] = []
    repeats: dict[str, int] = {}
    for i in samples:
        name = timeline[i]["phase"]
        if not phases or phases[-1]["phase"] != name:
            repeats[name] = repeats.get(name, 0) + 1
            phases.append({"phase": name, "repeat": repeats[name], "samples": [], "peak": i})
        run = phases[-1]
        run["samples"].append(i)
        if totals[i] > totals[run["peak"]]:
            run["peak"] = i
    peak = max(samples, key=totals.__getitem__)  # the first of equals, like the tracker's peak
    holds = totals[peak] == rank["peak"]["total"] and step == rank["peak"]["step"]
    return {"step": step, "samples": samples, "peak": peak, "holds_peak": holds, "phases": phases}


# -- text ------------------------------------------------------------------------------------------------------
def _table(head: list[str], rows: list[list[str]], left: int = 0) -> list[str]:
    """Columns right-aligned (the first ``left`` ones left-aligned), two spaces apart."""
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    return ["  ".join((c.ljust(w) if i < left else c.rjust(w)) for i, (c, w) in enumerate(zip(line, widths)))
            .rstrip() for line in [head, *rows]]


def _tracked(rank: Mapping[str, Any]) -> bool:
    """Taken with a tracker: peaks over samples (without one the "peak" is the current sample)."""
    return bool(rank["timeline"] or rank["phases"])


def _format_step(rank: Mapping[str, Any], cats: list[str]) -> list[str]:
    view = peak_step(rank)
    if view is None:
        return []
    timeline = rank["timeline"]
    rows: list[list[str]] = []
    for run in view["phases"]:
        name = run["phase"] + (f" {run['repeat']}" if run["repeat"] > 1 else "")
        start = run["samples"][0]
        for at, i in ((("start", start), ("peak", run["peak"])) if run["peak"] != start else (("start, peak", start),)):
            s = timeline[i]
            mark = "<- the rank's peak" if i == view["peak"] and view["holds_peak"] else ""
            rows.append([name if at.startswith("start") else "", at, s["event"], s["unit"] or "",
                         *(format_bytes(s["bytes"].get(c, 0)) for c in cats), format_bytes(in_memory_total(s["bytes"])),
                         mark])
    order = " -> ".join(run["phase"] for run in view["phases"])
    where = "the step holding the peak" if view["holds_peak"] else "the step of the peak; its sample is not in the timeline"
    lines = [f"rank {rank['rank']} step {view['step']} by phase ({where}): {order}; each phase at its first sample "
             f"(start) and its largest (peak)"]
    head = ["phase", "sample", "event", "unit", *cats, "in memory", ""]
    return lines + ["  " + line for line in _table(head, rows, left=4)]


def format_text(data: Mapping[str, Any]) -> str:
    """One validated report as text: per rank, each category now, at the peak sample (these sum to the peak) and
    at its own maximum over the run, with the totals, the estimate when there is one and the process figures (RSS,
    and the allocator's on CUDA); then per rank the peak and the step holding it, phase by phase."""
    run, est = data["run"], data["estimate"]
    cats = list(data["categories"])
    head = ["rank", "", *cats, "in memory", "rss", "peak rss", "unaccounted"]
    cuda = run["device"] == "cuda"
    if cuda:
        head += ["gpu alloc", "gpu peak"]
    blank = [""] * (len(head) - len(cats) - 3)  # after the in-memory column
    rows: list[list[str]] = []
    for r in data["ranks"]:
        proc = r["process"]
        now = in_memory_total(r["current"])
        base = proc["device_allocated"] if cuda else proc["rss"]
        extra = [format_bytes(proc["device_allocated"]), format_bytes(proc["device_peak"])] if cuda else []
        rows.append([str(r["rank"]), "now", *(format_bytes(r["current"].get(c, 0)) for c in cats),
                     format_bytes(now), format_bytes(proc["rss"]), format_bytes(proc["peak_rss"]),
                     format_bytes(base - now), *extra])
        if _tracked(r):
            peak = r["peak"]
            rows.append(["", "at peak", *(format_bytes(peak["bytes"].get(c, 0)) for c in cats),
                         format_bytes(peak["total"]), *blank])
            # no total: the maxima are reached at different times, their sum is no sample's
            rows.append(["", "max over run", *(format_bytes(r["category_peak"].get(c, 0)) for c in cats), "",
                         *blank])
    if est is not None:
        for e in est.get("stages") or [est]:  # under pp: one row per pipeline rank
            label = f"pp {e['pp_rank']}" if "pp_rank" in e else f"N={est['world_size']}"
            rows.append(["est", label, *(format_bytes(e["bytes"].get(c, 0)) for c in cats),
                         format_bytes(e["peak_total"]), *blank])
    name = f" {run['name']}" if run["name"] and run["name"] != run["profile"] else ""
    title = f"memory report{name}" + (f" ({run['profile']})" if run["profile"] else "")
    lines = [f"{title}: {run['world_size']} rank(s) on {run['device']}"
             + (f", {run['model']} {run['num_params']:,} parameters" if run["model"] else "")]
    lines += _table(head, rows)
    if any(_tracked(r) for r in data["ranks"]):
        lines.append("at peak: each category at the peak sample (they sum to its in-memory total); max over run: "
                     "each category's own maximum, reached at different times")
    for r in data["ranks"]:
        p = r["peak"]
        if _tracked(r):
            unit = f", unit {p['unit']}" if p["unit"] else ""
            lines.append(f"rank {r['rank']} peak {format_bytes(p['total'])} at step {p['step']}, {p['phase']}{unit}")
    for r in data["ranks"]:
        lines += _format_step(r, cats)
    if est is not None:
        lines += [f"note: {n}" for n in est["notes"]]
    pipe = data.get("pipeline")
    if pipe is not None:
        lines.append(f"pipeline: pp = {pipe['pp']}, schedule {pipe['schedule']}, virtual {pipe['virtual']}, "
                     f"balance by {pipe['balance']}")
        for st in pipe["stages"]:
            blocks = st["blocks"]
            shown = blocks[0] if len(blocks) == 1 else f"{blocks[0]} .. {blocks[-1]} ({len(blocks)})"
            cost = "".join([f", {st['ms']:.2f} ms" if st["ms"] is not None else "",
                            f", {format_bytes(st['bytes'])}" if st["bytes"] is not None else ""])
            lines.append(f"  stage {st['stage']} (pp rank {st['rank']}): {shown}{cost}")
    return "\n".join(lines)
