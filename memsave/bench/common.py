"""What every ``memsave bench`` mode shares: its options, the configurations run one after another (each in
fresh processes) with a failure that keeps the rows that finished, and the table and JSON file of the results.

Every other module of ``memsave/bench/`` imports this one and the layers below; only the dispatcher
(``memsave/bench/__init__.py``) imports the modes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from memsave._launch import LaunchError
from memsave.models import GPTConfig, gpt_config

__all__ = ["BenchOptions", "ConfigFailed", "columns", "mib", "run_each", "show_results", "split_names", "to_json"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """What to run: model size, batch, steps (the first ``warmup`` are not timed), processes."""

    size: str = "bench"
    tie_weights: bool = False
    batch_size: int = 4
    seq_len: int = 256
    steps: int = 8
    warmup: int = 2
    nproc: int = 2
    lr: float = 3e-4
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len", "steps", "nproc"):
            if getattr(self, name) < 1:
                raise ValueError(f"bench option {name}={getattr(self, name)} is not allowed; expected >= 1")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"bench option warmup={self.warmup} is not allowed; expected 0 <= warmup < steps")

    def model_config(self) -> GPTConfig:
        """The reference GPT of ``size``, its context long enough for ``seq_len``."""
        return gpt_config(self.size, tie_weights=self.tie_weights, block_size=max(self.seq_len, 8))


class ConfigFailed(LaunchError):
    """A configuration of the bench failed (after :func:`memsave._launch.spawn_local`'s retries on a taken port).

    Its message names the configuration; ``rows`` are the configurations that finished before it, compared
    among themselves as a full run's rows are.
    """

    def __init__(self, name: str, rows: list[dict[str, Any]], cause: LaunchError) -> None:
        super().__init__(f"configuration {name!r} failed: {cause.summary}", rank=cause.rank,
                         exc_type=cause.exc_type, message=f"configuration {name!r}: {cause.message}",
                         child_traceback=cause.child_traceback)
        self.name = name
        self.rows = rows


def run_each(names: list[str], run_one: Callable[[str], dict[str, Any]],
             compare: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """``run_one(name)`` for each configuration in order, then ``compare(rows)``; a configuration that fails
    raises :class:`ConfigFailed` naming it and carrying the finished rows, compared."""
    rows: list[dict[str, Any]] = []
    for name in names:
        try:
            rows.append(run_one(name))
        except LaunchError as exc:
            if rows:
                compare(rows)
            raise ConfigFailed(name, rows, exc) from None
    compare(rows)
    return rows


def split_names(text: str) -> list[str]:
    """The configurations of a comma-separated command-line value, blanks dropped."""
    return [n.strip() for n in text.split(",") if n.strip()]


def mib(n: float) -> str:
    """Bytes as MiB for a table cell: one decimal, thousands separated."""
    return f"{n / 2**20:,.1f}"


def columns(head: Sequence[str], lines: Sequence[Sequence[str]], *, strip: bool = True) -> list[str]:
    """The heading and the rows of a table, each column as wide as its widest cell, two spaces apart (with
    ``strip``, no trailing blanks)."""
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines]
    return [line.rstrip() for line in out] if strip else out


def to_json(rows: list[dict[str, Any]], opts: Any, *, schema: str = "memsave.bench/1",
            failed: str | None = None) -> str:
    """The results file: the options and the rows (and, after a failure, the configuration that failed)."""
    out: dict[str, Any] = {"schema": schema, "options": dataclasses.asdict(opts), "rows": rows}
    if failed is not None:
        out["failed"] = failed
    return json.dumps(out, indent=2)


def show_results(run: Callable[[], list[dict[str, Any]]], show: Callable[[list[dict[str, Any]]], None],
                 json_path: Path | None, opts: Any, *, schema: str = "memsave.bench/1") -> int:
    """``show(run())`` and the JSON file. When a configuration fails (:class:`ConfigFailed`), the rows that
    finished are shown and written all the same, with a line naming the failed one, before the error goes on to
    ``memsave``'s handler."""
    try:
        rows = run()
    except ConfigFailed as exc:
        if exc.rows:
            show(exc.rows)
        print(f"{len(exc.rows)} configuration{'' if len(exc.rows) == 1 else 's'} finished; {exc.name!r} failed "
              "and the rest did not run", flush=True)
        if json_path is not None and exc.rows:
            json_path.write_text(to_json(exc.rows, opts, schema=schema, failed=exc.name))
            print(f"finished results written to {json_path}", flush=True)
        raise
    show(rows)
    if json_path is not None:
        json_path.write_text(to_json(rows, opts, schema=schema))
        print(f"results written to {json_path}")
    return 0
