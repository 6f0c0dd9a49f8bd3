"""Layer 2: what is held where. Components register through :class:`HoldsMemory`; nothing here imports them."""

from memsave.memory.accounting import (
    HoldsMemory,
    MemoryAccount,
    account,
    default_tensors,
    peak_rss_bytes,
    rss_bytes,
)
from memsave.memory.html import render_html
from memsave.memory.report import MemoryReport, RankMemory, report
from memsave.memory.saved import SavedTensorCounter, note_kept
from memsave.memory.schema import load_report, save_report, validate_report
from memsave.memory.tracker import MemoryTracker

__all__ = [
    "HoldsMemory",
    "MemoryAccount",
    "MemoryReport",
    "MemoryTracker",
    "RankMemory",
    "SavedTensorCounter",
    "account",
    "default_tensors",
    "load_report",
    "note_kept",
    "peak_rss_bytes",
    "render_html",
    "report",
    "rss_bytes",
    "save_report",
    "validate_report",
]
