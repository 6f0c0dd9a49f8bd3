"""The layout of offloaded optimizer state (memsave/offload/state.py): a stepped tensor's row *pieces*, the
*chunks* they are packed into, and where each per-element state entry sits in a chunk's buffer."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["ENTRY_ALIGN", "MASTER", "MASTER_BYTES", "Chunk", "Piece", "per_element", "plan", "row_pieces", "rows_of", "view",
           "window_bytes"]

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
    dev: torch.Tensor | None = None  # host step without masters: the model's rows on the device ([Note: host step])
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
        return self.low if self.low is not None else self.dev if self.dev is not None else self.sub


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


def window_bytes(numel: int, npieces: int, per_elem: int) -> int:
    """Bytes of a chunk's buffer: its elements' state, each piece's (at most 4) entries aligned."""
    return numel * per_elem + ENTRY_ALIGN * 4 * npieces


def row_pieces(rows: int, row_numel: int, chunk_numel: int) -> list[tuple[int, int]]:
    """A tensor's ``rows`` cut into ``[start, stop)`` slices of at most ``chunk_numel`` elements (a row at least)."""
    step = max(1, chunk_numel // max(row_numel, 1))
    return [(start, min(rows, start + step)) for start in range(0, max(rows, 1), step)]


def plan(pieces: Sequence[tuple[Hashable, int]], chunk_numel: int, fraction: float, *,
         offload_last: bool = False) -> list[tuple[list[int], bool]]:
    """The chunks of ``pieces`` (``(file, elements)``, in step order): consecutive pieces of one file packed up to
    ``chunk_numel`` elements; whole chunks offloaded, in order (from the last when ``offload_last``), while the
    offloaded share stays nearest to ``fraction``. Each chunk: its pieces' indices, and whether it is offloaded.
    OffloadedState builds its chunks with it, ``memsave.estimate`` its prediction."""
    chunks: list[list[int]] = []
    files: list[Hashable] = []
    sizes: list[int] = []
    for i, (file, numel) in enumerate(pieces):
        if not chunks or files[-1] != file or sizes[-1] + numel > chunk_numel:
            chunks.append([])
            files.append(file)
            sizes.append(0)
        chunks[-1].append(i)
        sizes[-1] += numel
    total = sum(sizes)
    offloaded = [False] * len(chunks)
    done = 0
    for c in reversed(range(len(chunks))) if offload_last else range(len(chunks)):
        if sizes[c] and done + sizes[c] / 2 <= fraction * total:
            offloaded[c] = True
            done += sizes[c]
    return list(zip(chunks, offloaded, strict=True))
