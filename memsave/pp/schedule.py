"""Pipeline schedules as data: one ordered list of compute actions per pp rank.

A schedule says, for each pp rank, which stage runs which micro-batch's forward (``F``), backward (``B``), or the
backward split in two as zero-bubble schedules do: the input-gradient pass (``I``) that the previous stage waits
for, and the weight-gradient pass (``W``) that can wait to fill a bubble (Qi et al., 2024, arXiv 2401.10241).

Stages are *virtual*: ``n_stages = pp * virtual``; rank ``r`` holds the stages for which ``rank_of(stage) == r``
(looped placement, stage ``s`` on rank ``s % pp``, as Megatron's interleaved schedule). Communication is implicit
in the data: the forward of stage ``s > 0`` needs the output of stage ``s - 1`` and the backward of stage
``s < n_stages - 1`` needs the input gradient of stage ``s + 1``; where the two stages sit on different ranks the
runtime sends right after the producing action (non-blocking) and receives right before the consuming one. That
is what :func:`check` simulates to reject a schedule that would deadlock, before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KINDS", "SCHEDULES", "Action", "Schedule", "build", "check", "gpipe", "interleaved", "one_f_one_b",
           "zero_bubble", "zero_bubble_h1"]

KINDS = ("F", "B", "I", "W")  # forward; full backward; input-gradient backward; weight-gradient backward


@dataclass(frozen=True)
class Action:
    """One compute action: ``kind`` of micro-batch ``mb`` on (virtual) stage ``stage``."""

    kind: str
    stage: int
    mb: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Action kind {self.kind!r} is not one of {KINDS}")

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.mb}"


@dataclass(frozen=True)
class Schedule:
    """``actions[r]``: the ordered compute actions of pp rank ``r``."""

    name: str
    pp: int
    micro_batches: int
    actions: tuple[tuple[Action, ...], ...]
    virtual: int = 1

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual

    def rank_of(self, stage: int) -> int:
        """The pp rank holding ``stage`` (looped placement)."""
        return stage % self.pp

    def stages_of(self, rank: int) -> list[int]:
        return [s for s in range(self.n_stages) if self.rank_of(s) == rank]


def gpipe(pp: int, micro_batches: int) -> Schedule:
    """GPipe (Huang et al., 2019): every forward, then every backward (in reverse micro-batch order)."""
    acts = tuple(
        tuple([Action("F", r, mb) for mb in range(micro_batches)]
              + [Action("B", r, mb) for mb in reversed(range(micro_batches))])
        for r in range(pp))
    return Schedule("gpipe", pp, micro_batches, acts)


def one_f_one_b(pp: int, micro_batches: int) -> Schedule:
    """1F1B (PipeDream-flush, Narayanan et al., 2021): rank ``r`` warms up with ``pp - r - 1`` forwards, then
    alternates one forward and one backward, then drains the backwards. Stage ``r`` holds at most ``pp - r``
    micro-batches' activations."""
    acts = []
    for r in range(pp):
        warm = min(pp - r - 1, micro_batches)
        seq = [Action("F", r, mb) for mb in range(warm)]
        f, b = warm, 0
        while f < micro_batches:
            seq.append(Action("F", r, f))
            f += 1
            seq.append(Action("B", r, b))
            b += 1
        seq += [Action("B", r, mb) for mb in range(b, micro_batches)]
        acts.append(tuple(seq))
    return Schedule("1f1b", pp, micro_batches, tuple(acts))


