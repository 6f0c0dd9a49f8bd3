"""``memsave.report(model, optimizer)``: bytes per category on every rank, beside the process figures."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from memsave import dist as mdist
from memsave.memory.accounting import MemoryAccount, account, peak_rss_bytes, rss_bytes
from memsave.phases import MemoryCategory

__all__ = ["MemoryReport", "RankMemory", "report"]


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


@dataclasses.dataclass
class RankMemory:
    rank: int
    bytes: dict[str, int]
    rss: int
    peak_rss: int
    device_allocated: int = 0
    device_peak: int = 0


@dataclasses.dataclass
class MemoryReport:
    """Per-rank memory: accounted bytes per category, and what the process / allocator says."""

    ranks: list[RankMemory]
    profile: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "memsave.report/1", "profile": self.profile,
                "ranks": [dataclasses.asdict(r) for r in self.ranks]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_text(self) -> str:
        cats = [c.value for c in MemoryCategory if any(c.value in r.bytes for r in self.ranks)]
        head = ["rank", *cats, "accounted", "rss", "peak rss"]
        gpu = any(r.device_peak for r in self.ranks)
        if gpu:
            head += ["gpu alloc", "gpu peak"]
        rows = []
        for r in self.ranks:
            row = [str(r.rank), *(_fmt(r.bytes.get(c, 0)) for c in cats), _fmt(sum(r.bytes.values())),
                   _fmt(r.rss), _fmt(r.peak_rss)]
            if gpu:
                row += [_fmt(r.device_allocated), _fmt(r.device_peak)]
            rows.append(row)
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
        lines = [f"memory report{f' ({self.profile})' if self.profile else ''}: bytes held per rank"]
        lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths)))
        lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
        return "\n".join(lines)


def report(*holders: object, profile: str = "", group: mdist.ProcessGroup | None = None) -> MemoryReport:
    """Account the memory that ``holders`` (a wrapped model, its optimizer, ...) keep, on every rank.

    Collective: every rank of ``group`` (default: all) must call it. Returns the same report on each rank.
    """
    acct: MemoryAccount = account(holders)
    rss = rss_bytes()  # the kernel updates the high-water mark lazily: never report a peak below now
    mine = RankMemory(rank=mdist.group_rank(None), bytes=acct.bytes, rss=rss, peak_rss=max(peak_rss_bytes(), rss))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        mine.device_allocated = torch.cuda.memory_allocated()
        mine.device_peak = torch.cuda.max_memory_allocated()
    ranks = mdist.all_gather_object(mine, group)
    return MemoryReport(ranks=sorted(ranks, key=lambda r: r.rank), profile=profile)
