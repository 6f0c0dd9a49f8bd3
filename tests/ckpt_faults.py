"""Fault, async and interop cases of tests/test_checkpoint.py, run on every rank of the 2-rank group: each returns
"ok" or raises.

Tampering is done by rank 0 with the manifest's sizes and checksums updated too (an attacker can edit JSON), so
what stops the load is the allow-list unpickler or ``weights_only``, not the checksum; corruption leaves the
manifest alone (the checksum names the file).
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

import memsave
from memsave.checkpoint.commit import MANIFEST, crc32_file
from memsave.dist.dcp import CheckpointFormatError
from tests.ckpt_cases import Layout, batches, train, wrapped

Z2 = Layout("zero2")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _trained() -> tuple[Any, Any, Any]:
    model, opt, mesh = wrapped(Z2)
    train(model, opt, mesh, batches(1), Z2)
    return model, opt, mesh


def _weights(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _rewrite(path: Path, name: str, data: bytes) -> None:
    """Rank 0 replaces a file of the checkpoint and makes the manifest agree with it."""
    if _rank() == 0:
        (path / name).write_bytes(data)
        manifest = json.loads((path / MANIFEST).read_text())
        manifest["files"][name] = [len(data), crc32_file(path / name)]
        (path / MANIFEST).write_text(json.dumps(manifest))
    _barrier()


def _expect(exc: type[BaseException], needles: list[str], fn: Callable[[], Any]) -> str:
    try:
        fn()
    except exc as e:
        text = str(e)
        for needle in needles:
            assert needle in text, f"{needle!r} not in the error: {text}"
        return text
    raise AssertionError(f"no {exc.__name__} raised")


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def tampered_metadata(root: Path) -> str:
    path, marker = root / "tamper-md", root / "pwned-md"
    model, opt, _ = _trained()
    memsave.save(path, model, opt)
    _rewrite(path, ".metadata", pickle.dumps(_Payload(marker)))
    fresh, fopt, _ = wrapped(Z2, seed=3)
    _expect(CheckpointFormatError, ["refusing to unpickle posix.system", ".metadata", "nothing from it was executed"],
            lambda: memsave.load(path, fresh, fopt))
    assert not marker.exists()
    return "ok"


def tampered_shard(root: Path) -> str:
    path, marker = root / "tamper-shard", root / "pwned-shard"
    model, opt, _ = _trained()
    memsave.save(path, model, opt)
    name = "__0_0.distcp"
    size = (path / name).stat().st_size
    evil = bytearray(size)
    if _rank() == 0:
        import io

        buf = io.BytesIO()
        torch.save({"x": _Payload(marker)}, buf)
        assert buf.tell() <= size
        evil[: buf.tell()] = buf.getvalue()
    _rewrite(path, name, bytes(evil))
    fresh, fopt, _ = wrapped(Z2, seed=3)
    text = _expect(CheckpointFormatError, [name, "not a weights-only tensor record"],
                   lambda: memsave.load(path, fresh, fopt))
    assert "'model/" in text or "'optim/" in text or "'master/" in text, text  # the key
    assert not marker.exists()
    return "ok"


def corrupt_shard(root: Path) -> str:
    path = root / "corrupt"
    model, opt, _ = _trained()
    memsave.save(path, model, opt)
    if _rank() == 0:
        with open(path / "__1_0.distcp", "r+b") as f:
            f.seek(200)
            byte = f.read(1)
            f.seek(200)
            f.write(bytes([byte[0] ^ 0xFF]))
    _barrier()
    fresh, fopt, _ = wrapped(Z2, seed=3)
    _expect(CheckpointFormatError, ["__1_0.distcp", "CRC-32"], lambda: memsave.load(path, fresh, fopt))
    if _rank() == 0:  # `memsave export` checks the files as a load does (it wrote the garbled weight, rc 0)
        with pytest.raises(CheckpointFormatError, match=r"__1_0\.distcp: CRC-32 differs"):
            memsave.checkpoint.export(path, root / "corrupt.safetensors")
        assert not (root / "corrupt.safetensors").exists()
    _barrier()
    # without verification the garbled record is still refused, naming the file and the key
    return "ok"


def missing_and_truncated_shard(root: Path) -> str:
    path = root / "missing"
    model, opt, _ = _trained()
    memsave.save(path, model, opt)
    copy = root / "missing-copy"
    if _rank() == 0:
        shutil.copytree(path, copy)
        (path / "__1_0.distcp").unlink()
    _barrier()
    fresh, fopt, _ = wrapped(Z2, seed=3)
    _expect(CheckpointFormatError, ["__1_0.distcp", "missing", "holds 'model/"], lambda: memsave.load(path, fresh, fopt))
    # a record whose bytes are cut short, with the manifest made to agree (verify=False skips the checksums):
    # the error names the file and the key
    with open(copy / "__0_0.distcp", "rb") as f:
        head = f.read()
    _rewrite(copy, "__0_0.distcp", head[: len(head) // 2])
    _expect(CheckpointFormatError, ["__0_0.distcp", "'"], lambda: memsave.load(copy, fresh, fopt, verify=False))
    # one rank's random state unreadable (unchecked): every rank raises, naming it (rank 0 alone returned, then
    # hung in its next collective)
    memsave.save(root / "bad-rng", model, opt)
    if _rank() == 0:
        f = root / "bad-rng" / "rank1.json"
        f.write_text("{" + " " * (f.stat().st_size - 1))  # (as long as the manifest says)
    _barrier()
    _expect(CheckpointFormatError, ["failed on rank 1", "rank1.json"],
            lambda: memsave.load(root / "bad-rng", fresh, fopt, verify=False))
    return "ok"


def full_disk(root: Path) -> str:
    """ENOSPC in the writer of rank 1: every rank raises OSError(ENOSPC); the previous checkpoint of the same
    name is intact and loads; nothing half-written is left."""
    path = root / "full"
    model, opt, mesh = _trained()
    memsave.save(path, model, opt, extra={"step": 1})
    before = _weights(model)
    train(model, opt, mesh, batches(2)[1:], Z2)
    from torch.distributed.checkpoint import filesystem

    real = filesystem._write_item

    def failing(*args: Any, **kwargs: Any) -> Any:
        if _rank() == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    with mock.patch.object(filesystem, "_write_item", failing):
        text = _expect(OSError, ["rank 1", "No space left on device"], lambda: memsave.save(path, model, opt))
    assert "writing the shards" in text, text
    assert not (root / "full.tmp").exists()
    fresh, fopt, _ = wrapped(Z2, seed=3)
    assert memsave.load(path, fresh, fopt).extra == {"step": 1}
    after = _weights(fresh)
    assert all(torch.equal(before[k], after[k]) for k in before)
    return "ok"


def unwritable_path(root: Path) -> str:
    blocker = root / "a-file"
    if _rank() == 0:
        blocker.write_text("not a directory")
    _barrier()
    model, opt, _ = _trained()
    _expect(OSError, ["rank 0", "creating"], lambda: memsave.save(blocker / "ckpt", model, opt))
    assert blocker.read_text() == "not a directory"
    # an extra that one rank cannot store (a sampler's state with an object in it): raised on that rank alone
    # before the first collective, while the other waited in it for the collective timeout
    extra = {"step": 1, "sampler": object() if _rank() == 1 else [0, 1]}
    _expect(ValueError, ["failed on rank 1", "extra.sampler: a object cannot be stored"],
            lambda: memsave.save(root / "bad-extra", model, opt, extra=extra))
    assert not (root / "bad-extra").exists() and not (root / "bad-extra.tmp").exists()
    return "ok"


def interrupted_save_and_keep_last(root: Path) -> str:
    """A save killed before its commit leaves ``<name>.tmp``: never loaded, never the latest, removed by the next
    save of that name (which does not hang); keep_last=2 keeps the two newest."""
    runs = root / "runs"
    model, opt, mesh = _trained()
    memsave.save(runs / "step1", model, opt, extra={"step": 1})
    if _rank() == 0:  # what a kill between the shards and the commit leaves
        shutil.copytree(runs / "step1", runs / "step2.tmp")
        (runs / "step2.tmp" / MANIFEST).unlink()
    _barrier()
    assert memsave.checkpoint.latest(runs) == runs / "step1"
    fresh, fopt, _ = wrapped(Z2, seed=3)
    _expect(CheckpointFormatError, ["uncommitted"], lambda: memsave.load(runs / "step2.tmp", fresh, fopt))
    for step in (2, 3, 4):
        train(model, opt, mesh, batches(1, seed=step), Z2)
        memsave.save(runs / f"step{step}", model, opt, extra={"step": step}, keep_last=2)
    assert sorted(p.name for p in runs.iterdir()) == ["step3", "step4"], sorted(p.name for p in runs.iterdir())
    assert memsave.checkpoint.latest(runs) == runs / "step4"
    assert memsave.load(runs / "step4", fresh, fopt).extra == {"step": 4}
    if _rank() == 0:  # a save over step4 whose rank 0 died between commit()'s two renames: the old one set aside
        os.replace(runs / "step4", runs / "step4.old")
        shutil.copytree(runs / "step4.old", runs / "step4.tmp")
    _barrier()
    assert memsave.checkpoint.latest(runs) == runs / "step4.old"  # (was step3: the newest commit was lost)
    assert memsave.load(runs / "step4.old", fresh, fopt).extra == {"step": 4}
    memsave.save(runs / "step4", model, opt, extra={"step": 5})
    assert sorted(p.name for p in runs.iterdir()) == ["step3", "step4"], sorted(p.name for p in runs.iterdir())
    assert memsave.checkpoint.latest(runs) == runs / "step4"
    return "ok"


def async_save(root: Path) -> str:
    """async_=True stages this rank's shards (its rows of the parameters and the AdamW state: about 3 x 4 bytes x
    numel / 2 under ZeRO-2 on 2 ranks), training goes on while the thread writes, and what loads is the state at
    the save; a write error surfaces at the next wait."""
    model, opt, mesh = _trained()
    expected = _weights(model)
    numel = sum(p.numel() for p in model.parameters())
    handle = memsave.save(root / "async", model, opt, extra={"step": 1}, async_=True)
    assert 0 < handle.staged_bytes <= 3 * 4 * numel // 2 + 4096, (handle.staged_bytes, numel)
    train(model, opt, mesh, batches(2)[1:], Z2)  # changes the live tensors while the save writes
    handle.wait()
    fresh, fopt, _ = wrapped(Z2, seed=3)
    assert memsave.load(root / "async", fresh, fopt).extra == {"step": 1}
    got = _weights(fresh)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    from torch.distributed.checkpoint import filesystem

    real = filesystem._write_item

    def failing(*args: Any, **kwargs: Any) -> Any:
        if _rank() == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    with mock.patch.object(filesystem, "_write_item", failing):
        failed = memsave.save(root / "async2", model, opt, async_=True)
        failed._thread.join()
    _expect(OSError, ["No space left on device"], memsave.checkpoint.wait)
    assert not (root / "async2").exists() and not (root / "async2.tmp").exists()
    memsave.checkpoint.wait()  # raised once; nothing pending now
    return "ok"


def export_and_load_weights(root: Path) -> str:
    """A tiny HF Llama (tied and untied) saved by save_pretrained loads into ZeRO-3 and tp=2 models with
    load_weights (each rank its rectangles); `memsave export` of a ZeRO-3 checkpoint writes the model's own
    state_dict keys (a tied parameter once) that safetensors reads back equal."""
    from safetensors.torch import load_file

    from memsave.cli import main
    from tests.ckpt_cases import llama

    for layout in (Layout("zero3", model="llama-untied"), Layout("ddp", tp=2, model="llama-untied"),
                   Layout("zero3", model="llama")):
        model, opt, mesh = wrapped(layout, seed=9)
        src = llama(5, tie=layout.model == "llama")
        folder = root / f"hf-{layout.model}"
        if mesh.rank == 0 and not folder.exists():
            src.save_pretrained(folder, safe_serialization=True)
        _barrier()
        assert memsave.load_weights(model, folder) == []
        got = model.state_dict()
        assert all(torch.equal(got[k], v) for k, v in src.state_dict().items()), layout
        opt.close()
    # the folder missing on one rank's node: every rank raises, naming it (rank 0 returned, then hung)
    _expect(ValueError, ["failed on rank 1", "elsewhere"],
            lambda: memsave.load_weights(model, folder if mesh.rank == 0 else root / "elsewhere"))
    model, opt, mesh = _trained()
    memsave.save(root / "to-export", model, opt)
    whole = model.state_dict()
    if mesh.rank == 0:
        assert main(["export", str(root / "to-export"), str(root / "model.safetensors")]) == 0
        exported = load_file(root / "model.safetensors")
        assert sorted(set(whole) - set(exported)) == ["lm_head.weight"], sorted(set(whole) - set(exported))
        assert all(torch.equal(whole[k], exported[k]) for k in exported)
        (root / "hf").mkdir()  # a folder: FOLDER/model.safetensors, where from_pretrained looks
        assert main(["export", str(root / "to-export"), str(root / "hf")]) == 0
        assert load_file(root / "hf" / "model.safetensors").keys() == exported.keys()
        with pytest.raises(ValueError, match=r"the folder .*missing.* does not exist"):
            memsave.checkpoint.export(root / "to-export", root / "missing" / "model.safetensors")
        # a folder meant (a trailing slash), which does not exist: refused, not a file named so
        assert main(["export", str(root / "to-export"), f"{root / 'newdir'}/"]) == 2
        assert not (root / "newdir").exists()
    _barrier()
    return "ok"


CASES: dict[str, Callable[[Path], str]] = {
    "export to safetensors, load_weights from HF folders": export_and_load_weights,
    "async save: staged, written in the background, errors at the next wait": async_save,
    "tampered .metadata: refused, nothing ran": tampered_metadata,
    "tampered shard: refused, nothing ran": tampered_shard,
    "corrupt shard: the checksum names the file": corrupt_shard,
    "missing or truncated shard: the file and the key": missing_and_truncated_shard,
    "full disk: every rank raises, the previous checkpoint loads": full_disk,
    "unwritable path, an extra one rank cannot store: every rank raises": unwritable_path,
    "interrupted save, keep_last": interrupted_save_and_keep_last,
}
