"""What a wrapped model and its optimizer hold on this rank, as checkpoint rectangles (save) and as rectangles
to fill, plus the tensors to create (load).

Keys are the model's own names (tied parameters under their first name): ``model/<name>`` (the parameters, in
their dtype), ``buffer/<name>`` (persistent buffers), ``master/<name>`` (fp32 masters under mixed precision) and
``optim/<name>/<key>`` (the optimizer's per-parameter state). Hyperparameters, non-tensor state and the loss
scaler go into the JSON manifest.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from memsave.checkpoint.encode import decode, encode
from memsave.checkpoint.layout import Held, follow_mask, held_params
from memsave.dist import Mesh, Shard
from memsave.dist.dcp import CheckpointFormatError, Rect
from memsave.engines import MemsaveOptimizer
from memsave.offload.chunks import MASTER
from memsave.wrapped import MemsaveModule

__all__ = ["Target", "buffers", "engine_param_offload", "model_rects", "offloaded_params_in",
           "offloaded_params_out", "optimizer_meta", "optimizer_rects", "target_of"]


@dataclasses.dataclass
class Target:
    """A wrapped model (and optimizer) as this rank holds them."""

    model: nn.Module
    optimizer: MemsaveOptimizer | None
    mesh: Mesh
    stage: int
    held: dict[nn.Parameter, Held]
    engine: Any

    @property
    def device(self) -> torch.device:
        return self.mesh.device


def target_of(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Target:
    if not isinstance(model, MemsaveModule):
        raise ValueError(f"memsave.save/load: model is a plain {type(model).__name__}; pass the model returned by "
                         "memsave.wrap (for a plain model use memsave.load_weights or torch's own state_dict)")
    engine = model.memsave_engine
    if optimizer is not None and not isinstance(optimizer, MemsaveOptimizer):
        raise ValueError(f"memsave.save/load: optimizer is a plain {type(optimizer).__name__}; pass the optimizer "
                         "returned by memsave.wrap together with its model")
    if optimizer is not None and optimizer.engine is not engine:
        raise ValueError("memsave.save/load: the optimizer was wrapped with another model")
    stepped = dict(engine.stepped())
    rows_sharded = {p: s for p, s in stepped.items() if isinstance(engine.placement_of(s).dp, Shard)}
    stage = int(getattr(engine, "stage", 0))
    held = {h.param: h for h in held_params(model, engine.mesh, stage, rows_sharded)}
    return Target(model, optimizer, engine.mesh, stage, held, engine)


def buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's persistent buffers by their state-dict name."""
    out = {}
    for prefix, module in model.named_modules():
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = b
    return out


def model_rects(t: Target, *, for_load: bool, keys: dict[str, Any] | None = None) -> list[Rect]:
    """The parameters' rectangles: on save this rank's rows (ZeRO: every rank writes only its rows), on load what
    the rank holds (ZeRO-3: its rows; otherwise the whole TP slice). On load a parameter whose checkpoint holds an
    fp32 master is read from it when the parameter itself is fp32 (the master is the exact value)."""
    rects: list[Rect] = []
    po = engine_param_offload(t.engine)
    unit_of = {id(p): u for u in getattr(t.engine, "units", ()) for p in u.params} if po is not None else {}
    for h in t.held.values():
        key = f"model/{h.name}"
        if for_load and keys is not None and h.param.dtype == torch.float32 and f"master/{h.name}" in keys:
            key = f"master/{h.name}"
        if for_load or h.stepped is None or h.rows is None:
            value, rows = h.local, h.local_rows
        else:
            value, rows = h.stepped, h.rows
        unit = unit_of.get(id(h.param))
        if po is not None and unit is not None and not for_load:  # [Note: offloaded parameters in checkpoints]
            meta = torch.empty(value.shape, dtype=value.dtype, device="meta")
            for r in h.rects(key, meta, (True,) * value.dim(), rows):
                v = r.tensor
                rects.append(dataclasses.replace(r, fill=functools.partial(
                    _offloaded_param, po, unit, value, tuple(v.size()), tuple(v.stride()), int(v.storage_offset()))))
            continue
        rects += h.rects(key, value.detach(), (True,) * value.dim(), rows)
    for name, b in buffers(t.model).items():
        rects.append(Rect(f"buffer/{name}", b.detach(), (0,) * b.dim(), tuple(b.shape)))
    return rects


