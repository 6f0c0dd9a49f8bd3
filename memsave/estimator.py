"""``memsave.estimate``: per-rank memory of a model under a profile, predicted before anything is allocated.

Model states come from arithmetic on the parameters' shapes and dtypes (the ZeRO formulas of DESIGN.md, with
the exact dim-0 row sharding and padding of ``memsave/zero/layout.py``, the units of ``memsave.wrap``, the
optimizer's state per element, masters under mixed precision, offloaded shares). Activations come from one
forward of a *meta-device* copy of the model under the profile's recompute policy, with the saved-tensor
counting of ``memsave.recompute.measure``: shapes and dtypes only, so a model far bigger than this machine is
estimated in seconds.

[Note: the estimated peak] Memory peaks either at the end of forward (every activation held, nothing of this
step's gradients yet) or during backward, where activations are freed unit by unit as gradients appear and
reduce-scatters hold staging buffers. The estimate replays the tracker's samples: the end of forward, then
before and after each unit's backward in backward order. Before a unit's backward the units up to it still
hold their saved bytes; after it, its own are freed, its gradients exist (stage 1: the full gradients, kept
until the step; stages 2-3: only the persistent shard) and its reduce-scatter is in flight, with staging of
N x C elements in the reduce dtype (stage 1: plus a fresh output chunk), at most two at a time as in
``memsave/zero/engine.py``. At stage 3 the root stays gathered throughout, a unit is gathered from before its
backward until after it (its reduce-scatter is launched before it is freed: the point after it holds both), and
the gather of the unit before it is in flight (its staging buffer) with ``prefetch`` on. What the root saved before
the first unit ran (an embedding's indices, a vision model's patch convolution's pixels) is held at every point
of backward, and so are the gradients of the root's parameters used only after the last unit (a final norm, an
untied head: their ``.grad`` exists from backward's start until the root's reduce at its end; left out, an HF
Llama's peak under ZeRO-2 with full recomputation was 6.1% under the tracker's, and ``profile="auto"`` chose it
for a budget it then exceeded: a review). The largest total of these points is the estimated peak.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memsave.config import Profile, load_profile
from memsave.deferred.meta import meta_copy
from memsave.dist.placement import Placement, Shard
from memsave.estimate_activations import activations, sequence_parallel
from memsave.estimate_cuda import allocator_extra
from memsave.estimate_format import format_estimates
from memsave.estimate_offload import offload_states
from memsave.memory.schema import OFF_DEVICE
from memsave.models.units import REDUCES_IN_FLIGHT, choose_units, unit_parameters
from memsave.precision import compute_dtype, reduce_dtype_for
from memsave.wrapped import user_class

__all__ = ["Estimate", "estimate", "format_estimates", "meta_copy"]

_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Predicted bytes per category on the busiest rank (rank 0 holds the most rows), at the estimated peak.

    model_state: parameters, gradients, masters and optimizer state as the ZeRO formula counts them (full
        gradients at stages 0-1), the figure to compare with a step's end.
    activations: what one forward leaves held under the recompute policy, at its end: the bytes saved for
        backward and the outputs (logits, loss) not among them, as the tracker counts them.
    units: which units were estimated and why (``units: 30 units (children of ...): 0, 1 .. 29``), also a note.
    """

    profile: str
    world_size: int
    model: str
    num_params: int
    bytes: dict[str, int]
    model_state: int
    activations: int
    notes: tuple[str, ...] = ()
    units: str = ""
    tp: int = 1  # tensor-parallel degree: world_size / tp data-parallel ranks
    pp: int = 1  # pipeline degree: world_size / pp data-parallel ranks per stage
    pp_rank: int = 0  # under pp > 1: the pipeline rank this estimate is for (memsave/estimate_pp.py)
    stages: tuple[Estimate, ...] = ()  # under pp > 1: every pipeline rank's estimate; this one is the busiest
    transient: int = 0  # on CUDA: what the allocator holds beyond the tensors counted (memsave/estimate_cuda.py)

    @property
    def peak_total(self) -> int:
        return sum(v for k, v in self.bytes.items() if k not in OFF_DEVICE)

    @property
    def device_peak(self) -> int:
        """The device allocator's peak: ``peak_total`` and, on CUDA, its ``transient`` bytes."""
        return self.peak_total + self.transient

    def to_report_dict(self) -> dict[str, Any]:
        """The ``estimate`` entry of a ``memsave.report/2`` dict (under pp: the busiest rank's, and ``stages``, each
        pipeline rank's bytes and peak)."""
        out: dict[str, Any] = {"world_size": self.world_size, "bytes": {k: int(v) for k, v in self.bytes.items() if v},
                               "peak_total": int(self.peak_total), "notes": list(self.notes)}
        if self.stages:
            out["stages"] = [{"pp_rank": e.pp_rank, "bytes": {k: int(v) for k, v in e.bytes.items() if v},
                              "peak_total": int(e.peak_total)} for e in self.stages]
        return out


