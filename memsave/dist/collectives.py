"""Every collective memsave issues, in one place: typed wrappers with async handles, a size-1 fast path, a
profiler label per call and a counter of the logical bytes each moves.

[Note: logical bytes] The counter follows the ZeRO paper's accounting, per rank and independent of the
algorithm the backend picks: an all-gather moves the bytes of its *output*, a reduce-scatter the bytes of its
*input*, and an all-reduce twice its size (a reduce-scatter followed by an all-gather). So DDP moves 2 bytes per
gradient byte, and ZeRO-3 moves 3 (two all-gathers and one reduce-scatter per parameter). Gloo emulates
reduce-scatter with other primitives; the logical figure is what CPU tests check. A group of one moves nothing
and counts nothing.

torch 2.13 renames ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` and deprecates the old names; 2.11 has only the old ones. This module picks whichever
exists so the rest of memsave never sees the difference.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

__all__ = [
    "COMM_STATS",
    "CollectiveError",
    "CommStats",
    "Handle",
    "ProcessGroup",
    "ReduceOp",
    "all_gather_into",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast",
    "doing",
    "gather_tensors",
    "group_rank",
    "group_size",
    "reduce_scatter_into",
    "shutdown",
]

ProcessGroup = dist.ProcessGroup
ReduceOp = dist.ReduceOp

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Handle(Protocol):
    def wait(self) -> Any: ...


class _Done:
    """The handle of a collective that completed synchronously (or needed no communication)."""

    def wait(self) -> bool:
        return True


_DONE = _Done()

# [Note: named collectives] What the engines are doing, set at each hook ("forward, unit 'blocks.1'"): a
# collective that fails (a peer died, the timeout passed) says which collective, in which phase and unit, instead
# of gloo's or NCCL's generic message alone. Captured when the collective is issued, so an async one's wait()
# names where it was issued.
_doing: list[tuple[int, str, str | None]] = [(0, "no phase", None)]


def doing(step: int, phase: str, unit: str | None = None) -> None:
    """Say what this rank does now (step, phase, unit); named by the collectives that fail from here on. Only the
    parts are kept: the text is made if a collective fails (this runs at every unit's hooks)."""
    _doing[0] = (step, phase, unit)


def _label(kind: str, group: ProcessGroup | None, where: tuple[int, str, str | None]) -> str:
    step, phase, unit = where
    return f"{kind} over {group_size(group)} ranks during step {step}, {phase}" + (f" of unit {unit!r}" if unit else "")


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the collective, the phase and the unit."""


_PEER_GONE = ("closed by peer", "reset by peer", "timed out", "timeout")


def _failed(label: str, exc: BaseException) -> CollectiveError:
    hint = ""
    if any(what in str(exc).lower() for what in _PEER_GONE):  # a peer that never came (or left): say what it may be
        hint = (" (a peer rank never joined this collective: it ended or crashed, or it runs something else, such "
                "as a rank that ran out of batches before the others (give every rank the same number of steps: "
                "DistributedSampler(..., drop_last=True), or a step count agreed on all ranks), or an evaluation, "
                "barrier or save on some ranks only; its own error or log says which)")
    return CollectiveError(f"memsave: {label} failed: {type(exc).__name__}: {exc}{hint}")


class _Named:
    """An async collective's work, whose failure names the collective ([Note: named collectives])."""

    __slots__ = ("group", "kind", "where", "work")

    def __init__(self, work: Any, kind: str, group: ProcessGroup | None, where: tuple[int, str, str | None]) -> None:
        self.work, self.kind, self.group, self.where = work, kind, group, where

    def wait(self) -> Any:
        try:
            return self.work.wait()
        except RuntimeError as exc:
            raise _failed(_label(self.kind, self.group, self.where), exc) from exc


_IS_NCCL: dict[int, bool] = {}  # by id(group): does the group run on NCCL (CUDA tensors only)?


def _check_device(kind: str, group: ProcessGroup | None, *tensors: torch.Tensor) -> None:
    """A CPU tensor in an NCCL collective fails only at world size >= 2, deep inside NCCL: refuse it here, named."""
    nccl = _IS_NCCL.get(id(group))
    if nccl is None:
        nccl = _IS_NCCL[id(group)] = dist.get_backend(group) == "nccl"
    if nccl:
        for t in tensors:
            if t.device.type != "cuda":
                raise ValueError(f"memsave.dist {kind}: a {tuple(t.shape)} {t.dtype} tensor on {t.device} over an NCCL "
                                 "group, which moves CUDA tensors only; put it on the group's device (mesh.device)")


def _issue(kind: str, group: ProcessGroup | None, async_op: bool, call: Callable[[], Any]) -> Handle:
    where = _doing[0]  # the text is made only if it fails
    try:
        with record_function(f"memsave::{kind}"):
            work = call()
    except RuntimeError as exc:
        raise _failed(_label(kind, group, where), exc) from exc
    return _Named(work, kind, group, where) if async_op else _DONE


@dataclasses.dataclass
class CommStats:
    """Calls and logical bytes per collective kind, for this process (see [Note: logical bytes]); the few bytes
    ranks exchange to agree (control flow, non-finite steps) count as "control", apart from the model's traffic."""

    calls: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    bytes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    def add(self, kind: str, nbytes: int) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {"calls": dict(self.calls), "bytes": dict(self.bytes)}

    @contextmanager
    def measure(self) -> Iterator[CommStats]:
        """Counts of the collectives issued inside the ``with`` block only."""
        before_calls, before_bytes = collections.Counter(self.calls), collections.Counter(self.bytes)
        window = CommStats()
        try:
            yield window
        finally:
            window.calls = self.calls - before_calls
            window.bytes = self.bytes - before_bytes


COMM_STATS = CommStats()


def group_size(group: ProcessGroup | None) -> int:
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    if not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def group_ranks(group: ProcessGroup | None) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order."""
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(
    tensor: torch.Tensor, group: ProcessGroup | None, *, op: Any = ReduceOp.SUM, async_op: bool = False,
    count_as: str = "all_reduce",
) -> Handle:
    """In-place all-reduce of ``tensor`` over ``group``. ``count_as``: the kind :data:`COMM_STATS` counts it
    under (``"control"`` for the few bytes of an agreement, apart from the model's traffic)."""
    if group_size(group) == 1:
        return _DONE
    _check_device("all_reduce", group, tensor)
    COMM_STATS.add(count_as, 2 * _nbytes(tensor))
    return _issue("all_reduce", group, async_op,
                  lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op))


def all_gather_into(
    output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None, *, async_op: bool = False,
    count_as: str = "all_gather",
) -> Handle:
    """Gather every rank's ``input`` into the flat ``output`` (rank order), ``output.numel() == size * input.numel()``."""
    size = group_size(group)
    if output.numel() != size * input.numel():
        raise AssertionError(f"all_gather_into: output {output.numel()} != {size} x input {input.numel()}")
    if size == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return _DONE
    _check_device("all_gather", group, output, input)
    COMM_STATS.add(count_as, _nbytes(output))
    return _issue("all_gather", group, async_op,
                  lambda: _all_gather_single(output, input, group=group, async_op=async_op))


def reduce_scatter_into(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup | None,
    *,
    op: Any = ReduceOp.SUM,
    async_op: bool = False,
    count_as: str = "reduce_scatter",
) -> Handle:
    """Reduce the flat ``input`` over ``group`` and keep this rank's slice in ``output``."""
    size = group_size(group)
    if input.numel() != size * output.numel():
        raise AssertionError(f"reduce_scatter_into: input {input.numel()} != {size} x output {output.numel()}")
    if size == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return _DONE
    _check_device("reduce_scatter", group, output, input)
    COMM_STATS.add(count_as, _nbytes(input))
    return _issue("reduce_scatter", group, async_op,
                  lambda: _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op))