def interleaved(pp: int, micro_batches: int, virtual: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., 2021; Megatron's virtual pipeline): rank ``r`` holds stages ``r``,
    ``r + pp``, ... (``virtual`` of them) and works through micro-batches in groups of ``pp``, one chunk after
    the other, warming up with ``2 (pp - r - 1) + (virtual - 1) pp`` forwards. The bubble shrinks by ``virtual``;
    each rank holds ``1 + (pp - 1) / (pp virtual)`` times 1F1B's activations. Needs ``micro_batches % pp == 0``
    (as Megatron does): the groups must be whole."""
    _check_sizes(pp, micro_batches, virtual)
    if micro_batches % pp:
        raise ValueError(f"schedule 'interleaved' needs micro_batches divisible by pp: micro_batches={micro_batches}, "
                         f"pp={pp} (use {micro_batches + pp - micro_batches % pp}, or schedule '1f1b')")
    total = micro_batches * virtual

    def order(rank: int, k: int, backward: bool) -> Action:
        group, within = divmod(k, pp * virtual)
        chunk = within // pp
        if backward:
            chunk = virtual - 1 - chunk
        return Action("B" if backward else "F", chunk * pp + rank, group * pp + within % pp)

    acts = []
    for r in range(pp):
        warm = min(total, 2 * (pp - r - 1) + (virtual - 1) * pp)
        seq = [order(r, k, False) for k in range(warm)]
        for i in range(total - warm):
            seq += [order(r, warm + i, False), order(r, i, True)]
        seq += [order(r, k, True) for k in range(total - warm if warm < total else 0, total)]
        acts.append(tuple(seq))
    return Schedule("interleaved", pp, micro_batches, tuple(acts), virtual)


def zero_bubble_h1(pp: int, micro_batches: int) -> Schedule:
    """ZB-H1 (Qi et al., 2024): 1F1B with each backward split into the input-gradient pass ``I``, sent upstream at
    once, and the weight-gradient pass ``W``, which stage ``r`` runs ``r`` micro-batches late: the later stages,
    which warm up with fewer forwards, fill their bubbles with ``W`` passes while the ``I`` passes travel up.
    Every stage holds at most ``pp`` micro-batches (forward done, ``W`` not), 1F1B's peak; the bubble is
    ``(p-1)(T_F + T_I - T_W)``, with equal costs a third of 1F1B's: idle fraction ``(p-1)/(3m+p-1)``."""
    _check_sizes(pp, micro_batches, 1)
    acts = []
    for r in range(pp):
        warm = min(pp - 1 - r, micro_batches)
        seq = [Action("F", r, f) for f in range(warm)]
        w = 0
        for i in range(micro_batches):  # one forward (while any is left), then one input-gradient pass
            if warm + i < micro_batches:
                seq.append(Action("F", r, warm + i))
            seq.append(Action("I", r, i))
            if i + 1 - w > r:  # the W of the micro-batch r places back
                seq.append(Action("W", r, w))
                w += 1
        seq += [Action("W", r, mb) for mb in range(w, micro_batches)]
        acts.append(tuple(seq))
    return Schedule("zero-bubble", pp, micro_batches, tuple(acts))


def zero_bubble(pp: int, micro_batches: int, *, in_flight: str = "h1") -> Schedule:
    """Zero-bubble pipeline (Qi et al., 2024): each backward split into the input-gradient pass ``I`` (what the
    previous stage waits for) and the weight-gradient pass ``W`` (which nobody waits for), and the ``W`` passes
    moved into what would be bubbles. ``in_flight="h1"``: :func:`zero_bubble_h1`. ``"h2"`` (ZB-H2: almost no
    bubble, ``2 pp - 1`` micro-batches in flight): the order found by running the pipeline with equal costs and
    taking, on each rank whenever it is free, an ``I`` that is ready first, then a forward if fewer than
    ``2 pp - 1`` micro-batches are in flight, then a pending ``W``."""
    _check_sizes(pp, micro_batches, 1)
    if in_flight not in ("h1", "h2"):
        raise ValueError(f"zero_bubble in_flight={in_flight!r} is not allowed; expected 'h1' or 'h2'")
    if in_flight == "h1":
        return zero_bubble_h1(pp, micro_batches)
    limit = 2 * pp - 1
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, mb) -> finish time
    seqs: list[list[Action]] = [[] for _ in range(pp)]
    free = [0] * pp
    nxt_f, nxt_i = [0] * pp, [0] * pp
    pending_w: list[list[int]] = [[] for _ in range(pp)]
    t = 0
    while any(len(s) < 3 * micro_batches for s in seqs):
        for r in range(pp):
            if free[r] > t:
                continue
            pick: Action | None = None
            i = nxt_i[r]
            if i < micro_batches and _ready(done, ("F", r, i), t) and (
                    r == pp - 1 or _ready(done, ("I", r + 1, i), t)):
                pick = Action("I", r, i)
                nxt_i[r] += 1
                pending_w[r].append(i)
            else:
                f = nxt_f[r]
                flight = f - (len(seqs[r]) - f - nxt_i[r])  # forwards done minus W done
                if f < micro_batches and flight < limit and (r == 0 or _ready(done, ("F", r - 1, f), t)):
                    pick = Action("F", r, f)
                    nxt_f[r] += 1
                elif pending_w[r]:
                    pick = Action("W", r, pending_w[r].pop(0))
            if pick is not None:
                seqs[r].append(pick)
                done[(pick.kind, pick.stage, pick.mb)] = t + 1
                free[r] = t + 1
        t += 1
        if t > 10 * 3 * micro_batches * pp:  # cannot happen for these rules; a guard, not a fallback
            raise AssertionError("zero_bubble: the greedy construction did not finish")
    return Schedule("zero-bubble-h2", pp, micro_batches, tuple(tuple(s) for s in seqs))


def _ready(done: dict[tuple[str, int, int], int], key: tuple[str, int, int], t: int) -> bool:
    return key in done and done[key] <= t


def _check_sizes(pp: int, micro_batches: int, virtual: int) -> None:
    for key, value in (("pp", pp), ("micro_batches", micro_batches), ("virtual", virtual)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"schedule {key}={value!r} is not allowed; expected a positive integer")


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble", "zero-bubble-h2")


def build(name: str, pp: int, micro_batches: int, virtual: int = 1, *, checked: bool = True) -> Schedule:
    """The schedule named by ``[parallel] schedule``, checked (:func:`check`) before it is returned (``checked=False``:
    for a caller that simulates it at once, which rejects it the same way)."""
    if name not in SCHEDULES:
        raise ValueError(f"[parallel] schedule = {name!r} is not allowed; expected one of {list(SCHEDULES)}")
    if virtual != 1 and name != "interleaved":
        raise ValueError(f"[parallel] virtual = {virtual} needs schedule 'interleaved', not {name!r}")
    if name == "gpipe":
        sched = gpipe(pp, micro_batches)
    elif name == "1f1b":
        sched = one_f_one_b(pp, micro_batches)
    elif name == "interleaved":
        sched = interleaved(pp, micro_batches, virtual)
    else:
        sched = zero_bubble(pp, micro_batches, in_flight="h1" if name == "zero-bubble" else "h2")
    if checked:
        check(sched)
    return sched


def check(schedule: Schedule) -> None:
    """Reject a schedule that is incomplete, misplaced or would deadlock, before anything runs (ValueError)."""
    from memsave.pp.simulate import Costs, simulate  # (simulate imports this module)

    simulate(schedule, Costs.uniform(schedule.n_stages))
