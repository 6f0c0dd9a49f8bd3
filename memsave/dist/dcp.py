"""The ``torch.distributed.checkpoint`` (DCP) seam: rectangles of global tensors written and read by chunk
metadata, and DCP's own metadata read without executing code.

memsave describes every tensor a rank holds as one or more :class:`Rect` s: a rectangular chunk (``offsets``,
``tensor.shape``) of a global tensor of ``shape`` keyed by the model's original name. ZeRO's dim-0 rows, TP's
dim-0/dim-1 blocks and ZeRO rows inside a TP block are all rectangles (ANCHORS.md 3.5), so DCP's
``ChunkStorageMetadata`` describes them directly and its read planner reshards on load (any world size, stage or
mesh): nothing is gathered. A rectangle held by several ranks (replicated over an axis) is written once (DCP's
plan deduplication).

[Note: no pickle on load] DCP writes its ``.metadata`` with plain ``pickle`` and reads it back with plain
``pickle.load`` (pytorch/pytorch#189308): a tampered file would run code. :func:`read_metadata` unpickles it with
an allow-list of DCP's metadata dataclasses, torch's dtypes/sizes and builtin containers (:data:`_ALLOWED`);
anything else is refused before it is called. Tensor payloads are read with ``torch.load(weights_only=True)``
(DCP's own reader does; :class:`SafeReader` re-raises its errors naming the file and the key).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # memsave/dist/dcp_store.py imports DCP on first use
    from torch.distributed.checkpoint import metadata as dcp_md
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

__all__ = ["CheckpointFormatError", "Rect", "initialized", "load_rects", "new_world_group", "read_metadata",
           "save_rects", "tensor_keys"]

METADATA_FILE = ".metadata"


class CheckpointFormatError(ValueError):
    """A checkpoint file that is tampered with, corrupt, missing or not one memsave can read."""


@dataclasses.dataclass(frozen=True)
class Rect:
    """This rank's rectangle of the global tensor ``key`` of ``shape``: ``tensor`` (a view: read on save, written
    on load) holds elements ``[offsets[d], offsets[d] + tensor.shape[d])`` along each dim ``d``."""

    key: str
    tensor: torch.Tensor
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    # save only: makes the data when it is written (``tensor`` is then a meta tensor of its shape and dtype), so
    # state that lives off memory (offloaded) is read one rectangle at a time, never all at once
    fill: Callable[[], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        sizes = tuple(self.tensor.shape)
        if len(sizes) != len(self.shape) or len(self.offsets) != len(self.shape) or any(
                o < 0 or o + s > n for o, s, n in zip(self.offsets, sizes, self.shape)):
            raise AssertionError(f"{self.key}: chunk offsets {self.offsets} sizes {sizes} outside {self.shape}")

    @property
    def chunk(self) -> dcp_md.ChunkStorageMetadata:
        from torch.distributed.checkpoint import metadata as dcp_md

        return dcp_md.ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=torch.Size(self.tensor.shape))


def new_world_group() -> Any:
    """A gloo group of every rank for checkpoint traffic of its own (collective; None without a process group):
    an async save's collectives in a background thread must not interleave with training's."""
    return dist.new_group(backend="gloo") if initialized() else None


def initialized() -> bool:
    """Whether a default process group exists (DCP then coordinates over it)."""
    return dist.is_available() and dist.is_initialized()


# DCP itself is imported by memsave/dist/dcp_store.py on the first call of one of these
def save_rects(path: str | Path, rects: Sequence[Rect], *, group: Any = None, sync_files: bool = True,
               writer: FileSystemWriter | None = None) -> dict[str, tuple[int, int]]:
    """Write ``rects`` (every rank's, a collective over ``group`` or the default group) into directory ``path``.
    Returns ``{file name: (size, CRC-32)}`` of the files this rank wrote, computed as they were written ([Note:
    one pass per byte] in dcp_io.py; empty with a ``writer`` of the caller's)."""
    from memsave.dist import dcp_store

    return dcp_store.save_rects(path, rects, group=group, sync_files=sync_files, writer=writer)


def load_rects(path: str | Path, rects: Sequence[Rect], *, group: Any = None, no_dist: bool | None = None) -> None:
    """Fill every rank's ``rects`` from the checkpoint in directory ``path`` (a collective over ``group``;
    ``no_dist=True``: this process alone, whatever process group exists)."""
    from memsave.dist import dcp_store

    dcp_store.load_rects(path, rects, group=group, no_dist=no_dist)


def read_metadata(path: str | Path) -> dcp_md.Metadata:
    """DCP's metadata of the checkpoint in directory ``path``, unpickled with an allow-list ([Note: no pickle on
    load])."""
    from memsave.dist import dcp_store

    return dcp_store.read_metadata(path)


def tensor_keys(md: dcp_md.Metadata) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor key of a checkpoint with its global shape and dtype."""
    from memsave.dist import dcp_store

    return dcp_store.tensor_keys(md)
