"""Control-flow agreement: ranks that stopped doing the same thing are named within one step, not after a hang.

[Note: control-flow agreement] Collectives pair up across ranks by issue order. When one rank skips
``optimizer.step()`` or runs an extra forward/backward, its next collective pairs with a different one on its
peers: a hang for the whole collective timeout (600 s) ending in gloo's generic message, or, under plain data
parallelism, several steps that average the wrong gradients first. So each engine, at the start of every phase
that communicates, all-gathers ``(step, phase)`` on a group of its own (these calls pair only with each other,
whatever else is in flight) and raises on every rank when they differ, naming each rank's step and phase:
"rank 1 is at step 4 (backward), rank 0 at step 4 (optimizer)". It costs one all-gather of two integers per
phase; a phase that does not communicate (a forward under plain data parallelism or ZeRO-1/2, a ``no_sync``
backward) is not checked, so a rank-0-only evaluation pass there stays legal.
"""

from __future__ import annotations

import torch

from memsave.dist.collectives import ProcessGroup, all_gather_into, group_rank, group_size

__all__ = ["Agreement"]

PHASES = ("forward", "backward", "optimizer")


class Agreement:
    """``check(phase)`` at the start of each communicating phase; ``step`` counts the optimizer steps taken."""

    def __init__(self, group: ProcessGroup | None, device: torch.device) -> None:
        self.group, self.device = group, device
        self.size = group_size(group)
        self.step = 0

    def check(self, phase: str) -> None:
        if self.size <= 1:
            return
        mine = torch.tensor([self.step, PHASES.index(phase)], dtype=torch.int64, device=self.device)
        every = torch.empty(2 * self.size, dtype=torch.int64, device=self.device)
        all_gather_into(every, mine, self.group, count_as="control")
        seen = every.view(self.size, 2).tolist()
        if all(s == seen[0] for s in seen):
            return
        me = group_rank(self.group)
        others = ", ".join(f"rank {r} at step {s} ({PHASES[p]})" for r, (s, p) in enumerate(seen) if r != me)
        raise RuntimeError(
            f"memsave: control flow diverged across ranks: rank {me} is at step {self.step} ({phase}), {others} "
            "(ranks of the data-parallel group, which must run the same forward, backward and optimizer.step() "
            "calls in the same order: look for a condition on the rank, or data of different length per rank)"
        )
