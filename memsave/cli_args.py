"""What every ``memsave`` subcommand reports its command-line mistakes with: :class:`UsageError` (one line, exit
code 2), argparse's own errors raised as one, and the ``--section.key=value`` profile overrides."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

__all__ = ["ArgumentError", "Parser", "UsageError", "split_overrides"]


class UsageError(Exception):
    """A mistake in the command line, reported in one line with exit code 2."""


class ArgumentError(UsageError):
    """What argparse found wrong (a bad number, a missing value), raised instead of printing usage and exiting."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """argparse, with its errors raised as :class:`ArgumentError` so that ``memsave.cli.main`` prints them in one
    line (and returns 2 rather than exiting). The subcommands' parsers are of this class too
    (``add_subparsers``)."""

    def error(self, message: str) -> Any:  # argparse's signature says NoReturn
        raise ArgumentError(self.prog, message)


def split_overrides(extra: Sequence[str], *, hint: str = "") -> list[str]:
    """``--section.key=value`` (or ``--section.key value``) arguments argparse did not know; ``hint`` is added to
    the error for any other argument."""
    out: list[str] = []
    i = 0
    while i < len(extra):
        item = extra[i]
        name = item[2:].partition("=")[0]
        if not item.startswith("--") or "." not in name:
            raise UsageError(f"unrecognized argument {item!r}; profile overrides look like --zero.stage=2{hint}")
        if "=" not in item and i + 1 < len(extra) and not extra[i + 1].startswith("--"):
            item = f"{item}={extra[i + 1]}"
            i += 1
        out.append(item[2:])
        i += 1
    return out
