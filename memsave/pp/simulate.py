"""Run a pipeline schedule on paper: per-action times, step time, each rank's idle fraction and activation peak.

:func:`simulate` plays every rank's list in order, as the runtime does: an action starts when its rank is free and
its inputs have arrived (the forward of stage ``s`` needs stage ``s - 1``'s output, a backward needs its own
forward and stage ``s + 1``'s input gradient, a ``W`` its own ``I``), a transfer between ranks taking
``latency + bytes / bandwidth``. Costs are per stage: measured forward, input-gradient and weight-gradient times
(a full backward ``B`` costs ``I + W``) and the activation bytes a micro-batch holds from its forward until its
backward frees them (with the backward split, ``kept_after_input`` of them stay until ``W``). torch's own
pipelining simulator checks the order only; this one also predicts time and memory, which the balancer and the
planner read.

The same run is the deadlock check: when no rank can start its next action, the schedule would hang, and the
error names what each stuck rank waits for (:func:`memsave.pp.schedule.check`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from memsave.pp.schedule import Action, Schedule

__all__ = ["Costs", "SimResult", "Timed", "bubble_formula", "simulate"]


@dataclasses.dataclass(frozen=True)
class Costs:
    """Per-stage costs: seconds (or any time unit) and bytes per micro-batch."""

    forward: Sequence[float]
    backward_input: Sequence[float]
    backward_weight: Sequence[float]
    activation_bytes: Sequence[float]
    send_bytes: Sequence[float] = ()  # stage s's output per micro-batch (its input gradient is as large)
    bandwidth: float = math.inf  # bytes per time unit between two ranks
    latency: float = 0.0
    kept_after_input: float = 1.0  # the share of a micro-batch's activations that W still needs after I

    @classmethod
    def uniform(cls, n_stages: int, forward: float = 1.0, backward_input: float = 1.0,
                backward_weight: float = 1.0, activation_bytes: float = 1.0) -> Costs:
        return cls([forward] * n_stages, [backward_input] * n_stages, [backward_weight] * n_stages,
                   [activation_bytes] * n_stages)

    def time(self, a: Action) -> float:
        if a.kind == "F":
            return self.forward[a.stage]
        if a.kind == "I":
            return self.backward_input[a.stage]
        if a.kind == "W":
            return self.backward_weight[a.stage]
        return self.backward_input[a.stage] + self.backward_weight[a.stage]

    def transfer(self, stage: int) -> float:
        nbytes = self.send_bytes[stage] if stage < len(self.send_bytes) else 0.0
        return self.latency + (nbytes / self.bandwidth if nbytes else 0.0)


@dataclasses.dataclass(frozen=True)
class Timed:
    rank: int
    action: Action
    start: float
    end: float


@dataclasses.dataclass
class SimResult:
    schedule: Schedule
    timed: list[Timed]
    step_time: float
    busy: list[float]
    peak_bytes: list[float]  # per rank: the largest activation bytes held at once
    peak_micro_batches: list[int]  # per rank: the most micro-batches whose activations were held at once

    @property
    def idle_fraction(self) -> list[float]:
        return [1.0 - b / self.step_time if self.step_time else 0.0 for b in self.busy]

    def rows(self) -> list[dict[str, Any]]:
        """Plain data for a report: one dict per action."""
        return [{"rank": t.rank, "action": str(t.action), "kind": t.action.kind, "stage": t.action.stage,
                 "mb": t.action.mb, "start": t.start, "end": t.end} for t in self.timed]

    def to_text(self, unit: float | None = None) -> str:
        """One row per rank: each action in the time slots it takes (``unit`` time per character), ``.`` idle."""
        unit = unit or min((t.end - t.start for t in self.timed if t.end > t.start), default=1.0)
        width = max(1, round(self.step_time / unit))
        label = max(len(str(t.action)) for t in self.timed) if self.timed else 1
        lines = [f"{self.schedule.name}: pp={self.schedule.pp} micro-batches={self.schedule.micro_batches}"
                 + (f" virtual={self.schedule.virtual}" if self.schedule.virtual > 1 else "")
                 + f"; step {self.step_time:.4g}, one column = {unit:.4g}"]
        for r in range(self.schedule.pp):
            cells = ["." * label] * width
            for t in self.timed:
                if t.rank == r:
                    for c in range(round(t.start / unit), max(round(t.end / unit), round(t.start / unit) + 1)):
                        if c < width:
                            cells[c] = str(t.action).ljust(label)
            idle = self.idle_fraction[r]
            lines.append(f"rank {r} |{'|'.join(cells)}| idle {idle:.0%}, peak {self.peak_micro_batches[r]} mb")
        return "\n".join(lines)


def bubble_formula(name: str, pp: int, micro_batches: int, virtual: int = 1) -> float:
    """The idle fraction of each rank the literature gives, with equal stage costs and free communication:
    GPipe and 1F1B (p-1)/(m+p-1); interleaved (p-1)/(v m+p-1); ZB-H1 with F = I = W (p-1)/(3m+p-1), a third of
    1F1B's idle time (Qi et al., 2024, Table 1)."""
    p, m, v = pp, micro_batches, virtual
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zero-bubble":
        return (p - 1) / (3 * m + p - 1)
    raise ValueError(f"bubble_formula: no formula for schedule {name!r}")