def broadcast(tensor: torch.Tensor, src_group_rank: int, group: ProcessGroup | None) -> None:
    """Broadcast ``tensor`` in place from the rank whose rank *within group* is ``src_group_rank``."""
    if group_size(group) == 1:
        return
    _check_device("broadcast", group, tensor)
    COMM_STATS.add("broadcast", _nbytes(tensor))
    src = dist.get_global_rank(group, src_group_rank) if group is not None else src_group_rank
    _issue("broadcast", group, False, lambda: dist.broadcast(tensor, src=src, group=group))


def all_gather_object(obj: Any, group: ProcessGroup | None = None) -> list[Any]:
    """Every rank's picklable ``obj``, in group rank order (small control data only; not counted)."""
    size = group_size(group)
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def shutdown() -> None:
    """Destroy the default process group (if any): the clean end of a run, needed by NCCL.

    [Note: gloo at exit] Gloo's worker thread drops a finished collective's work object just after the caller's
    ``wait()`` returns, and when that releases the last reference to a tensor Python has already freed, it takes
    the GIL. A rank that goes from its last collective straight into interpreter exit can be finalizing by then,
    and a thread taking the GIL during finalization is unwound into ``std::terminate`` ("terminate called without
    an active exception": about 1 run in 10 of examples/train_gpt.py on 2 gloo ranks). A gloo barrier does not
    help (its work holds the previous works and is dropped the same way), so the ranks meet through the store
    instead, which takes no worker thread, and give the workers a moment before the group goes."""
    if dist.is_initialized():
        if dist.get_world_size() > 1:
            _store_barrier("memsave/shutdown")
        time.sleep(0.02)
        dist.destroy_process_group()
    _forget_groups()


