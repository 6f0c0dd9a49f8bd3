"""The ``torch.distributed.checkpoint`` side of memsave/dist/dcp.py: the planners that write and read
:class:`~memsave.dist.dcp.Rect` s, the reader that checks every record, and metadata read without pickle's code
execution. Importing DCP costs about a second (it imports DTensor), so memsave/dist/dcp.py imports this module on
first use: ``import memsave`` and ``memsave plan`` do not pay for it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import math
import os
import pickle
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from memsave.dist.dcp import METADATA_FILE, CheckpointFormatError, Rect, initialized
from memsave.dist.dcp_io import ChecksumFileSystem, raw_record, record_crc_off

__all__ = ["SafeReader", "load_rects", "read_metadata", "save_rects", "tensor_keys"]


# -- save ------------------------------------------------------------------------------------------------------
class _RectSavePlanner(SavePlanner):
    """Writes exactly the given rectangles (deduplicated across ranks), each as one DCP chunk."""

    def __init__(self, rects: Sequence[Rect]) -> None:
        self.rects = {(r.key, r.offsets): r for r in rects if r.tensor.numel() > 0 or not r.shape}

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for (key, offsets), r in self.rects.items():
            props = dcp_md.TensorProperties(dtype=r.tensor.dtype)
            items.append(WriteItem(index=dcp_md.MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(chunk=r.chunk, properties=props,
                                                               size=torch.Size(r.shape))))
        return SavePlan(items)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], dcp_md.Metadata]:
        # a replicated buffer can differ between ranks (BatchNorm's running statistics: each rank's forward
        # updates its own): the copy saved is the first rank's that holds it, as model.state_dict() there gives
        # (deduplication alone picked any rank's); the rest is deduplicated for balance
        seen: set[str] = set()
        kept = []
        for plan in all_plans:
            items = [i for i in plan.items if not (i.index.fqn.startswith("buffer/") and i.index.fqn in seen)]
            seen |= {i.index.fqn for i in items if i.index.fqn.startswith("buffer/")}
            kept.append(dataclasses.replace(plan, items=items))
        plans = dedup_save_plans(kept, save_to_lowest_rank=False)
        return create_default_global_save_plan(plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        r = self.rects[(write_item.index.fqn, tuple(write_item.index.offset or ()))]
        if r.fill is not None:  # made now; DCP holds it until its file is closed (see save_rects)
            return r.fill().detach().contiguous()
        t = r.tensor.detach()
        # a slice of a larger storage would be written whole by torch.save: copy it out (one rectangle at a time)
        if t.device.type != "cpu" or not t.is_contiguous() or t.untyped_storage().nbytes() != t.nbytes:
            t = t.to("cpu", copy=True).contiguous()
        return t


def save_rects(path: str | Path, rects: Sequence[Rect], *, group: Any = None, sync_files: bool = True,
               writer: FileSystemWriter | None = None) -> dict[str, tuple[int, int]]:
    """:func:`memsave.dist.dcp.save_rects`."""
    fs = None
    if writer is None:
        # DCP's writer keeps every tensor of a file referenced until it closes the file: rectangles made when
        # written (Rect.fill: offloaded state) then go one to a file, so only one is ever made at a time
        streamed = any(r.fill is not None for r in rects)
        writer = FileSystemWriter(path, single_file_per_rank=not streamed, sync_files=sync_files, thread_count=1,
                                  overwrite=True)
        writer.fs = fs = ChecksumFileSystem()
    with _unwrapped(), record_crc_off():
        dcp.save({}, storage_writer=writer, planner=_RectSavePlanner(rects), process_group=group,
                 no_dist=not initialized())
    return dict(fs.sums) if fs is not None else {}


# -- metadata without pickle's code execution ------------------------------------------------------------------
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch", "layout"),
     ("collections", "OrderedDict"), ("torch.serialization", "_get_layout"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "tuple"),
     ("builtins", "list"), ("builtins", "dict"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")} | {
    ("torch", name) for name in ("strided", "sparse_coo", "contiguous_format", "channels_last", "preserve_format")}
_DTYPES = {str(t).removeprefix("torch.") for t in vars(torch).values() if isinstance(t, torch.dtype)}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise CheckpointFormatError(
            f"{self.where}: refusing to unpickle {module}.{name} (not one of DCP's metadata types): the file is "
            "tampered with or not a DCP checkpoint's metadata; nothing from it was executed")


def read_metadata(path: str | Path) -> dcp_md.Metadata:
    """:func:`memsave.dist.dcp.read_metadata`."""
    where = os.path.join(os.fspath(path), METADATA_FILE)
    try:
        with open(where, "rb") as f:
            md = _MetadataUnpickler(f, where).load()
    except CheckpointFormatError:
        raise
    except FileNotFoundError:
        raise CheckpointFormatError(f"{where}: missing (not a committed checkpoint directory)") from None
    except Exception as exc:  # truncated or garbled
        raise CheckpointFormatError(f"{where}: cannot be read as DCP metadata: {type(exc).__name__}: {exc}") from exc
    if not isinstance(md, dcp_md.Metadata):
        raise CheckpointFormatError(f"{where}: holds a {type(md).__name__}, not DCP metadata")
    return md


def tensor_keys(md: dcp_md.Metadata) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """:func:`memsave.dist.dcp.tensor_keys`."""
    return {k: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items()
            if isinstance(v, dcp_md.TensorStorageMetadata)}


class SafeReader(FileSystemReader):
    """DCP's file-system reader with the metadata read by :func:`read_metadata`, and read errors naming the file
    and the key."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_md.Metadata:
        md = read_metadata(os.fspath(self.path))
        if md.storage_meta is None:
            md.storage_meta = dcp_md.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: dcp_md.Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.chunks = {(k, tuple(c.offsets)): (tuple(c.sizes), md.properties.dtype)
                       for k, md in metadata.state_dict_metadata.items()
                       if isinstance(md, dcp_md.TensorStorageMetadata) for c in md.chunks}

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        per_file: dict[str, list[ReadItem]] = collections.defaultdict(list)
        for req in plan.items:
            info: _StorageInfo = self.storage_data[req.storage_index]
            per_file[info.relative_path].append(req)
        for relative, reqs in per_file.items():
            where = os.path.join(os.fspath(self.path), relative)
            try:
                stream = open(where, "rb")
            except OSError as exc:
                raise CheckpointFormatError(f"{where}: cannot be opened ({exc.strerror}) to read "
                                            f"{reqs[0].storage_index.fqn!r}") from exc
            with stream:
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    self._read_one(stream, req, planner, where)
        return _done()

    def _read_one(self, stream: Any, req: ReadItem, planner: LoadPlanner, where: str) -> None:
        info = self.storage_data[req.storage_index]
        assert req.type != LoadItemType.BYTE_IO, "memsave checkpoints hold tensors only"
        stream.seek(info.offset)
        data = stream.read(info.length)
        if len(data) != info.length:
            raise CheckpointFormatError(f"{where}: truncated: {req.storage_index.fqn!r} needs bytes "
                                        f"[{info.offset}, {info.offset + info.length}), the file has fewer")
        chunk = self.chunks.get((req.storage_index.fqn, tuple(req.storage_index.offset or ())))
        tensor = raw_record(data, *chunk) if chunk is not None else None  # [Note: one pass per byte]
        try:
            if tensor is None:
                tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointFormatError(f"{where}: {req.storage_index.fqn!r} at offset {info.offset} is not a "
                                        f"weights-only tensor record ({type(exc).__name__}: {str(exc)[:300]})"
                                        ) from exc
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointFormatError(f"{where}: {req.storage_index.fqn!r} holds a {type(tensor).__name__}")
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CheckpointFormatError(f"{where}: {req.storage_index.fqn!r} has a chunk of shape "
                                        f"{tuple(tensor.shape)} where the metadata says {tuple(target.shape)}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)


def _done() -> Any:
    from torch.futures import Future

    fut: Future[None] = Future()
    fut.set_result(None)
    return fut


# -- load ------------------------------------------------------------------------------------------------------
class _RectLoadPlanner(LoadPlanner):
    """Reads every given rectangle from whichever saved chunks overlap it (DCP's resharding)."""

    def __init__(self, rects: Sequence[Rect]) -> None:
        self.rects = {(r.key, r.offsets): r for r in rects if r.tensor.numel() > 0 or not r.shape}

    def set_up_planner(self, state_dict: Any, metadata: dcp_md.Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        assert metadata is not None
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        saved = self.metadata.state_dict_metadata
        for (key, offsets), r in self.rects.items():
            md = saved.get(key)
            if not isinstance(md, dcp_md.TensorStorageMetadata):
                raise CheckpointFormatError(f"checkpoint has no tensor {key!r}")
            if tuple(md.size) != r.shape:
                raise CheckpointFormatError(f"checkpoint tensor {key!r} has shape {tuple(md.size)}, this model's "
                                            f"is {r.shape}")
            reads = create_read_items_for_chunk_list(key, md, [r.chunk])
            covered = sum(math.prod(x.lengths) for x in reads)
            if covered != r.tensor.numel():  # saved chunks are disjoint: less means a hole
                raise CheckpointFormatError(f"checkpoint tensor {key!r}: its saved chunks cover {covered} of the "
                                            f"{r.tensor.numel()} elements at offsets {offsets}")
            items.extend(reads)
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointFormatError(f"checkpoint entry {read_item.dest_index.fqn!r} is bytes, not a tensor")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        r = self.rects[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset or ()))]
        return narrow_tensor_by_index(r.tensor, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def load_rects(path: str | Path, rects: Sequence[Rect], *, group: Any = None, no_dist: bool | None = None) -> None:
    """:func:`memsave.dist.dcp.load_rects`."""
    with _unwrapped(), warnings.catch_warnings():  # (one process on purpose: not torch's "assuming the intent")
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load({}, storage_reader=SafeReader(path), planner=_RectLoadPlanner(rects), process_group=group,
                 no_dist=not initialized() if no_dist is None else no_dist)


@contextlib.contextmanager
def _unwrapped() -> Iterator[None]:
    """DCP reports a failure on any rank as a ``CheckpointException`` (a ``BaseException``) on every rank:
    re-raise the first rank's own exception (its type and message: an ``OSError`` stays one), naming the rank."""
    try:
        yield
    except CheckpointException as wrapped:
        rank, (exc, _trace) = min(wrapped.failures.items())
        if isinstance(exc, OSError):
            raise type(exc)(exc.errno, f"rank {rank}: {exc.strerror}", exc.filename) from exc
        try:
            again = type(exc)(f"rank {rank}: {exc}")
        except Exception:
            again = RuntimeError(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise again from exc
