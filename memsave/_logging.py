"""Logging for memsave: one logger, rank-tagged, with warn-once for settings ignored on this hardware."""

from __future__ import annotations

import logging
import os

__all__ = ["get_logger", "warn_once"]

_warned: set[str] = set()


def get_logger(name: str = "memsave") -> logging.Logger:
    logger = logging.getLogger(name)
    if not logging.getLogger("memsave").handlers:
        handler = logging.StreamHandler()
        rank = os.environ.get("RANK", "0")
        handler.setFormatter(logging.Formatter(f"[memsave rank{rank}] %(levelname)s %(message)s"))
        root = logging.getLogger("memsave")
        root.addHandler(handler)
        root.setLevel(os.environ.get("MEMSAVE_LOG_LEVEL", "WARNING").upper())
        root.propagate = False
    return logger


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time it is seen in this process."""
    if message not in _warned:
        _warned.add(message)
        get_logger().warning(message)
