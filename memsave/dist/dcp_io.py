"""The byte-level side of memsave's DCP files: the CRC-32 of each file computed while DCP writes it, torch's
per-record CRC turned off where memsave's covers the same bytes, and a tensor record read without unpickling.

[Note: one pass per byte] A memsave checkpoint's manifest holds each file's CRC-32 (memsave/checkpoint/commit.py),
checked on load. Computed by reading the files back after DCP wrote them, a save passed over every byte three
times: ``torch.save``'s own CRC-32 of each zip record (which ``torch.load`` never checks), the write, and the
read-back with memsave's CRC; a third of a save's time on the reference GPT. Now the CRC is computed on the bytes
as they are written (:class:`ChecksumFileSystem`), and :func:`record_crc_off` turns torch's per-record CRC off
around a synchronous save (``torch.utils.serialization.config.save.compute_crc32``: a process-wide setting, so
only on the main thread; an async save's background thread leaves it as the user set it). The records stay
ordinary ``torch.save`` zips (DCP's own reader and ``torch.load`` read them; a zip tool would flag the CRCs).

On load, :func:`raw_record` takes a record's one storage straight from the zip with the dtype and shape DCP's
metadata gives the chunk (memsave writes every chunk contiguous, its storage exactly its bytes; see
``_RectSavePlanner.resolve_data``), instead of running ``torch.load``'s weights-only unpickler per record (most
of a load's time on the reference GPT). A record that does not look like that is left to ``torch.load``.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystem

__all__ = ["ChecksumFileSystem", "raw_record", "record_crc_off"]


class _Checksummed:
    """A binary file being written: every ``write`` also goes into the running CRC-32 and size."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.crc, self.size = raw, 0, 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = self.raw.write(view)
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        return n

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, ...
        return getattr(self.raw, name)


class ChecksumFileSystem(FileSystem):
    """DCP's local file system, recording each file it writes as ``sums[name] = (size, crc32)``."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as stream:
            out = _Checksummed(stream)
            yield out
        with self._lock:
            self.sums[Path(path).name] = (out.size, out.crc)


@contextlib.contextmanager
def record_crc_off() -> Iterator[None]:
    """torch's per-record CRC-32 off for the block, on the main thread only ([Note: one pass per byte])."""
    from torch.utils.serialization import config

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = before


def raw_record(data: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """The tensor of ``shape`` and ``dtype`` a ``torch.save`` record holds, read from its one storage without
    unpickling; None when the record is not one contiguous storage of exactly those bytes."""
    try:
        reader = torch._C.PyTorchFileReader(io.BytesIO(data))
        records = reader.get_all_records()
    except Exception:  # not a zip: torch.load will say what it is
        return None
    storages = [r for r in records if r.rsplit("/", 2)[-2:-1] == ["data"]]
    if len(storages) != 1 or not storages[0].endswith("data/0"):
        return None
    order = [r for r in records if r.endswith("byteorder")]
    if sys.byteorder != "little" or (order and reader.get_record(order[0]) != b"little"):
        return None
    numel = 1
    for s in shape:
        numel *= s
    item = torch.empty((), dtype=dtype).element_size()
    size_of = getattr(reader, "get_record_size", None)
    if size_of is None:  # torch 2.11's reader cannot size a record without reading it: torch.load reads it
        return None
    if size_of(storages[0]) != numel * item:
        return None
    storage = reader.get_storage_from_record(storages[0], numel * item, torch.uint8).untyped_storage()
    stride: list[int] = []
    step = 1
    for s in reversed(shape):
        stride.insert(0, step)
        step *= s
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape, tuple(stride))
