"""``memsave.Trainer``: the core training loop over a wrapped model and optimizer.

One optimizer step is ``micro_batches`` forward/backward passes (all but the last under ``model.no_sync()``,
each loss divided by ``micro_batches``), an optional global gradient clip, the learning-rate schedule, the
optimizer step and ``zero_grad``. Losses are averaged over the dp group with one small all-reduce per logging
interval (not per step), through ``memsave.dist``. Logging, progress and ``on_log`` happen on rank 0 only; every
collective (loss reduction, clip norm, evaluation, report) runs on every rank alike. Progress is a tqdm bar on a
terminal; where stderr is not one (CI logs, ``torchrun`` with its output redirected) a bar would write a
carriage-return frame per update, so plain lines are printed instead, at most every ``progress_every_s``.

The per-step work is :meth:`Trainer.train_step` and one micro-batch's forward and backward is
:meth:`Trainer._forward_backward`, so tensor- and pipeline-parallel engines can replace either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from tqdm import tqdm

from memsave import dist as mdist
from memsave._logging import set_rank_source
from memsave.dist import Mesh
from memsave.memory import MemoryReport, MemoryTracker, account, peak_rss_bytes, report
from memsave.wrapped import MemsaveOptimizer

__all__ = ["BatchSource", "LogRecord", "TrainConfig", "TrainResult", "Trainer", "cosine_schedule"]

Batch = Mapping[str, torch.Tensor]

# warn_once prints on rank 0 only; once a process group exists its rank is the one that counts (see [Note:
# rank-zero warnings] in memsave/_logging.py). Registered here because `import memsave` always loads this
# module and memsave/_logging.py, layer 0, may not import memsave.dist.
set_rank_source(lambda: mdist.group_rank(None) if mdist.group_size(None) > 1 else None)


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
        if not isinstance(self.report_dir, str):
            raise _bad("report_dir", self.report_dir, "a folder path as a string, or \"\" for none")


@dataclasses.dataclass(frozen=True)
class LogRecord:
    """One log line: the dp-averaged loss of ``step`` and the figures of the interval ending there."""

    step: int  # 1-based: optimizer steps done
    steps: int
    loss: float
    lr: float
    grad_norm: float | None
    tokens_per_s: float  # global (every dp rank) over the interval
    peak_rss_bytes: int  # this process (rank 0)
    model_state_bytes: int  # accounted parameters, gradients and optimizer state on rank 0
    loss_scale: float | None = None  # with a loss scaler: its current scale
    skipped_steps: int = 0  # steps skipped so far: a non-finite gradient, or an fp16 overflow

    def format(self) -> str:
        norm = "-" if self.grad_norm is None else f"{self.grad_norm:.3f}"
        scale = "" if self.loss_scale is None else f" | scale {self.loss_scale:g} ({self.skipped_steps} skipped)"
        if self.loss_scale is None and self.skipped_steps:
            scale = f" | {self.skipped_steps} skipped"
        return (f"step {self.step:>{len(str(self.steps))}}/{self.steps} | loss {self.loss:.4f} | lr {self.lr:.2e} | "
                f"grad norm {norm}{scale} | {self.tokens_per_s:,.0f} tok/s | peak rss "
                f"{self.peak_rss_bytes / 2**20:.1f} MiB | model state {self.model_state_bytes / 2**20:.2f} MiB")


@dataclasses.dataclass
class TrainResult:
    """What ``fit`` returns, the same on every rank (``logs`` only on rank 0)."""

    losses: list[float]  # per step, averaged over the dp group
    eval_losses: list[tuple[int, float]]  # (step, loss) of each periodic evaluation
    step_times: list[float]  # seconds per step on this rank
    tokens_per_s: float  # global tokens over the time spent in steps
    report: MemoryReport  # memsave.report(model, optimizer) after the last step
    logs: list[LogRecord] = dataclasses.field(default_factory=list)
    skipped_steps: int = 0  # steps not applied ([precision] nonfinite; fp16 overflows), the same on every rank


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


def _loss_of(output: Any) -> torch.Tensor:
    """The scalar loss in a model's output: a tensor, an object with ``.loss`` or a mapping with ``"loss"``."""
    loss = output if isinstance(output, torch.Tensor) else (
        output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None))
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(
            f"the model returned {type(output).__name__} without a scalar loss; the Trainer needs "
            "model(**batch) to return a loss (pass labels in the batch) or pass a model that returns it"
        )
    return loss.reshape(())


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty(), or a closed stream
        return False


