"""``memsave.recompute.apply``: choose the units to recompute under a policy and wrap them.

Activation recomputation (Chen et al., 2016, "Training Deep Nets with Sublinear Memory Cost"): a recomputed
unit keeps only its inputs from forward to backward and runs its forward again, inside backward, to rebuild
the activations its backward needs. Full recomputation costs one more forward of the unit (about a third more
compute per step); selective recomputation (Korthikanti et al., 2022, "Reducing Activation Recomputation in
Large Transformer Models") keeps the outputs of the expensive ops (matmuls, attention) and recomputes only the
cheap ones in between, for most of the compute back at a part of the memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memsave._logging import get_logger, warn_once
from memsave.config import RecomputeConfig
from memsave.models.units import default_units
from memsave.recompute.checkpoint import is_recomputed, recompute_unit, restore_unit
from memsave.recompute.measure import ELEMENT_COST, SavedBytes, measure_saved_bytes
from memsave.recompute.policy import DEFAULT_SAVE_OPS, RecomputePolicy, SelectivePolicy, parse_policy

__all__ = ["PLAN_ATTR", "RecomputePlan", "apply", "format_bytes", "remove"]

# apply(..., model=model) leaves its plan on the model object under this attribute (a plain attribute, not a
# submodule or buffer: not in state_dict), so that code which only sees the model (memsave demo, after
# memsave.wrap) can say what was recomputed and why.
PLAN_ATTR = "memsave_recompute_plan"

ExampleInputs = Callable[[], Any] | Mapping[str, Any] | Sequence[Any] | torch.Tensor


@dataclass(frozen=True)
class RecomputePlan:
    """What :func:`apply` did.

    policy: the parsed policy.
    units: the units whose forward is now recomputed, in the given order.
    names: their qualified names in ``model`` (``units[i]`` without a model).
    kinds: per unit of ``units``, "full" or "selective".
    measured: for "budget", the saved bytes measured with nothing recomputed (with what each unit keeps under
        selective recomputation, and each unit's estimated forward cost); else None.
    estimated_bytes: for "budget", the saved bytes estimated with the chosen units recomputed; else None.
    summary: what was chosen and, for "budget", why (the measured options and the estimated costs).
    """

    policy: RecomputePolicy
    units: tuple[nn.Module, ...]
    names: tuple[str, ...]
    kinds: tuple[str, ...] = ()
    measured: SavedBytes | None = None
    estimated_bytes: int | None = None
    summary: str = ""


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _check_units(units: Sequence[nn.Module], model: nn.Module | None) -> None:
    seen: set[int] = set()
    for i, u in enumerate(units):
        if not isinstance(u, nn.Module):
            raise ValueError(f"units[{i}] is a {type(u).__name__}, not a torch.nn.Module")
        if id(u) in seen:
            raise ValueError(f"units[{i}] ({type(u).__name__}) is listed twice; list each unit once")
        seen.add(id(u))
        if is_recomputed(u):
            raise ValueError(f"units[{i}] ({type(u).__name__}) is already recomputed; call "
                             "memsave.recompute.remove(units) first to change its policy")
        if model is not None and not any(u is m for m in model.modules()):
            raise ValueError(f"units[{i}] ({type(u).__name__}) is not a submodule of the model")


def _runner(model: nn.Module | None, example_inputs: ExampleInputs) -> Callable[[], Any]:
    if callable(example_inputs) and not isinstance(example_inputs, nn.Module | torch.Tensor):
        return example_inputs
    if model is None:
        raise ValueError("policy budget: example_inputs that are not a callable need model= to be called with")
    if isinstance(example_inputs, torch.Tensor):
        return lambda: model(example_inputs)
    if isinstance(example_inputs, Mapping):
        return lambda: model(**example_inputs)
    if isinstance(example_inputs, Sequence) and not isinstance(example_inputs, str):
        return lambda: model(*example_inputs)
    raise ValueError(f"example_inputs is a {type(example_inputs).__name__}; pass a callable that runs one forward, "
                     "a dict of keyword arguments, a tuple of positional arguments or a tensor")


_KINDS = ("none", "selective", "full")
# [Note: no selective recomputation around a GRU] Under torch's selective checkpoint, an nn.GRU whose matrix
# multiplies are kept (the default save list) trains with wrong gradients and no error on a CPU (17% off in its
# parameters after a few steps; torch alone, without memsave, shows it); nn.RNN raises torch's "cached ... has
# been mutated"; nn.LSTM is exact. The cells alike (GRUCell's gradients up to 1.64 off). Such a unit is refused
# selective recomputation (full is exact), and the budget policy never chooses it there.
_NO_SELECTIVE = (nn.GRU, nn.RNN, nn.GRUCell, nn.RNNCell)


def _no_selective(unit: nn.Module) -> str | None:
    """The type name of what in ``unit`` selective recomputation would get wrong, or None."""
    found = next((m for m in unit.modules() if isinstance(m, _NO_SELECTIVE)), None)
    return None if found is None else type(found).__name__


def _group_names(names: Sequence[str]) -> str:
    """``blocks.0, blocks.1, blocks.2, blocks.5`` -> ``blocks.0-2, blocks.5`` (runs of one prefix)."""
    out: list[str] = []
    run: list[tuple[str, int]] = []

    def flush() -> None:
        if run:
            p, a, b = run[0][0], run[0][1], run[-1][1]
            out.append(f"{p}{a}" if a == b else f"{p}{a}-{b}")
            run.clear()

    for name in names:
        head, _, tail = name.rpartition(".")
        if tail.isdigit() and run and run[-1][0] == head + "." and run[-1][1] + 1 == int(tail):
            run.append((head + ".", int(tail)))
            continue
        flush()
        if tail.isdigit():
            run.append((head + "." if head else "", int(tail)))
        else:
            out.append(name)
    flush()
    return ", ".join(out)


def _choose_for_budget(policy: RecomputePolicy, units: Sequence[nn.Module], names: Sequence[str],
                       model: nn.Module | None, example_inputs: ExampleInputs | None,
                       selective: SelectivePolicy) -> tuple[list[str], SavedBytes, int, str]:
    """Per unit none / selective / full, at the least estimated added compute whose estimated saved bytes fit.

    Two measured forwards (RNG restored after each): one with nothing recomputed (saved bytes per unit, each
    unit's inputs, and each unit's forward cost, op by op: [Note: the compute model of recomputation] in
    recompute/measure.py), one with every unit selectively recomputed (what each then keeps). Then greedy: from
    nothing recomputed, repeatedly take the upgrade (none -> selective, selective -> full, or none -> full) with
    the most bytes saved per unit of added compute until the estimate fits; then undo, most costly first, any
    upgrade the fit does not need.
    """
    if example_inputs is None:
        raise ValueError(f"[recompute] policy={policy} measures the activations of one forward: pass "
                         "example_inputs= (a batch like the training ones, or a callable running one forward)")
    run = _runner(model, example_inputs)
    plain = measure_saved_bytes(run, units, model=model, costs=True, saves=selective.saves)
    for u in units:
        recompute_unit(u, selective)
    try:
        sel = measure_saved_bytes(run, units, model=model)
    finally:
        for u in units:
            restore_unit(u)
    measured = plain.with_selective(sel)
    n = len(units)
    budget = policy.budget_bytes

    def estimate(kinds: Sequence[str]) -> int:
        return measured.estimate(frozenset(i for i in range(n) if kinds[i] == "full"),
                                 frozenset(i for i in range(n) if kinds[i] == "selective"))

    def cost(i: int, kind: str) -> float:
        c = measured.costs[i]
        return {"none": 0.0, "selective": c.selective, "full": c.forward}[kind]

    minimum = estimate(["full"] * n)
    if minimum > budget:
        raise ValueError(
            f"[recompute] policy={policy}: the budget of {format_bytes(budget)} ({budget} B) cannot be met; even "
            f"recomputing all {n} units keeps {format_bytes(minimum)} ({minimum} B) of activations (their "
            f"inputs, and {format_bytes(measured.outside)} saved outside the units): raise the budget to at least "
            f"that, or use smaller micro-batches"
        )
    kinds = ["none"] * n
    current = estimate(kinds)
    solutions: list[tuple[float, list[str], int]] = []  # (added compute, kinds, estimate) of plans that fit
    while current > budget:
        best: tuple[float, int, str, int] | None = None  # (-bytes saved per added compute, i, kind, estimate)
        for i in range(n):
            for kind in _KINDS[_KINDS.index(kinds[i]) + 1:]:
                if kind == "selective" and _no_selective(units[i]) is not None:
                    continue  # [Note: no selective recomputation around a GRU]
                trial = list(kinds)
                trial[i] = kind
                after = estimate(trial)
                if after >= current:
                    continue
                added = cost(i, kind) - cost(i, kinds[i])
                if after <= budget:  # one more step would fit: remember it, in case the greedy path overshoots
                    solutions.append((sum(cost(j, trial[j]) for j in range(n)), trial, after))
                cand = (-(current - after) / max(added, 1.0), i, kind, after)
                if best is None or cand < best:
                    best = cand
        if best is None:  # cannot happen: all-full fits (checked above)
            kinds, current = ["full"] * n, minimum
            break
        _, i, kind, current = best
        kinds[i] = kind
    solutions.append((sum(cost(j, kinds[j]) for j in range(n)), kinds, current))
    _, kinds, current = min(solutions, key=lambda s: s[0])
    # undo upgrades the fit does not need, the most costly first
    changed = True
    while changed:
        changed = False
        for i in sorted(range(n), key=lambda i: -cost(i, kinds[i])):
            idx = _KINDS.index(kinds[i])
            for lower in _KINDS[:idx]:
                if lower == "selective" and _no_selective(units[i]) is not None:
                    continue
                trial = list(kinds)
                trial[i] = lower
                after = estimate(trial)
                if after <= budget:
                    kinds, current, changed = trial, after, True
                    break
            if changed:
                break
    forward = sum(c.forward for c in measured.costs)
    added = sum(cost(i, kinds[i]) for i in range(n))
    sel_units = measured.selective_units()
    chosen_text = "; ".join(
        f"{kind} for {_group_names([names[i] for i in range(n) if kinds[i] == kind])}"
        for kind in ("full", "selective", "none") if kind in kinds)
    summary = (
        f"recompute policy {policy}: one forward saves {format_bytes(measured.total)} of activations "
        f"({format_bytes(measured.outside)} outside the {n} units); recomputing every unit selectively would keep "
        f"{format_bytes(estimate(['selective'] * n))} (+{_pct(sum(c.selective for c in measured.costs), forward)} "
        f"of the units' forward compute), fully {format_bytes(minimum)} (+100%). Chosen, for the least added "
        f"compute that fits {format_bytes(budget)}: {chosen_text}; estimated {format_bytes(current)} of "
        f"activations, +{_pct(added, forward)} of the units' forward compute (about a third of that on a whole "
        f"training step). Per unit (kept bytes none/selective/full): "
        + ", ".join(f"{names[i]} {kinds[i]} ({format_bytes(measured.units[i])}/{format_bytes(sel_units[i])}/"
                    f"{format_bytes(measured.inputs[i])})" for i in range(n))
        + ". Compute model: matmul/attention FLOPs plus "
        f"{ELEMENT_COST:g} FLOP-equivalents per element written by other ops; selective recomputation re-runs only "
        "the latter."
    )
    get_logger().info("[recompute] %s", summary)
    return kinds, measured, current, summary


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "0%"


def apply(
    units: Sequence[nn.Module] | None,
    policy: str | RecomputeConfig | RecomputePolicy,
    *,
    model: nn.Module | None = None,
    example_inputs: ExampleInputs | None = None,
    save_ops: Iterable[Any] | None = None,
) -> RecomputePlan:
    """Recompute the activations of ``units`` in backward under ``policy``, in place.

    Each chosen unit keeps its module object and class; its instance ``forward`` is replaced by one that runs
    the original under ``torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=True)``, so
    losses and gradients are bit-for-bit those without recomputation (dropout included), and hooks on the
    unit run outside the recomputed region ([Note: hooks stay outside the recomputed region] in
    recompute/checkpoint.py). Keyword arguments and any output structure (tensors, tuples, dataclasses,
    ``ModelOutput``) pass through. :func:`remove` restores the original forwards. A recomputed forward must
    compute what it computed the first time: no state it changes itself (a key/value cache: call Hugging Face
    models with ``use_cache=False`` for training, as their own gradient checkpointing does).

    Args:
        units: the candidate units, in forward order; None: ``model``'s default units, as ZeRO's
            (:func:`memsave.models.units.default_units`: the blocks of its largest ``nn.ModuleList``, else
            ``nn.Sequential`` children, else a size-based split).
        policy: ``"none"``; ``"full"`` (every unit); ``"every:K"`` (units 0, K, 2K, ...: the first of every K
            consecutive units); ``"selective"`` (every unit keeps the outputs of ``save_ops`` and recomputes the
            rest, via ``create_selective_checkpoint_contexts``); ``"budget:<size>"`` (measure on ``example_inputs``
            what each unit keeps with no, selective and full recomputation and estimate what each costs, then
            choose per unit none / selective / full for the least added compute whose estimated saved bytes
            fit the budget; the budget is on activations, the bytes autograd keeps for backward, not on
            parameters, gradients or optimizer state; ``ValueError`` naming the minimum if even recomputing
            every unit fully cannot fit). A ``RecomputeConfig`` works too.
        model: the model the units belong to (checked; needed for ``units=None`` and for "budget").
        example_inputs: "budget" only: one training-like batch for ``model`` (a dict of keyword arguments, a
            tuple of positional ones or a tensor), or a callable that runs one forward.
        save_ops: "selective" only: the ``torch.ops.aten.*.default`` overloads whose outputs are kept (default
            :data:`~memsave.recompute.policy.DEFAULT_SAVE_OPS`).

    Returns:
        A :class:`RecomputePlan` naming the units now recomputed, how, and (``summary``) why. With ``model``
        it is also left on the model as ``model.memsave_recompute_plan`` (:data:`PLAN_ATTR`).
    """
    pol = parse_policy(policy)
    if save_ops is not None and pol.kind != "selective":
        raise ValueError(f"save_ops= applies to the \"selective\" policy only, not {str(pol)!r}")
    if example_inputs is not None and pol.kind != "budget":
        warn_once(f"[recompute] policy={pol}: example_inputs= is only used by budget:<size> policies; ignored")
    if units is None:
        if model is None:
            raise ValueError("memsave.recompute.apply(None, ...) needs model= to find the default units")
        units = default_units(model)
    units = list(units)
    _check_units(units, model)
    qualified = {id(m): n for n, m in model.named_modules()} if model is not None else {}
    names = [qualified.get(id(u), f"units[{i}]") for i, u in enumerate(units)]
    if pol.kind != "none" and not units:
        raise ValueError(f"[recompute] policy={pol}: there are no units to recompute (no submodule of the model "
                         "holds parameters: memsave.models.units.choose_units); pass units= explicitly")
    if pol.kind != "none" and getattr(getattr(model, "config", None), "use_cache", False) is True:
        warn_once("[recompute]: the model's config has use_cache = True; a unit that appends to a key/value cache "
                  "in forward sees its own keys again when recomputed (Hugging Face: call the model with "
                  "use_cache=False for training, as its own gradient checkpointing does)")
    measured, estimate = None, None
    selective = SelectivePolicy(DEFAULT_SAVE_OPS if save_ops is None else save_ops)
    n = len(units)
    kinds = ["none"] * n
    summary = ""
    if pol.kind == "full":
        kinds = ["full"] * n
    elif pol.kind == "every":
        kinds = ["full" if i % pol.every == 0 else "none" for i in range(n)]
    elif pol.kind == "selective":
        kinds = ["selective"] * n
        for unit, name in zip(units, names, strict=True):
            held = _no_selective(unit)
            if held is not None:
                raise NotImplementedError(
                    f"[recompute] policy = \"selective\" on unit {name!r}, which holds an nn.{held}: torch's selective "
                    "checkpoint trains it with wrong gradients (its cached matrix multiplies are changed in place); "
                    "use policy = \"full\" (exact), or \"budget:<size>\", which recomputes such a unit fully")
    elif pol.kind == "budget":
        kinds, measured, estimate, summary = _choose_for_budget(pol, units, names, model, example_inputs, selective)
    chosen = [i for i in range(n) if kinds[i] != "none"]
    for i in chosen:
        recompute_unit(units[i], selective if kinds[i] == "selective" else None)
    if not summary:
        summary = (f"recompute policy {pol}: " + "; ".join(
            f"{kind} for {_group_names([names[i] for i in range(n) if kinds[i] == kind])}"
            for kind in ("full", "selective") if kind in kinds) if chosen else f"recompute policy {pol}: nothing recomputed")
    plan = RecomputePlan(policy=pol, units=tuple(units[i] for i in chosen), names=tuple(names[i] for i in chosen),
                         kinds=tuple(kinds[i] for i in chosen), measured=measured, estimated_bytes=estimate,
                         summary=summary)
    if model is not None:
        model.__dict__[PLAN_ATTR] = plan  # memsave demo reads it after memsave.wrap (see PLAN_ATTR)
    return plan


def remove(units: Sequence[nn.Module] | RecomputePlan, *, model: nn.Module | None = None) -> int:
    """Restore the original forward of every recomputed unit in ``units``; returns how many were restored.
    With ``model``, also drop the plan :func:`apply` left on it (``model.memsave_recompute_plan``)."""
    modules = units.units if isinstance(units, RecomputePlan) else units
    if model is not None:
        model.__dict__.pop(PLAN_ATTR, None)
    return sum(restore_unit(u) for u in modules)
