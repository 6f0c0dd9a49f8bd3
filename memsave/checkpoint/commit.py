"""Crash safety: a checkpoint is written into ``<path>.tmp`` and becomes ``<path>`` only when every rank wrote.

[Note: two-phase commit] Every rank writes its shards (DCP) and its own ``rank<r>.json`` into ``<path>.tmp``;
each checksums the files it wrote. After a barrier, rank 0 writes ``memsave.json`` (the manifest: every file's
size and CRC-32, the metadata, ``"complete": true``) and renames the directory to ``<path>`` (atomic on one file
system). A directory without ``memsave.json``, or named ``*.tmp``, is never loaded, so a kill at any moment leaves
the previous checkpoint the latest one; the next save removes the stale ``.tmp`` first. Failures on any rank (a
full disk, an unwritable path) are agreed on: every rank raises, the ``.tmp`` is removed, nothing committed is
touched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from memsave import dist as mdist
from memsave.dist.dcp import CheckpointFormatError, read_metadata

__all__ = ["MANIFEST", "agree", "checkpoints_in", "crc32_file", "latest", "prune", "read_manifest", "verify_files"]

MANIFEST = "memsave.json"
FORMAT = "memsave-dcp/1"
_CHUNK = 8 << 20
T = TypeVar("T")


def agree(what: str, fn: Callable[[], T], group: Any = None) -> T | None:
    """Run ``fn`` on every rank and agree on its outcome: if it raised on any rank, every rank raises the first
    failing rank's error (its type, errno and message, prefixed with ``what`` and the rank)."""
    result: T | None = None
    error: Exception | None = None
    try:
        result = fn()
    except Exception as exc:  # agreed on below
        error = exc
    mine = None if error is None else (type(error), str(error), getattr(error, "errno", None))
    everyone = mdist.all_gather_object(mine, group)  # (between this run's own ranks: trusted)
    failed = [(r, e) for r, e in enumerate(everyone) if e is not None]
    if not failed:
        return result
    rank, (kind, message, code) = failed[0]
    text = f"{what} failed on rank {rank}: {message}"
    if issubclass(kind, OSError) and code is not None:
        raise OSError(code, text) from error
    try:
        again = kind(text)
    except Exception:
        again = RuntimeError(f"{kind.__name__}: {text}")
    raise again from error


def arrive(what: str) -> None:
    """[Note: called on rank 0 alone] ``if rank == 0: memsave.save(...)`` (torch.save's habit) waited in the
    save's first collective for the collective timeout (600 s) and ended in gloo's "Timed out waiting 600000ms
    for send operation"; now in an arrival check that names the call and the ranks that did not come. It waits as
    long (``MEMSAVE_ARRIVAL_S``, default 600 s): another rank may come late for a good reason (rank 0 alone
    evaluating before the save), and refusing a correct save would be worse than the wait."""
    mdist.expect_every_rank(what, None, unset_s=600.0)