class _ProgressLines:
    """What the progress bar shows, as a plain line on stderr at most every ``every_s`` seconds and at the last
    step: for output that is not a terminal. Tokens/s is this rank's tokens times the dp size (every dp rank
    reads batches of the same shape) over the time since ``fit`` started."""

    def __init__(self, *, first_step: int, end_step: int, dp_size: int, every_s: float) -> None:
        self.first_step, self.end_step, self.dp_size, self.every_s = first_step, end_step, dp_size, every_s
        self.start = self.last = time.perf_counter()
        self.tokens = 0
        self.loss: float | None = None  # the last logged (dp-averaged) loss

    def update(self, done: int, tokens: int) -> None:
        """``done`` optimizer steps are done (of ``end_step``), ``tokens`` more read by this rank."""
        self.tokens += tokens
        now = time.perf_counter()
        if now - self.last < self.every_s and done < self.end_step:
            return
        self.last = now
        elapsed = max(now - self.start, 1e-9)
        rate = (done - self.first_step) / elapsed
        left = (self.end_step - done) / rate if rate > 0 else 0.0
        loss = "-" if self.loss is None else f"{self.loss:.4f}"
        print(f"train {done:>{len(str(self.end_step))}}/{self.end_step} ({100 * done / self.end_step:.0f}%) | "
              f"loss {loss} | {self.dp_size * self.tokens / elapsed:,.0f} tok/s | {rate:.2f} steps/s | elapsed "
              f"{tqdm.format_interval(elapsed)}, left {tqdm.format_interval(left)}", file=sys.stderr, flush=True)


