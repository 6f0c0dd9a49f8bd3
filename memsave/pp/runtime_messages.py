"""The stage runner's messages ([Note: the stage runner] in memsave/pp/runtime.py): each tensor a stage sends on
(or a gradient it sends back) is one tagged point-to-point message, or a hand-over in memory between two stages
of one rank."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from memsave.dist.p2p import P2P
from memsave.pp.message_order import MessageName, Op, message_order
from memsave.pp.probe import CallKey, Layout
from memsave.pp.schedule import Schedule

__all__ = ["Messages", "is_grad_dtype", "values_needed"]


def is_grad_dtype(t: torch.Tensor) -> bool:
    """Whether a tensor of ``t``'s dtype can carry a gradient (what a received tensor's gradient is sent back for)."""
    return t.is_floating_point() or t.is_complex()


@functools.cache
def _saved_names(node_type: type) -> tuple[str, ...]:
    """The ``_saved_*`` attributes of an autograd node type (``dir()`` per send was a tenth of a small stage's
    forward)."""
    return tuple(n for n in dir(node_type) if n.startswith("_saved_"))


_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _storage_refs(t: torch.Tensor) -> int:
    assert _use_count is not None
    return int(_use_count(t.untyped_storage()._cdata))


_ALONE = _storage_refs(torch.empty(1)) if _use_count is not None else 0  # the tensor and the storage asked for


def values_needed(t: torch.Tensor) -> bool:
    """Whether ``t``'s values may be read after its forward ([Note: freed sends]): it is a leaf or a view, or not
    contiguous, or its ``grad_fn`` is a custom ``autograd.Function`` (whose ``ctx`` may keep it in any attribute),
    or anything else references its storage: an autograd node that saved it (an op saving its result: tanh,
    sigmoid, ...), a selective recomputation's cache, a view.

    [Note: needed without unpacking] Autograd's saved tensors are not read: under a checkpoint's saved-tensor hooks
    reading one (``node._saved_self``) runs the unit's recomputation, at forward time, and keeps what it rebuilt
    until the backward (a whole unit's activations per micro-batch in flight). The count of references to the
    storage (torch's ``_storage_Use_Count``; every tensor or saved alias of it is one) answers without that."""
    node = t.grad_fn
    if node is None or t._base is not None or not t.is_contiguous():
        return True
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        return True
    if _use_count is not None:
        return _storage_refs(t) > _ALONE
    ptr = t.untyped_storage().data_ptr()  # a torch without the count: unpack (may recompute, see the note)
    return any(isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() == ptr
               for v in (getattr(node, n, None) for n in _saved_names(type(node))))


AUTOCAST_HINT = ("under torch.autocast: the probe runs the stages other ranks hold on the meta device, where "
                 "autocast does not cast, so stages made other dtypes than it found; train in the half dtype with "
                 "[precision] compute = \"bf16\" (or \"fp16\") instead of autocast around pipeline_step")


class Messages:
    """The sends and receives of :class:`~memsave.pp.runtime.StageRunner` (a base class of it)."""

    layout: Layout | None
    n_stages: int
    pp_rank: int
    pp_size: int
    p2p: P2P
    freed_bytes: int
    _mailbox: dict[tuple[Any, ...], list[torch.Tensor]]
    _posted: dict[tuple[Any, ...], list[Any]]  # receives posted ahead, by message ([Note: receives posted ahead])
    _waited: float
    _held: dict[tuple[int, int], Any]  # (stage, mb) -> what its forward keeps (memsave.pp.runtime._Held)
    _orders: dict[Any, tuple[list[Op], dict[MessageName, int]]]  # message orders, per schedule and layout
    _ops: list[Op]  # this step's messages in the order this rank posts them ([Note: messages in one order])
    _position: dict[MessageName, int]
    _cursor: int  # how many of ``_ops`` are posted
    _ready: dict[MessageName, tuple[list[torch.Tensor], frozenset[int]]]  # computed sends not yet posted
    _early: set[MessageName]  # receives posted ahead of the order (gloo only: :meth:`_post_ahead_of`)
    _loss_m: int | None  # the step's micro-batches while the loss's receive is not posted
    _loss_recv: Any
    last_losses: list[torch.Tensor]
    peer: Callable[[int], int]  # the global rank of a pp rank of this rank's slice
    device: torch.device

    @staticmethod
    def _split_by_key(held: Any, flat: list[torch.Tensor | None]) -> dict[CallKey, list[Any]]:
        """``flat`` (the gradients of a forward's received tensors that require grad) by the message they came in."""
        out: dict[CallKey, list[Any]] = {}
        i = 0
        for key, tensors in held.received.items():
            n = sum(1 for t in tensors if t.requires_grad)
            out[key] = flat[i: i + n]
            i += n
        return out

    def _tag(self, mb: int, key: CallKey, dst_stage: int, leaf: int, backward: bool) -> int:
        assert self.layout is not None and leaf < 64
        if self.p2p.by_order:  # [Note: messages in one order]
            return 0
        c = self.layout.index(key)
        return ((((mb * len(self.layout.order) + c) * self.n_stages + dst_stage) * 64 + leaf) * 2 + int(backward))

    def _rank_of(self, stage: int) -> int:
        return stage % self.pp_size

    # -- posting in one order ([Note: messages in one order] in message_order.py) ---------------------------
    def _begin(self, schedule: Schedule, *, forward_only: bool) -> None:
        """Start a step of ``schedule``: this rank's messages, in the order it posts them."""
        assert self.layout is not None
        cache_key = (schedule, id(self.layout), forward_only)
        order = self._orders.get(cache_key)
        if order is None:
            order = self._orders[cache_key] = message_order(schedule, self.layout, self.pp_rank,
                                                            forward_only=forward_only)
        self._ops, self._position = order
        self._cursor, self._ready, self._early, self._loss_m = 0, {}, set(), schedule.micro_batches
        self._loss_recv = None
        self._advance(-1, must=False)  # no messages at all: the loss's receive now

    def _advance(self, upto: int, *, must: bool) -> None:
        """Post this rank's messages in order through position ``upto``: receives at once, a send once its action
        computed it (:meth:`_send`). ``must``: the caller waits for position ``upto``, so a send not yet computed
        before it is a broken order (an error, not a hang)."""
        while self._cursor <= upto:
            is_send, name, peer = self._ops[self._cursor]
            if is_send:
                if name not in self._ready:
                    if must:
                        raise AssertionError(f"pipeline runtime: a message waits behind {name}, which this rank "
                                             "has not computed yet (the message order is broken)")
                    return
                tensors, free = self._ready.pop(name)
                mb, key, dst_stage, backward = name
                for j, t in enumerate(tensors):
                    self.p2p.send(t, self.peer(peer), self._tag(mb, key, dst_stage, j, backward),
                                  free_after=j in free)
            elif name in self._early:
                self._early.discard(name)
            else:
                self._posted[name] = self._post_recv(name)
            self._cursor += 1
        if self._cursor == len(self._ops) and self._loss_m is not None:  # [Note: the loss by message]
            self._loss_recv, self._loss_m = self._post_loss(self._loss_m), None

    def _post_ahead_of(self, names: list[MessageName]) -> None:
        """[Note: receives posted ahead] Gloo moves a message's bytes only once its receive is posted (the
        receiver tells the sender it is ready), so a receive posted when its action starts waits for the whole
        transfer even when the sender finished long before. The runner posts the receives of its next action
        before it runs the current one, so the transfer overlaps that compute; the action then finds them in
        ``_posted``. Where the backend pairs by order, as far as the order allows ([Note: messages in one order]);
        where it pairs by tag (gloo), at once, out of the order: a receive behind this rank's own send of the
        action now running would start its transfer only after that action."""
        mine = [n for n in names if n in self._position]
        if self.p2p.by_order:
            self._advance(max((self._position[n] for n in mine), default=-1), must=False)
            return
        assert self.layout is not None
        for name in mine:
            mb, key, _dst, backward = name
            if backward and (self.layout.stage_of[key], mb) not in self._held:
                continue  # its forward runs first: the gradients' shapes are those of what it sends
            if self._position[name] >= self._cursor and name not in self._early:
                self._posted[name] = self._post_recv(name)
                self._early.add(name)

    def _forget_step(self) -> None:
        """After a failed step: drop its messages (a peer may never receive the sends)."""
        self._mailbox.clear()
        self._posted.clear()
        self._ready.clear()
        self._early.clear()
        self.p2p.reset()

    def _send(self, tensors: list[torch.Tensor], src_stage: int, dst_stage: int, mb: int, key: CallKey,
              backward: bool, free: frozenset[int] = frozenset()) -> None:
        dst = self._rank_of(dst_stage if not backward else src_stage)
        if dst == self.pp_rank:
            self._mailbox[(mb, key, dst_stage, backward)] = [t.detach() for t in tensors]
            return
        if not backward:
            self._check_probed(tensors, src_stage, mb, key)
        name = (mb, key, dst_stage, backward)
        self._ready[name] = ([t.detach() for t in tensors], free)
        self._advance(self._position[name], must=True)

    def _check_probed(self, tensors: list[torch.Tensor], stage: int, mb: int, key: CallKey) -> None:
        """The receiver allocates what the probe found for ``key``; a tensor of another shape or dtype would land
        in it unchecked (gloo takes a smaller message into the buffer: garbage values; a larger one aborts the
        process), so it is refused here, naming it."""
        assert self.layout is not None
        want = self.layout.structure[key].tensor_meta()
        got = [(tuple(t.shape), t.dtype) for t in tensors]
        if got != want:
            hint = (f" ({AUTOCAST_HINT})" if torch.is_autocast_enabled(self.device.type)
                    else " What crosses stages keeps the shapes and dtypes the first step of these inputs found")
            raise RuntimeError(f"pipeline: stage {stage} sends {key[0]}'s output (micro-batch {mb}) as {got}, but the "
                               f"probe found {want}, which the receiving stage allocates.{hint}")

    def _freeable(self, stage: int, key: CallKey, tensors: list[torch.Tensor]) -> frozenset[int]:
        """[Note: freed sends] (Megatron's ``deallocate_output_tensor``) The outputs of a stage's last atom call,
        sent to one stage on another rank, are needed afterwards only as the roots of this stage's backward, which
        reads their shape and ``grad_fn``, not their values, unless autograd saved them (an op that saves its
        result: tanh, sigmoid, ...; :func:`values_needed`) or they view other storage. Such outputs are freed once
        sent: one activation per micro-batch in flight less on every stage but the last."""
        layout = self.layout
        assert layout is not None
        readers = layout.readers[key]
        if key != layout.last_call[stage] or len(readers) != 1 or self._rank_of(readers[0]) == self.pp_rank:
            return frozenset()
        out = set()
        for j, t in enumerate(tensors):
            if values_needed(t):
                continue
            out.add(j)
            self.freed_bytes += t.numel() * t.element_size()
        return frozenset(out)

    def _post_recv(self, name: MessageName) -> list[Any]:
        """Post the receives of one message (:meth:`_recv` finds them in ``_posted``)."""
        layout = self.layout
        assert layout is not None
        mb, key, dst_stage, backward = name
        if not backward:
            meta = layout.structure[key].tensor_meta()
            src = self._rank_of(layout.stage_of[key])
        else:  # the gradients of what this rank's forward of (stage, mb) sent: their shapes are known since
            meta = [(tuple(t.shape), t.dtype) for t in self._held[(layout.stage_of[key], mb)].produced[key]
                    if is_grad_dtype(t)]
            src = self._rank_of(dst_stage)
        return [self.p2p.recv(shape, dtype, self.peer(src), self._tag(mb, key, dst_stage, j, backward))
                for j, (shape, dtype) in enumerate(meta)]

    def _recv(self, src_stage: int, dst_stage: int, mb: int, key: CallKey, backward: bool) -> list[torch.Tensor]:
        src = self._rank_of(src_stage if not backward else dst_stage)
        name = (mb, key, dst_stage, backward)
        if src == self.pp_rank:
            return self._mailbox.pop(name)
        if name not in self._posted:
            self._advance(self._position[name], must=True)
        pending = self._posted.pop(name)
        t = time.perf_counter()
        out = [self.p2p.wait(p) for p in pending]
        self._waited += time.perf_counter() - t
        return out

    # -- the step's loss ([Note: the loss by message]) -------------------------------------------------------
    def _loss_tag(self, m: int) -> int:
        """The loss's tag: a message of micro-batch ``m``, which a step of ``m`` micro-batches never sends."""
        assert self.layout is not None
        return 0 if self.p2p.by_order else m * len(self.layout.order) * self.n_stages * 64 * 2

    def _post_loss(self, m: int) -> Any:
        """[Note: the loss by message] Every rank returns the step's loss, which only the last stage's rank
        computes. It sends it to each other pp rank as one tagged message after its last action; the others post
        its receive once they posted every other message of the step (:meth:`_advance`; at the latest before
        their last action runs), so it arrives while that action computes. It was a broadcast
        at the step's end: a collective, where the last stage waited for the first one's last backward, and whose
        latency every rank paid. The loss is the last message between each pair of ranks on both sides (sent
        after every other, its receive posted after every other), so it pairs with its receive whether the
        backend matches messages by tag (gloo) or by order. None: this rank holds the last stage."""
        src = self._rank_of(self.n_stages - 1)
        if src == self.pp_rank:
            return None
        return self.p2p.recv((1,), torch.float32, self.peer(src), self._loss_tag(m), count_as="control")

    def _send_loss(self, m: int) -> torch.Tensor | None:
        """On the last stage's rank: the sum of the step's ``m`` losses (each already divided by ``m``), sent to
        every other pp rank; None elsewhere."""
        if self._rank_of(self.n_stages - 1) != self.pp_rank:
            return None
        self._advance(len(self._ops) - 1, must=True)
        assert len(self.last_losses) == m, "pipeline runtime: the last stage ran another number of forwards"
        total = torch.stack(self.last_losses).sum().reshape(1)
        for r in range(self.pp_size):
            if r != self.pp_rank:
                self.p2p.send(total, self.peer(r), self._loss_tag(m), count_as="control")
        return total

    def _drain(self, total: torch.Tensor | None) -> torch.Tensor:
        """The step's end: wait for this rank's sends, then the loss or, on the last stage's rank, the ``total`` it
        sent."""
        self._advance(len(self._ops) - 1, must=True)
        self.p2p.drain()
        out = total if self._loss_recv is None else self.p2p.wait(self._loss_recv)
        assert out is not None
        return out
