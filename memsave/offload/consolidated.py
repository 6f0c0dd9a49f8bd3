"""The consolidated view of offloaded optimizer state (memsave/offload/state.py): each stepped tensor's state
(and, in master mode, its fp32 master) whole, as the plain optimizer would hold it, read back from the tier for a
state dict, and written out again on load."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from memsave.offload.chunks import MASTER, Chunk, Piece, per_element, rows_of, view
from memsave.offload.tiers import Tier, aligned_empty, round_up

__all__ = ["Consolidated"]


class Consolidated:
    """What :class:`~memsave.offload.state.OffloadedState` offers for checkpoints (a mixin: it uses the state's
    chunks, tier and packing)."""

    chunks: list[Chunk]
    pieces_of: dict[torch.Tensor, list[Piece]]
    masters: dict[torch.Tensor, torch.Tensor]
    tier: Tier
    device: torch.device
    window_bytes: int
    hooks: Any
    _slots: int
    _staging: Any

    if TYPE_CHECKING:
        def settle(self) -> None: ...

        def _pack(self, chunk: Chunk, states: list[dict[str, Any] | None], buf: torch.Tensor) -> None: ...

    def _read_sync(self, chunk: Chunk) -> torch.Tensor:
        buf = aligned_empty(round_up(max(chunk.region_bytes, 1)), self.device)
        self.tier.read_async(chunk.regions[chunk.slot], buf).wait()
        self.tier.drain()
        return buf

    def stream_layout(self) -> tuple[dict[torch.Tensor, dict[str, torch.dtype]], dict[torch.Tensor, dict[str, Any]]]:
        """Without reading the tier: each stepped tensor's per-element state keys (``MASTER`` for its master rows)
        with their dtypes, and its other entries (``step``): what :meth:`read_whole` then reads one at a time."""
        self.settle()
        keys: dict[torch.Tensor, dict[str, torch.dtype]] = {}
        scalars: dict[torch.Tensor, dict[str, Any]] = {}
        for shard, pieces in self.pieces_of.items():
            p = pieces[0]
            if p.state is not None:  # an in-memory chunk
                found = {k: v.dtype for k, v in p.state.items() if per_element(v, p)}
                other = {k: v for k, v in p.state.items() if not per_element(v, p)}
            else:
                found = {k: dt for k, dt, _off in p.entries}
                other = dict(p.scalars)
            if shard in self.masters:
                found = {MASTER: torch.float32, **found}
            keys[shard], scalars[shard] = found, other
        return keys, scalars

    def read_whole(self, shard: torch.Tensor, key: str, cache: dict[str, Any]) -> torch.Tensor:
        """``shard``'s whole entry ``key`` (``MASTER``: its fp32 master rows), read piece by piece from the tier;
        ``cache`` keeps the last chunk read (so the pieces of one chunk cost one read)."""
        if "of" not in cache:
            cache["of"] = {id(p): c for c in self.chunks for p in c.pieces}
        pieces = self.pieces_of[shard]
        out: torch.Tensor | None = None
        for p in pieces:
            chunk = cache["of"][id(p)]
            if not chunk.offloaded:
                assert key == MASTER or p.state is not None, f"{key}: an in-memory piece without state"
                rows = p.sub.detach() if key == MASTER else p.state[key]  # type: ignore[index]
            else:
                if cache.get("chunk") is not chunk:
                    need = round_up(max(chunk.region_bytes, 1))
                    if cache.get("buf") is None or cache["buf"].numel() < need:  # one buffer, chunk after chunk
                        cache["buf"] = aligned_empty(need, self.device)
                    self.tier.read_async(chunk.regions[chunk.slot], cache["buf"][:need]).wait()
                    self.tier.drain()
                    cache["chunk"] = chunk
                rows = view(cache["buf"], p, *{k: (dt, off) for k, dt, off in p.entries}[key])
            if out is None:
                out = torch.empty((shard.shape[0], *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
            out[p.start : p.stop].copy_(rows)  # copied out before the buffer takes the next chunk
        assert out is not None
        return out

    def local_state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Every stepped tensor's state as the plain optimizer would hold it (per-element entries whole)."""
        return self.local()[0]

    def _placed(self, state: dict[str, Any] | None) -> dict[str, Any] | None:
        """A chunk kept in memory holds its state where it steps: on the host for the host step ([Note: host
        step] in host_step.py), whatever device a loaded state dict put it on."""
        if state is None or self._staging is None:
            return state
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in state.items()}

    def local_masters(self) -> dict[torch.Tensor, torch.Tensor]:
        """Master mode: each master's fp32 rows, whole (read back from the tier)."""
        return self.local()[1]

    def local(self) -> tuple[dict[torch.Tensor, dict[str, Any]], dict[torch.Tensor, torch.Tensor]]:
        """Both, in one read of the tier: ``(local_state(), local_masters())``."""
        self.settle()
        parts: dict[int, dict[str, Any]] = {}
        rows: dict[int, torch.Tensor] = {}
        for chunk in self.chunks:
            buf = self._read_sync(chunk) if chunk.offloaded and chunk.slot >= 0 else None
            for p in chunk.pieces:
                if chunk.offloaded:
                    if not p.keys or buf is None:
                        continue
                    st = {k: view(buf, p, dt, off).clone() for k, dt, off in p.entries} | p.scalars
                    if MASTER in st:
                        rows[id(p)] = st[MASTER]
                    if any(k != MASTER for k in p.keys):
                        parts[id(p)] = {k: st[k] for k in p.keys if k != MASTER}
                else:
                    if p.low is not None:
                        rows[id(p)] = p.sub.detach().clone()
                    if p.state:
                        parts[id(p)] = p.state
        out: dict[torch.Tensor, dict[str, Any]] = {}
        masters: dict[torch.Tensor, torch.Tensor] = {}
        for shard, pieces in self.pieces_of.items():
            if shard in self.masters:
                masters[shard] = torch.cat([rows[id(p)] for p in pieces])
            states = [parts[id(p)] for p in pieces if id(p) in parts]
            if len(states) != len(pieces):
                continue  # never stepped (a partial set can only follow a failed step: see [Note: failed I/O])
            first = states[0]
            out[shard] = {k: (torch.cat([s[k] for s in states]) if per_element(v, pieces[0])
                              else (v.clone() if isinstance(v, torch.Tensor) else v)) for k, v in first.items()}
        return out, masters

    @torch.no_grad()
    def load_local_state(self, states: dict[torch.Tensor, dict[str, Any]],
                         masters: dict[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Replace the state by ``states`` (tensor -> its plain-optimizer state; absent: no state); in master
        mode also the fp32 masters by ``masters`` (None: keep them), cast into the model's rows."""
        self.settle()
        if self.masters and masters is None:
            masters = self.local_masters()
        for chunk in self.chunks:
            per_piece: list[dict[str, Any] | None] = []
            casts = [p for p in chunk.pieces if p.low is not None]
            if casts and self.hooks is not None:
                self.hooks.enter(chunk.group_file)  # the model's rows are about to change
            for p in chunk.pieces:
                st = rows_of(states.get(p.shard), p)
                if p.low is not None:
                    assert masters is not None
                    master = masters[p.shard][p.start : p.stop].to(p.low.device, torch.float32)
                    p.low.copy_(master)
                    if chunk.offloaded:
                        st = {MASTER: master, **st}
                    else:
                        p.sub.copy_(master)
                per_piece.append(st or None)
            if not chunk.offloaded:
                for p, kept in zip(chunk.pieces, per_piece):
                    p.state = self._placed(kept)
                continue
            for p in chunk.pieces:
                p.keys, p.entries, p.scalars = [], [], {}
            if all(s is None for s in per_piece):
                chunk.slot = -1
                continue
            buf = aligned_empty(max(self.window_bytes, 1), self.device)
            self._pack(chunk, per_piece, buf)
            target = (chunk.slot + 1) % self._slots if chunk.slot >= 0 else 0
            self.tier.write_async(chunk.regions[target], buf).wait()
            self.tier.drain()
            chunk.slot = target
        if self.masters and self.hooks is not None:
            self.hooks.finish()
