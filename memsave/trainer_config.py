"""What a :class:`memsave.Trainer` is configured with: :class:`TrainConfig` (validated), the data it reads
(:class:`BatchSource`) and the learning-rate schedule :func:`cosine_schedule`. The loop, its log records and its
result are memsave/trainer.py."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

__all__ = ["Batch", "BatchSource", "TrainConfig", "cosine_schedule"]

Batch = Mapping[str, torch.Tensor]


class BatchSource(Protocol):
    """Deterministic data: ``batch(i)`` is this rank's ``i``-th micro-batch (e.g. :class:`memsave.models.TokenBatches`)."""

    def batch(self, step: int) -> Batch: ...


def _bad(field: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"TrainConfig.{field}={value!r} is not allowed; expected {allowed}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How long and how to train.

    steps: optimizer steps to run.
    micro_batches: forward/backward passes per optimizer step (gradient accumulation).
    batch_size: rows per rank per micro-batch (checked against the data's ``input_ids``).
    seq_len: tokens per row (checked against the data's ``input_ids``).
    log_every: log (on rank 0) every this many steps, and at the last step.
    eval_every: evaluate every this many steps; 0 never evaluates during ``fit``.
    eval_batches: batches of ``eval_data`` averaged by the default evaluation.
    grad_clip: clip gradients to this global norm; None does not clip.
    progress: show progress on rank 0: a tqdm bar when stderr is a terminal, else a plain line on stderr (steps
        done, the last logged loss, tokens/s, elapsed and remaining time) at most every ``progress_every_s``
        seconds and at the last step.
    progress_every_s: seconds between those plain progress lines; 0 prints one every step.
    seed: seeds torch's RNG at the start of ``fit`` (plus the dp rank, so dropout masks differ per rank).
    track_memory: sample memory at every phase and unit boundary (:class:`memsave.memory.MemoryTracker`), so
        the final report carries peaks per category and phase and a timeline; off costs nothing.
    report_dir: where rank 0 writes the final memory report (``report.json`` and ``report.html``); "" writes none.
    ckpt_dir: where ``save_every`` writes checkpoints (``<ckpt_dir>/step<N>``, :func:`memsave.save`); "" none.
    save_every: save a checkpoint every this many steps (0: never); needs ``ckpt_dir``.
    keep_last: keep only this many of the newest checkpoints in ``ckpt_dir`` (0: all).
    resume: "" starts fresh; "latest" loads the newest committed checkpoint in ``ckpt_dir`` (none yet: starts
        fresh); anything else is a checkpoint path. ``steps`` counts from step 0 either way, so a resumed run
        ends where the uninterrupted one does.
    """

    steps: int = 100
    micro_batches: int = 1
    batch_size: int = 8
    seq_len: int = 64
    log_every: int = 10
    eval_every: int = 0
    eval_batches: int = 4
    grad_clip: float | None = 1.0
    progress: bool = False
    progress_every_s: float = 30.0
    seed: int = 0
    track_memory: bool = False
    report_dir: str = ""
    ckpt_dir: str = ""
    save_every: int = 0
    keep_last: int = 0
    resume: str = ""

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("micro_batches", 1), ("batch_size", 1), ("seq_len", 1),
                          ("log_every", 1), ("eval_every", 0), ("eval_batches", 1), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise _bad(name, value, f"an integer >= {low}")
        clip = self.grad_clip
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, int | float) or not clip > 0):
            raise _bad("grad_clip", clip, "None or a positive number")
        every = self.progress_every_s
        if isinstance(every, bool) or not isinstance(every, int | float) or not every >= 0:
            raise _bad("progress_every_s", every, "a number of seconds >= 0")
        for name in ("progress", "track_memory"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "true or false")
        for name in ("save_every", "keep_last"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise _bad(name, value, "an integer >= 0")
        for name in ("ckpt_dir", "resume"):
            if not isinstance(getattr(self, name), str):
                raise _bad(name, getattr(self, name), "a path as a string")
        if (self.save_every or self.resume == "latest") and not self.ckpt_dir:
            what = f"save_every={self.save_every}" if self.save_every else "resume='latest'"
            raise _bad("ckpt_dir", self.ckpt_dir, f"a folder: {what} needs one")
        if self.keep_last and not self.save_every:  # nothing is saved, so nothing would ever be pruned
            raise _bad("keep_last", self.keep_last, "0 when save_every = 0 (it prunes what save_every writes)")
        if not isinstance(self.report_dir, str):
            raise _bad("report_dir", self.report_dir, "a folder path as a string, or \"\" for none")


def _checked_init(init: Callable[..., None]) -> Callable[..., None]:
    names = [f.name for f in dataclasses.fields(TrainConfig)]

    @functools.wraps(init)  # keeps the dataclass's signature for help() and editors
    def __init__(self: TrainConfig, **kwargs: object) -> None:
        for key in kwargs:
            if key not in names:
                raise ValueError(f"TrainConfig has no key {key!r} (given {kwargs[key]!r}); allowed: {', '.join(names)}")
        init(self, **kwargs)

    return __init__


TrainConfig.__init__ = _checked_init(TrainConfig.__init__)  # type: ignore[method-assign]  # an unknown key names itself


def cosine_schedule(warmup_steps: int, total_steps: int, min_ratio: float) -> Callable[[int], float]:
    """LR multiplier: linear warm-up to 1 over ``warmup_steps``, then cosine decay to ``min_ratio`` at the last step.

    Step ``s`` (0-based) gets ``(s + 1) / warmup_steps`` during warm-up; from ``warmup_steps`` to
    ``total_steps - 1`` the multiplier follows half a cosine from 1 to ``min_ratio``, and stays there after.
    """
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"cosine_schedule total_steps={total_steps!r} is not allowed; expected an integer >= 1")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or not 0 <= warmup_steps <= total_steps:
        raise ValueError(
            f"cosine_schedule warmup_steps={warmup_steps!r} is not allowed; expected an integer in [0, {total_steps}]"
        )
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"cosine_schedule min_ratio={min_ratio!r} is not allowed; expected a number from 0 to 1")
    decay_steps = total_steps - warmup_steps

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if decay_steps <= 1:
            return 1.0 if step < total_steps else min_ratio
        progress = min(1.0, (step - warmup_steps) / (decay_steps - 1))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier
