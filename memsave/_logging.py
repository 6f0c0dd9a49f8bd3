"""Logging for memsave: one logger, rank-tagged, with warn-once for settings ignored on this hardware.

[Note: rank-zero warnings] Every rank of a job usually hits the same ignored setting, so a warning from
:func:`warn_once` is printed once per job, by rank 0, not once per process. The filter sits on memsave's own
handler (the one that prints), not in :func:`warn_once`, so a handler a caller adds to the ``memsave`` logger
still receives every rank's record. Errors, and anything else that is not a warn-once, print on every rank: a
failure on rank 3 must not be hidden. The rank is ``torch.distributed``'s once a process group is initialized
(through :func:`set_rank_source`, which a higher layer calls: this module may not import ``memsave.dist``),
else the launcher's ``RANK``, else 0.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

__all__ = ["get_logger", "process_rank", "set_rank_source", "warn_once"]

_warned: set[str] = set()
_rank_source: Callable[[], int | None] | None = None
_ONCE = "memsave_warn_once"  # the attribute warn_once puts on its records


def set_rank_source(source: Callable[[], int | None] | None) -> None:
    """Where :func:`process_rank` reads the rank: ``source()`` returns it, or None before a process group exists."""
    global _rank_source
    _rank_source = source


def process_rank() -> int:
    """This process's global rank: the process group's when initialized, else ``RANK``, else 0."""
    if _rank_source is not None:
        rank = _rank_source()
        if rank is not None:
            return rank
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class _RankFilter(logging.Filter):
    """Tags each record with the rank for the prefix, and drops warn-once records on ranks other than 0."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = process_rank()
        record.memsave_rank = rank
        return rank == 0 or not getattr(record, _ONCE, False)


def get_logger(name: str = "memsave") -> logging.Logger:
    logger = logging.getLogger(name)
    if not logging.getLogger("memsave").handlers:
        handler = logging.StreamHandler()
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[memsave rank%(memsave_rank)s] %(levelname)s %(message)s"))
        root = logging.getLogger("memsave")
        root.addHandler(handler)
        root.setLevel(os.environ.get("MEMSAVE_LOG_LEVEL", "WARNING").upper())
        root.propagate = False
    return logger


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time it is seen in this process; memsave's handler prints it on
    rank 0 only (see [Note: rank-zero warnings])."""
    if message not in _warned:
        _warned.add(message)
        get_logger().warning(message, extra={_ONCE: True})
