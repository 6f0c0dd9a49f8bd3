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
from memsave.pp.probe import CallKey, Layout

__all__ = ["Messages", "values_needed"]


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
    last_losses: list[torch.Tensor]
    peer: Callable[[int], int]  # the global rank of a pp rank of this rank's slice

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
        c = self.layout.index(key)
        return ((((mb * len(self.layout.order) + c) * self.n_stages + dst_stage) * 64 + leaf) * 2 + int(backward))

    def _rank_of(self, stage: int) -> int:
        return stage % self.pp_size

    def _send(self, tensors: list[torch.Tensor], src_stage: int, dst_stage: int, mb: int, key: CallKey,
              backward: bool, free: frozenset[int] = frozenset()) -> None:
        dst = self._rank_of(dst_stage if not backward else src_stage)
        if dst == self.pp_rank:
            self._mailbox[(mb, key, dst_stage, backward)] = [t.detach() for t in tensors]
            return
        for j, t in enumerate(tensors):
            self.p2p.send(t.detach(), self.peer(dst), self._tag(mb, key, dst_stage, j, backward),
                          free_after=j in free)

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

    def _post(self, meta: list[tuple[tuple[int, ...], torch.dtype]], src_stage: int, dst_stage: int, mb: int,
              key: CallKey, backward: bool) -> list[Any] | None:
        """Post the receives of one message (None: it comes from this rank, through the mailbox).

        [Note: receives posted ahead] Gloo moves a message's bytes only once its receive is posted (the receiver
        tells the sender it is ready), so a receive posted when its action starts waits for the whole transfer
        even when the sender finished long before. The runner posts the receives of its next action before it
        runs the current one (:meth:`StageRunner._post_ahead`), so the transfer overlaps that compute; the
        action then finds them here."""
        src = self._rank_of(src_stage if not backward else dst_stage)
        if src == self.pp_rank:
            return None
        name = (mb, key, dst_stage, backward)
        pending = self._posted.pop(name, None)
        if pending is None:
            pending = [self.p2p.recv(shape, dtype, self.peer(src), self._tag(mb, key, dst_stage, j, backward))
                       for j, (shape, dtype) in enumerate(meta)]
        return pending

    def _recv(self, meta: list[tuple[tuple[int, ...], torch.dtype]], src_stage: int, dst_stage: int, mb: int,
              key: CallKey, backward: bool) -> list[torch.Tensor]:
        pending = self._post(meta, src_stage, dst_stage, mb, key, backward)
        if pending is None:
            return self._mailbox.pop((mb, key, dst_stage, backward))
        t = time.perf_counter()
        out = [self.p2p.wait(p) for p in pending]
        self._waited += time.perf_counter() - t
        return out

    # -- the step's loss ([Note: the loss by message]) -------------------------------------------------------
    def _loss_tag(self, m: int) -> int:
        """The loss's tag: a message of micro-batch ``m``, which a step of ``m`` micro-batches never sends."""
        assert self.layout is not None
        return m * len(self.layout.order) * self.n_stages * 64 * 2

    def _post_loss(self, m: int) -> Any:
        """[Note: the loss by message] Every rank returns the step's loss, which only the last stage's rank
        computes. It sends it to each other pp rank as one tagged message after its last action; the others post
        its receive before their last action runs, so it arrives while that action computes. It was a broadcast
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
        assert len(self.last_losses) == m, "pipeline runtime: the last stage ran another number of forwards"
        total = torch.stack(self.last_losses).sum().reshape(1)
        for r in range(self.pp_size):
            if r != self.pp_rank:
                self.p2p.send(total, self.peer(r), self._loss_tag(m), count_as="control")
        return total

    def _drain(self, pending: Any, total: torch.Tensor | None) -> torch.Tensor:
        """The step's end: wait for this rank's sends, then the loss (``pending``) or, on the last stage's rank,
        the ``total`` it sent."""
        self.p2p.drain()
        out = total if pending is None else self.p2p.wait(pending)
        assert out is not None
        return out
