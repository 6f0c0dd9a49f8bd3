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

__all__ = ["KINDS", "Action", "Schedule", "gpipe", "one_f_one_b"]

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
