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
from memsave.recompute.measure import SavedBytes, measure_saved_bytes
from memsave.recompute.policy import DEFAULT_SAVE_OPS, RecomputePolicy, SelectivePolicy, parse_policy

__all__ = ["RecomputePlan", "apply", "format_bytes", "remove"]

ExampleInputs = Callable[[], Any] | Mapping[str, Any] | Sequence[Any] | torch.Tensor


@dataclass(frozen=True)
class RecomputePlan:
    """What :func:`apply` did.

    policy: the parsed policy.
    units: the units whose forward is now recomputed, in the given order.
    names: their qualified names in ``model`` (``units[i]`` without a model).
    measured: for "budget", the saved bytes measured with nothing recomputed; else None.
    estimated_bytes: for "budget", the saved bytes estimated with the chosen units recomputed; else None.
    """

    policy: RecomputePolicy
    units: tuple[nn.Module, ...]
    names: tuple[str, ...]
    measured: SavedBytes | None = None
    estimated_bytes: int | None = None


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


def _choose_for_budget(policy: RecomputePolicy, units: Sequence[nn.Module], names: Sequence[str],
                       model: nn.Module | None, example_inputs: ExampleInputs | None) -> tuple[list[int], SavedBytes, int]:
    """Greedy: recompute whole units, largest saved bytes first, until the estimated total fits the budget."""
    if example_inputs is None:
        raise ValueError(f"[recompute] policy={policy} measures the activations of one forward: pass "
                         "example_inputs= (a batch like the training ones, or a callable running one forward)")
    measured = measure_saved_bytes(_runner(model, example_inputs), units, model=model)
    budget = policy.budget_bytes
    minimum = measured.estimate(frozenset(range(len(units))))
    if minimum > budget:
        raise ValueError(
            f"[recompute] policy={policy}: the budget of {format_bytes(budget)} ({budget} B) cannot be met; even "
            f"recomputing all {len(units)} units keeps {format_bytes(minimum)} ({minimum} B) of activations (their "
            f"inputs, and {format_bytes(measured.outside)} saved outside the units): raise the budget to at least "
            f"that, or use smaller micro-batches"
        )
    chosen: set[int] = set()
    estimate = measured.estimate(chosen)
    for i in sorted(range(len(units)), key=lambda i: (-measured.units[i], i)):
        if estimate <= budget:
            break
        chosen.add(i)
        estimate = measured.estimate(chosen)
    get_logger().info(
        "[recompute] policy=%s: one forward saves %s of activations (%s of them outside the units); recomputing "
        "%d of %d units, the largest savers first, until the estimate fits the budget of %s: %s; estimated %s",
        policy, format_bytes(measured.total), format_bytes(measured.outside), len(chosen), len(units),
        format_bytes(budget), ", ".join(f"{names[i]} (keeps {format_bytes(measured.inputs[i])} instead of "
                                        f"{format_bytes(measured.units[i])})" for i in sorted(chosen)) or "none needed",
        format_bytes(estimate))
    return sorted(chosen), measured, estimate


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
        units: the candidate units, in forward order; None: the blocks of ``model``'s largest ``nn.ModuleList``.
        policy: ``"none"``; ``"full"`` (every unit); ``"every:K"`` (units 0, K, 2K, ...: the first of every K
            consecutive units); ``"selective"`` (every unit keeps the outputs of ``save_ops`` and recomputes the
            rest, via ``create_selective_checkpoint_contexts``); ``"budget:<size>"`` (measure each unit's saved
            bytes on ``example_inputs``, then fully recompute units, largest first, until the estimate fits;
            ``ValueError`` naming the minimum if even all of them cannot fit). A ``RecomputeConfig`` works too.
        model: the model the units belong to (checked; needed for ``units=None`` and for "budget").
        example_inputs: "budget" only: one training-like batch for ``model`` (a dict of keyword arguments, a
            tuple of positional ones or a tensor), or a callable that runs one forward.
        save_ops: "selective" only: the ``torch.ops.aten.*.default`` overloads whose outputs are kept (default
            :data:`~memsave.recompute.policy.DEFAULT_SAVE_OPS`).

    Returns:
        A :class:`RecomputePlan` naming the units now recomputed.
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
        raise ValueError(f"[recompute] policy={pol}: there are no units to recompute (the model has no "
                         "nn.ModuleList of blocks); pass units= explicitly")
    if pol.kind != "none" and getattr(getattr(model, "config", None), "use_cache", False) is True:
        warn_once("[recompute]: the model's config has use_cache = True; a unit that appends to a key/value cache "
                  "in forward sees its own keys again when recomputed (Hugging Face: call the model with "
                  "use_cache=False for training, as its own gradient checkpointing does)")
    measured, estimate = None, None
    selective = None
    if pol.kind == "none":
        chosen: list[int] = []
    elif pol.kind == "full":
        chosen = list(range(len(units)))
    elif pol.kind == "every":
        chosen = list(range(0, len(units), pol.every))
    elif pol.kind == "selective":
        chosen = list(range(len(units)))
        selective = SelectivePolicy(DEFAULT_SAVE_OPS if save_ops is None else save_ops)
    else:
        chosen, measured, estimate = _choose_for_budget(pol, units, names, model, example_inputs)
    for i in chosen:
        recompute_unit(units[i], selective)
    return RecomputePlan(policy=pol, units=tuple(units[i] for i in chosen), names=tuple(names[i] for i in chosen),
                         measured=measured, estimated_bytes=estimate)


def remove(units: Sequence[nn.Module] | RecomputePlan) -> int:
    """Restore the original forward of every recomputed unit in ``units``; returns how many were restored."""
    modules = units.units if isinstance(units, RecomputePlan) else units
    return sum(restore_unit(u) for u in modules)