# [Note: offloaded parameters in checkpoints] With ``[offload] params`` a unit's shard lives on its tier and is
# in memory only while used. A save reads each parameter's rows when DCP writes them (``Rect.fill``): the unit is
# loaded, the rows copied out, the unit released (evicted again, it is clean). A load brings every unit in
# (``enter``: loaded and marked changed), reads the checkpoint into the shards, and writes them back to the tier
# (``finish``, then ``drain``): for the load only, this rank's parameter shards are all in memory once.
def _offloaded_param(po: Any, unit: Any, value: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...],
                     at: int) -> torch.Tensor:
    po.load(unit)
    try:
        rows = value.detach().clone()  # contiguous: the rectangle's strides are those of a tensor like it
    finally:
        po.release(unit)
    return rows if tuple(rows.shape) == size and at == 0 else rows.as_strided(size, stride, at).clone()


def engine_param_offload(engine: Any) -> Any:
    """The ZeRO-3 engine's ``[offload] params`` (under pp its stages' engine's), None without: the engine holds it
    whether or not the optimizer is given (a model-only load read into evicted shards: garbage, or a crash)."""
    return getattr(getattr(engine, "inner", engine), "param_offload", None)


def offloaded_params_in(engine: Any) -> Any:
    """Load with ``[offload] params``: every unit's shard in memory and marked changed (see the Note above); call
    :func:`offloaded_params_out` after the read."""
    po = engine_param_offload(engine)
    if po is not None:
        for u in po.units:
            po.enter(u)
    return po


def offloaded_params_out(po: Any) -> None:
    if po is not None:
        po.finish()
        po.drain()


def _stepped_pairs(opt: MemsaveOptimizer) -> list[torch.Tensor]:
    return [s for g in opt.optimizer.param_groups for s in g["params"]]


def optimizer_meta(t: Target, opt: MemsaveOptimizer) -> dict[str, Any]:
    """The JSON half of the optimizer: class, param groups (hyperparameters, their parameters by name),
    non-tensor per-parameter state and the loss scaler."""
    inner = opt.optimizer
    groups = []
    for g in inner.param_groups:
        names = [t.held[opt.full_of(s)].name for s in g["params"]]
        groups.append({"params": names, **{k: encode(v, f"param_groups.{k}") for k, v in g.items() if k != "params"}})
    scalars: dict[str, dict[str, Any]] = {}
    for s, st in _states(opt).items():
        plain = {k: encode(v, f"state.{k}") for k, v in st.items() if not isinstance(v, torch.Tensor)}
        if plain:
            scalars[t.held[opt.full_of(s)].name] = plain
    return {"class": type(inner).__name__, "param_groups": groups, "scalars": scalars,
            "mixed_precision": opt.mp is not None,
            "loss_scaler": opt.scaler.state_dict() if opt.scaler is not None else None}


def _states(opt: MemsaveOptimizer) -> dict[torch.Tensor, dict[str, Any]]:
    if opt.offloaded is not None:  # what is not per element (``step``): no read of the tier
        return {s: sc for s, sc in opt.offloaded.stream_layout()[1].items() if sc}
    return {s: st for s in _stepped_pairs(opt) if (st := opt.optimizer.state.get(s))}


def _masters(opt: MemsaveOptimizer) -> dict[torch.Tensor, torch.Tensor]:
    """Inner optimizer tensor -> its fp32 master rows (under mixed precision)."""
    if opt.mp is None:
        return {}
    own = opt.offloaded.local()[1] if opt.offloaded is not None else {}
    return {s: own.get(s, s) for s in _stepped_pairs(opt)}


