"""The optimizer's state in the plain optimizer's format, whatever the engine shards.

A state dict saved under any engine is the one the user's optimizer would save unwrapped (plus ``master_params``
and ``loss_scaler`` under mixed precision, the format of :class:`~memsave.precision.MixedPrecisionOptimizer`),
so it loads under another engine, stage or dp size. Which entries are gathered on save and cut to this rank's
rows on load follows each stepped tensor's placement: ``dp=Shard(0)`` rows are gathered (a collective over dp),
replicated tensors are taken as they are. Under tensor parallelism the per-element state (and the fp32 masters)
of a parameter tp cuts is gathered whole over ``tp`` too, as ``model.state_dict()`` holds it, and each rank cuts
its slice on load (a state dict of this rank's slices loads as it is); Adafactor's factored statistics likewise
along the dims they follow the parameter ([Note: factored statistics over tp] below). So a state dict saved on
one rank loads on every rank, and into a plain optimizer; before, rank 0's file held its own slices, which the
other tp rank loaded as its own with no error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from memsave import dist as mdist
from memsave.tp import TPParam, cut_tp, gather_tp, tp_param
from memsave.zero.rows import RowSharding

if TYPE_CHECKING:
    from memsave.engines.optimizer import MemsaveOptimizer

__all__ = ["full_grads", "load_state_dict", "state_dict"]


def _sharded(opt: MemsaveOptimizer, t: torch.Tensor) -> bool:
    """Whether a tensor the user's optimizer steps (a stepped tensor or its fp32 master) holds rows over dp."""
    return isinstance(opt.placement_of(t).dp, mdist.Shard)


def _tp_cut(opt: MemsaveOptimizer, t: torch.Tensor) -> TPParam | None:
    """The tp layout of the parameter of ``t`` (a stepped tensor or its master), where tp cuts it (else None)."""
    lay = tp_param(opt.full_of(t))
    return lay if lay is not None and lay.dim is not None else None


# [Note: factored statistics over tp] Adafactor's factored statistics: the dim each is a mean over (size 1
# there). Along the other dims they follow the parameter, so tp cuts them with it; along that one they are whole
# (reduced over tp: [Note: Adafactor under row sharding] in memsave/optim/adafactor.py), the same on every tp rank.
_MEAN_OVER = {"row_var": -1, "col_var": -2}


def _cut_with(key: str, value: Any, shape: tuple[int, ...], dim: int) -> bool:
    """Whether the state entry ``value`` of a parameter of ``shape`` (this rank's or the whole) is cut with it along
    ``dim``: per-element entries, and Adafactor's factored statistics along a dim they are not a mean over."""
    if not isinstance(value, torch.Tensor) or key == "step" or value.ndim != len(shape):
        return False
    if tuple(value.shape) == tuple(shape):
        return True
    over = _MEAN_OVER.get(key)
    return over is not None and dim != value.ndim + over and value.shape[dim] == shape[dim]


def _whole_over_tp(opt: MemsaveOptimizer, t: torch.Tensor, value: Any, key: str = "") -> Any:
    """``value`` (an entry of ``t``'s state, whole over dp) gathered whole over tp where it is cut with ``t``."""
    lay = _tp_cut(opt, t)
    if lay is None or lay.dim is None or not _cut_with(key, value, tuple(opt.full_of(t).shape), lay.dim):
        return value
    return gather_tp(value, lay.dim, opt.engine.mesh.group("tp"), blocks=lay.blocks, full=lay.full_shape[lay.dim])


def _slice_over_tp(opt: MemsaveOptimizer, t: torch.Tensor, value: Any, key: str = "") -> Any:
    """``value`` (an entry of a state dict for ``t``) cut to this tp rank's slice where it is whole over tp."""
    lay = _tp_cut(opt, t)
    if lay is None or lay.dim is None or not _cut_with(key, value, lay.full_shape, lay.dim):
        return value
    mesh = opt.engine.mesh
    return cut_tp(value, lay, mesh.degree("tp"), mesh.axis_rank("tp"))


