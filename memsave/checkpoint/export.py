"""Export a checkpoint's model to safetensors, and load safetensors weights into a (wrapped) model.

:func:`export` writes the safetensors layout itself (an 8-byte header length, the JSON header with every
tensor's dtype, shape and byte range, then the data) so that it can stream: the header comes from DCP's metadata,
then one tensor at a time is read (from the chunks of every rank) and appended. Peak memory is the largest
tensor, never the model. Keys are the model's own ``state_dict`` names (a tied parameter once, under its first
name, as ``save_pretrained`` writes it).

:func:`load_weights` reads a ``.safetensors`` file, or a folder with ``model.safetensors`` or a sharded
``model.safetensors.index.json``, memory-mapped: each rank reads only its rectangles (ZeRO-3 rows, TP slices).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memsave.checkpoint.commit import agree, arrive, read_manifest, verify_files
from memsave.checkpoint.layout import held_params
from memsave.checkpoint.state import buffers, offloaded_params_in, offloaded_params_out
from memsave.dist import Shard
from memsave.dist.dcp import Rect, load_rects, read_metadata, tensor_keys
from memsave.wrapped import MemsaveModule

__all__ = ["export", "load_weights"]

_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def export(checkpoint: str | Path, out: str | Path) -> dict[str, tuple[int, ...]]:
    """Write the model of ``checkpoint`` (a :func:`memsave.save` directory) to the safetensors file ``out`` (an
    existing folder: ``out/model.safetensors``, where ``from_pretrained`` looks), one tensor at a time. One
    process, no process group needed. Returns the keys written with their shapes."""
    target = Path(out)
    if target.is_dir():
        target = target / "model.safetensors"
    elif str(out).endswith(("/", os.sep)):  # a folder meant (Path drops the slash): it must exist
        raise ValueError(f"export: out={str(out)!r}: the folder does not exist; create it first, or name a file")
    if not target.parent.is_dir():
        raise ValueError(f"export: out={str(out)!r}: the folder {str(target.parent)!r} does not exist; "
                         "create it first, or name a file in an existing folder")
    ckpt = Path(checkpoint)
    # every file's size and CRC-32, as a load checks them (a flipped byte was exported as a weight of 4.5e36)
    verify_files(ckpt, read_manifest(ckpt), checksums=True, alone=True)
    keys = tensor_keys(read_metadata(ckpt))
    names = {k.split("/", 1)[1]: k for k in sorted(keys) if k.startswith(("model/", "buffer/"))}
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": f"memsave checkpoint {ckpt.name}"}}
    offset = 0
    for name, key in names.items():
        shape, dtype = keys[key]
        if dtype not in _ST_DTYPES:
            raise NotImplementedError(f"export: {name} has dtype {dtype}, which safetensors cannot hold")
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    tmp = target.with_name(target.name + ".part")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for key in names.values():
            shape, dtype = keys[key]
            whole = torch.empty(shape, dtype=dtype)
            load_rects(ckpt, [Rect(key, whole, (0,) * len(shape), tuple(shape))], no_dist=True)
            f.write(whole.reshape(-1).view(torch.uint8).numpy().tobytes() if whole.numel() else b"")
    tmp.replace(target)
    return {name: keys[key][0] for name, key in names.items()}


def _files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it."""
    if path.is_file():
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return dict.fromkeys(f.keys(), path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: path / v for k, v in weight_map.items()}
    single = path / "model.safetensors"
    if single.is_file():
        return _files(single)
    raise ValueError(f"load_weights: {path} is neither a .safetensors file nor a folder with model.safetensors or "
                     "model.safetensors.index.json")


def load_weights(model: nn.Module, path: str | Path, *, strict: bool = True) -> list[str]:
    """Load safetensors weights (file, or a Hugging Face folder, sharded or not) into ``model``, wrapped or plain:
    each rank reads only the rectangles it holds, memory-mapped. Returns the names in the files the model does not
    have (with ``strict``, a missing parameter raises ``ValueError``). Call on every rank of a wrapped model."""
    if not isinstance(model, MemsaveModule):
        return _load_weights(model, path, strict=strict)
    # agreed: a rank that cannot read its part (a file missing on its node, a stage's weight missing) raised
    # alone, and the others went on to hang in their next collective
    arrive("memsave.load_weights() into a wrapped model")  # [Note: called on rank 0 alone]
    unused = agree(f"load_weights({path})", lambda: _load_weights(model, path, strict=strict))
    assert unused is not None
    return unused


def _load_weights(model: nn.Module, path: str | Path, *, strict: bool) -> list[str]:
    from safetensors import safe_open

    where = _files(Path(path))
    aliases: dict[nn.Parameter, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(p, []).append(name)
    po = None
    if isinstance(model, MemsaveModule):
        engine = model.memsave_engine
        engine.reshard()
        po = offloaded_params_in(engine)  # [offload] params: every shard in memory for the read, written back after
        rows = {p: s for p, s in engine.stepped() if isinstance(engine.placement_of(s).dp, Shard)}
        held = held_params(model, engine.mesh, int(getattr(engine, "stage", 0)), rows)
        rects = [r for h in held for r in h.rects(h.name, h.local.detach(), (True,) * h.local.dim(), h.local_rows)]
        params = {h.name: h.param for h in held}
    else:
        rects = [Rect(n, p.detach(), (0,) * p.dim(), tuple(p.shape)) for n, p in model.named_parameters()]
        params = dict(model.named_parameters())
    rects += [Rect(n, b.detach(), (0,) * b.dim(), tuple(b.shape)) for n, b in buffers(model).items()]
    used: set[str] = set()
    missing: list[str] = []
    sources: list[tuple[Rect, str]] = []
    for r in rects:
        owner = params.get(r.key)
        source = next((n for n in ([r.key] if owner is None else aliases[owner]) if n in where), None)
        if source is None:
            missing.append(r.key)
        else:
            sources.append((r, source))
    # file by file, one open at a time: an open file's pages that were read stay resident until it is closed
    sources.sort(key=lambda rs: str(where[rs[1]]))
    current: tuple[Path, Any] | None = None
    try:
        with torch.no_grad():
            for r, source in sources:
                used.add(source)
                if current is None or current[0] != where[source]:
                    current = None  # the previous file's mapping goes before the next is opened
                    current = (where[source], safe_open(str(where[source]), framework="pt"))
                piece = current[1].get_slice(source)
                if tuple(piece.get_shape()) != r.shape:
                    raise ValueError(f"load_weights: {source} in {where[source]} has shape "
                                     f"{tuple(piece.get_shape())}, the model's is {r.shape}")
                index = tuple(slice(o, o + n) for o, n in zip(r.offsets, r.tensor.shape))
                r.tensor.copy_(piece[index] if index else piece[:])
    finally:
        offloaded_params_out(po)
    if strict and missing:
        raise ValueError(f"load_weights: {path} has no weights for {sorted(set(missing))[:8]}")
    if isinstance(model, MemsaveModule):
        for listener in model.memsave_engine.load_listeners:  # fp32 masters follow the loaded parameters
            listener(None)
    return sorted(set(where) - used)

