"""``memsave.report(model, optimizer)``: bytes per category on every rank, beside the process figures.

The result is a :class:`MemoryReport` around one ``memsave.report/2`` dict (the schema: docs/memory.md, "Memory
reports"; validated by :mod:`memsave.memory.schema`). With a :class:`~memsave.memory.tracker.MemoryTracker`
attached to the model (or passed as ``tracker=``) each rank's entry carries its peak sample (``peak``: the
categories at that instant, which sum to the peak), each category's own maximum over the run
(``category_peak``, shown as "max over run": the maxima fall at different times), the peaks per phase and the
whole timeline; without one, the current bytes only. An estimate (``memsave.estimate(...)``) can be put beside
the measurement. The text and the page also zoom into the step holding the peak, phase by phase
(:func:`~memsave.memory.schema.peak_step`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memsave import dist as mdist
from memsave.memory.accounting import account, peak_rss_bytes, rss_bytes
from memsave.memory.schema import (
    CATEGORIES,
    SCHEMA,
    format_text,
    in_memory_total,
    peak_step,
    save_report,
    validate_report,
)
from memsave.memory.tracker import MemoryTracker, accounting_holders
from memsave.wrapped import user_class

__all__ = ["MemoryReport", "RankMemory", "report"]


@dataclasses.dataclass
class RankMemory:
    """One rank's bytes per category and process figures (a view of the report dict).

    ``bytes``: now. ``at_peak``: at the peak sample, the one with the highest in-memory total ``peak_total``
    (they sum to it, off-device tiers aside). ``max_over_run``: each category's own maximum over the samples,
    reached at different times (each at least its ``at_peak``; their sum is no sample's). Without a tracker all
    three are the current bytes.
    """

    rank: int
    bytes: dict[str, int]
    rss: int
    peak_rss: int
    device_allocated: int = 0
    device_peak: int = 0
    peak_total: int = 0
    at_peak: dict[str, int] = dataclasses.field(default_factory=dict)
    max_over_run: dict[str, int] = dataclasses.field(default_factory=dict)


class MemoryReport:
    """Per-rank memory: accounted bytes per category, peaks and timeline when tracked, the process figures."""

    def __init__(self, data: dict[str, Any]) -> None:
        validate_report(data)
        self.data = data

    @property
    def profile(self) -> str:
        return str(self.data["run"]["profile"])

    @property
    def ranks(self) -> list[RankMemory]:
        return [RankMemory(rank=r["rank"], bytes=dict(r["current"]), rss=r["process"]["rss"],
                           peak_rss=r["process"]["peak_rss"], device_allocated=r["process"]["device_allocated"],
                           device_peak=r["process"]["device_peak"], peak_total=r["peak"]["total"],
                           at_peak=dict(r["peak"]["bytes"]), max_over_run=dict(r["category_peak"]))
                for r in self.data["ranks"]]

    def peak_step(self, rank: int = 0) -> dict[str, Any] | None:
        """The step holding ``rank``'s peak, phase by phase (:func:`memsave.memory.schema.peak_step`: indices into
        that rank's ``timeline``); ``None`` without a timeline."""
        for r in self.data["ranks"]:
            if r["rank"] == rank:
                return peak_step(r)
        raise ValueError(f"rank = {rank} is not in this report; its ranks are "
                         f"{', '.join(str(r['rank']) for r in self.data['ranks'])}")

    def to_dict(self) -> dict[str, Any]:
        return self.data

    def to_json(self) -> str:
        return json.dumps(self.data, indent=1)

    def to_text(self) -> str:
        return format_text(self.data)

    def to_html(self) -> str:
        from memsave.memory.html import render_html

        return render_html([self.data])

    def save(self, path: str | Path) -> Path:
        """Write the report: ``.html`` as the self-contained page, anything else as JSON."""
        path = Path(path)
        if path.suffix == ".html":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(self.to_html())
        else:
            save_report(self.data, path)
        return path


def _process(tracker: MemoryTracker | None) -> dict[str, int]:
    rss = rss_bytes()  # the kernel updates the high-water mark lazily: never report a peak below now
    out = {"rss": rss, "peak_rss": max(peak_rss_bytes(), rss), "device_allocated": 0, "device_peak": 0,
           "device_reserved": 0, "device_peak_reserved": 0}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out.update(device_allocated=torch.cuda.memory_allocated(), device_peak=torch.cuda.max_memory_allocated(),
                   device_reserved=torch.cuda.memory_reserved(),
                   device_peak_reserved=torch.cuda.max_memory_reserved())
    return out


def _rank_entry(holders: tuple[object, ...], tracker: MemoryTracker | None, rank: int) -> dict[str, Any]:
    if tracker is not None:
        tracker.sample("report")
        current = dict(tracker.current)
        return {"rank": rank, "current": current, "peak": dict(tracker.peak),
                "category_peak": dict(tracker.category_peak), "process": _process(tracker),
                "phases": {k: dict(v) for k, v in tracker.phase_peaks.items()}, "timeline": list(tracker.timeline)}
    model = next((h for h in holders if isinstance(h, nn.Module)), None)
    counted = (accounting_holders(model, tuple(h for h in holders if h is not model)) if model is not None
               else list(holders))
    current = dict(account(counted).bytes)
    return {"rank": rank, "current": current,
            "peak": {"total": in_memory_total(current), "step": 0, "phase": "idle", "unit": None,
                     "bytes": dict(current)},
            "category_peak": dict(current), "process": _process(None), "phases": {}, "timeline": []}


def _num_params(holders: tuple[object, ...]) -> tuple[str, int]:
    for h in holders:
        if isinstance(h, nn.Module):  # parameters() lists a tied parameter once
            return user_class(h).__name__, sum(p.numel() for p in h.parameters())
    return "", 0


def report(*holders: object, profile: str = "", name: str = "", group: mdist.ProcessGroup | None = None,
           tracker: MemoryTracker | None = None, estimate: dict[str, Any] | None = None) -> MemoryReport:
    """Account the memory that ``holders`` (a wrapped model, its optimizer, ...) keep, on every rank.

    Collective: every rank of ``group`` (default: all) must call it. Returns the same report on each rank.
    ``tracker``: default, the :class:`MemoryTracker` attached to a holder (``holder.memsave_tracker``).
    ``estimate``: a dict from ``Estimate.to_report_dict()`` put beside the measurement.
    """
    if tracker is None:
        tracker = next((t for h in holders if isinstance(t := getattr(h, "memsave_tracker", None), MemoryTracker)),
                       None)
    if not profile:  # the wrapped model's profile
        profile = next((str(n) for h in holders if (n := getattr(h, "memsave_profile", None))), "")
    mine = _rank_entry(holders, tracker, mdist.group_rank(None))
    # printed on rank 0 alone, it waited 600 s for the others and ended in a raw gloo timeout; named now (as
    # memsave.save: [Note: called on rank 0 alone] in memsave/checkpoint/commit.py)
    mdist.expect_every_rank("memsave.report()", group, unset_s=600.0)
    ranks = sorted(mdist.all_gather_object(mine, group), key=lambda r: r["rank"])
    present: set[str] = set()
    for r in ranks:
        present.update(r["current"], r["category_peak"])
    if estimate is not None:
        present.update(estimate["bytes"])
        for stage in estimate.get("stages", ()):
            present.update(stage["bytes"])
    model, num_params = _num_params(holders)
    device = "cuda" if any(r["process"]["device_peak"] for r in ranks) else "cpu"
    data = {
        "schema": SCHEMA,
        "run": {"name": name or profile or "run", "profile": profile, "world_size": len(ranks), "device": device,
                "model": model, "num_params": num_params,
                "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")},
        "categories": [c for c in CATEGORIES if c in present],
        "ranks": ranks,
        "estimate": estimate,
    }
    pipeline = _pipeline_of(holders)
    if pipeline is not None:
        data["pipeline"] = pipeline
    return MemoryReport(data)


def _pipeline_of(holders: tuple[object, ...]) -> dict[str, Any] | None:
    """A pipelined model's stages (``[parallel] pp > 1``): blocks, and with ``[parallel] balance`` their measured
    cost: ms and bytes for ``"time"`` (``null`` otherwise: ``"params"`` weighs parameter counts, ``"count"``
    blocks)."""
    engine = next((e for h in holders if hasattr(e := getattr(h, "memsave_engine", None), "split")
                   and hasattr(e, "pp_size")), None)
    if engine is None:
        return None
    split, bal, by = engine.split, engine.balance, getattr(engine, "balance_by", "count")
    stages = []
    for k in range(engine.pp_size * engine.virtual):
        ms = bal.times[k] * 1e3 if bal is not None and by == "time" else None
        nbytes = int(bal.bytes[k]) if bal is not None and by == "time" else None  # ("params": counts)
        stages.append({"stage": k, "rank": k % engine.pp_size, "blocks": list(split.atoms_of(k)), "ms": ms,
                       "bytes": nbytes})
    return {"pp": engine.pp_size, "schedule": engine.schedule_name, "virtual": engine.virtual, "balance": by,
            "stages": stages}