class Trainer:
    """Train a model wrapped by :func:`memsave.wrap` (see the module docstring for the loop).

    Micro-batch ``m`` of step ``s`` is ``train_data.batch(s * micro_batches + m)``; the default evaluation
    averages the loss of ``eval_data.batch(0 .. eval_batches - 1)`` over the dp group. ``lr_schedule(step)``
    returns a multiplier of each param group's learning rate as it was when the Trainer was built.
    ``on_log(record)`` receives each :class:`LogRecord` on rank 0 instead of it being printed.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: MemsaveOptimizer,
        *,
        mesh: Mesh,
        config: TrainConfig,
        train_data: BatchSource,
        eval_data: BatchSource | None = None,
        lr_schedule: Callable[[int], float] | None = None,
        on_log: Callable[[LogRecord], None] | None = None,
        eval_fn: Callable[[nn.Module], float] | None = None,
        profile: str = "",
        estimate: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(optimizer, MemsaveOptimizer):
            raise ValueError(
                f"optimizer is a {type(optimizer).__name__}; pass the optimizer that memsave.wrap returned"
            )
        if config.micro_batches > 1 and not hasattr(model, "no_sync"):
            raise ValueError("micro_batches > 1 needs model.no_sync(); pass the model that memsave.wrap returned")
        if config.eval_every and eval_fn is None and eval_data is None:
            raise ValueError(f"TrainConfig.eval_every={config.eval_every} needs eval_data or eval_fn; pass one or "
                             "set eval_every=0")
        self.model = model
        self.optimizer = optimizer
        self.mesh = mesh
        self.config = config
        self.train_data = train_data
        self.eval_data = eval_data
        self.lr_schedule = lr_schedule
        self.on_log = on_log
        self.eval_fn = eval_fn
        self.profile = profile
        self.estimate = estimate  # memsave.estimate(...).to_report_dict(), put beside the final report
        self.initial_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self.step = 0  # optimizer steps done
        self._end_step = config.steps  # where the current fit() ends
        self.last_grad_norm: torch.Tensor | None = None
        self.is_main = mesh.is_main
        self._checked_shape = False
        self._tokens = 0  # local tokens since the last flush

    # -- one step ------------------------------------------------------------------------------------------
    def _to_device(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {k: v.to(self.mesh.device, non_blocking=True) for k, v in batch.items()}

    def _forward_backward(self, batch: Batch) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its (unscaled, detached) loss."""
        loss = _loss_of(self.model(**batch))
        self.optimizer.backward(loss / self.config.micro_batches)
        return loss.detach()

    def _check_shape(self, batch: Batch) -> None:
        ids = batch.get("input_ids")
        cfg = self.config
        if ids is not None and tuple(ids.shape) != (cfg.batch_size, cfg.seq_len):
            raise ValueError(
                f"train_data gave input_ids of shape {tuple(ids.shape)} but TrainConfig says batch_size="
                f"{cfg.batch_size}, seq_len={cfg.seq_len}; make them agree"
            )
        self._checked_shape = True

    def _apply_lr(self, step: int) -> None:
        if self.lr_schedule is None:
            return
        multiplier = float(self.lr_schedule(step))
        for group, initial in zip(self.optimizer.param_groups, self.initial_lrs):
            group["lr"] = initial * multiplier

    def train_step(self, batches: Sequence[Batch]) -> float:
        """One optimizer step over ``micro_batches`` micro-batches; returns this rank's mean micro-batch loss."""
        if len(batches) != self.config.micro_batches:
            raise ValueError(f"train_step got {len(batches)} micro-batches; TrainConfig.micro_batches is "
                             f"{self.config.micro_batches}")
        if not self._checked_shape:
            self._check_shape(batches[0])
        total = torch.zeros((), device=self.mesh.device)
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            # all micro-batches but the last accumulate locally; the last one synchronizes everything
            with contextlib.nullcontext() if last else self.model.no_sync():  # type: ignore[operator]
                total += self._forward_backward(self._to_device(batch)).float()
            ids = batch.get("input_ids")
            self._tokens += ids.numel() if ids is not None else 0
        clip = self.config.grad_clip
        if clip is not None:
            self.last_grad_norm = self.optimizer.clip_grad_norm(float(clip))
        elif self._is_log_step(self.step):
            # the norm for the log; a max_norm of inf scales by exactly 1 (every rank logs the same steps)
            self.last_grad_norm = self.optimizer.clip_grad_norm(math.inf)
        self._apply_lr(self.step)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.step += 1
        return total.item() / len(batches)

    # -- evaluation ----------------------------------------------------------------------------------------
    def evaluate(self) -> float:
        """``eval_fn(model)``, or the dp-averaged mean loss over ``eval_batches`` of ``eval_data``. Collective."""
        self.model.eval()
        try:
            with torch.no_grad():
                if self.eval_fn is not None:
                    return float(self.eval_fn(self.model))
                if self.eval_data is None:
                    raise ValueError("evaluate() needs eval_data or eval_fn; pass one to the Trainer")
                total = torch.zeros(1, device=self.mesh.device)
                for i in range(self.config.eval_batches):
                    total += _loss_of(self.model(**self._to_device(self.eval_data.batch(i)))).float()
                mdist.all_reduce(total, self.mesh.dp_group)
                return total.item() / (self.config.eval_batches * mdist.group_size(self.mesh.dp_group))
        finally:
            self.model.train()

    # -- the loop ------------------------------------------------------------------------------------------
    def _is_log_step(self, step: int) -> bool:
        """Whether step ``step`` (0-based) ends a logging interval (the same answer on every rank)."""
        return (step + 1) % self.config.log_every == 0 or step + 1 == self._end_step

    def _flush(self, pending: list[float]) -> tuple[list[float], int]:
        """dp-average the pending local losses and sum the tokens, with one all-reduce."""
        packed = torch.tensor([*pending, float(self._tokens)], dtype=torch.float64, device=self.mesh.device)
        mdist.all_reduce(packed, self.mesh.dp_group)
        dp_size = mdist.group_size(self.mesh.dp_group)
        self._tokens = 0
        values = packed.tolist()
        return [v / dp_size for v in values[:-1]], int(values[-1])

    def _say(self, text: str, bar: tqdm) -> None:
        """Print a line on rank 0 without breaking the progress bar."""
        if not bar.disable:
            bar.write(text, file=sys.stdout)
            sys.stdout.flush()  # live through a pipe too
        else:
            print(text, flush=True)

    def _record(self, step: int, loss: float, tokens_per_s: float) -> LogRecord:
        norm = self.last_grad_norm
        scaler = getattr(self.optimizer, "scaler", None)  # a LossScaler, where the optimizer has one
        return LogRecord(
            step=step + 1, steps=self._end_step, loss=loss, lr=float(self.optimizer.param_groups[0]["lr"]),
            grad_norm=None if norm is None else float(norm), tokens_per_s=tokens_per_s,
            peak_rss_bytes=peak_rss_bytes(), model_state_bytes=account((self.model, self.optimizer)).model_state(),
            loss_scale=None if scaler is None else scaler.scale,
            skipped_steps=self._skipped(),
        )

    def _skipped(self) -> int:
        guard = getattr(self.optimizer, "nonfinite", None)  # memsave/precision/nonfinite.py
        scaler = getattr(self.optimizer, "scaler", None)
        return guard.num_skipped if guard is not None else (scaler.num_skipped if scaler is not None else 0)

    def fit(self) -> TrainResult:
        """Run ``config.steps`` optimizer steps (from ``self.step``); evaluate, log, and report memory at the end."""
        cfg = self.config
        self._end_step = self.step + cfg.steps
        torch.manual_seed(cfg.seed + self.mesh.dp_rank)
        self.model.train()
        losses: list[float] = []
        eval_losses: list[tuple[int, float]] = []
        step_times: list[float] = []
        logs: list[LogRecord] = []
        pending: list[float] = []
        interval_time = total_time = 0.0
        total_tokens = 0
        show = cfg.progress and self.is_main
        on_terminal = show and _is_terminal(sys.stderr)
        bar = tqdm(initial=self.step, total=self._end_step, disable=not on_terminal,
                   desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)
        lines = None
        if show and not on_terminal:
            lines = _ProgressLines(first_step=self.step, end_step=self._end_step, dp_size=self.mesh.dp_size,
                                   every_s=cfg.progress_every_s)
        tracker = None
        if cfg.track_memory and getattr(self.model, "memsave_tracker", None) is None:
            tracker = MemoryTracker(self.model, self.optimizer)
        try:
            for _ in range(cfg.steps):
                step = self.step
                start = time.perf_counter()
                first = step * cfg.micro_batches
                batches = [self.train_data.batch(first + m) for m in range(cfg.micro_batches)]
                tokens_before = self._tokens
                pending.append(self.train_step(batches))
                step_tokens = self._tokens - tokens_before
                elapsed = time.perf_counter() - start
                step_times.append(elapsed)
                interval_time += elapsed
                bar.update(1)
                if self._is_log_step(step):
                    reduced, tokens = self._flush(pending)
                    losses += reduced
                    pending = []
                    total_tokens += tokens
                    total_time += interval_time
                    if self.is_main:
                        record = self._record(step, reduced[-1], tokens / max(interval_time, 1e-9))
                        logs.append(record)
                        bar.set_postfix(loss=f"{record.loss:.4f}", refresh=False)
                        if lines is not None:
                            lines.loss = record.loss
                        if self.on_log is not None:
                            self.on_log(record)
                        else:
                            self._say(record.format(), bar)
                    interval_time = 0.0
                if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
                    eval_losses.append((step + 1, self.evaluate()))
                    if self.is_main and self.on_log is None:
                        self._say(f"step {step + 1}: eval loss {eval_losses[-1][1]:.4f}", bar)
                if lines is not None:
                    lines.update(step + 1, step_tokens)
        finally:
            bar.close()
        try:
            final = report(self.model, self.optimizer, profile=self.profile, estimate=self.estimate)
        finally:
            if tracker is not None:
                tracker.close()
        if cfg.report_dir and self.is_main:
            out = Path(cfg.report_dir)
            final.save(out / "report.json")
            final.save(out / "report.html")
        return TrainResult(losses=losses, eval_losses=eval_losses, step_times=step_times,
                           tokens_per_s=total_tokens / max(total_time, 1e-9), report=final, logs=logs,
                           skipped_steps=self._skipped())
