"""``memsave.save(..., async_=True)``: the step pays for staging this rank's shards into host memory; the write
and the commit go on in a background thread.

[Note: async save] Staging copies every rectangle this rank writes (its own shards and its share of the
replicated ones, :func:`_owned`: the memory is bounded by the rank's share of the checkpoint, reported as
:attr:`AsyncSave.staged_bytes`), so training may change the live tensors at once. The thread runs the same two-phase commit as a synchronous save over a process group of its own
(created once, collectively, by the first async save), so its collectives never interleave with training's. One
save is in flight per process: the next save or load waits for it, and a failure is raised there (or by
:func:`wait`).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memsave import dist as mdist
from memsave.checkpoint.api import snapshot, write_rects
from memsave.dist.dcp import Rect, new_world_group

__all__ = ["AsyncSave", "save_async", "wait"]

_GROUP: list[Any] = []  # the background group, made by the first async save
_PENDING: list[AsyncSave] = []


class AsyncSave:
    """A save writing in the background: :meth:`wait` for it (raises its error)."""

    def __init__(self, path: Path, staged: list[Rect], meta: dict[str, Any], rng: dict[str, Any], *,
                 keep_last: int | None, sync_files: bool, group: Any, stage_s: float) -> None:
        self.path = path
        self.staged_bytes = sum(r.tensor.nbytes for r in staged)
        self.stage_s = stage_s
        self.write_s: float | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"memsave-save:{path.name}", daemon=True,
                                        args=(staged, meta, rng, keep_last, sync_files, group))
        self._thread.start()

    def _run(self, staged: list[Rect], meta: dict[str, Any], rng: dict[str, Any], keep_last: int | None,
             sync_files: bool, group: Any) -> None:
        start = time.perf_counter()
        try:
            write_rects(self.path, staged, meta, rng, keep_last=keep_last, sync_files=sync_files, group=group)
        except BaseException as exc:  # raised by wait()
            self.error = exc
        finally:
            self.write_s = time.perf_counter() - start

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Block until the save is committed; raise its error if it failed."""
        self._thread.join()
        if _PENDING and _PENDING[0] is self:
            _PENDING.clear()
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def wait() -> None:
    """Wait for this process's async save in flight, if any (raises its error)."""
    if _PENDING:
        _PENDING[0].wait()


def _owned(rects: list[Rect]) -> list[Rect]:
    """The rectangles this rank writes: a rectangle held by several ranks (replicated: DDP's whole tensors, a
    ZeRO-1/2 parameter) is written by one of them, so only that one stages it. Every rank assigns every such
    rectangle alike, from all ranks' lists (one collective): to the holder with the fewest bytes so far (the
    balance DCP's plan deduplication aims for), the lowest rank on a tie."""
    if mdist.group_size(None) == 1:
        return rects
    mine = [(r.key, r.offsets, r.tensor.nbytes) for r in rects]
    everyone = mdist.all_gather_object(mine)
    holders: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    size: dict[tuple[str, tuple[int, ...]], int] = {}
    for rank, items in enumerate(everyone):
        for key, offsets, nbytes in items:
            holders.setdefault((key, offsets), []).append(rank)
            size[(key, offsets)] = nbytes
    load = [0] * len(everyone)
    owner = {}
    for item in sorted(holders, key=lambda i: (len(holders[i]) > 1, i)):  # the unshared first: they are fixed
        rank = min(holders[item], key=lambda r: (load[r], r))
        owner[item] = rank
        load[rank] += size[item]
    me = mdist.group_rank(None)
    return [r for r in rects if owner[(r.key, r.offsets)] == me]


def _stage(r: Rect) -> Rect:
    if r.fill is not None:  # offloaded state: read from its tier now (an async save stages it like the rest)
        return Rect(r.key, r.fill().to("cpu", copy=True), r.offsets, r.shape)
    host = torch.empty(r.tensor.shape, dtype=r.tensor.dtype, device="cpu",
                       pin_memory=r.tensor.device.type == "cuda")
    host.copy_(r.tensor.detach(), non_blocking=True)
    return Rect(r.key, host, r.offsets, r.shape)


def save_async(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, *,
               extra: dict[str, Any] | None, keep_last: int | None, sync_files: bool) -> AsyncSave:
    """Stage this rank's shards and write them in the background (collective: every rank calls it)."""
    wait()
    if not _GROUP:
        _GROUP.append(new_world_group())
    start = time.perf_counter()
    rects, meta, rng = snapshot(model, optimizer, extra)
    staged = [_stage(r) for r in _owned(rects)]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    handle = AsyncSave(Path(path), staged, meta, rng, keep_last=keep_last, sync_files=sync_files,
                       group=_GROUP[0], stage_s=time.perf_counter() - start)
    _PENDING.append(handle)
    return handle
