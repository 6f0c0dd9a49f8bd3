"""Offload for optimizers that are not elementwise (memsave's Adafactor): whole shards, stepped in one call.

[Note: whole-shard offload] Adafactor's update of a row depends on statistics over every row and column of the
tensor (its factored second moments, the update's RMS), which it sums over the ranks holding the other rows in
collectives inside its step. A row piece cannot be stepped alone, and a step per chunk would issue a different
set of collectives on each rank. So each stepped tensor is one piece (its whole shard), the chunks pack whole
shards, and one step runs over every piece at once, as without offload: every offloaded chunk is read into a
buffer of its own first (and on CUDA every chunk's gradients are fetched, [Note: host step]), the optimizer steps
once, and each chunk is packed and written back. The state lives on its tier between steps; during the step it is
all in host memory, as it would be without offload (Adafactor's state is its small factored statistics, its
optional first moment and, under mixed precision, the fp32 masters). Its per-element entries (the first moment,
the masters, a vector's second moment) are what moves; the factored row and column statistics stay in memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from memsave.offload.chunks import ENTRY_ALIGN, MASTER, Chunk, Piece, per_element
from memsave.offload.host_step import HostStaging
from memsave.offload.tiers import Tier, aligned_empty, round_up
from memsave.offload.window import Run

__all__ = ["WholeStep"]


class WholeStep:
    """The one-call step of :class:`~memsave.offload.state.OffloadedState` for whole shards (a mixin)."""

    chunks: list[Chunk]
    tier: Tier
    hooks: Any
    device: torch.device
    _slots: int
    _staging: HostStaging | None

    if TYPE_CHECKING:
        def _attach(self, piece: Piece, buf: torch.Tensor | None, run: Run) -> bool: ...
        def _call(self, pieces: list[Piece], run: Run) -> None: ...
        def _cast(self, pieces: list[Piece]) -> None: ...
        def _pack(self, chunk: Chunk, states: list[dict[str, Any] | None], buf: torch.Tensor) -> None: ...
        @staticmethod
        def _detach(piece: Piece, run: Run) -> dict[str, Any]: ...
        def _before(self, piece: Piece) -> torch.Tensor: ...

    def _step_whole(self, run: Run) -> None:
        active = [c for c in self.chunks if any(id(p) in run.grads for p in c.pieces)]
        if self._staging is not None:
            self._staging.begin(active, run.grads, at_once=True)
        bufs: dict[int, torch.Tensor] = {}
        reads = []
        for c in active:
            if c.offloaded and c.slot >= 0:
                bufs[c.index] = aligned_empty(round_up(max(c.region_bytes, 1)), self.device)
                reads.append(self.tier.read_async(c.regions[c.slot], bufs[c.index]))
        try:
            for handle in reads:
                handle.wait()
        finally:
            self.tier.drain()
        stepped: list[Piece] = []
        for c in active:
            if self._staging is not None:
                self._staging.fetch(c)
            if self.hooks is not None:
                self.hooks.enter(c.group_file)
            stepped += [p for p in c.pieces if self._attach(p, bufs.get(c.index) if c.offloaded else None, run)]
        undo = {c.index: [(p, self._before(p).to("cpu", p.visible.dtype, copy=True),
                           {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in p.scalars.items()},
                           list(p.keys), list(p.entries)) for p in c.pieces]
                for c in active if c.offloaded and self.tier.kind == "disk"}
        try:
            self._call(stepped, run)
            self._cast(stepped)
        finally:
            states = {id(p): self._detach(p, run) for p in stepped}
            for p in stepped:
                if p.dev is not None:
                    p.sub.data = p.dev
        for p in stepped:
            if p.low is not None:
                states[id(p)] = {MASTER: p.sub.detach(), **states[id(p)]}
        error: BaseException | None = None
        for c in active:
            if not c.offloaded:
                for p in c.pieces:
                    if id(p) in states:
                        p.state = {k: v for k, v in states[id(p)].items() if k != MASTER}
                continue
            per = [states.get(id(p)) for p in c.pieces]
            need = sum(round_up(v.numel() * v.element_size(), ENTRY_ALIGN) for p, st in zip(c.pieces, per)
                       for v in (st or {}).values() if per_element(v, p))
            buf = bufs.get(c.index)
            if buf is None or buf.numel() < need:
                fresh = aligned_empty(round_up(max(need, 1)), self.device)
                if buf is not None:
                    fresh[: buf.numel()].copy_(buf)  # entries of pieces not stepped keep their bytes
                buf = fresh
            kept = (c.regions, c.region_bytes, c.slot)
            self._pack(c, per, buf)
            target = (c.slot + 1) % self._slots if c.slot >= 0 else 0
            try:
                self.tier.write_async(c.regions[target], buf).wait()
            except BaseException as exc:  # [Note: failed I/O]: this chunk goes back to before the step
                error = error or exc
                if self._staging is not None:
                    self._staging.synchronize()
                c.regions, c.region_bytes, c.slot = kept
                for p, rows, scalars, keys, entries in undo.get(c.index, ()):
                    p.visible.copy_(rows)
                    p.scalars, p.keys, p.entries = scalars, keys, entries
                continue
            c.slot = target
        self.tier.drain()
        if self._staging is not None:
            self._staging.end()
        if self.hooks is not None:
            self.hooks.finish()
        if error is not None:
            raise error