def _forget_groups() -> None:
    """Every group and mesh went with the default group."""
    from memsave.dist.groups import forget  # (they import this module)
    from memsave.dist.init import forget_meshes

    forget()
    forget_meshes()


def shutdown_at_exit() -> None:
    """[Note: gloo at exit] for scripts that end without :func:`shutdown` (registered by ``memsave.init`` when it
    started the process group): the same meeting through the store, bounded to a few seconds, at interpreter
    exit; skipped after an uncaught exception (its peers may never come), and quiet whatever fails."""
    if not dist.is_initialized() or getattr(sys, "last_value", None) is not None:
        return
    with contextlib.suppress(Exception):
        if dist.get_world_size() > 1:
            _store_barrier("memsave/exit", timeout_s=10.0)
        time.sleep(0.02)
        dist.destroy_process_group()
        _forget_groups()


_store_rounds: dict[str, int] = {}


def _store_barrier(name: str, timeout_s: float = 300.0) -> None:
    """Every rank of the default group reaches this point (through its TCP store, not a collective)."""
    store = dist.distributed_c10d._get_default_store()
    _store_rounds[name] = _store_rounds.get(name, 0) + 1
    key = f"{name}/{_store_rounds[name]}"
    world = dist.get_world_size()
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"memsave.dist.shutdown: not every rank reached it within {timeout_s:.0f} s")
        time.sleep(0.001)


_arrivals: dict[str, int] = {}


def expect_every_rank(what: str, group: ProcessGroup | None, timeout_s: float | None = None, *,
                      unset_s: float = 60.0) -> None:
    """Check, through the store, that every rank of ``group`` reaches this call before a collective that would
    otherwise hang for the whole collective timeout (600 s) and end in a raw gloo/NCCL error. Raises
    ``RuntimeError`` naming the ranks that did not arrive within ``timeout_s`` (default ``MEMSAVE_ARRIVAL_S``, else
    ``unset_s``). For rare calls only (state dicts): each costs a few store round trips."""
    size = group_size(group)
    if size <= 1:
        return
    timeout = timeout_s if timeout_s is not None else float(os.environ.get("MEMSAVE_ARRIVAL_S", unset_s))
    ranks = group_ranks(group)
    name = f"memsave/arrive/{what}/{'-'.join(map(str, ranks))}"
    _arrivals[name] = _arrivals.get(name, 0) + 1
    key = f"{name}/{_arrivals[name]}"
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{key}/{dist.get_rank()}", "1")
    keys = [f"{key}/{r}" for r in ranks]
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
            with contextlib.suppress(RuntimeError, NotImplementedError):  # (a store that cannot delete keys)
                store.delete_key(f"{key}/{dist.get_rank()}")  # not counted: every rank's next call pairs again
                _arrivals[name] -= 1
            raise RuntimeError(
                f"{what} is collective: every rank of its group (global ranks {ranks}) must call it, but rank(s) "
                f"{missing} did not within {timeout:.0f} s (MEMSAVE_ARRIVAL_S). Call it on every rank and keep or "
                "save the result on rank 0 only, as memsave.save does; if every rank calls it, the missing ones "
                "are elsewhere: still training (a rank with more batches than the others), or stopped"
            )
        time.sleep(0.002)


def barrier(group: ProcessGroup | None = None) -> None:
    if group_size(group) > 1:
        dist.barrier(group=group)


def gather_tensors(mine: dict[str, torch.Tensor], group: ProcessGroup | None,
                   device: torch.device) -> dict[str, torch.Tensor]:
    """Every member's named tensors, on every member, in group rank order (each member's in its own order): the
    names, shapes and dtypes first, then one broadcast per tensor from its member. For whole-model state dicts
    assembled from pipeline stages (rare: a save); the group's members hold disjoint names."""
    metas = all_gather_object([(k, tuple(v.shape), v.dtype) for k, v in mine.items()], group)
    out: dict[str, torch.Tensor] = {}
    for src, meta in enumerate(metas):
        for name, shape, dtype in meta:
            if src == group_rank(group):
                tensor = mine[name].detach().to(device).contiguous()
            else:
                tensor = torch.empty(shape, dtype=dtype, device=device)
            broadcast(tensor, src, group)
            out[name] = tensor
    return out
