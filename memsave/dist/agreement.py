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

Under tensor parallelism every forward communicates over ``tp``, so there each forward is checked too, over
``tp`` alone (:meth:`Agreement.watch_forwards`: an evaluation on one dp replica's ranks stays legal). That also
names a tp rank that skipped a backward or a step, at its next forward, so the backward's and the step's checks
stay over ``dp``: each costs a small collective, which on gloo is a millisecond or more. A forward without
autograd (an evaluation, ``generate()``) is a phase of its own: on one rank only, it would pair its all-reduces
with the peers' next training forward and compute with their activations, then pair that forward with their
backward until two sizes differ (gloo then aborts the process); checked, it raises on every rank before its
first all-reduce.

[Note: one input per tp group] The ranks of a ``tp`` group compute one model on one batch, each a slice of
every layer: their inputs must be equal (so must a pipeline's: the first stage embeds the rows whose labels the
last scores; ``pipeline_step`` checks its micro-batches over the ``pp`` and ``tp`` axes once a step). A loader
sharded by the global rank (``DistributedSampler`` with its defaults, as a DDP script has it) gives them
different rows; the all-reduces then add partial sums of different rows, and the loss trains on a mixture with
no error where the shapes agree. So the forward's check also carries a fingerprint of its tensor inputs (their
count, shapes, their sum and their rows' sums weighted by position, in fp64 without an fp64 copy), and a
difference raises on every rank, naming the ranks' shapes and what to shard by.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from memsave.dist.collectives import (
    ProcessGroup,
    all_gather_into,
    doing,
    expect_every_rank,
    group_rank,
    group_ranks,
    group_size,
)
from memsave.inputs import tensors_in

__all__ = ["Agreement", "watch_loads"]

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

    def _check_over(self, group: ProcessGroup | None, phase: str, inputs: tuple[Any, dict] | None = None) -> None:
        size = group_size(group)
        if size <= 1:
            return
        if phase == "forward" and not torch.is_grad_enabled():
            phase = "forward without autograd"
        mine = _fingerprint(self.step, PHASES.index(phase), inputs, self.device)
        every = torch.empty(size * mine.numel(), dtype=torch.float64, device=self.device)
        all_gather_into(every, mine, group, count_as="control")
        seen = every.view(size, -1).tolist()
        if all(s == seen[0] for s in seen):
            return
        me, ranks = group_rank(group), group_ranks(group)
        if all(s[:2] == seen[0][:2] for s in seen):  # [Note: one input per tp group]
            shapes = ", ".join(f"rank {ranks[r]}: {_shapes(s)}" for r, s in enumerate(seen))
            raise RuntimeError(
                f"memsave: ranks {ranks} run one model replica together (its tensor- and pipeline-parallel ranks) "
                f"but got different inputs (tensors, shapes or values; {shapes}): they would compute one model on "
                "several batches. Shard the data over the data-parallel ranks only, DistributedSampler(dataset, "
                "num_replicas=mesh.dp_size, rank=mesh.dp_rank), and draw any random input from a generator seeded "
                "alike on those ranks")
        others = ", ".join(f"rank {ranks[r]} at step {int(s[0])} ({PHASES[int(s[1])]})"
                           for r, s in enumerate(seen) if r != me)
        evaluating = PHASES.index("forward without autograd") in {int(s[1]) for s in seen}
        hint = ("; an evaluation or generate() must run on every rank that a forward communicates with (HF "
                "generate: synced_gpus=True, so that a rank that finished keeps taking part)") if evaluating else ""
        raise RuntimeError(
            f"memsave: control flow diverged across ranks: rank {ranks[me]} is at step {self.step} ({phase}), "
            f"{others} (ranks of a data- or tensor-parallel group, which must run the same forward, backward and "
            "optimizer.step() calls in the same order: look for a condition on the rank, or data of "
            f"different length per rank{hint})"
        )

    def check_inputs(self, group: ProcessGroup, inputs: Any) -> None:
        """The ranks of ``group`` (one model replica's) are at this step, with equal inputs (a pipeline step's
        micro-batches), or every one raises ([Note: one input per tp group])."""
        self._check_over(group, "forward", (inputs, {}))

    def watch_forwards(self, model: nn.Module, group: ProcessGroup) -> RemovableHandle:
        """Check every forward of ``model`` over ``group`` (``tp``: under tensor parallelism every forward
        communicates over it, and only over it: a forward on one dp replica's ranks alone stays legal), with its
        inputs ([Note: one input per tp group])."""

        @torch.compiler.disable  # (under torch.compile: run between the compiled pieces, not traced)
        def check(module: nn.Module, args: tuple, kwargs: dict) -> None:
            doing(self.step, "forward")
            self._check_over(group, "forward", (args, kwargs))

        return model.register_forward_pre_hook(check, prepend=True, with_kwargs=True)


