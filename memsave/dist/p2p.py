"""Point-to-point sends and receives between pipeline stages: ordered plain ``isend`` / ``irecv``.

Never ``batch_isend_irecv``: it has no stable gloo implementation and can hang there (pytorch/PiPPy#1130, #989;
pytorch/pytorch#132644). Each message is one tensor with a *tag* that names it (micro-batch, direction, channel).
NCCL ignores tags and pairs sends and receives by their order alone, so the pipeline posts every message in one
order that both of its ends agree on ([Note: messages in one order] in memsave/pp/message_order.py), and
``MEMSAVE_PP_MATCH=order`` tags every message 0 on gloo, which then pairs by order too (the tests run so). A send
is not waited for until its buffer must be reused or the step ends (:meth:`P2P.drain`).

[Note: failure while waiting] A rank whose stage raises writes its error to the store (:func:`announce_failure`,
under a key of the current pipeline step: :func:`set_failure_scope`); a peer waiting for one of its messages
(its wait runs in a helper thread, since gloo completes a send or receive only inside ``wait()``) watches that
key and raises :class:`PeerFailed` with the error within ``MEMSAVE_PP_POLL_S`` (0.2 s), instead of waiting for
the backend's timeout (600 s or more) and ending in its generic message.

Counted in :data:`~memsave.dist.COMM_STATS` as ``pp_send`` / ``pp_recv`` (the bytes of each tensor once, on the
side that moves it), device-checked as the collectives are.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from memsave.dist.collectives import COMM_STATS, ProcessGroup, _check_device, _doing, _failed, _label, _nbytes

__all__ = ["P2P", "PeerFailed", "announce_failure", "arrive", "drop_published", "global_rank", "new_subgroups",
           "publish", "set_failure_scope", "wait_published"]


class PeerFailed(RuntimeError):
    """A peer of this pipeline raised; this rank stops with its error ([Note: failure while waiting])."""


_scope = ["0"]  # what a failure ends: one pipeline step (set by the runner on every rank alike)


def set_failure_scope(scope: str) -> None:
    """Failures announced from now on (and the ones waited for) belong to ``scope`` (the pipeline and its step):
    an error every rank raised alike (a refused step) does not end the next step's waits."""
    _scope[0] = scope


def _fail_key() -> str:
    return f"memsave/pp/failed/{_scope[0]}"


def announce_failure(message: str) -> None:
    """Tell every pipeline peer (through the store) that this rank failed, with ``message``; first one wins."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    try:
        store.compare_set(_fail_key(), "", f"rank {dist.get_rank()}: {message}")
    except RuntimeError:
        pass


def _peer_failure() -> str | None:
    store = dist.distributed_c10d._get_default_store()
    key = _fail_key()
    if store.check([key]):
        return store.get(key).decode()
    return None


class _Pending:
    """One posted send or receive, waited for by polling (so a peer's failure is seen: see the module note)."""

    __slots__ = ("kind", "peer", "tensor", "where", "work")

    def __init__(self, work: Any, tensor: torch.Tensor, kind: str, peer: int) -> None:
        self.work, self.tensor, self.kind, self.peer = work, tensor, kind, peer
        self.where = _doing[0]

    def wait(self, poll_s: float) -> torch.Tensor:
        if self.work is None:
            return self.tensor
        try:
            if poll_s > 0:
                self._wait_polling(poll_s)
            else:
                self.work.wait()
        except RuntimeError as exc:
            if isinstance(exc, PeerFailed):
                raise
            failed = _peer_failure() if dist.is_initialized() else None
            if failed is not None:
                raise PeerFailed(f"memsave: pipeline stopped: {failed}") from exc
            raise _failed(_label(f"{self.kind} with global rank {self.peer}", None, self.where), exc) from exc
        self.work = None
        return self.tensor

    def _wait_polling(self, poll_s: float) -> None:
        """Gloo's send/recv work completes only inside ``wait()`` (``is_completed()`` stays False until then, and a
        ``wait(timeout)`` that expires closes the connection), so a helper thread waits while this one watches the
        store for a failed peer."""
        done, error = _Waiter.get("wait").submit(self.work.wait)
        while not done.wait(poll_s):
            failed = _peer_failure()
            if failed is not None:
                _Waiter.abandon("wait")  # its thread stays blocked in this wait; later waits get a new one
                raise PeerFailed(f"memsave: pipeline stopped: {failed}")
        if error:
            raise error[0]


class _Waiter:
    """One long-lived helper thread that runs ``work.wait()`` for the waits handed to it, in order (a rank waits
    for one message at a time). Before, each wait started a thread of its own: in ``memsave bench --pp`` about a
    tenth of a pipeline step's CPU time at 4 m waits per rank and step (interleaved) against torch's."""

    _current: dict[str, _Waiter] = {}  # "wait": receives and sends waited for; "free": freed sends

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], threading.Event, list[BaseException]]] = (
            queue.SimpleQueue())
        threading.Thread(target=self._run, daemon=True, name=f"memsave-p2p-{name}").start()

    @classmethod
    def get(cls, name: str) -> _Waiter:
        waiter = cls._current.get(name)
        if waiter is None:
            waiter = cls._current[name] = cls(name)
        return waiter

    @classmethod
    def abandon(cls, name: str) -> None:
        cls._current.pop(name, None)

    def submit(self, fn: Callable[[], Any]) -> tuple[threading.Event, list[BaseException]]:
        """Run ``fn`` (a wait) in the helper thread; the event is set when it returned or raised (the error)."""
        done, error = threading.Event(), []  # type: tuple[threading.Event, list[BaseException]]
        self._queue.put((fn, done, error))
        return done, error

    def _run(self) -> None:
        while True:
            fn, done, error = self._queue.get()
            try:
                fn()
            except BaseException as exc:  # handed to the caller
                error.append(exc)
            done.set()