def state_dict(opt: MemsaveOptimizer) -> dict[str, Any]:
    """The full optimizer state (collective over dp when anything is sharded, and over tp where tp cuts a
    parameter: call on every rank)."""
    rows = RowSharding(opt.engine.mesh)
    if opt.any_sharded:
        mdist.expect_every_rank("optimizer.state_dict() under ZeRO", rows.group)
    if opt.engine.mesh.degree("tp") > 1:
        mdist.expect_every_rank("optimizer.state_dict() under tensor parallelism", opt.engine.mesh.group("tp"))
    opt.settle()
    inner = opt.optimizer
    sd = inner.state_dict()
    stepped = [s for g in inner.param_groups for s in g["params"]]
    own: dict[torch.Tensor, torch.Tensor] = {}  # offloaded fp32 masters
    if opt.offloaded is not None:  # the state of every shard is in the offload store, in the plain format
        local, own = opt.offloaded.local()
        sd["state"] = {i: local[s] for i, s in enumerate(stepped) if s in local}
    for index, live in sd["state"].items():
        s = stepped[index]
        full = opt.full_of(s)
        state = sd["state"][index] = dict(live)  # torch hands out the live per-parameter dicts
        if _sharded(opt, s):
            for key in sorted(state):
                if rows.is_per_element(inner, key, state[key], s, full):
                    state[key] = rows.gather(state[key], full)
        for key in sorted(state):
            state[key] = _whole_over_tp(opt, s, state[key], key)
    if opt.mp is not None:  # the format of MixedPrecisionOptimizer's
        sd["master_params"] = [_whole_over_tp(opt, m, rows.gather(own.get(m, m).detach(), opt.full_of(m))
                                              if _sharded(opt, m) else own.get(m, m).detach().clone())
                               for m in stepped]
        sd["loss_scaler"] = opt.scaler.state_dict() if opt.scaler is not None else None
    return sd


def load_state_dict(opt: MemsaveOptimizer, sd: dict[str, Any]) -> None:
    """Load a full (plain-optimizer) state dict: every rank keeps its rows of what is sharded."""
    opt.settle()
    rows = RowSharding(opt.engine.mesh)
    inner = opt.optimizer
    stepped = [s for g in inner.param_groups for s in g["params"]]
    sd = _this_stage(opt, sd, len(stepped))
    local: dict[str, Any] = {"param_groups": sd["param_groups"], "state": {}}
    for index, state in sd["state"].items():
        s = stepped[int(index)]
        full = opt.full_of(s)
        out = {}
        for key, value in state.items():
            value = _slice_over_tp(opt, s, value, key)
            if _sharded(opt, s) and rows.is_per_element(inner, key, value, full, full):
                out[key] = rows.own_rows(value.to(s.device), full).clone()
            else:  # never alias the caller's tensors (e.g. Adam's step, which is incremented in place)
                out[key] = value.clone() if isinstance(value, torch.Tensor) else value
        local["state"][index] = out
    if opt.mp is None:
        inner.load_state_dict(local)
        if opt.offloaded is not None:  # into the store: the live optimizer holds no offloaded state
            opt.offloaded.load_local_state({s: inner.state.pop(s) for s in stepped if s in inner.state})
        return
    masters = sd.get("master_params")
    if masters is not None:
        if len(masters) != len(stepped):
            raise ValueError(f"state dict holds {len(masters)} master weights, this optimizer has {len(stepped)}")
        masters = [_slice_over_tp(opt, s, m) for m, s in zip(masters, stepped)]
        local["master_params"] = [
            rows.own_rows(m.to(s.device, torch.float32), opt.full_of(s)).clone() if _sharded(opt, s)
            else m.to(s.device, torch.float32) for m, s in zip(masters, stepped)]
    local["loss_scaler"] = sd.get("loss_scaler")
    if opt.offloaded is None:
        opt.mp.load_state_dict(local)
        return
    # offloaded masters ([Note: offloaded masters] in memsave/offload/state.py): they go into the store with
    # the state (absent from a plain optimizer's state dict: kept as they are)
    inner.load_state_dict({"param_groups": local["param_groups"], "state": local["state"]})
    own = {s: m for s, m in zip(stepped, local["master_params"])} if masters is not None else None
    opt.offloaded.load_local_state({s: inner.state.pop(s) for s in stepped if s in inner.state}, own)
    if opt.scaler is not None and local["loss_scaler"] is not None:
        opt.scaler.load_state_dict(local["loss_scaler"])


