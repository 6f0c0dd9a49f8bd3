"""Layer 2: what is held where. Components register through :class:`HoldsMemory`; nothing here imports them."""

from memsave.memory.accounting import (
    HoldsMemory,
    MemoryAccount,
    account,
    default_tensors,
    peak_rss_bytes,
    rss_bytes,
)
from memsave.memory.report import MemoryReport, RankMemory, report

__all__ = [
    "HoldsMemory",
    "MemoryAccount",
    "MemoryReport",
    "RankMemory",
    "account",
    "default_tensors",
    "peak_rss_bytes",
    "report",
    "rss_bytes",
]
