"""Dropout under tensor parallelism: which random stream each region draws from.

[Note: TP random streams] Megatron's RNG tracker idea (``tensor_parallel/random.py``), without a tracker to save:
- In a *replicated* region (the embedding, everything between blocks without sequence parallelism) every ``tp``
  rank holds the same tensor, so every rank must draw the same mask: the default generator, which memsave makes
  equal across ``tp`` at wrap time (:func:`sync_default_rng`; the user's seed on ``tp`` rank 0 decides).
- In a *tensor-parallel* region (between a column-parallel output and the next row-parallel input: each rank its
  heads or its slice of the MLP) and in a *sequence-parallel* region (each rank its slice of the sequence), the
  ranks hold different parts, so their masks must differ: on entering such a region one seed is drawn from the
  default generator (the same draw on every ``tp`` rank), the generator is re-seeded with that seed and the
  ``tp`` rank, and on leaving the default generator's state is put back where the draw left it.

The seeds are thus derived from the default generator's state and the rank alone: saving and restoring the
default generator (as ``memsave.save`` and the trainer do) restores these streams too, and a recomputed unit
(``torch.utils.checkpoint`` restores the default generator at the unit's start) replays exactly the masks of its
first forward. Every unit's forward starts and ends in the replicated stream (:func:`scoped`), so the state never
crosses a recomputed unit's boundary.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from memsave import dist as mdist
from memsave.dist import ProcessGroup

__all__ = ["RegionRandom", "sync_default_rng"]

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: decorrelates the per-rank seeds of one draw


class RegionRandom:
    """Switches the default generator of ``device`` (and the CPU's) between the replicated stream and this ``tp``
    rank's stream ([Note: TP random streams])."""

    def __init__(self, tp_rank: int, device: torch.device) -> None:
        self.tp_rank = tp_rank
        self.device = device
        self.varying = False
        self._saved: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def enter(self) -> None:
        """Draw masks that differ per ``tp`` rank from here on."""
        if self.varying:
            return
        seed = int(torch.randint(0, 2**62, (1,)))  # the same draw on every tp rank
        cuda = self.device.type == "cuda"
        self._saved = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if cuda else None)
        mine = (seed * _MIX + self.tp_rank + 1) % 2**63
        torch.default_generator.manual_seed(mine)
        if cuda:
            torch.cuda.default_generators[self.device.index or 0].manual_seed(mine)
        self.varying = True

    def leave(self) -> None:
        """Back to the replicated stream, where the draw of :meth:`enter` left it."""
        if not self.varying:
            return
        assert self._saved is not None
        cpu, dev = self._saved
        torch.set_rng_state(cpu)
        if dev is not None:
            torch.cuda.set_rng_state(dev, self.device)
        self.varying = False
        self._saved = None

    def scoped(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """``forward`` starting and ending in the replicated stream (a unit's, recomputed or not)."""

        @functools.wraps(forward)
        def run(*args: Any, **kwargs: Any) -> Any:
            self.leave()
            try:
                return forward(*args, **kwargs)
            finally:
                self.leave()

        return run


@torch.no_grad()
def sync_default_rng(group: ProcessGroup, device: torch.device) -> None:
    """Make the default generator (CPU, and ``device``'s) equal on every rank of ``group`` (``tp``): replicated
    regions then draw the same dropout masks. ``tp`` rank 0's state decides."""
    if mdist.group_size(group) == 1:
        return
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    for i, state in enumerate(states):
        buf = state.to(device)
        mdist.broadcast(buf, 0, group)
        if i == 0:
            torch.set_rng_state(buf.cpu())
        else:
            torch.cuda.set_rng_state(buf.cpu(), device)
