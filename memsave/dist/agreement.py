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

The group spans the ``dp`` and ``tp`` axes. Under tensor parallelism every forward communicates over ``tp``, so
there each forward is checked too, over ``tp`` alone (:meth:`Agreement.watch_forwards`: an evaluation on one dp
replica's ranks stays legal). A forward without autograd (an
evaluation, ``generate()``) is a phase of its own: on one rank only, it would pair its all-reduces with the
peers' next training forward and compute with their activations, then pair that forward with their backward
until two sizes differ (gloo then aborts the process); checked, it raises on every rank before its first
all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from memsave.dist.collectives import ProcessGroup, all_gather_into, doing, group_rank, group_ranks, group_size

__all__ = ["Agreement"]

PHASES = ("forward", "backward", "optimizer", "forward without autograd")


class Agreement:
    """``check(phase)`` at the start of each communicating phase; ``step`` counts the optimizer steps taken."""

    def __init__(self, group: ProcessGroup | None, device: torch.device) -> None:
        self.group, self.device = group, device
        self.size = group_size(group)
        self.step = 0

    def check(self, phase: str) -> None:
        """All ranks of the group are at this step and phase, or every one raises."""
        self._check_over(self.group, phase)

    def _check_over(self, group: ProcessGroup | None, phase: str) -> None:
        size = group_size(group)
        if size <= 1:
            return
        if phase == "forward" and not torch.is_grad_enabled():
            phase = "forward without autograd"
        mine = torch.tensor([self.step, PHASES.index(phase)], dtype=torch.int64, device=self.device)
        every = torch.empty(2 * size, dtype=torch.int64, device=self.device)
        all_gather_into(every, mine, group, count_as="control")
        seen = every.view(size, 2).tolist()
        if all(s == seen[0] for s in seen):
            return
        me, ranks = group_rank(group), group_ranks(group)
        others = ", ".join(f"rank {ranks[r]} at step {s} ({PHASES[p]})" for r, (s, p) in enumerate(seen) if r != me)
        evaluating = PHASES.index("forward without autograd") in {p for _, p in seen}
        hint = ("; an evaluation or generate() must run on every rank that a forward communicates with (HF "
                "generate: synced_gpus=True, so that a rank that finished keeps taking part)") if evaluating else ""
        raise RuntimeError(
            f"memsave: control flow diverged across ranks: rank {ranks[me]} is at step {self.step} ({phase}), "
            f"{others} (ranks of the data-parallel and tensor-parallel groups, which must run the same forward, "
            "backward and optimizer.step() calls in the same order: look for a condition on the rank, or data of "
            f"different length per rank{hint})"
        )

    def watch_forwards(self, model: nn.Module, group: ProcessGroup) -> RemovableHandle:
        """Check every forward of ``model`` over ``group`` (``tp``: under tensor parallelism every forward
        communicates over it, and only over it: a forward on one dp replica's ranks alone stays legal)."""

        @torch.compiler.disable  # (under torch.compile: run between the compiled pieces, not traced)
        def check(module: nn.Module, args: object) -> None:
            doing(self.step, "forward")
            self._check_over(group, "forward")

        return model.register_forward_pre_hook(check, prepend=True)
