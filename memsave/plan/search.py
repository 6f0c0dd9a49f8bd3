"""``memsave plan``: every configuration that fits, ranked by predicted step time, and why the others do not.

:func:`plan` enumerates the mesh (every dp x tp x pp factorization of the world: tp within a node and dividing
the heads, pp at most the layers), the ZeRO stage, precision, recomputation, offload, the micro-batch split of
the global batch and, under pp, the schedule; prices each (:func:`memsave.plan.cost.price`); keeps those whose
busiest rank fits the device, host and disk budgets; and ranks them by step time. A family (ZeRO stage and
offload) with no fitting member is reported with the reason of its smallest member ("zero2: optimizer state
41.0 GiB ... > budget 16.0 GiB"). With no fitting configuration at all, the error names the smallest budget that
would fit (an exact figure where the model can be estimated: the closed forms near the smallest are checked),
and with no configuration to price at all, the rule each mesh breaks. Sequence parallelism comes with tp where
the sequence splits evenly over its ranks; tp's groups stay within a node (tp divides the devices per node).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from memsave.estimate_activations import MetaValueError, activations_cached
from memsave.memory.schema import OFF_DEVICE, format_bytes
from memsave.plan.cost import Candidate, Priced, price
from memsave.plan.hardware import Hardware
from memsave.plan.spec import ModelSpec

__all__ = ["HEADROOM", "Plan", "PlanError", "at_least", "candidates", "plan"]

HEADROOM = 0.05  # of an exact peak (memsave.estimate), kept free: the estimator's validated error
ANALYTIC_HEADROOM = 0.10  # of a closed-form peak
FAR_OVER = 1.5  # a closed-form peak this far over the budget is not estimated exactly (see plan())
NEAR = 0.15  # nothing fits: closed forms within this of the smallest are estimated exactly (see plan())

_NAMES = {"params": "parameters", "grads": "gradients", "master": "fp32 masters", "optimizer_state":
          "optimizer state", "params_gathered": "gathered parameters", "activations": "activations",
          "transient": "CUDA allocator's transients (workspace, logit gradients, step temporaries)",
          "comm": "communication buffers (gather and reduce staging, prefetched chunks, pipeline messages in flight)",
          "buffers": "module buffers"}


class PlanError(ValueError):
    """No configuration fits; the message names the smallest budget that would."""


@dataclasses.dataclass
class Plan:
    ranked: list[Priced]  # the fitting configurations, fastest first
    rejected: dict[str, str]  # family -> why none of its members fits
    budget: float
    host_budget: float
    disk_budget: float
    considered: int
    # mesh -> why its memory is not memsave.estimate's (a transformer's are then the closed forms', else unknown)
    unpriced: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def best(self) -> Priced:
        return self.ranked[0]

    def binding(self, p: Priced | None = None) -> str:
        """Which limit of ``p`` (default: the choice) would break first: the resource nearest its budget and the
        largest term in it."""
        p = p or self.best
        uses = [("device memory", p.peak, self.budget, p.device)]
        if p.host:
            uses.append(("host memory", p.host, self.host_budget, {}))
        if p.disk:
            uses.append(("disk", p.disk, self.disk_budget, {}))
        name, used, limit, cats = max(uses, key=lambda u: u[1] / u[2] if u[2] else 0.0)
        largest = max(cats, key=cats.__getitem__) if cats else ""
        detail = f", the largest term {_NAMES.get(largest, largest)} {format_bytes(int(cats[largest]))}" if cats else ""
        return f"{name}: {format_bytes(int(used))} of {format_bytes(int(limit))} ({used / limit:.0%}){detail}"


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in ascending order, in O(sqrt n) (a world of 1e8 took 22 s by trial of every d)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def candidates(spec: ModelSpec, world: int, global_batch: int, *, gpus_per_node: int, precisions: Sequence[str],
               offloads: Sequence[str], recomputes: Sequence[str] = ("none", "selective", "full"),
               schedules: Sequence[str] = ("1f1b", "interleaved", "zero-bubble"), max_micro_batches: int = 64,
               optimizer: str = "adamw", tp_degrees: Sequence[int] | None = None,
               pp_degrees: Sequence[int] | None = None, seq: int = 0) -> Iterator[Candidate]:
    """Every candidate of the search ([module docstring]); sequence parallelism with tp where ``seq`` (0: any)
    splits evenly over the tp ranks."""
    for tp in _divisors(world):
        if _tp_refused(spec, world, tp, gpus_per_node) or (tp_degrees and tp not in tp_degrees):
            continue
        for pp in _divisors(world // tp):
            if pp_degrees and pp not in pp_degrees:
                continue
            if pp > spec.layers:
                continue
            dp = world // (tp * pp)
            if global_batch % dp:
                continue
            rows = global_batch // dp
            for mb in _divisors(rows):
                m = rows // mb
                if m > max_micro_batches or (pp > 1 and m < pp):
                    continue
                scheds = [("", 1)] if pp == 1 else [
                    (s, 2 if s == "interleaved" else 1) for s in schedules
                    if s != "interleaved" or (m % pp == 0 and spec.layers % (2 * pp) == 0)]
                for sched, v in scheds:
                    for stage in (0, 1, 2, 3):
                        for off in offloads:
                            if off.startswith("optimizer+params") and stage != 3:
                                continue  # parameters are offloaded as ZeRO-3 shards
                            if off != "none" and (stage == 0 or tp > 1 or (pp > 1 and off.startswith("optimizer+"))):
                                # offload streams ZeRO's shards; the estimator misses ~10% of the peak of
                                # parameter offload under pp and ~30% of offload with tp: not offered
                                continue
                            if dp == 1 and stage and (off == "none" or stage not in (1, 3)):
                                continue  # one rank: a stage only to offload (1: the optimizer, 3: parameters)
                            for prec in precisions:
                                for rec in recomputes:
                                    yield Candidate(dp=dp, tp=tp, pp=pp, stage=stage, precision=prec,
                                                    recompute=rec, offload=off, micro_batch=mb, micro_batches=m,
                                                    schedule=sched or "1f1b", virtual=v,
                                                    sequence=tp > 1 and seq % tp == 0,
                                                    optimizer=optimizer)


def _tp_refused(spec: ModelSpec, world: int, tp: int, gpus_per_node: int) -> str:
    """Why tensor parallelism of degree ``tp`` is not offered ('' when it is): it must divide the heads, and its
    groups (consecutive ranks) must stay within a node: tp divides the devices per node, or the whole world is
    one node."""
    if spec.heads and spec.heads % tp:
        return f"tp {tp} does not divide the {spec.heads} heads"
    if tp > gpus_per_node or (world > gpus_per_node and gpus_per_node % tp):
        return f"tp {tp} groups would span nodes of {gpus_per_node} devices (tp must divide --gpus-per-node)"
    return ""


def _no_mesh(spec: ModelSpec, world: int, global_batch: int, gpus_per_node: int, tp_degrees: Sequence[int] | None,
             pp_degrees: Sequence[int] | None, max_micro_batches: int = 64) -> str:
    """Why no candidate was made: each dp x tp x pp of ``world`` and the first rule it breaks."""
    why = []
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            rows = global_batch // dp if global_batch % dp == 0 else 0
            rule = (_tp_refused(spec, world, tp, gpus_per_node)
                    or (f"tp {tp} not in the allowed degrees" if tp_degrees and tp not in tp_degrees else "")
                    or (f"pp {pp} not in the allowed degrees" if pp_degrees and pp not in pp_degrees else "")
                    or (f"pp {pp} > the {spec.layers} layers" if pp > spec.layers else "")
                    or (f"dp {dp} does not divide the global batch {global_batch}" if not rows else "")
                    or (f"{rows} rows per rank: no micro-batch split with at least pp = {pp} and at most "
                        f"{max_micro_batches} micro-batches"))
            why.append(f"dp{dp} tp{tp} pp{pp}: {rule}")
    return ("no dp x tp x pp of the world is allowed (tp must divide the heads and --gpus-per-node, pp be at most "
            "the layers, dp = world / (tp x pp) divide the global batch): " + "; ".join(why[:12])
            + (f"; ... {len(why) - 12} more" if len(why) > 12 else ""))


def _measuring_once(exact: Callable[[Candidate], dict[str, int]]) -> Callable[[Candidate], dict[str, int]]:
    """``exact`` with the activations it measures kept across its calls ([Note: activations measured once per
    plan] in memsave/estimate_activations.py)."""
    store: dict[Any, Any] = {}

    def run(c: Candidate) -> dict[str, int]:
        with activations_cached(store):
            return exact(c)

    return run


def plan(spec: ModelSpec, hw: Hardware, *, world: int, global_batch: int, seq: int, budget: float,
         host_budget: float | None = None, disk_budget: float = 0.0, gpus_per_node: int = 8,
         precisions: Sequence[str] | None = None, offloads: Sequence[str] | None = None,
         recomputes: Sequence[str] = ("none", "selective", "full"), optimizer: str = "adamw",
         exact: Callable[[Candidate], dict[str, int]] | None = None, headroom: float = HEADROOM,
         analytic_headroom: float = ANALYTIC_HEADROOM, tp_degrees: Sequence[int] | None = None,
         pp_degrees: Sequence[int] | None = None) -> Plan:
    """Every configuration of ``spec`` on ``world`` devices of ``hw`` for ``global_batch`` sequences of ``seq``
    tokens per step, ranked ([module docstring]). ``exact``: bytes per category of a candidate from the model
    itself (:func:`memsave.plan.profile.exact_peak`), used instead of the closed forms.
    A candidate fits when its peak plus ``headroom`` (of the exact figure; ``analytic_headroom`` of the closed
    forms) is within ``budget``: the validated error of each, kept free. ``tp_degrees``, ``pp_degrees``: only
    these degrees (default: every divisor that fits)."""
    for key, value in (("world", world), ("global_batch", global_batch), ("seq", seq)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} = {value!r} is not allowed; expected a positive integer")
    if not budget > 0:
        raise ValueError(f"budget = {budget!r} is not allowed; expected a positive number of bytes")
    if spec.max_seq and seq > spec.max_seq:
        raise ValueError(f"seq = {seq} is not allowed; the model takes at most {spec.max_seq} positions")
    host_budget = hw.host_memory if host_budget is None else host_budget
    precisions = precisions or (("bf16",) if hw.device == "cuda" else ("fp32",))
    if offloads is None:  # what memsave implements on the device (host offload on a CPU moves nothing)
        offloads = ("none", "optimizer", "optimizer+params") if hw.device == "cuda" else (
            ("none", "optimizer:disk", "optimizer+params:disk") if disk_budget else ("none",))
    fits: list[Priced] = []
    unpriced: dict[str, str] = {}
    smallest: dict[str, Priced] = {}
    skipped: list[Priced] = []  # a closed form past FAR_OVER x the budget: not estimated exactly (yet)
    n = 0
    measure = _measuring_once(exact) if exact is not None else None

    def estimated(p: Priced) -> Priced | None:
        assert measure is not None
        try:
            measured = measure(p.candidate)
        except Exception as exc:  # the estimator cannot run this one: said; priced by the closed forms only where
            # the forward reads values on the meta device (else the configuration itself is in question)
            mesh = p.candidate.label().split(" zero")[0]
            closed = isinstance(exc, MetaValueError) and bool(spec.heads and spec.vocab)
            unpriced.setdefault(mesh, f"memsave.estimate failed ({type(exc).__name__}: {exc}); "
                                      + ("the closed forms used" if closed else "not priced"))
            return p if closed else None
        host, disk = measured.get("offload_host", 0), measured.get("offload_disk", 0)
        device = {k: float(v) for k, v in measured.items() if k not in OFF_DEVICE}
        return dataclasses.replace(p, device=device, host=host or p.host, disk=disk or p.disk, exact=True)

    def judge(p: Priced) -> None:
        if p.peak * (1 + (headroom if p.exact else analytic_headroom)) <= budget and p.host <= host_budget and \
                p.disk <= disk_budget:
            fits.append(p)
        elif p.candidate.family not in smallest or _over(p, budget, host_budget, disk_budget) < _over(
                smallest[p.candidate.family], budget, host_budget, disk_budget):
            smallest[p.candidate.family] = p

    for c in candidates(spec, world, global_batch, gpus_per_node=gpus_per_node, precisions=precisions,
                        offloads=offloads, recomputes=recomputes, optimizer=optimizer, tp_degrees=tp_degrees,
                        pp_degrees=pp_degrees, seq=seq):
        n += 1
        p = price(spec, c, hw, seq, gpus_per_node=gpus_per_node)
        if measure is not None:
            # a transformer's closed forms are within 15% of the exact figure (tests/test_plan_memory.py): one
            # whose closed form is past FAR_OVER x the budget cannot fit, and is not estimated exactly (it was 80%
            # of a plan's time on a module)
            if spec.heads and spec.vocab and p.peak > FAR_OVER * budget:
                skipped.append(p)
                continue
            q = estimated(p)
            if q is None:
                continue  # said in ``unpriced``
            p = q
        judge(p)
    if not fits and skipped:
        # nothing fits: the smallest budget named must be an exact figure where one can be had, not a closed form
        # (which overstates by up to 15%): the candidates within NEAR of the smallest closed form are estimated
        floor = min(p.peak for p in skipped)
        skipped = [(estimated(p) or p) if p.peak <= floor * (1 + NEAR) else p for p in skipped]
    for p in skipped:
        judge(p)
    fits.sort(key=lambda p: (p.step_time, p.peak))
    fitting_families = {p.candidate.family for p in fits}
    rejected = {fam: _why(p, budget, host_budget, disk_budget, headroom if p.exact else analytic_headroom)
                for fam, p in sorted(smallest.items()) if fam not in fitting_families}
    if not fits:
        if not smallest:
            raise PlanError(f"no configuration of {spec.name} could be priced: " + (
                "; ".join(f"{k}: {v}" for k, v in unpriced.items()) if unpriced else
                _no_mesh(spec, world, global_batch, gpus_per_node, tp_degrees, pp_degrees)))
        need = min(smallest.values(), key=lambda p: (p.host > host_budget or p.disk > disk_budget,
                                                     p.peak * (1 + (headroom if p.exact else analytic_headroom))))
        raise PlanError(f"no configuration of {spec.name} fits {format_bytes(int(budget))} per device on {world} "
                        f"device(s): the smallest that would fit needs "
                        f"{at_least(need.peak * (1 + (headroom if need.exact else analytic_headroom)))} "
                        f"per device ({_source(need)}: {need.candidate.label()}); "
                        + "; ".join(f"{k}: {v}" for k, v in rejected.items())
                        + "".join(f"; {k} not priced: {v}" for k, v in unpriced.items()))
    return Plan(fits, rejected, budget, host_budget, disk_budget, n, unpriced)


def at_least(n: float) -> str:
    """``n`` bytes as :func:`format_bytes` prints them, rounded up (a budget of the printed figure fits ``n``)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{math.ceil(n / scale * 10) / 10:.1f} {unit}"
    return f"{math.ceil(n)} B"


def _over(p: Priced, budget: float, host: float, disk: float) -> float:
    return max(p.peak / budget, p.host / host if host else 0.0, p.disk / disk if disk else (2.0 if p.disk else 0.0))


def _source(p: Priced) -> str:
    return "exact, memsave.estimate" if p.exact else "closed-form figure"


def _why(p: Priced, budget: float, host: float, disk: float, margin: float) -> str:
    if p.host > host:
        return f"host memory {at_least(p.host)} > host budget {format_bytes(int(host))} ({p.candidate.label()})"
    if p.disk > disk:
        return f"disk {at_least(p.disk)} > disk budget {format_bytes(int(disk))} ({p.candidate.label()})"
    largest = max(p.device, key=p.device.__getitem__)
    # the figures compared with a budget are rounded up: a peak just over 9.0 MiB reads 9.1, not "9.0 > 9.0"
    # under the budget but not with the headroom kept free: say so (the peak alone would read as fitting)
    kept = "" if p.peak > budget else f", {at_least(p.peak * (1 + margin))} with {margin:.0%} headroom"
    return (f"{_NAMES.get(largest, largest)} {format_bytes(int(p.device[largest]))} of {at_least(p.peak)} per "
            f"device{kept} > budget {format_bytes(int(budget))} at best ({_source(p)}: {p.candidate.label()})")
