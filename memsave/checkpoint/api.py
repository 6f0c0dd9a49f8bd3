"""``memsave.save`` / ``memsave.load``: sharded checkpoints on DCP that load under another world size, ZeRO stage
or tensor-parallel degree, committed only when every rank wrote ([Note: two-phase commit] in commit.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memsave import dist as mdist
from memsave._logging import warn_once
from memsave.checkpoint import commit as _commit
from memsave.checkpoint.encode import capture_rng, decode, encode, restore_rng
from memsave.checkpoint.state import (
    Target,
    merge_stage_metas,
    model_rects,
    offloaded_params_in,
    offloaded_params_out,
    optimizer_load,
    optimizer_meta,
    optimizer_rects,
    target_of,
)
from memsave.dist.dcp import CheckpointFormatError, Rect, load_rects, read_metadata, save_rects, tensor_keys

__all__ = ["Loaded", "load", "save", "write_rects"]


@dataclasses.dataclass(frozen=True)
class Loaded:
    """What :func:`load` read besides the tensors: the ``extra`` saved with the checkpoint, its manifest."""

    path: Path
    extra: dict[str, Any]
    manifest: dict[str, Any]


def save(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         extra: dict[str, Any] | None = None, async_: bool = False, keep_last: int | None = None,
         sync_files: bool = True) -> Any:
    """Save ``model`` and ``optimizer`` (as :func:`memsave.wrap` returned them) into directory ``path``.

    Collective: call on every rank. Every rank writes only the rectangles it owns (ZeRO rows, TP slices; a
    replicated tensor once), nothing is gathered. Saved with them: fp32 masters, the loss scaler, the optimizer's
    hyperparameters, ``extra`` (JSON data: step, data position, LR scheduler state...) and every rank's RNG
    states. The directory appears only when every rank finished; ``keep_last=N`` then removes all but the N most
    recent checkpoints in ``path``'s parent directory. ``async_=True``: see :func:`memsave.checkpoint.save_async`.
    """
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last={keep_last!r} is not allowed; expected a positive int or None")
    _commit.arrive("memsave.save()")
    if async_:
        from memsave.checkpoint.background import save_async

        return save_async(path, model, optimizer, extra=extra, keep_last=keep_last, sync_files=sync_files)
    from memsave.checkpoint.background import wait

    wait()  # an async save still writing: finish it first (and raise its error)
    with collector_paused():
        rects, meta, rng = snapshot(model, optimizer, extra)
        write_rects(Path(path), rects, meta, rng, keep_last=keep_last, sync_files=sync_files)
    return None


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for a synchronous save or load (on the main thread only: it is
    process-wide). [Note: no collection inside a collective] A save allocates thousands of plan and metadata
    objects, which set off collections; a full one over a training process's heap (about 300,000 tracked
    objects with the reference GPT: 0.11-0.18 s) on one rank inside DCP's collectives made every other rank wait
    for it, so on the reference GPT one zero3 save in two took twice as long. The garbage a save leaves is freed
    by reference counting; anything else waits for the next collection after it."""
    if threading.current_thread() is not threading.main_thread() or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer | None,
             extra: dict[str, Any] | None) -> tuple[list[Rect], dict[str, Any], dict[str, Any]]:
    """The rectangles to write (views of the live tensors), the JSON metadata and this rank's RNG state."""
    t = target_of(model, optimizer)

    def local() -> Any:  # what can fail on one rank alone comes before the first collective, and is agreed on
        if extra is not None and not isinstance(extra, dict):
            raise ValueError(f"extra must be a dict of JSON data or None, got {type(extra).__name__}")
        if t.optimizer is not None:
            t.optimizer.settle()  # a background step's error ([offload] overlap)
        return encode(extra or {}, "extra")

    encoded = _commit.agree("memsave.save: before writing (extra, a background step)", local)
    meta = {"extra": encoded, "world_size": mdist.group_size(None),
            "mesh": {a: t.mesh.degree(a) for a in ("dp", "tp", "pp")}, "stage": t.stage,
            "optimizer": optimizer_meta(t, t.optimizer) if t.optimizer is not None else None,
            "torch": torch.__version__}
    if t.mesh.degree("pp") > 1 and meta["optimizer"] is not None:  # each stage steps its own parameters
        meta["optimizer"] = merge_stage_metas(mdist.all_gather_object(meta["optimizer"]))
    rects = model_rects(t, for_load=False)
    if t.optimizer is not None:
        rects += optimizer_rects(t, t.optimizer)
    return rects, meta, capture_rng(t.device)