class P2P:
    """Tagged sends and receives with this rank's pipeline peers, addressed by *global* rank.

    ``send`` posts at once and keeps the work until :meth:`drain`; ``recv`` posts at once and returns a key whose
    :meth:`wait` gives the tensor. The device check and the byte counts are those of the collectives."""

    def __init__(self, device: torch.device, *, poll_s: float | None = None) -> None:
        self.device = device
        self.poll_s = float(os.environ.get("MEMSAVE_PP_POLL_S", "0.2")) if poll_s is None else poll_s
        match = os.environ.get("MEMSAVE_PP_MATCH", "tag")
        if match not in ("tag", "order"):
            raise ValueError(f"MEMSAVE_PP_MATCH={match!r}: expected 'tag' (gloo pairs a receive with its send by "
                             "tag) or 'order' (by order alone, as NCCL does)")
        # the backend pairs messages by order, not tag: NCCL ignores tags ([Note: messages in one order] in
        # memsave/pp/message_order.py); MEMSAVE_PP_MATCH=order makes gloo do the same (every tag 0)
        self.by_order = match == "order" or (dist.is_initialized() and dist.get_backend() != "gloo")
        self._sends: list[_Pending] = []
        self._freeing: list[tuple[threading.Event, list[BaseException]]] = []

    def send(self, tensor: torch.Tensor, peer: int, tag: int, *, free_after: bool = False,
             count_as: str = "pp_send") -> None:
        """Post the send of ``tensor``. ``free_after``: free its storage (``resize_(0)``) once the send completed,
        from a helper thread (the caller vouches that nothing reads the values again: [Note: freed sends] in
        memsave/pp/runtime.py). ``count_as``: its kind in :data:`COMM_STATS` (``"control"``: not the model's
        traffic)."""
        tensor = tensor.contiguous()
        _check_device("pp_send", None, tensor)
        COMM_STATS.add(count_as, _nbytes(tensor))
        pending = _Pending(dist.isend(tensor, dst=peer, tag=tag), tensor, "pp_send", peer)
        if not free_after:
            self._sends.append(pending)
            return
        # freed in order by one helper thread: the sends of a stage's outputs complete in the order its reader
        # takes them, which is the order they were posted in every schedule here
        def wait_then_free() -> None:
            pending.wait(0)
            tensor.untyped_storage().resize_(0)

        self._freeing.append(_Waiter.get("free").submit(wait_then_free))

    def recv(self, shape: Sequence[int], dtype: torch.dtype, peer: int, tag: int, *,
             count_as: str = "pp_recv") -> _Pending:
        tensor = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        _check_device("pp_recv", None, tensor)
        COMM_STATS.add(count_as, _nbytes(tensor))
        return _Pending(dist.irecv(tensor, src=peer, tag=tag), tensor, "pp_recv", peer)

    def wait(self, pending: _Pending) -> torch.Tensor:
        return pending.wait(self.poll_s)

    def drain(self) -> None:
        """Wait for every send posted so far (the end of a step: their buffers may then be freed)."""
        sends, self._sends = self._sends, []
        for s in sends:
            s.wait(self.poll_s)
        freeing, self._freeing = self._freeing, []
        for done, error in freeing:
            while not done.wait(self.poll_s or None):
                failed = _peer_failure()
                if failed is not None:
                    _Waiter.abandon("free")
                    raise PeerFailed(f"memsave: pipeline stopped: {failed}")
            if error:
                raise error[0]

    def reset(self) -> None:
        """Forget the sends of a step that failed (a peer may never receive them); later waits get new helper
        threads, not ones still blocked in those sends."""
        self._sends, self._freeing = [], []
        _Waiter.abandon("wait")
        _Waiter.abandon("free")

    @property
    def sends_in_flight(self) -> int:
        return len(self._sends) + len(self._freeing)