def _deps(a: Action, backward_of: dict[tuple[int, int], Action], last: int) -> list[Action]:
    if a.kind == "F":
        return [Action("F", a.stage - 1, a.mb)] if a.stage > 0 else []
    if a.kind == "W":
        return [Action("I", a.stage, a.mb)]
    deps = [Action("F", a.stage, a.mb)]
    if a.stage < last:
        deps.append(backward_of[(a.stage + 1, a.mb)])
    return deps


def _complete(schedule: Schedule) -> dict[tuple[int, int], Action]:
    """Each (stage, mb) once forward and once backward (B, or I then W) on the rank holding the stage; returns
    the action that produces each (stage, mb)'s input gradient (B or I)."""
    seen: dict[tuple[str, int, int], int] = {}
    for r, acts in enumerate(schedule.actions):
        for a in acts:
            if not 0 <= a.stage < schedule.n_stages or not 0 <= a.mb < schedule.micro_batches:
                raise ValueError(f"schedule {schedule.name!r}: rank {r}: {a} is outside {schedule.n_stages} stages "
                                 f"x {schedule.micro_batches} micro-batches")
            if schedule.rank_of(a.stage) != r:
                raise ValueError(f"schedule {schedule.name!r}: rank {r} lists {a}, but stage {a.stage} is on rank "
                                 f"{schedule.rank_of(a.stage)}")
            key = (a.kind, a.stage, a.mb)
            if key in seen:
                raise ValueError(f"schedule {schedule.name!r}: rank {r} lists {a} twice")
            seen[key] = r
    backward_of = {}
    for s in range(schedule.n_stages):
        for mb in range(schedule.micro_batches):
            has = {k for k in "FBIW" if (k, s, mb) in seen}
            if has not in ({"F", "B"}, {"F", "I", "W"}):
                raise ValueError(f"schedule {schedule.name!r}: stage {s} micro-batch {mb} has {sorted(has)}; "
                                 "expected F and B, or F, I and W")
            backward_of[(s, mb)] = Action("B" if "B" in has else "I", s, mb)
    return backward_of


def simulate(schedule: Schedule, costs: Costs) -> SimResult:
    """Play ``schedule`` with ``costs``; ValueError if it is incomplete or would deadlock."""
    backward_of = _complete(schedule)
    last = schedule.n_stages - 1
    end: dict[Action, float] = {}
    free = [0.0] * schedule.pp
    pos = [0] * schedule.pp
    timed: list[Timed] = []
    total = sum(len(a) for a in schedule.actions)
    while len(timed) < total:
        progress = False
        for r, acts in enumerate(schedule.actions):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                deps = _deps(a, backward_of, last)
                if any(d not in end for d in deps):
                    break
                ready = [end[d] + (costs.transfer(min(d.stage, a.stage)) if schedule.rank_of(d.stage) != r else 0.0)
                         for d in deps]
                start = max([free[r], *ready])
                end[a] = free[r] = start + costs.time(a)
                timed.append(Timed(r, a, start, end[a]))
                pos[r] += 1
                progress = True
        if not progress:
            raise ValueError(_deadlock(schedule, pos, end, backward_of))
    step = max((t.end for t in timed), default=0.0)
    busy = [sum(t.end - t.start for t in timed if t.rank == r) for r in range(schedule.pp)]
    peak_bytes, peak_mb = _memory(schedule, timed, costs)
    return SimResult(schedule, sorted(timed, key=lambda t: (t.start, t.rank)), step, busy, peak_bytes, peak_mb)


def _deadlock(schedule: Schedule, pos: list[int], end: dict[Action, float],
              backward_of: dict[tuple[int, int], Action]) -> str:
    where = {a: (r, i) for r, acts in enumerate(schedule.actions) for i, a in enumerate(acts)}
    parts = []
    for r, acts in enumerate(schedule.actions):
        if pos[r] < len(acts):
            a = acts[pos[r]]
            for d in _deps(a, backward_of, schedule.n_stages - 1):
                if d not in end:
                    dr, di = where[d]
                    blocker = schedule.actions[dr][pos[dr]] if pos[dr] < len(schedule.actions[dr]) else None
                    parts.append(f"rank {r} waits at {a} for {d}, which rank {dr} runs at position {di}, after "
                                 f"{blocker} it is stuck at" if blocker is not None and blocker != d else
                                 f"rank {r} waits at {a} for {d} (rank {dr}, position {di})")
    return f"schedule {schedule.name!r} would deadlock: " + "; ".join(parts)


def _memory(schedule: Schedule, timed: list[Timed], costs: Costs) -> tuple[list[float], list[int]]:
    """Per rank: activation bytes held over time (allocated at a forward's start, freed at the end of the backward
    that needs them last) and the most micro-batches held at once."""
    peaks_b, peaks_m = [], []
    for r in range(schedule.pp):
        events: list[tuple[float, int, float, int]] = []  # (time, order: frees first, bytes, micro-batches)
        for t in timed:
            if t.rank != r:
                continue
            act, kept = costs.activation_bytes[t.action.stage], costs.kept_after_input
            if t.action.kind == "F":
                events.append((t.start, 1, act, 1))
            elif t.action.kind == "B":
                events.append((t.end, 0, -act, -1))
            elif t.action.kind == "I":
                events.append((t.end, 0, -act * (1 - kept), 0))
            else:
                events.append((t.end, 0, -act * kept, -1))
        held_b = peak_b = 0.0
        held_m = peak_m = 0
        for _, _, b, m in sorted(events):
            held_b += b
            held_m += m
            peak_b, peak_m = max(peak_b, held_b), max(peak_m, held_m)
        peaks_b.append(peak_b)
        peaks_m.append(peak_m)
    return peaks_b, peaks_m