def _this_stage(opt: MemsaveOptimizer, sd: dict[str, Any], count: int) -> dict[str, Any]:
    """Under pp a rank's optimizer holds its stages' parameters, and ``optimizer.state_dict()`` gives those. A
    whole model's state dict (a plain optimizer's, saved without pp, as ``model.load_state_dict`` takes the whole
    model's) is cut to this rank's entries, renumbered; it raised a bare IndexError (a review)."""
    if opt.whole_positions is None:
        return sd
    positions, total = opt.whole_positions
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    if len(ids) == count or total == count:
        return sd
    if len(ids) != total:
        raise ValueError(f"optimizer state dict holds {len(ids)} parameters; this optimizer has {count} (this pipeline "
                         f"rank's stages) of the model's {total}: load the state dict this rank saved, or the whole "
                         "model's")
    local = {ids[pos]: k for k, pos in enumerate(positions)}
    out = {**sd, "param_groups": [{**g, "params": [local[i] for i in g["params"] if i in local]}
                                  for g in sd["param_groups"]],
           "state": {local[int(i)]: v for i, v in sd["state"].items() if int(i) in local}}
    if sd.get("master_params") is not None:
        out["master_params"] = [sd["master_params"][pos] for pos in positions]
    return out


@torch.no_grad()
def full_grads(opt: MemsaveOptimizer) -> dict[str, torch.Tensor | None]:
    """The averaged, unscaled full gradient of every trainable parameter, by name (collective over dp when
    anything is sharded; for checks and debugging)."""
    engine = opt.engine
    rows = RowSharding(engine.mesh)
    pairs = [(p, s) for s, p in opt.stepped_to_full.items()]
    names = {p: n for n, p in engine.model.named_parameters()}
    grads = {s: engine.grad_of(s) for _, s in pairs}
    flags = torch.tensor([g is not None for g in grads.values()], dtype=torch.int32, device=engine.mesh.device)
    if opt.any_sharded:
        mdist.all_reduce(flags, rows.group)
    master_of = {s: m for m, s in opt.mp.pairs} if opt.mp is not None else {}
    out: dict[str, torch.Tensor | None] = {}
    for (p, s), has in zip(pairs, flags.tolist()):
        if not p.requires_grad:
            continue
        master = master_of.get(s)
        grad = grads[s]
        if master is not None and master is not s and master.grad is not None:
            grad = master.grad  # unscaled already (clip_grad_norm ran)
        elif grad is None:
            grad = torch.zeros_like(s)
        elif opt.scaler is not None and not (master is s and opt.mp is not None and opt.mp.unscaled):
            grad = grad.float() / opt.scaler.scale  # the user sees unscaled gradients
        if not has:
            out[names[p]] = None
        else:
            sharded = isinstance(engine.placement_of(s).dp, mdist.Shard)
            full = rows.gather(grad, p) if sharded else grad.clone()
            lay = tp_param(p)
            if lay is not None and lay.dim is not None:  # whole over tp too (a collective over tp)
                full = gather_tp(full, lay.dim, engine.mesh.group("tp"), blocks=lay.blocks,
                                 full=lay.full_shape[lay.dim])
            out[names[p]] = full
    return out
