"""The fields of the memory report format, ``memsave.report/2`` (memsave/memory/schema.py), and their checks:
:func:`validate_report`, and :func:`convert_v1` for a ``memsave.report/1`` dict.

This module checks a report field by field and names what is wrong by its JSON path, the value found and what is
allowed, e.g. ``report.ranks[1].timeline[3].phase = 'fwd' is not allowed; expected one of forward, backward,
optimizer, idle``. Unknown keys are refused like bad values, so a typo in a producer fails at save time
rather than as a silently empty chart.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

__all__ = ["CATEGORIES", "OFF_DEVICE", "PHASES", "SCHEMA", "SCHEMA_V1", "convert_v1", "in_memory_total",
           "validate_report"]

SCHEMA = "memsave.report/2"
SCHEMA_V1 = "memsave.report/1"  # MemoryReport.to_dict() before the tracker: current bytes only
# stacking order of the charts; the last two live on another tier and are never stacked into device memory
CATEGORIES = ("params", "params_gathered", "grads", "master", "optimizer_state", "activations", "buffers",
              "comm", "offload_host", "offload_disk")
OFF_DEVICE = ("offload_host", "offload_disk")
PHASES = ("forward", "backward", "optimizer", "idle")
_PROCESS = ("rss", "peak_rss", "device_allocated", "device_peak", "device_reserved", "device_peak_reserved")


def in_memory_total(nbytes: Mapping[str, int]) -> int:
    """The sum of every category except the off-device tiers (``offload_host``, ``offload_disk``)."""
    return sum(v for k, v in nbytes.items() if k not in OFF_DEVICE)


# -- validation -----------------------------------------------------------------------------------------------
def _fail(path: str, value: Any, expected: str) -> ValueError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ValueError(f"{path} = {shown} is not allowed; expected {expected}")


def _keys(obj: Any, path: str, required: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise _fail(path, obj, f"an object with keys {', '.join(required)}")
    for key in obj:
        if key not in required:
            raise ValueError(f"{path}.{key} is not allowed (unknown key); expected only {', '.join(required)}")
    for key in required:
        if key not in obj:
            raise ValueError(f"{path}.{key} is missing; {path} needs keys {', '.join(required)}")
    return obj


def _int(value: Any, path: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(path, value, f"an integer >= {minimum}")
    return value


def _str(value: Any, path: str, nullable: bool = False) -> None:
    if not (isinstance(value, str) or (nullable and value is None)):
        raise _fail(path, value, "a string or null" if nullable else "a string")


def _choice(value: Any, path: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise _fail(path, value, f"one of {', '.join(allowed)}")


def _list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise _fail(path, value, "a list")
    return value


def _bytes(value: Any, path: str, categories: tuple[str, ...]) -> None:
    """A ``{category: bytes}`` map; a category the report does not list is refused (missing ones mean 0)."""
    if not isinstance(value, dict):
        raise _fail(path, value, "an object {category: bytes}")
    for key, n in value.items():
        if key not in categories:
            raise ValueError(f"{path}.{key} is not allowed; expected one of report.categories: "
                             f"{', '.join(categories)}")
        _int(n, f"{path}.{key}")


def _categories(value: Any, path: str) -> tuple[str, ...]:
    seen: list[str] = []
    for i, cat in enumerate(_list(value, path)):
        _choice(cat, f"{path}[{i}]", CATEGORIES)
        if cat in seen:
            raise _fail(f"{path}[{i}]", cat, "each category once")
        seen.append(cat)
    return tuple(seen)


def _run(value: Any, path: str) -> int:
    run = _keys(value, path, ("name", "profile", "world_size", "device", "model", "num_params", "created"))
    for key in ("name", "profile", "model"):
        _str(run[key], f"{path}.{key}")
    _choice(run["device"], f"{path}.device", ("cpu", "cuda"))
    _int(run["num_params"], f"{path}.num_params")
    try:
        datetime.datetime.fromisoformat(run["created"])
    except (TypeError, ValueError):
        raise _fail(f"{path}.created", run["created"], "an ISO 8601 date and time") from None
    return _int(run["world_size"], f"{path}.world_size", 1)


def _rank(value: Any, path: str, cats: tuple[str, ...], world_size: int) -> int:
    rank = _keys(value, path, ("rank", "current", "peak", "category_peak", "process", "phases", "timeline"))
    r = _int(rank["rank"], f"{path}.rank")
    if r >= world_size:
        raise _fail(f"{path}.rank", r, f"a rank below report.run.world_size = {world_size}")
    _bytes(rank["current"], f"{path}.current", cats)
    peak = _keys(rank["peak"], f"{path}.peak", ("total", "step", "phase", "unit", "bytes"))
    _int(peak["total"], f"{path}.peak.total")
    _int(peak["step"], f"{path}.peak.step")
    _choice(peak["phase"], f"{path}.peak.phase", PHASES)
    _str(peak["unit"], f"{path}.peak.unit", nullable=True)
    _bytes(peak["bytes"], f"{path}.peak.bytes", cats)
    if in_memory_total(peak["bytes"]) != peak["total"]:
        raise _fail(f"{path}.peak.total", peak["total"],
                    f"the in-memory sum of {path}.peak.bytes, {in_memory_total(peak['bytes'])}")
    _bytes(rank["category_peak"], f"{path}.category_peak", cats)
    for cat, at_peak in peak["bytes"].items():  # the peak sample is one of the samples each maximum is over
        if rank["category_peak"].get(cat, 0) < at_peak:
            raise _fail(f"{path}.category_peak.{cat}", rank["category_peak"].get(cat, 0),
                        f"at least the bytes at the peak sample, {path}.peak.bytes.{cat} = {at_peak} (the "
                        "maximum over the run)")
    process = _keys(rank["process"], f"{path}.process", _PROCESS)
    for key in _PROCESS:
        _int(process[key], f"{path}.process.{key}")
    phases = rank["phases"]
    if not isinstance(phases, dict):
        raise _fail(f"{path}.phases", phases, "an object {phase: {peak_total, bytes}}")
    for name, entry in phases.items():
        _choice(name, f"{path}.phases key", PHASES)
        entry = _keys(entry, f"{path}.phases.{name}", ("peak_total", "bytes"))
        _int(entry["peak_total"], f"{path}.phases.{name}.peak_total")
        _bytes(entry["bytes"], f"{path}.phases.{name}.bytes", cats)
    last_t = 0.0
    for i, sample in enumerate(_list(rank["timeline"], f"{path}.timeline")):
        where = f"{path}.timeline[{i}]"
        s = _keys(sample, where, ("t", "step", "phase", "unit", "event", "bytes", "rss", "device_allocated"))
        t = s["t"]
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t < float("inf") or t < last_t:
            raise _fail(f"{where}.t", t, f"seconds >= {last_t:g} (times never go back)")
        last_t = float(t)
        _int(s["step"], f"{where}.step")
        _choice(s["phase"], f"{where}.phase", PHASES)
        _str(s["unit"], f"{where}.unit", nullable=True)
        _str(s["event"], f"{where}.event")
        _bytes(s["bytes"], f"{where}.bytes", cats)
        _int(s["rss"], f"{where}.rss")
        _int(s["device_allocated"], f"{where}.device_allocated")
    return r


def _estimate(value: Any, path: str, cats: tuple[str, ...]) -> None:
    if value is None:
        return
    keys = ("world_size", "bytes", "peak_total", "notes")
    est = _keys(value, path, (*keys, "stages") if isinstance(value, dict) and "stages" in value else keys)
    _int(est["world_size"], f"{path}.world_size", 1)
    _bytes(est["bytes"], f"{path}.bytes", cats)
    _int(est["peak_total"], f"{path}.peak_total")
    for i, note in enumerate(_list(est["notes"], f"{path}.notes")):
        _str(note, f"{path}.notes[{i}]")
    for i, stage in enumerate(_list(est.get("stages", []), f"{path}.stages")):  # under pp: one per pipeline rank
        where = f"{path}.stages[{i}]"
        _keys(stage, where, ("pp_rank", "bytes", "peak_total"))
        _int(stage["pp_rank"], f"{where}.pp_rank")
        _bytes(stage["bytes"], f"{where}.bytes", cats)
        _int(stage["peak_total"], f"{where}.peak_total")


def _pipeline(value: Any, path: str) -> None:
    """The optional ``pipeline`` section: the stage split of a ``pp > 1`` run and what each stage costs."""
    p = _keys(value, path, ("pp", "schedule", "virtual", "balance", "stages"))
    pp, virtual = _int(p["pp"], f"{path}.pp", 2), _int(p["virtual"], f"{path}.virtual", 1)
    if not isinstance(p["schedule"], str) or not p["schedule"]:
        raise _fail(f"{path}.schedule", p["schedule"], "a schedule name")
    if p["balance"] not in ("count", "params", "time"):
        raise _fail(f"{path}.balance", p["balance"], "one of 'count', 'params', 'time'")
    stages = _list(p["stages"], f"{path}.stages")
    if len(stages) != pp * virtual:
        raise _fail(f"{path}.stages", f"{len(stages)} stages", f"pp x virtual = {pp * virtual} stages")
    for i, stage in enumerate(stages):
        where = f"{path}.stages[{i}]"
        st = _keys(stage, where, ("stage", "rank", "blocks", "ms", "bytes"))
        if st["stage"] != i or st["rank"] != i % pp:
            raise _fail(where, (st["stage"], st["rank"]), f"stage {i} on pp rank {i % pp}")
        if not isinstance(st["blocks"], list) or not st["blocks"] or not all(isinstance(b, str) for b in st["blocks"]):
            raise _fail(f"{where}.blocks", st["blocks"], "a non-empty list of module names")
        if st["ms"] is not None and not (isinstance(st["ms"], (int, float)) and st["ms"] >= 0):
            raise _fail(f"{where}.ms", st["ms"], "null or a time >= 0")
        if st["bytes"] is not None:
            _int(st["bytes"], f"{where}.bytes")


def validate_report(data: Any, *, where: str = "report") -> None:
    """Raise ``ValueError`` naming the first field of ``data`` that breaks ``memsave.report/2``."""
    optional = ("pipeline",) if isinstance(data, dict) and "pipeline" in data else ()
    top = _keys(data, where, ("schema", "run", "categories", "ranks", "estimate", *optional))
    if optional:
        _pipeline(top["pipeline"], f"{where}.pipeline")
    if top["schema"] != SCHEMA:
        raise _fail(f"{where}.schema", top["schema"], f"{SCHEMA!r} (load_report also converts {SCHEMA_V1!r})")
    world_size = _run(top["run"], f"{where}.run")
    cats = _categories(top["categories"], f"{where}.categories")
    ranks = _list(top["ranks"], f"{where}.ranks")
    if not ranks:
        raise _fail(f"{where}.ranks", ranks, "at least one rank")
    seen: set[int] = set()
    for i, rank in enumerate(ranks):
        r = _rank(rank, f"{where}.ranks[{i}]", cats, world_size)
        if r in seen:
            raise _fail(f"{where}.ranks[{i}].rank", r, "each rank once")
        seen.add(r)
    _estimate(top["estimate"], f"{where}.estimate", cats)


# -- version 1 -------------------------------------------------------------------------------------------------
def convert_v1(data: Mapping[str, Any], *, name: str = "", created: str | None = None) -> dict[str, Any]:
    """A ``memsave.report/1`` dict (current bytes and process figures per rank) as ``memsave.report/2``.

    The peak is the current sample (step 0, phase idle), the timeline and phases are empty, the fields v1 did
    not have are 0 or "" (model, num_params, reserved device bytes) and there is no estimate.
    """
    ranks_v1 = _list(data.get("ranks"), "report.ranks")
    keys = ("rank", "bytes", "rss", "peak_rss", "device_allocated", "device_peak")
    present: set[str] = set()
    for i, r in enumerate(ranks_v1):
        if not isinstance(r, dict) or not set(r) <= set(keys) or not {"rank", "bytes", "rss", "peak_rss"} <= set(r):
            raise _fail(f"report.ranks[{i}]", r, f"a {SCHEMA_V1} rank with keys {', '.join(keys)}")
        _bytes(r["bytes"], f"report.ranks[{i}].bytes", CATEGORIES)
        present.update(r["bytes"])
    profile = data.get("profile", "")
    ranks = []
    for r in ranks_v1:
        current = dict(r["bytes"])
        process = {k: r.get(k, 0) for k in _PROCESS}
        ranks.append({
            "rank": r["rank"], "current": current,
            "peak": {"total": in_memory_total(current), "step": 0, "phase": "idle", "unit": None,
                     "bytes": dict(current)},
            "category_peak": dict(current), "process": process, "phases": {}, "timeline": [],
        })
    out = {
        "schema": SCHEMA,
        "run": {"name": name or profile or "run", "profile": profile if isinstance(profile, str) else "",
                "world_size": len(ranks_v1), "device": "cuda" if any(r.get("device_peak") for r in ranks_v1) else "cpu",
                "model": "", "num_params": 0,
                "created": created or datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")},
        "categories": [c for c in CATEGORIES if c in present],
        "ranks": ranks,
        "estimate": None,
    }
    validate_report(out)
    return out