_arrivals: dict[str, int] = {}


def arrive(what: str, group: ProcessGroup | None, timeout_s: float = 600.0) -> None:
    """Wait, through the store, until every rank of ``group`` reached this call (before a collective): a peer
    that failed before it ([Note: failure while waiting]) ends this rank with its error instead of a hang."""
    if group is None or dist.get_world_size(group) <= 1:
        return
    ranks = dist.get_process_group_ranks(group)
    name = f"memsave/pp/arrive/{what}/{'-'.join(map(str, ranks))}"
    _arrivals[name] = _arrivals.get(name, 0) + 1
    key = f"{name}/{_arrivals[name]}"
    store = dist.distributed_c10d._get_default_store()
    store.add(key, 1)
    _poll(lambda: store.add(key, 0) >= len(ranks), timeout_s,
          f"memsave: {what}: not every pipeline rank of {ranks} arrived within {timeout_s:.0f} s")


def _poll(done: Callable[[], bool], timeout_s: float, late: str) -> None:
    """Wait until ``done()``; a peer that failed first ([Note: failure while waiting]) raises its error, and
    ``late`` is the ``TimeoutError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        failed = _peer_failure()
        if failed is not None:
            raise PeerFailed(f"memsave: pipeline stopped: {failed}")
        if time.monotonic() > deadline:
            raise TimeoutError(late)
        time.sleep(0.005)


def publish(key: str, value: bytes) -> None:
    """Write ``value`` under ``key`` in the store, for :func:`wait_published` on other ranks (the pipeline probe's
    output structures: [Note: structures the meta device cannot find] in memsave/pp/probe.py)."""
    dist.distributed_c10d._get_default_store().set(key, value)  # type: ignore[arg-type]  # (bytes too)


def wait_published(key: str, what: str, timeout_s: float = 600.0) -> bytes:
    """The value another rank :func:`publish`-ed under ``key``, once it is there; a peer that failed first
    ([Note: failure while waiting]) ends this rank with its error instead of a wait for ``timeout_s``."""
    store = dist.distributed_c10d._get_default_store()
    _poll(lambda: store.check([key]), timeout_s, f"memsave: {what}: not published within {timeout_s:.0f} s")
    return store.get(key)


def drop_published(keys: Sequence[str]) -> None:
    """Delete the keys this rank :func:`publish`-ed, once every reader has read them."""
    store = dist.distributed_c10d._get_default_store()
    for key in keys:
        store.delete_key(key)


def global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    """The global rank of the member ``group_rank`` of ``group``."""
    if group is None or not dist.is_initialized():
        return group_rank
    return dist.get_global_rank(group, group_rank)


def new_subgroups(mesh: Any, axis: str, member_sets: Sequence[Sequence[int]],
                  owner: object | None = None) -> list[ProcessGroup | None]:
    """For each set of ``axis`` coordinates, the group of those ranks in this rank's slice (ranks that agree on
    every other axis); None where this rank is not a member or the set has one rank. Collective over the world.
    ``owner``: as for :meth:`~memsave.dist.mesh.Mesh.new_group`."""
    from memsave.dist import groups
    from memsave.dist.mesh import AXES

    ranks = mesh.device_mesh.mesh
    dim = AXES.index(axis)
    slices = ranks.movedim(dim, -1).reshape(-1, ranks.size(dim)).tolist()
    out: list[ProcessGroup | None] = []
    for coords in member_sets:
        members = [[row[c] for c in sorted(set(coords))] for row in slices]
        out.append(groups.create(members, owner) if len(members[0]) > 1 else None)
    return out