def crc32_file(path: str | Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            crc = zlib.crc32(block, crc)
    return crc


def write_json(path: Path, obj: Any) -> None:
    """Write JSON durably: a temporary file, fsync, rename."""
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The committed checkpoint's manifest; ``CheckpointFormatError`` if ``path`` is not a committed checkpoint."""
    where = Path(path) / MANIFEST
    if Path(path).name.endswith(".tmp"):
        raise CheckpointFormatError(f"{path}: an uncommitted (interrupted) save; load the checkpoint it would have "
                                    "replaced, or memsave.checkpoint.latest(<dir>)")
    if not Path(path).is_dir():
        near = sorted(p.name for p in Path(path).parent.glob("*") if p.is_dir()) if Path(path).parent.is_dir() else []
        raise CheckpointFormatError(f"{path}: no such checkpoint directory"
                                    + (f" (in {Path(path).parent}: {', '.join(near[-5:])})" if near else ""))
    try:
        manifest = json.loads(where.read_text())
    except FileNotFoundError:
        if (Path(path) / ".metadata").is_file():  # written by torch.distributed.checkpoint, not by memsave.save
            raise CheckpointFormatError(
                f"{path}: a torch.distributed.checkpoint folder without memsave's manifest {where.name}: written "
                "by torch's dcp.save (then load it into the plain model and optimizer with dcp.load and hand their "
                "state_dict()s to model.load_state_dict / optimizer.load_state_dict after memsave.wrap), or a "
                "memsave.save interrupted before its commit") from None
        raise CheckpointFormatError(f"{where}: missing, so {path} is not a committed memsave checkpoint "
                                    "(an interrupted save never writes it)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointFormatError(f"{where}: unreadable ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("complete") is not True:
        raise CheckpointFormatError(f"{where}: not a complete {FORMAT} manifest")
    return manifest


def verify_files(path: Path, manifest: dict[str, Any], *, checksums: bool, alone: bool = False) -> None:
    """Every file of the manifest exists with its size; with ``checksums`` this rank also checks the CRC-32 of
    its share of them (agreed by the caller): the shard file saved by rank ``r`` on rank ``r mod world`` (under
    the world size it was saved with, the file this rank reads next, then from the page cache), any other file
    ``i`` on rank ``i mod world``. ``alone``: this process checks every file (``memsave export``)."""
    rank, world = (0, 1) if alone else (mdist.group_rank(None), mdist.group_size(None))
    for i, (name, (size, crc)) in enumerate(sorted(manifest["files"].items())):
        shard = re.fullmatch(r"__(\d+)_\d+\.distcp", name)
        owner = (int(shard.group(1)) if shard else i) % world
        where = path / name
        try:
            actual = where.stat().st_size
        except FileNotFoundError:
            raise CheckpointFormatError(f"{where}: missing (listed in {MANIFEST} with {size} bytes); it "
                                        f"holds {_keys_in(path, name)}") from None
        if actual != size:
            raise CheckpointFormatError(f"{where}: {actual} bytes, {MANIFEST} says {size}: truncated or replaced")
        if (checksums or name == ".metadata") and owner == rank and crc32_file(where) != crc:
            raise CheckpointFormatError(f"{where}: CRC-32 differs from {MANIFEST}: the file is corrupt")


def _keys_in(path: Path, name: str) -> str:
    """The tensors stored in file ``name`` of the checkpoint (from DCP's metadata), for error messages."""
    if not name.endswith(".distcp"):
        return "memsave's metadata"
    try:
        storage = read_metadata(path).storage_data or {}
    except CheckpointFormatError as exc:
        return f"(unknown: {exc})"
    keys = sorted({index.fqn for index, info in storage.items() if info.relative_path == name})
    more = f" and {len(keys) - 6} more" if len(keys) > 6 else ""
    return ", ".join(repr(k) for k in keys[:6]) + more


def commit(tmp: Path, final: Path, manifest: dict[str, Any]) -> None:
    """Rank 0: write the manifest into ``tmp`` and rename it to ``final`` (replacing an older one of that name)."""
    write_json(tmp / MANIFEST, {**manifest, "format": FORMAT, "complete": True, "committed_ns": time.time_ns()})
    _fsync_dir(tmp)
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def checkpoints_in(directory: str | Path) -> list[tuple[int, Path]]:
    """Committed checkpoints directly under ``directory``, oldest first: ``(committed_ns, path)``."""
    out = []
    root = Path(directory)
    if not root.is_dir():
        return []
    for child in root.iterdir():
        # ``X.old``: the checkpoint a save over ``X`` set aside; committed still where ``X`` is gone (rank 0 died
        # between commit()'s two renames; a pruned one loses its manifest first, prune())
        aside = child.name.endswith(".old") and child.with_name(child.name[: -len(".old")]).exists()
        if child.is_dir() and not child.name.endswith(".tmp") and not aside:
            try:
                out.append((int(read_manifest(child)["committed_ns"]), child))
            except (CheckpointFormatError, KeyError, ValueError):
                continue
    return sorted(out)


def latest(directory: str | Path) -> Path | None:
    """The most recently committed checkpoint under ``directory`` (None: none yet)."""
    found = checkpoints_in(directory)
    return found[-1][1] if found else None


def prune(directory: Path, keep_last: int) -> list[Path]:
    """Rank 0: remove all but the ``keep_last`` most recent committed checkpoints under ``directory``."""
    found = checkpoints_in(directory)
    gone = [p for _, p in found[: max(0, len(found) - keep_last)]]
    for p in gone:
        doomed = p.with_name(p.name + ".old")
        os.replace(p, doomed)
        (doomed / MANIFEST).unlink(missing_ok=True)  # no longer a checkpoint, even if the removal is interrupted
        shutil.rmtree(doomed, ignore_errors=True)
    return gone