def watch_loads(model: nn.Module, what: str, group: ProcessGroup | None) -> list[RemovableHandle]:
    """``load_state_dict`` on ``model`` or any of its modules (a backbone through ``model.model``) checks first
    that every rank of ``group`` calls it (:func:`expect_every_rank`). Loaded on rank 0 alone, as into a torch DDP
    model before a broadcast, replicas diverged (ddp), ZeRO-1/2 stepped rank 0's loaded rows beside the others'
    old ones, and tp ranks and pipeline stages kept their old weights, with no error. Waits 600 s where
    ``MEMSAVE_ARRIVAL_S`` is unset: each rank reads its file before the call, minutes apart on a shared disk."""

    def check(state_dict: Any, prefix: str, *_: Any) -> None:
        if prefix == "":  # the module it was called on (its children see a prefix)
            expect_every_rank(what, group, unset_s=600.0)

    return [m._register_load_state_dict_pre_hook(check) for m in model.modules()]


_DIMS = 4  # the dims of the first tensors' shapes carried for the message


@torch.no_grad()
def _fingerprint(step: int, phase: int, inputs: tuple[Any, dict] | None, device: torch.device) -> torch.Tensor:
    """step, phase, then of the tensor inputs: count, numel, a shape code, their sum and their rows' sums weighted
    by position (on the device: no synchronization before the all-gather), the first two's shapes."""
    tensors = tensors_in(inputs)  # (in dataclasses and BatchEncoding too)
    code = sum((k + 1) * sum((j + 1) * d for j, d in enumerate(t.shape)) + k * t.dim() for k, t in enumerate(tensors))
    shapes = [d for t in tensors[:2] for d in [*t.shape[:_DIMS], *[-1] * (_DIMS - min(t.dim(), _DIMS))]]
    head = torch.tensor([step, phase, len(tensors), sum(t.numel() for t in tensors), code, *shapes,
                         *[-1] * (2 * _DIMS - len(shapes))], dtype=torch.float64).to(device)
    sums = [torch.zeros(2, dtype=torch.float64, device=device)]
    for t in tensors:  # accumulated in fp64 by the reductions, no fp64 copy (inputs_embeds, images can be large)
        x = t.detach()
        if not x.numel():  # (an empty batch: its shape is in the code)
            continue
        rows = x.reshape(x.shape[0] if x.dim() else 1, -1).sum(1, dtype=torch.float64)  # one sum per row
        where = torch.arange(1, rows.numel() + 1, dtype=torch.float64, device=rows.device)
        sums.append(torch.stack([rows.sum(), (rows * where).sum()]).to(device))
    return torch.cat([head, torch.stack(sums).sum(0).nan_to_num(-7.0)])


def _shapes(seen: list[float]) -> str:
    count, dims = int(seen[2]), seen[5:5 + 2 * _DIMS]
    first = [tuple(int(d) for d in dims[i * _DIMS:(i + 1) * _DIMS] if d >= 0) for i in range(min(count, 2))]
    return f"{count} tensors, first {', '.join(map(str, first))}" if count else "no tensor"
