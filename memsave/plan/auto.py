"""``memsave.wrap(..., profile="auto", budget="16GiB", example_inputs=batch)``: the planner, in the process.

The mesh is already chosen (``memsave.init``), and so are the model, the optimizer and the micro-batch (the
example inputs): what is left to choose is the ZeRO stage, recomputation and offload. Each candidate's memory is
:func:`memsave.estimate` on the model itself with the example batch (validated against the tracker per
category); the fastest that fits ``budget`` with 5% headroom wins, priced on this machine's calibrated rates
(``memsave calibrate``, cached). Precision is never changed behind the user's back: the profile computes in
fp32 as the model was built. Rank 0 decides and every rank takes its choice, so the ranks cannot disagree.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from typing import Any

import torch
from torch import nn

from memsave._logging import get_logger
from memsave.config import Profile
from memsave.dist import Mesh, all_gather_object
from memsave.estimate_activations import activations_cached
from memsave.memory.schema import OFF_DEVICE, format_bytes
from memsave.plan.cost import Candidate, price
from memsave.plan.hardware import calibrate
from memsave.plan.profile import exact_peak, to_profile
from memsave.plan.search import HEADROOM, PlanError, at_least
from memsave.plan.spec import from_module
from memsave.recompute.policy import parse_size

__all__ = ["auto_profile"]


def _optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    name = type(optimizer).__name__.lower()
    return name if name in ("adamw", "adam", "sgd", "adafactor") else "adamw"


def _budget(budget: Any) -> tuple[float | None, str | None]:
    """``budget=`` as bytes, or why it is not allowed: (value, None) or (None, the error)."""
    if budget is None:
        return None, ('profile = "auto" needs budget= (bytes per rank, e.g. "16GiB"); allowed: an int or a size '
                      'string in B, KiB, MiB, GiB or TiB')
    try:
        if isinstance(budget, bool) or not isinstance(budget, (str, int, float)):
            raise ValueError("expected an int or a size string")
        if isinstance(budget, float) and math.isfinite(budget) and not budget.is_integer():  # 1.5: a unit forgotten?
            raise ValueError("expected a whole number of bytes or a size string such as '1.5GiB'")
        limit = float(parse_size(budget) if isinstance(budget, str) else budget)
    except ValueError as exc:
        return None, f"budget = {budget!r} is not allowed: {exc}"
    if not 0 < limit < math.inf:
        return None, f"budget = {budget!r} is not allowed; expected a positive, finite size"
    return limit, None


def _sendable(error: Exception) -> Exception:
    """``error`` as it can travel to the other ranks: itself when it pickles, else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def auto_profile(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh, *, budget: str | int | None,
                 example_inputs: Any) -> Profile:
    """The profile ``wrap(profile="auto")`` trains with (module docstring); ``ValueError`` without a budget or
    example inputs, or (on every rank) when a rank's budget is not allowed or the ranks' budgets differ;
    :class:`memsave.plan.PlanError` (naming the smallest budget that would fit) when none fits."""
    limit, error = _budget(budget)
    if error is None and example_inputs is None:
        error = ('profile = "auto" needs example_inputs= (one micro-batch like the training ones) to measure the '
                 "activations of each candidate")
    # every rank's budget is checked before rank 0 chooses: one rank's error raised alone would leave the others
    # waiting in the choice's all-gather for ever
    gathered = all_gather_object((limit, error, repr(budget)))
    if len(gathered) == 1 and error is not None:
        raise ValueError(error)
    bad = [f"on rank {r}, {e}" for r, (_, e, _) in enumerate(gathered) if e]
    if bad:
        raise ValueError('profile = "auto": ' + "; ".join(bad))
    if len({v for v, _, _ in gathered}) > 1:
        raise ValueError('profile = "auto": the ranks were given different budgets ('
                         + ", ".join(f"rank {r}: budget = {text}" for r, (_, _, text) in enumerate(gathered))
                         + "); every rank must pass the same budget=")
    assert limit is not None
    tp, pp = mesh.degree("tp"), mesh.degree("pp")
    if pp > 1:
        raise NotImplementedError('profile = "auto" under [parallel] pp > 1 is not implemented: the estimator does '
                                  "not model pipeline stages yet; run `memsave plan` and pass its profile")
    choice: tuple[Candidate, dict[str, int]] | str | Exception | None = None
    failed: Exception | None = None
    if mesh.rank == 0:
        try:
            choice = _choose(model, optimizer, mesh, tp, limit, example_inputs)
        except Exception as exc:  # sent to every rank: raised on rank 0 alone, the others would wait for ever
            failed, choice = exc, _sendable(exc)
    choice = all_gather_object(choice)[0]
    if failed is not None:
        raise failed
    if isinstance(choice, Exception):
        choice.add_note('raised on rank 0 while it chose the profile (profile = "auto")')
        raise choice
    if isinstance(choice, str):
        raise PlanError(choice)
    assert choice is not None
    if mesh.rank == 0:
        peak = sum(v for k, v in choice[1].items() if k not in OFF_DEVICE)
        # shown by default (as the units' choice is): the user should see what runs, not guess
        get_logger().warning('profile = "auto": %s, predicted peak %s per rank (memsave.estimate) of budget %s',
                          choice[0].label(), format_bytes(int(peak)), format_bytes(int(limit)))
    return to_profile(choice[0], name="auto")


