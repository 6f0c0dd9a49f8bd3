"""The layout of offloaded optimizer state (memsave/offload/state.py): a stepped tensor's row *pieces*, the
*chunks* they are packed into, and where each per-element state entry sits in a chunk's buffer."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

__all__ = ["ENTRY_ALIGN", "MASTER", "MASTER_BYTES", "Chunk", "Piece", "layout_bytes", "per_element", "rows_of", "view"]

ENTRY_ALIGN = 64
MASTER = "memsave.master"  # the fp32 master rows' entry in an offloaded chunk ([Note: offloaded masters])
MASTER_BYTES = 4


@dataclasses.dataclass
class Piece:
    """Rows ``[start, stop)`` of one stepped tensor (``shard``), as a sub-parameter sharing its storage."""

    shard: torch.Tensor
    group: int
    start: int
    stop: int
    sub: nn.Parameter  # what the optimizer steps: the shard's rows, or (master mode) the fp32 master rows
    low: torch.Tensor | None = None  # master mode: the model's low-precision rows the master is cast into
    keys: list[str] = dataclasses.field(default_factory=list)  # state key order; empty: no state yet
    scalars: dict[str, Any] = dataclasses.field(default_factory=dict)  # entries kept in memory (``step``)
    entries: list[tuple[str, torch.dtype, int]] = dataclasses.field(default_factory=list)  # (key, dtype, offset)
    state: dict[str, Any] | None = None  # in-memory chunks: the whole state dict

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.stop - self.start, *self.shard.shape[1:])) if self.shard.dim() else torch.Size((1,))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def visible(self) -> torch.Tensor:
        """The rows the model sees (restored after a failed write)."""
        return self.low if self.low is not None else self.sub


@dataclasses.dataclass
class Chunk:
    index: int
    group_file: str
    pieces: list[Piece]
    offloaded: bool
    regions: list[Any] = dataclasses.field(default_factory=list)  # two on disk ([Note: failed I/O]), one on host
    region_bytes: int = 0  # bytes of the current layout
    slot: int = -1  # the region holding the current state; -1: none yet

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)


def view(buf: torch.Tensor, piece: Piece, dtype: torch.dtype, offset: int) -> torch.Tensor:
    nbytes = piece.numel * dtype.itemsize
    return buf[offset : offset + nbytes].view(dtype).view(piece.shape)


def per_element(value: Any, piece: Piece) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == piece.shape


def rows_of(state: dict[str, Any] | None, piece: Piece) -> dict[str, Any]:
    """The piece's rows of a whole tensor's plain-optimizer state (copies)."""
    rows = piece.shard.shape[0]
    return {k: v[piece.start : piece.stop].clone() if isinstance(v, torch.Tensor) and v.dim() > 0
            and v.shape[0] == rows and v.shape == piece.shard.shape else
            (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in (state or {}).items()}


def layout_bytes(chunk: Chunk, per_elem: int) -> int:
    return sum(p.numel * per_elem + ENTRY_ALIGN * 4 for p in chunk.pieces)  # <= 4 entries a piece
