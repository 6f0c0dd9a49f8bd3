"""Split a model's blocks into pipeline stages so that the slowest stage is as fast as it can be.

torchgpipe's ``balance_by_time`` measures each block and partitions the sequence; DeepSpeed and torchtitan split
by parameter or layer count, which leaves a pipeline as slow as its heaviest stage when blocks differ (an
embedding and an LM head much wider than a layer). :func:`balance` takes each block's measured cost (time, and
optionally bytes) and finds the contiguous split into ``stages`` parts with the smallest largest time, exactly
(dynamic programming over split points), optionally under a per-stage memory limit that counts what a 1F1B stage
really holds: stage ``i`` of ``p`` keeps ``p - i`` micro-batches' activations in flight.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = ["Balance", "balance", "balance_by_params", "by_count"]


@dataclasses.dataclass(frozen=True)
class Balance:
    """``bounds[k]``: the first block of stage ``k`` (``bounds[0] == 0``); times and bytes per stage."""

    names: tuple[str, ...]
    bounds: tuple[int, ...]
    times: tuple[float, ...]
    bytes: tuple[int, ...]

    @property
    def stages(self) -> list[tuple[str, ...]]:
        ends = [*self.bounds[1:], len(self.names)]
        return [self.names[a:b] for a, b in zip(self.bounds, ends)]

    @property
    def slowest_vs_ideal(self) -> float:
        """The slowest stage against the ideal ``total / stages`` (1.0: perfectly even)."""
        ideal = sum(self.times) / len(self.times)
        return max(self.times) / ideal if ideal else 1.0

    def to_text(self, unit: str = "ms", scale: float = 1e3) -> str:
        lines = [f"{'stage':>5}  {'blocks':<40} {unit:>9} {'bytes':>13}"]
        for k, blocks in enumerate(self.stages):
            shown = blocks[0] if len(blocks) == 1 else f"{blocks[0]} .. {blocks[-1]} ({len(blocks)})"
            lines.append(f"{k:>5}  {shown:<40} {self.times[k] * scale:>9.2f} {self.bytes[k]:>13,}")
        lines.append(f"slowest stage {self.slowest_vs_ideal:.2f}x the ideal (total / {len(self.times)})")
        return "\n".join(lines)


def _make(names: Sequence[str], times: Sequence[float], nbytes: Sequence[int], bounds: list[int]) -> Balance:
    ends = [*bounds[1:], len(names)]
    return Balance(tuple(names), tuple(bounds), tuple(sum(times[a:b]) for a, b in zip(bounds, ends)),
                   tuple(int(sum(nbytes[a:b])) for a, b in zip(bounds, ends)))


def _check(names: Sequence[str], times: Sequence[float], stages: int) -> None:
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"balance: stages={stages!r} is not allowed; expected a positive integer")
    if len(names) != len(times):
        raise ValueError(f"balance: {len(names)} block names but {len(times)} costs")
    if len(names) < stages:
        raise ValueError(f"balance: {len(names)} blocks cannot fill {stages} stages (each needs one at least)")
    if any(not math.isfinite(t) or t < 0 for t in times):
        raise ValueError(f"balance: block costs must be finite and >= 0, got {list(times)}")


def balance(names: Sequence[str], times: Sequence[float], stages: int, *, nbytes: Sequence[int] | None = None,
            activation_bytes: Sequence[int] | None = None, memory_limit: int | None = None) -> Balance:
    """The contiguous split of blocks ``names`` (costs ``times``) into ``stages`` minimizing the slowest stage.

    With ``memory_limit``: stage ``i`` must fit ``sum(nbytes) + (stages - i) * sum(activation_bytes)`` of its
    blocks (model state plus the 1F1B in-flight activations); ValueError if no split fits."""
    _check(names, times, stages)
    n = len(names)
    weights = list(nbytes) if nbytes is not None else [0] * n
    acts = list(activation_bytes) if activation_bytes is not None else [0] * n
    pre_t = [0.0]
    pre_b = [0]
    pre_a = [0]
    for t, b, a in zip(times, weights, acts):
        pre_t.append(pre_t[-1] + t)
        pre_b.append(pre_b[-1] + b)
        pre_a.append(pre_a[-1] + a)

    def fits(stage: int, a: int, b: int) -> bool:
        if memory_limit is None:
            return True
        return pre_b[b] - pre_b[a] + (stages - stage) * (pre_a[b] - pre_a[a]) <= memory_limit

    inf = math.inf
    # best[k][j]: the smallest slowest-stage time splitting blocks [0, j) into stages 0..k-1; cut[k][j]: the start
    # of stage k-1 in that split
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == inf or not fits(k - 1, i, j):
                    continue
                cost = max(best[k - 1][i], pre_t[j] - pre_t[i])
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    if best[stages][n] == inf:
        raise ValueError(f"balance: no split of {n} blocks into {stages} stages fits memory_limit={memory_limit:,} "
                         "bytes per stage (model state plus 1F1B's in-flight activations)")
    bounds, j = [], n
    for k in range(stages, 0, -1):
        j = cut[k][j]
        bounds.append(j)
    return _make(names, times, weights, bounds[::-1])


def balance_by_params(names: Sequence[str], params: Sequence[int], stages: int) -> Balance:
    """The split evening out parameter counts (DeepSpeed's ``partition_method="parameters"``)."""
    b = balance(names, [float(p) for p in params], stages, nbytes=params)
    return b


def by_count(names: Sequence[str], times: Sequence[float], stages: int) -> Balance:
    """The layer-count split (equal numbers of blocks, the first stages one more), for comparison."""
    _check(names, times, stages)
    per, extra = divmod(len(names), stages)
    bounds, start = [], 0
    for k in range(stages):
        bounds.append(start)
        start += per + (1 if k < extra else 0)
    return _make(names, times, [0] * len(names), bounds)