# [Note: offloaded state streamed] An offloaded optimizer's state and masters live on their tier in chunks
# (memsave/offload/state.py). Saving them never reads the tier whole: each rectangle is a meta tensor of its shape
# with a ``fill`` that DCP's writer calls when it writes that rectangle (one at a time, memsave/dist/dcp.py); the
# fill reads the tensor's pieces from their chunks (the last chunk kept) and keeps only that one tensor until the
# next is asked for. An async save stages the same way, so it holds them all (staging is its point).
def _offloaded_rects(t: Target, opt: MemsaveOptimizer) -> list[Rect]:
    """Save with offloaded state: each rectangle reads its tensor from the tier when it is written ([Note:
    offloaded state streamed]), so at most one state tensor of this rank (and one chunk) is in memory at once."""
    off = opt.offloaded
    assert off is not None
    keys, scalars = off.stream_layout()
    cache: dict[str, Any] = {}
    whole: dict[str, Any] = {}

    def fill(s: torch.Tensor, key: str, size: tuple[int, ...], stride: tuple[int, ...], at: int) -> torch.Tensor:
        if whole.get("key") != (id(s), key):  # one tensor at a time: the rectangles of one come in a row
            whole.clear()
            value = off.read_whole(s, key, cache)
            if tuple(value.shape) == size and at == 0:  # the rectangle is the whole tensor: handed over as it is
                return value
            whole["key"], whole["value"] = (id(s), key), value
        return whole["value"].as_strided(size, stride, at).clone()

    rects: list[Rect] = []
    for s, found in keys.items():
        h = t.held[opt.full_of(s)]
        for key, dtype in found.items():
            if key == MASTER:
                name, follows = f"master/{h.name}", (True,) * s.dim()
            else:
                name, follows = f"optim/{h.name}/{key}", follow_mask(opt.optimizer, key, s.shape, s.shape)
            for r in h.rects(name, torch.empty(s.shape, dtype=dtype, device="meta"), follows, _rows(opt, h, s)):
                v = r.tensor
                rects.append(dataclasses.replace(r, fill=functools.partial(
                    fill, s, key, tuple(v.size()), tuple(v.stride()), int(v.storage_offset()))))
        for key, value in scalars.get(s, {}).items():  # in memory (``step``): written as it is
            if isinstance(value, torch.Tensor):
                follows = follow_mask(opt.optimizer, key, value.shape, s.shape)
                rects += h.rects(f"optim/{h.name}/{key}", value.detach(), follows, _rows(opt, h, s))
    return rects


def optimizer_rects(t: Target, opt: MemsaveOptimizer) -> list[Rect]:
    """Save: the rectangles of this rank's optimizer state and fp32 masters."""
    if opt.mp is not None:  # [Note: edits between steps] in memsave/precision/edits.py
        opt.mp.edits.sync()
    if opt.offloaded is not None:
        return _offloaded_rects(t, opt)
    inner = opt.optimizer
    rects: list[Rect] = []
    for s, master in _masters(opt).items():
        h = t.held[opt.full_of(s)]
        rects += h.rects(f"master/{h.name}", master.detach(), (True,) * master.dim(), _rows(opt, h, s))
    for s, st in _states(opt).items():
        h = t.held[opt.full_of(s)]
        for key, v in st.items():
            if isinstance(v, torch.Tensor):
                follows = follow_mask(inner, key, v.shape, s.shape)
                rects += h.rects(f"optim/{h.name}/{key}", v.detach(), follows, _rows(opt, h, s))
    return rects


def _rows(opt: MemsaveOptimizer, h: Held, s: torch.Tensor) -> tuple[int, int] | None:
    return h.rows if isinstance(opt.placement_of(s).dp, Shard) else None


