"""``memsave.estimate`` under pipeline parallelism: one estimate per pipeline rank, before anything is allocated.

[Note: a stage's estimate] A pipeline rank holds the stages ``r, r + pp, ...`` of the split
(memsave/pp/split.py), so its model states are those of the meta model with the other stages' atoms stripped, as
``memsave.wrap`` strips them before ZeRO: the same :func:`memsave.estimator.held_states` over the ``world_size /
pp`` dp ranks of the stage (a weight tied across stages is held, and counted, on every stage that uses it).

Activations come from one forward of the whole meta model, each saved storage attributed to the atom whose
forward saved it; what the model's own code saves between atoms belongs to the stage of the next atom called
(the stage runner runs that code with real inputs on that stage only: memsave/pp/runtime.py), after the last atom
to the last stage. That gives each stage's bytes per micro-batch. The schedule (``[parallel] schedule``, or one
given) says how many micro-batches each rank holds at once: :func:`memsave.pp.simulate`'s memory walk with those
bytes per stage, e.g. ``pp - r`` micro-batches on rank ``r`` under 1F1B, ``m`` under GPipe, and under
interleaved and zero-bubble schedules whatever their action lists hold. The last stage also holds one
micro-batch's outputs (the logits) at the end of its forward.

The peak walks the rank's actions in order: after each forward (what it holds, the outputs on the last stage)
and after each backward, the gradients are the buckets' (stage 0) and the full gradients accumulated under
``no_sync``: a stage's from its own first backward on (under interleaving a rank's chunks start apart; the
root's, the embedding and the head, from the rank's first backward); the last backward (the synchronizing
one) is the walk of [Note: the estimated peak] with what is left of the activations. ZeRO-3 stages hold every
unit gathered for the step under ``[parallel] gather = "step"``. P2P receive buffers: a received activation is held until its
backward; where no op of the stage saves it (then it is not among the activations) it is counted as ``comm``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from memsave.config import Profile
from memsave.estimate_activations import measure_activations, reuse
from memsave.estimate_cuda import allocator_extra
from memsave.estimator import Estimate, _total, _units, held_states, meta_copy, peak_bytes
from memsave.memory.schema import format_bytes
from memsave.models.units import output_tensors, unit_parameters
from memsave.pp.schedule import Schedule, build
from memsave.pp.simulate import Costs, simulate
from memsave.pp.split import StageSplit, plan_split, strip_atoms
from memsave.precision import compute_dtype
from memsave.wrapped import user_class

__all__ = ["StageActivations", "estimate_stages", "stage_activations"]


@dataclasses.dataclass(frozen=True)
class StageActivations:
    """Per (virtual) stage, bytes of one micro-batch ([Note: a stage's estimate]).

    saved: kept for backward by the stage's atoms and by the code the stage runs between them.
    per_atom: the saved bytes of each atom (by name), for the walk of the last backward.
    outputs: the model's outputs backward does not keep (the logits), on the last stage.
    received: the activations the stage receives from the one before it; unsaved: the part no op saves.
    """

    saved: tuple[int, ...]
    per_atom: dict[str, int]
    outputs: int
    received: tuple[int, ...]
    unsaved: tuple[int, ...]
    note: str
    logits: int = 0  # elements of the largest floating output (the logits), on the last stage


def stage_activations(meta: nn.Module, split: StageSplit, modules: list[nn.Module], prof: Profile, batch: Any,
                      device_type: str) -> StageActivations:
    """One forward of the (whole) meta model, its saved bytes per stage ([Note: a stage's estimate])."""
    return reuse("stages", meta, modules, prof, batch, device_type, (split.atoms, tuple(split.stage_of.items())),
                 lambda: _stage_activations(meta, split, modules, prof, batch, device_type))


def _stage_activations(meta: nn.Module, split: StageSplit, modules: list[nn.Module], prof: Profile, batch: Any,
                       device_type: str) -> StageActivations:
    atoms = [meta.get_submodule(a) for a in split.atoms]
    stage_of = [split.stage_of[a] for a in split.atoms]
    last = split.n_stages - 1
    produced: list[list[torch.Tensor]] = []  # each atom call's output tensors, in call order (kept alive here)

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        produced.append([t for t in output_tensors(output) if t.is_floating_point()])

    hooks = [m.register_forward_hook(keep) for m in atoms]
    try:
        saved, outputs, scale, note, logits = measure_activations(meta, modules, prof, batch, device_type,
                                                                  attribute=atoms)
    finally:
        for h in hooks:
            h.remove()
    keys: list[dict[Any, int]] = [{} for _ in range(split.n_stages)]
    for i, unit_keys in enumerate(saved._unit_keys):
        keys[stage_of[i]].update(unit_keys)
    calls = saved._calls
    for key, at in (saved._outside_at or {}).items():
        keys[stage_of[calls[at]] if at < len(calls) else last][key] = (saved._outside_keys or {})[key]
    received, unsaved = [0] * split.n_stages, [0] * split.n_stages
    for c in range(1, min(len(calls), len(produced))):  # where the stage changes, the previous call's output
        src, dst = stage_of[calls[c - 1]], stage_of[calls[c]]  # is what the next stage receives
        if dst != src:
            for t in produced[c - 1]:
                storage = t.untyped_storage()
                received[dst] += storage.nbytes()
                unsaved[dst] += 0 if storage._cdata in keys[dst] else storage.nbytes()
    per_atom = {a: int(sum(k.values()) * scale) for a, k in zip(split.atoms, saved._unit_keys)}
    return StageActivations(tuple(int(sum(k.values()) * scale) for k in keys), per_atom, outputs,
                            tuple(received), tuple(unsaved), note, logits)


def _check(prof: Profile, world_size: int) -> int:
    pp, tp = prof.parallel.pp, prof.parallel.tp
    if world_size % (pp * tp):
        what = f"[parallel] pp = {pp}" if tp == 1 else f"pp x tp = {pp} x {tp}"
        raise ValueError(f"world_size = {world_size} is not divisible by {what}; the ranks are dp x "
                         + ("pp" if tp == 1 else "tp x pp"))
    return world_size // (pp * tp)


def _copy(model: nn.Module, dtype: torch.dtype | None, tp: int, tp_plan: Mapping[str, str] | None) -> nn.Module:
    """A meta copy of ``model`` in the compute dtype, cut to tp rank 0's shapes under ``tp > 1``
    (:func:`memsave.tp.cut_shapes`, as :func:`memsave.estimate` does at pp = 1)."""
    meta = meta_copy(model)
    if dtype is not None:
        for p in meta.parameters():
            if p.is_floating_point():
                p.data = p.data.to(dtype)
    if tp > 1:
        from memsave.tp import cut_shapes  # layer 3

        cut_shapes(meta, tp, tp_plan)
    return meta


def estimate_stages(model: nn.Module, prof: Profile, *, world_size: int, batch: Any = None,
                    units: Sequence[nn.Module] | None = None, device: str = "cpu", micro_batches: int = 1,
                    schedule: Schedule | None = None, tp_plan: Mapping[str, str] | None = None) -> list[Estimate]:
    """One :class:`~memsave.estimator.Estimate` per pipeline rank (in pp rank order) of training ``model`` under
    ``prof`` (``[parallel] pp > 1``) on ``world_size`` ranks, ``micro_batches`` per step under the profile's
    schedule or ``schedule``; see [Note: a stage's estimate]. ``batch``: one micro-batch (None: model states
    only). Arguments otherwise as :func:`memsave.estimate`, which calls this."""
    n = _check(prof, world_size)
    pp, par = prof.parallel.pp, prof.parallel
    if schedule is None:
        schedule = build(par.schedule, pp, micro_batches, par.virtual)
    elif not isinstance(schedule, Schedule):
        raise ValueError(f"schedule = {schedule!r} is not allowed; expected a memsave.pp.Schedule")
    if (schedule.pp, schedule.micro_batches) != (pp, micro_batches):
        raise ValueError(f"schedule {schedule.name!r} is for pp = {schedule.pp} and {schedule.micro_batches} "
                         f"micro-batches; the profile has pp = {pp} and micro_batches = {micro_batches}")
    mixed = prof.precision.compute != "fp32"
    dtype = compute_dtype(prof.precision) if mixed else None
    whole = _copy(model, dtype, par.tp, tp_plan)
    split = plan_split(whole, schedule.n_stages, par.split)
    names = {id(m): name for name, m in model.named_modules()}
    if units is not None:  # the same modules, found in each copy by name
        unit_names = [names[id(u)] for u in units]
    else:  # the units of the whole model, as memsave.wrap chooses them before the split strips the others' stages
        whole_names = {id(m): name for name, m in whole.named_modules()}
        unit_names = [whole_names[id(u)] for u in _units(whole, None)[1]]
    whole_modules = dict(whole.named_modules())
    acts = None
    gathered = False
    if par.tp > 1 and par.sequence:
        from memsave.tp import gathers_whole  # layer 3

        gathered = gathers_whole(whole, tp_plan)  # each unit as without SP, an upper bound (as memsave.estimate)
    sequence = par.tp > 1 and par.sequence and prof.recompute.policy == "none" and not gathered
    if batch is not None:
        acts = stage_activations(whole, split, [whole_modules[u] for u in unit_names], prof, batch, device)
        if sequence:  # each unit keeps 1/tp of what it keeps uncut (as memsave.estimate without pp)
            uncut = _copy(model, dtype, 1, None)
            by_name = dict(uncut.named_modules())
            full = stage_activations(uncut, split, [by_name[u] for u in unit_names], prof, batch, device).per_atom
            per_atom, saved = dict(acts.per_atom), list(acts.saved)
            for a in unit_names:
                if a in per_atom:
                    share = -(-full[a] // par.tp)
                    saved[split.stage_of[a]] += share - per_atom[a]
                    per_atom[a] = share
            acts = dataclasses.replace(acts, saved=tuple(saved), per_atom=per_atom)
    per_mb = list(acts.saved) if acts is not None else [0] * schedule.n_stages
    sim = simulate(schedule, dataclasses.replace(Costs.uniform(schedule.n_stages), activation_bytes=per_mb))
    out = []
    for r in range(pp):
        meta = _copy(model, dtype, par.tp, tp_plan)
        strip_atoms(meta, split, schedule.stages_of(r), dtype=dtype)
        by_name = dict(meta.named_modules())
        mine = [(u, by_name[u]) for u in unit_names if any(True for _ in by_name[u].parameters())]
        groups = [[p for _, p in g] for g in unit_parameters(meta, [m for _, m in mine])]
        notes: list[str] = []
        held, states, model_state = held_states(meta, groups, prof, n, device, notes,
                                                over=f" of dp in each of {pp} pipeline ranks"
                                                + (f", each cut over tp = {par.tp} (per-rank shapes of tp rank 0)"
                                                   if par.tp > 1 else ""))
        if gathered:
            notes.append("sequence parallelism with projections that gather their outputs whole (colwise_gather_"
                         "output: the attention or MLP then runs whole on every rank): each unit as without it, an "
                         "upper bound")
        elif par.tp > 1 and par.sequence:
            notes.append(f"sequence parallelism: each unit keeps 1/{par.tp} of what it keeps without tensor "
                         "parallelism" if sequence else "sequence parallelism under recomputation: activations as "
                         "without it, an upper bound")
        peak = _walk(r, schedule, split, acts, held, states, prof, [u for u, _ in mine], notes)
        outputs = acts.outputs if acts is not None and split.n_stages - 1 in schedule.stages_of(r) else 0
        stage_params = sum(p.numel() for p in meta.parameters())
        local = schedule.stages_of(r)
        where = ", ".join(f"stage {s}: {_atoms_text(split.atoms_of(s))}" for s in local)
        notes.insert(0, f"pipeline rank {r} of {pp} ({where}; {stage_params:,} parameters), schedule "
                        f"{schedule.name}, {micro_batches} micro-batches: at most {sim.peak_micro_batches[r]} "
                        f"micro-batches' activations at once"
                        + (f", {' + '.join(format_bytes(per_mb[s]) for s in local)} each" if acts else ""))
        if acts is not None:
            notes.append(acts.note)
            if any(acts.received[s] for s in local):
                notes.append("p2p: receives " + " + ".join(format_bytes(acts.received[s]) for s in local)
                             + " per micro-batch, held until its backward"
                             + (f" ({' + '.join(format_bytes(acts.unsaved[s]) for s in local)} that no op saves, "
                                "counted as comm)" if any(acts.unsaved[s] for s in local) else
                                " (saved by the stage's first op: among the activations)"))
        transient = 0
        if device == "cuda":  # [Note: the allocator's peak]; the head's at this rank's peak: an upper bound
            total = _total(peak)
            transient, note = allocator_extra(
                forward_end=total, step=_total(held), peak=total,
                logits=acts.logits if acts is not None and outputs else 0, compute=prof.precision.compute,
                optimizer_state=held.get("optimizer_state", 0), optimizer=prof.optimizer.name)
            notes.append(note)
        out.append(Estimate(profile=prof.name, world_size=world_size, tp=par.tp, model=user_class(model).__name__,
                            num_params=sum(p.numel() for p in model.parameters()), transient=int(transient),
                            bytes={k: int(v) for k, v in peak.items() if v}, model_state=model_state,
                            activations=int(sim.peak_bytes[r]) + outputs, notes=tuple(notes),
                            units=f"units: {len(mine)} of this rank's stages", pp=pp, pp_rank=r))
    return out


def _atoms_text(names: list[str]) -> str:
    return f"{names[0]} .. {names[-1]}" if len(names) > 2 else ", ".join(names)


def _walk(r: int, schedule: Schedule, split: StageSplit, acts: StageActivations | None, held: dict[str, int],
          states: dict[str, Any], prof: Profile, unit_names: list[str], notes: list[str]) -> dict[str, int]:
    """The largest total over rank ``r``'s actions ([Note: a stage's estimate]): after each forward and each
    backward but the last, then the walk of the last backward (:func:`memsave.estimator.peak_bytes`)."""
    n_stages, m = schedule.n_stages, schedule.micro_batches
    saved = acts.saved if acts is not None else (0,) * n_stages
    unsaved = acts.unsaved if acts is not None else (0,) * n_stages
    outputs = acts.outputs if acts is not None else 0
    zero3 = prof.zero.stage == 3
    gathered = sum(states["unit_full"]) if zero3 and prof.parallel.gather == "step" else None
    static = dict(held)
    if zero3:
        static["params_gathered"] = gathered if gathered is not None else (
            states["unit_full"][0] + max(states["unit_full"][1:], default=0))
    # no_sync: p.grad of a stage's parameters from its first backward on (the root's, the embedding and the
    # head, counted from the rank's first backward)
    full = states["unit_grad_full"]
    stage_of = {a: s for s in schedule.stages_of(r) for a in split.atoms_of(s)}
    stage_grads = dict.fromkeys(schedule.stages_of(r), 0)
    for k, u in enumerate(unit_names):
        if u in stage_of:
            stage_grads[stage_of[u]] += full[k + 1]
    seen: set[int] = set()
    actions = schedule.actions[r]
    last_bwd = max(i for i, a in enumerate(actions) if a.kind in ("B", "W"))
    held_acts = p2p = 0
    best: dict[str, int] = dict(static)
    for a in actions[:last_bwd]:
        end_of_forward = 0
        if a.kind == "F":
            held_acts += saved[a.stage]
            p2p += unsaved[a.stage]
            end_of_forward = outputs if a.stage == n_stages - 1 else 0
        else:
            seen.add(a.stage)
            if a.kind != "I":  # an I keeps the graph (and its activations) for its W
                held_acts -= saved[a.stage]
                p2p -= unsaved[a.stage]
        accumulated = full[0] + sum(stage_grads[x] for x in seen) if m > 1 and seen else 0
        point = dict(static, activations=held_acts + end_of_forward, grads=static.get("grads", 0) + accumulated,
                     comm=static.get("comm", 0) + p2p)
        if _total(point) > _total(best):
            best = point
    stage = actions[last_bwd].stage
    atoms = set(split.atoms_of(stage))
    per_unit = [acts.per_atom.get(u, 0) if acts is not None and u in atoms else 0 for u in unit_names]
    base = dict(held, comm=held.get("comm", 0) + p2p)
    last = peak_bytes(base, states, prof, per_unit, held_acts, m, notes, gathered=gathered)
    return last if _total(last) > _total(best) else best
