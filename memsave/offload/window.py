"""A chunk's state in a window buffer (memsave/offload/state.py): the buffers themselves, the layout of a chunk's
state in one (:meth:`Window._pack`), and the chunk's pieces lent to the step's shadow optimizer for one raw step
and taken back (:meth:`Window._attach`, :meth:`Window._call`, :meth:`Window._detach`).
:class:`Run` is what one step hands them: the shadow optimizer and each piece's gradient rows."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from memsave.offload.chunks import ENTRY_ALIGN, MASTER, Chunk, Piece, per_element, view
from memsave.offload.tiers import Handle, Tier, aligned_empty, round_up

__all__ = ["Run", "Window"]


@dataclasses.dataclass
class Run:
    """One step: the hyperparameters as of ``step()`` (a shadow of the optimizer, see
    :func:`~memsave.offload.stepping.shadow`), each piece's gradient rows, and in the background which files are
    done ([Note: overlapped step] in state.py)."""

    opt: torch.optim.Optimizer
    grads: dict[int, torch.Tensor]
    done: dict[str, threading.Event] = dataclasses.field(default_factory=dict)
    writes_of: dict[str, list[Handle]] = dataclasses.field(default_factory=dict)  # file -> its chunks' writes
    future: Future[None] | None = None
    error: BaseException | None = None  # set before the events, so a woken waiter sees it
    waited: float = 0.0  # seconds this step's loop waited for reads and writes


class Window:
    """The window-buffer side of :class:`~memsave.offload.state.OffloadedState` (a mixin: it uses the state's
    optimizer, tier and chunks)."""

    optimizer: torch.optim.Optimizer
    tier: Tier
    chunks: list[Chunk]
    prefetch: int
    device: torch.device
    window_bytes: int
    _slots: int
    _raw: Callable[[torch.optim.Optimizer], Any]
    _buffers: list[torch.Tensor]
    _snapshots: list[torch.Tensor]

    def _call(self, pieces: list[Piece], run: Run) -> None:
        """One raw optimizer step over ``pieces`` (their state already in the run's shadow optimizer)."""
        groups = run.opt.param_groups
        try:
            for p in pieces:
                groups[p.group]["params"].append(p.sub)
            self._raw(run.opt)
        finally:
            for g in groups:
                g["params"] = []

    def _attach(self, piece: Piece, buf: torch.Tensor | None, run: Run) -> bool:
        """Point the piece at its gradient rows and its state (from ``buf`` when offloaded); False: no grad."""
        grad = run.grads.pop(id(piece), None)  # dropped as the step goes (mixed precision: fp32 copies)
        if grad is None:
            return False
        if grad.dtype != piece.sub.dtype:  # the model's low-precision rows: the same values as a whole .float()
            grad = grad.to(piece.sub.dtype)
        if buf is None:
            state = piece.state
        elif piece.keys:
            views = {k: view(buf, piece, dtype, off) for k, dtype, off in piece.entries}
            if piece.low is not None:
                piece.sub.data = views[MASTER]  # [Note: offloaded masters] in state.py
            state = {k: views[k] if k in views else piece.scalars[k] for k in piece.keys if k != MASTER}
        else:
            state = None
        piece.sub.grad = grad
        if state:
            run.opt.state[piece.sub] = state
        return True

    @staticmethod
    def _detach(piece: Piece, run: Run) -> dict[str, Any]:
        piece.sub.grad = None
        return run.opt.state.pop(piece.sub, {})

    def _pack(self, chunk: Chunk, states: list[dict[str, Any] | None], buf: torch.Tensor) -> None:
        """Record each piece's state layout and put its per-element entries into ``buf`` (regions allocated on
        first use, or again if the layout grew). ``None``: the piece was not stepped, keep what ``buf`` holds."""
        full: list[dict[str, Any]] = []
        for piece, state in zip(chunk.pieces, states):
            if state is None and piece.keys:
                views = {k: view(buf, piece, dt, off) for k, dt, off in piece.entries}
                state = {k: views[k] if k in views else piece.scalars[k] for k in piece.keys}
            full.append(state or {})
        layout: list[tuple[list[str], list[tuple[str, torch.dtype, int]], dict[str, Any]]] = []
        offset = 0
        for piece, state in zip(chunk.pieces, full):
            entries, scalars = [], {}
            for key, value in state.items():
                if per_element(value, piece):
                    entries.append((key, value.dtype, offset))
                    offset += round_up(value.numel() * value.element_size(), ENTRY_ALIGN)
                else:
                    scalars[key] = value
            layout.append((list(state), entries, scalars))
        if offset > buf.numel():
            raise NotImplementedError(
                f"{type(self.optimizer).__name__} keeps {offset} bytes of per-element state for offload chunk "
                f"{chunk.index}, more than the {buf.numel()} its probe step predicted; offload supports optimizers "
                "whose per-element state is fixed after their first step (SGD, Adam, AdamW, ...)")
        if all(entries == piece.entries for piece, (_, entries, _) in zip(chunk.pieces, layout)):
            sources = full  # the usual case: the optimizer updated the buffer's views in place
        else:  # a new layout: copy out first, the old entries may overlap the new ones
            sources = [{k: v.clone() for k, v in s.items() if per_element(v, p)}
                       for p, s in zip(chunk.pieces, full)]
        for piece, (keys, entries, scalars), source in zip(chunk.pieces, layout, sources):
            for key, dtype, off in entries:
                target = view(buf, piece, dtype, off)
                if source[key].data_ptr() != target.data_ptr():
                    target.copy_(source[key])
            piece.keys, piece.entries, piece.scalars = keys, entries, scalars
        if offset > chunk.region_bytes or not chunk.regions:
            chunk.regions = [self.tier.allocate(chunk.group_file, max(offset, 1)) for _ in range(self._slots)]
            chunk.region_bytes = offset
            chunk.slot = -1

    def _ensure_buffers(self) -> None:
        """The window buffers ([Note: chunk pipeline] in state.py) and, on disk, as many snapshot buffers for the
        parameters a failed write puts back ([Note: failed I/O] in state.py); made at the first step."""
        if not self._buffers and self.window_bytes:
            n = self.prefetch + 2 if self.prefetch else 1
            self._buffers = [aligned_empty(self.window_bytes, self.device) for _ in range(n)]
            if self.tier.kind == "disk":
                most = max(sum(p.numel * p.visible.element_size() for p in c.pieces)
                           for c in self.chunks if c.offloaded)
                self._snapshots = [torch.empty(most, dtype=torch.uint8) for _ in range(n)]
