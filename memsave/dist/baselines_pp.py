"""torch's own pipeline parallelism (``torch.distributed.pipelining``) on an ``nn.Sequential``, set up as
``memsave bench --pp`` measures it against memsave's pipeline engine (memsave/engines/pipeline.py).

It lives in ``dist/`` because this is the only layer that touches ``torch.distributed`` (as
memsave/dist/baselines.py; the same [Note: baselines import cost]: import it inside the worker that runs it).

Each pp rank builds a :class:`~torch.distributed.pipelining.PipelineStage` per stage it holds (looped placement,
stage ``s`` on rank ``s % pp``, as memsave's schedules) from the blocks memsave's split gives that stage, and the
torch schedule of the same name: ``gpipe`` -> ``ScheduleGPipe``, ``1f1b`` -> ``Schedule1F1B``, ``interleaved``
-> ``ScheduleInterleaved1F1B`` (``virtual`` stages per rank), ``zero-bubble`` -> ``ScheduleInterleavedZeroBubble``
with one stage per rank (torch's ZB1P). torch's P2P on gloo: its schedules
post homogeneous batches as plain ``isend``/``irecv`` and mixed ones through ``batch_isend_irecv``, which can
hang on gloo (pytorch/PiPPy#1130); the bench runs each torch schedule under a time limit and reports one that
does not finish as such.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

__all__ = ["TORCH_SCHEDULES", "TorchPipeline"]

TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
                   "zero-bubble": ScheduleInterleavedZeroBubble}
_MULTI = ("interleaved", "zero-bubble")  # the schedules that take a list of stages


class TorchPipeline:
    """This rank's stages of ``stage_modules`` (all ``n_stages`` of them, indexed by stage; only this rank's are
    used) under torch's schedule ``name`` over ``micro_batches``. :meth:`step` runs one step's forwards and
    backwards on the whole batch (torch cuts it into micro-batches along dim 0)."""

    def __init__(self, stage_modules: Sequence[nn.Module], *, name: str, pp_rank: int, pp: int, micro_batches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device,
                 group: Any = None) -> None:
        if name not in TORCH_SCHEDULES:
            raise ValueError(f"torch pipeline schedule {name!r} is not allowed; expected one of "
                             f"{list(TORCH_SCHEDULES)}")
        n_stages = len(stage_modules)
        if n_stages % pp:
            raise ValueError(f"torch pipeline: {n_stages} stages on pp={pp} ranks; expected a multiple of pp")
        if n_stages != pp and name not in _MULTI:
            raise NotImplementedError(f"torch's {TORCH_SCHEDULES[name].__name__} runs one stage per rank, not "
                                      f"{n_stages // pp}")
        self.n_stages, self.pp_rank, self.pp = n_stages, pp_rank, pp
        self.local = [s for s in range(n_stages) if s % pp == pp_rank]
        self.stages = [PipelineStage(stage_modules[s], s, n_stages, device, group=group) for s in self.local]
        cls = TORCH_SCHEDULES[name]
        stages: Any = self.stages if name in _MULTI else self.stages[0]
        self.schedule = cls(stages, micro_batches, loss_fn=loss_fn)
        self.modules = [stage_modules[s] for s in self.local]

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules for p in m.parameters()]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """One step on the batch ``x`` with targets ``y``; the mean loss on the rank holding the last stage."""
        first, last = 0 in self.local, self.n_stages - 1 in self.local
        losses: list[torch.Tensor] = []
        args = (x,) if first else ()
        self.schedule.step(*args, target=y if last else None, losses=losses if last else None)
        return torch.stack([t.detach() for t in losses]).mean() if last and losses else None