def write_rects(final: Path, rects: list[Rect], meta: dict[str, Any], rng: dict[str, Any], *,
                keep_last: int | None, sync_files: bool, group: Any = None) -> None:
    """The two-phase commit of [Note: two-phase commit] (collective over ``group``, default: every rank)."""
    tmp = final.with_name(final.name + ".tmp")
    rank = mdist.group_rank(None)

    def prepare() -> None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a save interrupted before (never committed)
            tmp.mkdir(parents=True)

    _commit.agree(f"memsave.save({final}): creating {tmp}", prepare, group)

    def write() -> dict[str, Any]:
        sums = save_rects(tmp, rects, group=group, sync_files=sync_files)  # computed as written
        files = {}
        for p in sorted(tmp.glob(f"__{rank}_*.distcp")):
            size, crc = p.stat().st_size, sums.get(p.name, (-1, 0))[1]
            files[p.name] = [size, crc if sums.get(p.name, (-1, 0))[0] == size else _commit.crc32_file(p)]
        mine = {"rank": rank, "rng": rng, "files": files}
        _commit.write_json(tmp / f"rank{rank}.json", mine)
        return mine

    try:
        _commit.agree(f"memsave.save({final}): writing the shards", write, group)

        def finish() -> None:
            if rank != 0:
                return
            files: dict[str, list[int]] = {}
            for r in range(mdist.group_size(None)):
                files.update(json.loads((tmp / f"rank{r}.json").read_text())["files"])
                f = tmp / f"rank{r}.json"
                files[f.name] = [f.stat().st_size, _commit.crc32_file(f)]
            md = tmp / ".metadata"
            files[md.name] = [md.stat().st_size, _commit.crc32_file(md)]
            _commit.commit(tmp, final, {**meta, "files": files})
            if keep_last is not None:
                _commit.prune(final.parent, keep_last)

        _commit.agree(f"memsave.save({final}): committing", finish, group)
    except Exception:  # agreed: every rank is here
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        mdist.barrier(group)  # (so that no rank sees the half-written directory after save returned)
        raise


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         rng: bool = True, verify: bool = True) -> Loaded:
    """Load a checkpoint written by :func:`save` (under any world size, ZeRO stage or tp degree) into ``model``
    and ``optimizer``, each rank reading only what it holds. Collective: call on every rank.

    Nothing from the files is executed: the manifest is JSON, DCP's metadata is unpickled with an allow-list and
    tensors are read weights-only. ``verify``: check every file's CRC-32 (spread over the ranks) before reading.
    ``rng``: restore the random state this rank saved (a rank past the saved world size takes rank ``r mod N``'s).
    Returns the saved ``extra`` (step, data position, ...) in :class:`Loaded`."""
    from memsave.checkpoint.background import wait

    _commit.arrive("memsave.load()")
    wait()
    with collector_paused():
        return _load(Path(path), model, optimizer, rng=rng, verify=verify)


def _load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, rng: bool,
          verify: bool) -> Loaded:
    t = target_of(model, optimizer)

    def check() -> dict[str, Any]:
        if t.optimizer is not None:
            t.optimizer.settle()  # a background step's error, agreed on like the files'
        manifest = _commit.read_manifest(path)
        _commit.verify_files(path, manifest, checksums=verify)
        return manifest

    manifest = _commit.agree(f"memsave.load({path}): checking the files", check)
    assert manifest is not None
    keys = tensor_keys(read_metadata(path))
    _check_model_keys(t, keys)
    if t.optimizer is not None and manifest.get("optimizer") is None:
        raise ValueError(f"memsave.load: {path} was saved without an optimizer; pass optimizer=None")
    t.engine.reshard()  # ZeRO-3: the shards are what is read into
    po = offloaded_params_in(t.engine)  # [offload] params: the shards in memory for the read, written back after
    try:
        rects = model_rects(t, for_load=True, keys=keys)
        opt_load = None
        if t.optimizer is not None:
            opt_load = optimizer_load(t, t.optimizer, manifest["optimizer"], keys)
            rects += opt_load.rects
        load_rects(path, rects)
    finally:
        offloaded_params_out(po)
    if opt_load is not None:
        opt_load.install()
    else:  # a model-only load: the fp32 masters (and offloaded rows) follow the loaded parameters, as after
        for listener in t.engine.load_listeners:  # model.load_state_dict (zero3-bf16: the next step cast the
            listener(None)  # old masters back over the load, silently)
    # agreed, so load returns on no rank before every rank has read its files: a rank 1 still reading its
    # rank1.json when rank 0, back first, renamed or pruned the folder raised alone, and rank 0 went on to hang
    # in its next collective (seen in tests/ckpt_faults.py's interrupted save)
    _commit.agree(f"memsave.load({path}): restoring the random state",
                  lambda: _restore_rng(path, manifest, t) if rng else None)
    return Loaded(path, decode(manifest.get("extra", {})), manifest)


def _check_model_keys(t: Target, keys: dict[str, Any]) -> None:
    names = {f"model/{h.name}" for h in t.held.values()}
    saved = {k for k in keys if k.startswith("model/")}
    missing, unexpected = sorted(names - saved), sorted(saved - names)
    if t.mesh.degree("pp") > 1:  # a pipeline rank loads its stages' parameters: the others are the other ranks'
        unexpected = []
    if missing or unexpected:
        raise ValueError(f"memsave.load: the checkpoint's parameters differ from the model's: missing "
                         f"{[k[6:] for k in missing][:8]}, unexpected {[k[6:] for k in unexpected][:8]}")


def _restore_rng(path: Path, manifest: dict[str, Any], t: Target) -> None:
    rank, saved_world = mdist.group_rank(None), int(manifest["world_size"])
    if saved_world != mdist.group_size(None):
        warn_once(f"memsave.load: {path} was saved by {saved_world} ranks, this run has {mdist.group_size(None)}; "
                  f"rank r restores the random state of saved rank r mod {saved_world}")
    try:
        mine = json.loads((path / f"rank{rank % saved_world}.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointFormatError(f"{path / f'rank{rank % saved_world}.json'}: unreadable ({exc})") from exc
    restore_rng(mine["rng"], t.device)