def _cast(meta: nn.Module, prof: Profile) -> nn.Module:
    """``meta``'s floating-point parameters in the compute dtype under mixed precision."""
    if prof.precision.compute != "fp32":
        dtype = compute_dtype(prof.precision)
        for p in meta.parameters():
            if p.is_floating_point():
                p.data = p.data.to(dtype)
    return meta


def _rows(shape: torch.Size) -> tuple[int, int]:
    return (shape[0], math.prod(shape[1:])) if len(shape) else (1, 1)


def _local_rows(shape: torch.Size, placement: Placement, n: int) -> int:
    """Rows of a parameter rank 0 holds under ``placement`` over ``n`` dp ranks (the most any rank holds)."""
    if isinstance(placement.dp, Shard) and len(shape):
        return -(-shape[0] // n)
    return _rows(shape)[0]


def _state_per_shard(shape: torch.Size, local: int, prof: Profile) -> int:
    """Optimizer-state bytes for one parameter's shard of ``local`` rows (fp32 state, as the optimizer steps
    fp32 parameters or fp32 masters)."""
    numel = local * _rows(shape)[1]
    opt = prof.optimizer
    if opt.name in ("adam", "adamw"):
        return 8 * numel + 4  # exp_avg, exp_avg_sq, and the 0-d step tensor
    if opt.name == "sgd":
        return 4 * numel if opt.momentum else 0
    # Adafactor: factored over the last two dims for >= 2 dims ([Note: Adafactor under row sharding])
    if len(shape) >= 2:
        lead = local * math.prod(shape[1:-2])
        second = 4 * (lead * shape[-2] + lead * shape[-1]) if len(shape) > 2 else 4 * (local + shape[-1])
    else:
        second = 4 * numel
    momentum = (2 if opt.momentum_dtype == "bf16" else 4) * numel if opt.beta1 else 0
    return second + momentum + 4


def _units(model: nn.Module, units: Sequence[nn.Module] | None) -> tuple[list[list[nn.Parameter]], list[nn.Module], str]:
    """The root's parameters and each unit's, grouped as ``memsave.zero`` does (the same
    :func:`~memsave.models.units.unit_parameters`, over the same default units), and a line saying which."""
    if units is None:
        choice = choose_units(model)
        modules, said = list(choice.modules), f"units: {choice.describe()}"
    else:
        modules, said = list(units), f"units: {len(units)} given (units=)"
    groups = [[p for _, p in group] for group in unit_parameters(model, modules)]
    return groups, modules, said


def _model_states(groups: list[list[nn.Parameter]], order: list[nn.Parameter], prof: Profile,
                  n: int) -> dict[str, Any]:
    stage = prof.zero.stage
    mixed = prof.precision.compute != "fp32"
    c = _BYTES[compute_dtype(prof.precision)] if mixed else 4
    reduce = reduce_dtype_for(prof.precision)
    r = _BYTES[reduce] if reduce is not None else c
    out: dict[str, int] = dict.fromkeys(("params", "grads", "master", "optimizer_state"), 0)
    # what the optimizer steps is placed as the engines place it (memsave/dist/placement.py): rows over dp
    stepped = Placement(dp=Shard(0)) if stage else Placement()
    unit_full, unit_padded, unit_grad_full, unit_reduce, unit_state, unit_elems = [], [], [], [], [], []
    unit_grad_shard: list[int] = []  # the averaged rows a unit's reduce-scatter allocates (flat_grad)
    unit_shard: list[int] = []  # stage 3: this rank's rows of the unit (its flat_shard)
    for params in groups:
        trainable = [p for p in params if p.requires_grad]
        full = sum(p.numel() for p in params)
        chunk = sum(-(-_rows(p.shape)[0] // n) * _rows(p.shape)[1] for p in params)  # C, padded, per rank
        grad_chunk = sum(-(-_rows(p.shape)[0] // n) * _rows(p.shape)[1] for p in trainable)
        unit_full.append(full * c)
        unit_padded.append(chunk * n * c)
        unit_shard.append(chunk * c)
        unit_grad_full.append(sum(p.numel() for p in trainable) * c)
        unit_grad_shard.append(grad_chunk * r if trainable and (stage >= 2 or (stage == 1 and r != c)) else 0)
        # a reduce-scatter in flight: its staging (N * C in the reduce dtype) and, at stage 1 (or a reduce dtype
        # of its own), a fresh output chunk; stages 2-3 reduce into the persistent flat_grad
        if trainable and stage >= 1:
            unit_reduce.append(grad_chunk * n * r + (grad_chunk * r if stage == 1 else 0))
        else:
            unit_reduce.append(0)
        out["params"] += chunk * c if stage == 3 else full * c
        if stage == 0:
            out["grads"] += sum(p.numel() for p in trainable) * r
        elif stage == 1:
            out["grads"] += sum(p.numel() for p in trainable) * c + (grad_chunk * r if r != c else 0)
        else:
            out["grads"] += grad_chunk * r
        state_before, elems = out["optimizer_state"], 0
        for p in trainable:
            mine = stepped.local_numel(p.shape, degrees={"dp": n})  # what this rank's optimizer steps
            elems += mine
            if mixed:
                out["master"] += 4 * mine
            out["optimizer_state"] += _state_per_shard(p.shape, _local_rows(p.shape, stepped, n), prof)
        unit_state.append(out["optimizer_state"] - state_before)
        unit_elems.append(elems)
    unit_of = {p: u for u, params in enumerate(groups) for p in params}
    # in the model's parameter order: the optimizer's, when it is built over model.parameters()
    pieces = [(unit_of[p], _local_rows(p.shape, stepped, n), _rows(p.shape)[1]) for p in order if p.requires_grad]
    return {"bytes": out, "pieces": pieces, "param_bytes": c, "unit_full": unit_full, "unit_padded": unit_padded, "unit_grad_full": unit_grad_full,
            "unit_grad_shard": unit_grad_shard, "unit_shard": unit_shard,
            "unit_reduce": unit_reduce, "unit_state": unit_state, "unit_elems": unit_elems}


def estimate(model: nn.Module, profile: str | Path | Profile = "ddp", *, world_size: int = 1, batch: Any = None,
             units: Sequence[nn.Module] | None = None, device: str | None = None,
             micro_batches: int = 1, tp_plan: Mapping[str, str] | None = None, schedule: Any = None) -> Estimate:
    """Predict per-rank memory of training ``model`` under ``profile`` on ``world_size`` ranks: ``world_size /
    tp`` data-parallel ranks of ``[parallel] tp`` tensor-parallel ranks each.

    ``model`` may live on the meta device (build it under ``with torch.device("meta"):``); it is not changed.
    ``batch``: one micro-batch as the model takes it (dict of keyword arguments, tuple of positional ones, a
    tensor; meta tensors are fine) or a callable ``batch(model)`` running one forward; None: model states only.
    ``units``: as for ``memsave.wrap`` (default: :func:`memsave.models.units.choose_units`, the policy ZeRO and
    recompute use: the blocks of the largest ``nn.ModuleList``, else ``nn.Sequential`` children, else a
    size-based split; the note ``units: ...`` says which). Nothing is
    allocated on a real device. ``device``: "cpu" or "cuda", the kind of device trained on (default: cuda when
    available), for the attention kernel and whether host offload moves anything. ``micro_batches``: backwards
    per optimizer step (gradient accumulation under ``model.no_sync()``): at ZeRO stages 1-3 the full gradients
    accumulate locally until the last one. ``tp_plan``: as for ``memsave.wrap`` under ``[parallel] tp > 1``: the
    copy is cut to ``tp`` rank 0's shapes (:func:`memsave.tp.cut_shapes`), so every figure is per rank with the TP
    split; activations are those of the cut forward, under sequence parallelism 1/tp of each unit's whole
    (without recomputation; with it, the cut figure, an upper bound). See [Note: the estimated peak]. Under
    ``[parallel] pp > 1`` (``world_size / pp`` dp ranks per stage): each pipeline rank's estimate, its stages'
    states and the activations its schedule holds at once (``micro_batches`` per step; ``schedule``: a
    :class:`memsave.pp.Schedule` instead of the profile's), in ``.stages``; the one returned is the busiest
    (:func:`memsave.estimate_pp.estimate_stages`).
    """
    prof = load_profile(profile)
    device_type = device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device = {device!r} is not allowed; expected \"cpu\" or \"cuda\"")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size = {world_size!r} is not allowed; expected a positive integer")
    if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
        raise ValueError(f"micro_batches = {micro_batches!r} is not allowed; expected a positive integer")
    if prof.parallel.pp > 1:  # one estimate per pipeline rank; the busiest is returned, with all of them
        from memsave.estimate_pp import estimate_stages  # (it builds on this module)

        stages = estimate_stages(model, prof, world_size=world_size, batch=batch, units=units, device=device_type,
                                 micro_batches=micro_batches, schedule=schedule, tp_plan=tp_plan)
        busiest = max(stages, key=lambda e: e.device_peak)  # on CUDA with the allocator's transients
        others = tuple(e.notes[0] for e in stages if e is not busiest)  # which stages each rank holds
        return dataclasses.replace(busiest, stages=tuple(stages),
                                   notes=(busiest.notes[0], *others, *busiest.notes[1:]))
    if schedule is not None:
        raise ValueError("schedule= is for [parallel] pp > 1 only; this profile has pp = 1")
    tp = prof.parallel.tp
    if world_size % tp:
        raise ValueError(f"world_size = {world_size} is not divisible by [parallel] tp = {tp}; the ranks are dp x tp")
    meta = meta_copy(model)
    tp_note = ""
    if tp > 1:
        from memsave.tp import cut_shapes  # layer 3

        cut = cut_shapes(meta, tp, tp_plan)
        split = sum(p.numel() for p in meta.parameters() if id(p) in cut)
        whole = sum(p.numel() for p in meta.parameters() if id(p) not in cut)
        tp_note = (f"tensor parallel: {split:,} parameters per rank are 1/{tp} slices (padded), {whole:,} are "
                   f"replicated over tp")
    _cast(meta, prof)
    meta_units = None
    if units is not None:  # the same modules, found in the copy by name
        names = {id(m): n for n, m in model.named_modules()}
        by_name = dict(meta.named_modules())
        meta_units = [by_name[names[id(u)]] for u in units]
    groups, modules, said = _units(meta, meta_units)
    notes: list[str] = []
    acts, per_unit, outputs, logits, first, late = 0, [0] * len(modules), 0, 0, 0, 0
    if batch is not None:
        sp = tp if tp > 1 and prof.parallel.sequence else 1
        acts, per_unit, outputs, note, logits, first, late, order = activations(meta, modules, prof, batch,
                                                                                device_type, sp)
        notes.append(note)
        from memsave.tp import gathers_whole  # layer 3

        gathered = sp > 1 and gathers_whole(meta, tp_plan)
        if gathered:
            notes.append("sequence parallelism with projections that gather their outputs whole (colwise_gather_output:"
                         " the attention or MLP then runs whole on every rank): each unit as without it, an upper "
                         "bound")
        elif sp > 1 and prof.recompute.policy == "none":  # the blocks once more, whole
            names = {id(m): n for n, m in meta.named_modules()}
            acts, per_unit = sequence_parallel(_cast(meta_copy(model), prof), [names[id(m)] for m in modules], prof,
                                               batch, device_type, tp, acts, per_unit)
            notes.append(f"sequence parallelism: each unit keeps 1/{tp} of what it keeps without tensor parallelism")
        elif sp > 1:
            notes.append("sequence parallelism under recomputation: each unit's hidden-state input 1/tp (full "
                         "recomputation), the rest as without it, an upper bound")
        if sorted(order) == list(range(len(modules))) and list(order) != sorted(order):
            # the engine gathers and reduces in the order the forward calls the units ([Note: the units' call
            # order] in memsave/zero/engine.py): CLIP's vision tower before its text tower
            modules, per_unit = [modules[i] for i in order], [per_unit[i] for i in order]
            groups = [[p for _, p in group] for group in unit_parameters(meta, modules)]
            said += "; in the order the forward calls them"
    activation_notes, notes = notes, []
    held, states, model_state = held_states(meta, groups, prof, world_size // tp, device_type, notes,
                                            over=f" of dp, each cut over tp = {tp} (per-rank shapes of tp rank 0)"
                                            if tp > 1 else "")
    notes.insert(1, said)
    if tp_note:
        notes.append(tp_note)
    notes += activation_notes
    points: dict[str, int] = {}
    best = peak_bytes(held, states, prof, per_unit, acts + outputs, micro_batches, notes, points=points, kept=first,
                      late_grads=late * states["param_bytes"])
    best = {k: int(v) for k, v in best.items() if v}
    transient = 0
    if device_type == "cuda":  # [Note: the allocator's peak]
        transient, note = allocator_extra(**points, peak=_total(best), logits=logits, compute=prof.precision.compute,
                                          optimizer_state=held.get("optimizer_state", 0), optimizer=prof.optimizer.name)
        notes.append(note)
    return Estimate(profile=prof.name, world_size=world_size, tp=tp, model=user_class(model).__name__,
                    num_params=sum(p.numel() for p in model.parameters()), bytes=best, transient=transient,
                    model_state=model_state, activations=acts + outputs, notes=tuple(notes), units=said)


def held_states(meta: nn.Module, groups: list[list[nn.Parameter]], prof: Profile, n: int, device_type: str,
                notes: list[str], over: str = "") -> tuple[dict[str, int], dict[str, Any], int]:
    """What a rank holds besides activations, from the meta model it holds (its units' parameter ``groups``) over
    ``n`` dp ranks: the bytes per category with the gradients as after ``zero_grad`` (stages 1-3: none), the
    per-unit figures of :func:`_model_states`, and the model state as the ZeRO formula counts it."""
    stage, mixed = prof.zero.stage, prof.precision.compute != "fp32"
    states = _model_states(groups, list(meta.parameters()), prof, n)
    held: dict[str, int] = dict(states["bytes"])
    notes.append(f"model states: {prof.optimizer.name} state, {prof.precision.compute} parameters"
                 + (", fp32 masters" if mixed else "") + f", zero stage {stage} over {n} rank(s)" + over)
    held["buffers"] = sum(b.numel() * b.element_size() for b in meta.buffers())
    resident = offload_states(held, states, prof, device_type, notes)  # offloaded shards read in around their use
    model_state = sum(held.get(c, 0) for c in ("params", "grads", "master", "optimizer_state")) - resident
    states["persistent_grads"] = held["grads"]
    if stage >= 1:  # zero_grad(set_to_none) frees the full gradients (stage 1) and the reduced rows (every stage):
        held["grads"] = 0  # backward makes them again, unit by unit
    return held, states, model_state


def peak_bytes(held: dict[str, int], states: dict[str, Any], prof: Profile, per_unit: list[int], forward_end: int,
               micro_batches: int, notes: list[str], *, gathered: int | None = None,
               points: dict[str, int] | None = None, kept: int = 0, late_grads: int = 0) -> dict[str, int]:
    """The estimated peak ([Note: the estimated peak]) from what is held (:func:`held_states`), the activations
    per unit and at the end of forward (``forward_end``, the outputs included; ``kept`` of them, saved before the
    first unit, are held through backward; ``late_grads``: the bytes of the gradients of the root's parameters used
    only after the last unit, held from backward's start). ``gathered``: ZeRO-3 parameters
    held gathered throughout (a pipeline stage's ``[parallel] gather = "step"``) instead of root and one unit. ``points``:
    filled with the totals at the end of forward and in the step ([Note: the allocator's peak])."""
    stage = prof.zero.stage
    held, persistent_grads = dict(held), states["persistent_grads"]
    if stage == 3:
        biggest = max(states["unit_full"][1:], default=0)
        held["params_gathered"] = gathered if gathered is not None else states["unit_full"][0] + biggest
    if micro_batches > 1:  # no_sync: every micro-batch after the first holds the full gradients in p.grad (at
        # stage 0 beside the buckets, which adopt them at the synchronizing backward)
        accumulated = sum(states["unit_grad_full"])
        held["grads"] += accumulated
        notes.append(f"{micro_batches} micro-batches: the full gradients accumulate locally until the last backward")
    # [Note: the estimated peak]: walk backward unit by unit
    base = dict(held)
    best = dict(base, activations=forward_end)  # the end of forward: the outputs are still held
    if stage >= 1:
        best = _walk_backward(best, base, states, per_unit, stage, prof.zero.prefetch, persistent_grads,
                              gathered, kept, late_grads if micro_batches == 1 else 0)  # (else in the accumulated)
    if prof.precision.compute != "fp32" and reduce_dtype_for(prof.precision) is not torch.float32:
        # the step: every reduced gradient, and its fp32 copy on the masters (made by the unscale or by
        # clip_grad_norm, dropped after the step; with fp32 reduction the gradient itself is the master's). Offloaded
        # masters without clipping or loss scale skip the copy (cast chunk by chunk): counted anyway, as an upper bound
        step = dict(base, activations=0, grads=persistent_grads + states["bytes"]["master"])
        best = step if _total(step) > _total(best) else best
    else:
        step = dict(base, activations=0, grads=persistent_grads)
    if points is not None:
        points.update(forward_end=_total(base) + forward_end, step=_total(step))
    return best


def _walk_backward(best: dict[str, int], base: dict[str, int], states: dict[str, Any], per_unit: list[int],
                   stage: int, prefetch: int, persistent_grads: int, gathered: int | None = None,
                   kept: int = 0, late_grads: int = 0) -> dict[str, int]:
    """The largest total over the samples of backward at stages 1-3 ([Note: the estimated peak]): before and
    after each unit's backward, in backward order (the root's head before, its embedding after the units)."""
    n_units = len(per_unit)
    full, grads_full, reduce_, staging = (states["unit_full"], states["unit_grad_full"], states["unit_reduce"],
                                          states["unit_padded"])
    grads_shard = states["unit_grad_shard"]
    done: list[int] = []  # units whose reduce-scatter was launched, in order (indices into the unit lists)
    grads = late_grads  # the root's: its final norm's and untied head's, reduced with the root at backward's end
    for k in reversed(range(n_units)):
        u = k + 1  # the root is entry 0 of the per-unit lists
        for after in (False, True):
            if after:
                done.append(u)
                grads += (grads_full[u] if stage == 1 else 0) + grads_shard[u]
            point = dict(base)
            point["activations"] = kept + sum(per_unit[: k if after else k + 1])
            if stage == 1:  # (with micro-batches the accumulated full gradients are there throughout)
                point["grads"] = max(base.get("grads", 0), grads)
            else:  # the reduced rows of the units done so far (beside micro-batches' accumulated full gradients)
                point["grads"] = base.get("grads", 0) + grads
            comm = sum(reduce_[j] for j in done[-REDUCES_IN_FLIGHT:])
            if stage == 3 and gathered is not None:  # every unit gathered for the whole step: no prefetch
                point["params_gathered"] = gathered
            elif stage == 3:
                point["params_gathered"] = full[0] + full[u]  # (after: freed once its reduce-scatter is launched)
                if prefetch and k >= 1:  # the gather of the unit before it is in flight
                    comm += staging[u - 1]
            point["comm"] = base.get("comm", 0) + comm
            if _total(point) > _total(best):
                best = point
    end = dict(base, activations=0, grads=persistent_grads)
    return end if _total(end) > _total(best) else best


def _total(b: Mapping[str, int]) -> int:
    return sum(v for k, v in b.items() if k not in OFF_DEVICE)