def _choose(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh, tp: int, limit: float,
            batch: Any) -> tuple[Candidate, dict[str, int]] | str:
    device = mesh.device.type
    dp = mesh.dp_size
    rows = next((v.shape[0] for v in (batch.values() if isinstance(batch, dict) else
                                      batch if isinstance(batch, (tuple, list)) else [batch])
                 if isinstance(v, torch.Tensor) and v.dim()), 1)
    seq = next((v.shape[1] for v in (batch.values() if isinstance(batch, dict) else [batch])
                if isinstance(v, torch.Tensor) and v.dim() > 1), 1)
    spec = from_module(model)
    hw = calibrate(device=device, collectives=False)
    offloads = ("none", "optimizer", "optimizer+params") if device == "cuda" else ("none",)
    fits, smallest = [], None
    measured: dict[Any, Any] = {}  # [Note: activations measured once per plan] in memsave/estimate_activations.py
    for stage in (0, 1, 2, 3):
        for off in offloads:
            if (off != "none" and stage == 0) or (off == "optimizer+params" and stage != 3):
                continue
            if dp == 1 and stage and (off == "none" or stage not in (1, 3)):
                continue  # one rank: a stage only to offload, as memsave.plan.search.candidates
            for rec in ("none", "selective", "full"):
                c = Candidate(dp=dp, tp=tp, pp=1, stage=stage, precision="fp32", recompute=rec, offload=off,
                              micro_batch=rows, micro_batches=1, optimizer=_optimizer_name(optimizer))
                with activations_cached(measured):
                    held = exact_peak(model, c, batch, device=device)
                peak = sum(v for k, v in held.items() if k not in OFF_DEVICE)
                priced = dataclasses.replace(price(spec, c, hw, seq), device={k: float(v) for k, v in held.items()
                                                                               if k not in OFF_DEVICE}, exact=True)
                if peak * (1 + HEADROOM) <= limit:
                    fits.append((priced.step_time, peak, c, held))
                elif smallest is None or peak < smallest[0]:
                    smallest = (peak, c)
    if not fits:
        assert smallest is not None
        return (f'profile = "auto": nothing fits {format_bytes(int(limit))} per rank; the smallest is '
                f"{smallest[1].label()} at {at_least(smallest[0] * (1 + HEADROOM))} with {HEADROOM:.0%} "
                "headroom: raise budget= to that, or lower the micro-batch")
    fits.sort(key=lambda f: (f[0], f[1]))
    return fits[0][2], fits[0][3]
