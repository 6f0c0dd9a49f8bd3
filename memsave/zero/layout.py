"""Dim-0 sharding of a group of parameters, and the rank-major flat layout they communicate through.

Each parameter of shape ``(R, *rest)`` (a 0-dim one counts as ``(1,)``) is split by rows: rank ``r`` owns rows
``[r * rpr, min((r + 1) * rpr, R))`` with ``rpr = ceil(R / N)``, so whole rows stay on one rank (what keeps a
factored optimizer's row statistics local). For communication a unit's parameters are laid out *rank-major*:
rank ``r``'s chunk is the concatenation of its padded row shards, ``C`` elements per rank, so one
``all_gather`` of the chunks or one ``reduce_scatter`` of an ``N * C`` buffer serves the whole unit::

    staging (N * C,):  [ rank 0: p0 rows | p1 rows | ... ][ rank 1: p0 rows | p1 rows | ... ] ...

Padding rows (the last ranks of a parameter whose R is not a multiple of N) are zero in every staging buffer.
"""

from __future__ import annotations

import dataclasses
import math

import torch

__all__ = ["ParamSlot", "ShardLayout"]


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in a rank-major layout."""

    shape: torch.Size
    rows: int  # R
    row_numel: int  # product of shape[1:]
    rows_per_rank: int  # ceil(R / N)
    offset: int  # within a rank's chunk

    @property
    def padded_numel(self) -> int:
        return self.rows_per_rank * self.row_numel

    def local_rows(self, rank: int) -> tuple[int, int]:
        """``(start, stop)`` rows owned by ``rank``; empty for ranks past the end."""
        start = min(self.rows, rank * self.rows_per_rank)
        return start, min(self.rows, start + self.rows_per_rank)


class ShardLayout:
    """The rank-major layout of ``shapes`` over ``world`` ranks."""

    def __init__(self, shapes: list[torch.Size], world: int) -> None:
        self.world = world
        self.slots: list[ParamSlot] = []
        offset = 0
        for shape in shapes:
            rows = shape[0] if len(shape) > 0 else 1
            row_numel = math.prod(shape[1:]) if len(shape) > 0 else 1
            rpr = -(-rows // world)
            self.slots.append(ParamSlot(torch.Size(shape), rows, row_numel, rpr, offset))
            offset += rpr * row_numel
        self.chunk_numel = offset  # C: elements per rank

    @property
    def padded_numel(self) -> int:
        return self.chunk_numel * self.world

    def shard_view(self, chunk: torch.Tensor, i: int, rank: int) -> torch.Tensor:
        """Parameter ``i``'s rows owned by ``rank``, as a view of that rank's ``chunk``: ``(local_rows, *rest)``."""
        slot = self.slots[i]
        start, stop = slot.local_rows(rank)
        n = (stop - start) * slot.row_numel
        view = chunk[slot.offset : slot.offset + n]
        # a 0-dim parameter's shard is 1-D ((1,) on its owner, (0,) elsewhere), so that its optimizer state
        # never looks like a scalar such as Adam's "step"
        return view.view(stop - start, *slot.shape[1:]) if len(slot.shape) > 0 else view

    def copy_rows(self, chunk: torch.Tensor, i: int, full: torch.Tensor, rank: int) -> None:
        """Copy ``rank``'s rows of parameter ``i``'s full tensor into its slot of ``rank``'s ``chunk`` (the padding
        is left as it is): what :meth:`pack` then taking ``rank``'s chunk gives, without a full staging buffer."""
        slot = self.slots[i]
        start, stop = slot.local_rows(rank)
        view = self.shard_view(chunk, i, rank)
        view.copy_(full.reshape(slot.rows, slot.row_numel)[start:stop].reshape(view.shape))

    def _blocks(self, staging: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s padded rows across all ranks, as a ``(N, rpr, row)`` view of a staging buffer."""
        slot = self.slots[i]
        return staging.view(self.world, self.chunk_numel)[:, slot.offset : slot.offset + slot.padded_numel].view(
            self.world, slot.rows_per_rank, slot.row_numel
        )

    def pack(self, staging: torch.Tensor, i: int, full: torch.Tensor) -> None:
        """Scatter the full tensor ``full`` of parameter ``i`` into ``staging`` (rank-major), zeroing its padding."""
        slot = self.slots[i]
        blocks = self._blocks(staging, i)
        src = full.reshape(slot.rows, slot.row_numel)
        whole = slot.rows // slot.rows_per_rank
        blocks[:whole].copy_(src[: whole * slot.rows_per_rank].view(whole, slot.rows_per_rank, slot.row_numel))
        rem = slot.rows - whole * slot.rows_per_rank
        if whole < self.world:
            blocks[whole, :rem].copy_(src[whole * slot.rows_per_rank :])
            blocks[whole, rem:].zero_()
            blocks[whole + 1 :].zero_()

    def unpack(self, staging: torch.Tensor, i: int, full: torch.Tensor) -> None:
        """Gather parameter ``i``'s rows from ``staging`` (rank-major) into ``full``; rows are in the tensor's
        logical order, so a parameter in another memory format (a ``channels_last`` convolution weight) is
        filled through a contiguous copy."""
        slot = self.slots[i]
        blocks = self._blocks(staging, i)
        target = full if full.is_contiguous() else torch.empty(full.shape, dtype=full.dtype, device=full.device)
        dst = target.view(slot.rows, slot.row_numel)
        whole = slot.rows // slot.rows_per_rank
        dst[: whole * slot.rows_per_rank].view(whole, slot.rows_per_rank, slot.row_numel).copy_(blocks[:whole])
        rem = slot.rows - whole * slot.rows_per_rank
        if rem:
            dst[whole * slot.rows_per_rank :].copy_(blocks[whole, :rem])
        if target is not full:
            full.copy_(target)