@dataclasses.dataclass
class OptimizerLoad:
    """Load: the state tensors created for this rank (filled by the read), then installed by :meth:`install`."""

    opt: MemsaveOptimizer
    meta: dict[str, Any]
    states: dict[torch.Tensor, dict[str, Any]]
    masters: dict[torch.Tensor, torch.Tensor]  # filled from the checkpoint (empty: it has none)
    rects: list[Rect]

    def install(self) -> None:
        opt, inner = self.opt, self.opt.optimizer
        saved_groups = self.meta["param_groups"]
        groups, start = [], 0
        for g, saved in zip(inner.param_groups, saved_groups):  # numbered across the groups, as torch's state is
            groups.append({**{k: _like(decode(v), g.get(k)) for k, v in saved.items() if k != "params"},
                           "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        stepped = _stepped_pairs(opt)
        index = {s: i for i, s in enumerate(stepped)}
        for s, st in self.states.items():
            st.update(self.meta["scalars"].get(self.rects_name[s], {}))
        if opt.scaler is not None and self.meta.get("loss_scaler") is not None:
            opt.scaler.load_state_dict(self.meta["loss_scaler"])
        if opt.offloaded is not None:
            inner.param_groups[:] = [{**g, **{k: v for k, v in ng.items() if k != "params"}}
                                     for g, ng in zip(inner.param_groups, groups)]
            own = None
            if opt.mp is not None:
                own = {s: self.masters.get(s, s.detach().float()) for s in stepped}
            opt.offloaded.load_local_state(self.states, own)
            return
        inner.load_state_dict({"param_groups": groups, "state": {index[s]: st for s, st in self.states.items()}})
        if opt.mp is not None:
            if self.masters:
                opt.mp.load_masters([self.masters.get(m, m) for m, _ in opt.mp.pairs])
            else:
                opt.mp.refresh_masters()

    rects_name: dict[torch.Tensor, str] = dataclasses.field(default_factory=dict)


def _like(value: Any, current: Any) -> Any:
    """A hyperparameter as the live group holds it (a tensor lr stays a tensor)."""
    if isinstance(current, torch.Tensor) and not isinstance(value, torch.Tensor):
        return torch.tensor(value, dtype=current.dtype, device=current.device)
    return value


def merge_stage_metas(metas: list[dict[str, Any]]) -> dict[str, Any]:
    """The optimizer metadata of every pp rank (each steps its own stages) as one: each param group's names in
    stage order, a weight tied across stages once (under its whole-model name), every parameter's scalars."""
    merged = dict(metas[0])
    groups = []
    for i, g in enumerate(metas[0]["param_groups"]):
        names: dict[str, None] = {}
        for m in metas:
            names.update(dict.fromkeys(m["param_groups"][i]["params"]))
        groups.append({**g, "params": list(names)})
    merged["param_groups"] = groups
    merged["scalars"] = {k: v for m in metas for k, v in m["scalars"].items()}
    merged["pipeline"] = True
    return merged


def optimizer_load(t: Target, opt: MemsaveOptimizer, meta: dict[str, Any],
                   keys: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> OptimizerLoad:
    """Check the checkpoint's optimizer against this one and create the tensors its state is read into."""
    inner = opt.optimizer
    if meta["class"] != type(inner).__name__:
        raise ValueError(f"memsave.load: the checkpoint's optimizer is {meta['class']}, this one is "
                         f"{type(inner).__name__}; load with the same optimizer class")
    mine = [[t.held[opt.full_of(s)].name for s in g["params"]] for g in inner.param_groups]
    theirs = [g["params"] for g in meta["param_groups"]]
    # under pp a rank's optimizer steps its stages' parameters only: each of its groups is part of the saved one
    staged = (t.mesh.degree("pp") > 1 or meta.get("pipeline", False)) and len(mine) == len(theirs)
    if staged and all(set(a) <= set(b) for a, b in zip(mine, theirs)):
        pass
    elif mine != theirs:
        raise ValueError(f"memsave.load: the optimizer's param groups differ from the checkpoint's (by parameter "
                         f"name): this one has {[len(g) for g in mine]} parameters per group, the checkpoint "
                         f"{[len(g) for g in theirs]}; first difference: "
                         f"{next((a, b) for a, b in zip([*mine, []], [*theirs, []]) if a != b)}")
    states: dict[torch.Tensor, dict[str, Any]] = {}
    masters: dict[torch.Tensor, torch.Tensor] = {}
    rects: list[Rect] = []
    names: dict[torch.Tensor, str] = {}
    for s in _stepped_pairs(opt):
        h = t.held[opt.full_of(s)]
        names[s] = h.name
        rows = _rows(opt, h, s)
        prefix = f"optim/{h.name}/"
        for key, (shape, dtype) in keys.items():
            if not key.startswith(prefix):
                continue
            name = key[len(prefix):]
            follows = follow_mask(inner, name, shape, h.full_shape)
            value = torch.zeros(h.local_shape(shape, follows, s), dtype=dtype, device=s.device)
            states.setdefault(s, {})[name] = value
            rects += h.rects(key, value, follows, rows)
        if opt.mp is not None and f"master/{h.name}" in keys:
            master = torch.zeros(s.shape, dtype=torch.float32, device=s.device)
            masters[s] = master
            rects += h.rects(f"master/{h.name}", master, (True,) * master.dim(), rows)
    if opt.mp is not None and masters and len(masters) != len(names):
        missing = sorted(set(names.values()) - {names[s] for s in masters})
        raise CheckpointFormatError(f"memsave.load: the checkpoint has fp32 masters for some parameters but not "
                                    f"{missing[:5]}")
    return OptimizerLoad(opt, meta, states, masters, rects, names)
