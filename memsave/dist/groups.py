"""Process groups an engine owns, destroyed once its owner is gone on every rank.

[Note: group lifetime] Each wrap makes process groups of its own (ZeRO's reduce-scatter group, the agreement's,
the tp forward check's, a pipeline's replica and tie groups): a group per purpose keeps one engine's collectives
out of another's ordered stream. Kept forever, they leaked: 4-8 file descriptors per wrap on one rank and 13-18
on two (gloo's sockets; under NCCL a communicator's device buffers), so a sweep of about 60 wraps in one process
reached a 1024-descriptor limit.

A group cannot simply be destroyed when its engine is garbage-collected: collection happens at a different point
on each rank, and NCCL's teardown must be at the same point on all. So collection only *marks* the group on this
rank (:func:`create`'s ``owner``, through ``weakref.finalize``), and :func:`release_dead`, called where every rank
is at the same point of the program (the start of the next ``wrap`` / ``parallelize``, which makes new groups
there anyway), agrees over the world which groups are marked on *every* rank (one all-reduce of a flag per live
group, MIN) and destroys those, alike everywhere. Groups are numbered in creation order, which is the same on
every rank since creating one is collective. A group whose owner lives on some rank stays until it is gone there
too. An engine in a reference cycle is marked at the garbage collector's next full pass (``release_dead`` does
not force one: ``gc.collect()`` cost a tenth of a second a wrap with transformers loaded).
"""

from __future__ import annotations

import datetime
import itertools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["create", "forget", "live_count", "release_dead"]

_serial = itertools.count()
_live: dict[int, Any] = {}  # creation number -> this rank's group (None: not a member) of a group with an owner
_dead: set[int] = set()  # creation numbers whose owner this rank has collected


def create(slices: Sequence[Sequence[int]], owner: object | None,
           timeout: datetime.timedelta | None = None) -> Any:
    """A group per member list of ``slices`` (collective over the world: every rank creates every slice's group,
    as ``new_group`` requires); returns this rank's (None where it is in none). With ``owner``, this rank's group
    is destroyed by a :func:`release_dead` after ``owner`` is gone on every rank ([Note: group lifetime])."""
    mine = None
    me = dist.get_rank()
    for members in slices:
        group = dist.new_group(list(members), timeout=timeout) if timeout is not None else \
            dist.new_group(list(members))
        if me in members:
            mine = group
    if owner is not None:
        serial = next(_serial)
        _live[serial] = mine
        weakref.finalize(owner, _dead.add, serial)
    return mine


def release_dead(device: torch.device) -> int:
    """Destroy the owned groups whose owner is gone on every rank; returns how many went. Collective over the
    world: call it at a point every rank reaches alike ([Note: group lifetime])."""
    if not _live:
        return 0
    if not dist.is_initialized():
        _live.clear()
        _dead.clear()
        return 0
    serials = sorted(_live)
    if dist.get_world_size() > 1:
        from memsave.dist.collectives import all_reduce  # (collectives imports nothing from here)

        flags = torch.tensor([s in _dead for s in serials], dtype=torch.int32, device=device)
        all_reduce(flags, None, op=dist.ReduceOp.MIN, count_as="control")
        gone = [s for s, flag in zip(serials, flags.tolist()) if flag]
    else:
        gone = [s for s in serials if s in _dead]
    known = dist.distributed_c10d._world.pg_map
    for s in gone:
        group = _live.pop(s)
        _dead.discard(s)
        if group is not None and group in known:
            dist.destroy_process_group(group)
    return len(gone)


def live_count() -> int:
    """How many owned groups this rank still holds (for tests)."""
    return len(_live)


def forget() -> None:
    """The default group went (``shutdown``): every group went with it."""
    _live.clear()
    _dead.clear()
