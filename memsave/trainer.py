"""``memsave.Trainer``: the core training loop over a wrapped model and optimizer.

One optimizer step is ``micro_batches`` forward/backward passes (all but the last under ``model.no_sync()``,
each loss divided by ``micro_batches``; under pipeline parallelism one ``model.pipeline_step`` schedule over
them), an optional global gradient clip, the learning-rate schedule, the optimizer step and ``zero_grad``. Losses are averaged over the dp group with one small all-reduce per logging
interval (not per step), through ``memsave.dist``. Logging, progress and ``on_log`` happen on rank 0 only; every
collective (loss reduction, clip norm, evaluation, report) runs on every rank alike. Progress is a tqdm bar on a
terminal; where stderr is not one (CI logs, ``torchrun`` with its output redirected) a bar would write a
carriage-return frame per update, so plain lines are printed instead, at most every ``progress_every_s``.

The per-step work is :meth:`Trainer.train_step` and one micro-batch's forward and backward is
:meth:`Trainer._forward_backward`, so tensor- and pipeline-parallel engines can replace either.

What a Trainer is configured with (:class:`TrainConfig`, :class:`BatchSource`, :func:`cosine_schedule`) is
memsave/trainer_config.py, re-exported here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from memsave import dist as mdist
from memsave._logging import set_rank_source
from memsave.checkpoint.resume import resume_trainer, save_trainer
from memsave.dist import Mesh
from memsave.memory import MemoryReport, MemoryTracker, account, peak_rss_bytes, report
from memsave.memory.tracker import accounting_holders
from memsave.trainer_config import Batch, BatchSource, TrainConfig, cosine_schedule
from memsave.wrapped import WrappedOptimizer

__all__ = ["BatchSource", "LogRecord", "TrainConfig", "TrainResult", "Trainer", "cosine_schedule"]

# warn_once prints on rank 0 only; once a process group exists its rank is the one that counts (see [Note:
# rank-zero warnings] in memsave/_logging.py). Registered here because `import memsave` always loads this
# module and memsave/_logging.py, layer 0, may not import memsave.dist.
set_rank_source(lambda: mdist.group_rank(None) if mdist.group_size(None) > 1 else None)


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
        optimizer: WrappedOptimizer,
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
        if not isinstance(optimizer, WrappedOptimizer):
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
        pipeline_step = getattr(self.model, "pipeline_step", None)
        if pipeline_step is not None:  # pp > 1: the step's forwards and backwards run as one pipeline schedule
            mean = pipeline_step([self._to_device(b) for b in batches])
            for batch in batches:
                ids = batch.get("input_ids")
                self._tokens += ids.numel() if ids is not None else 0
            self._finish_step()
            return float(mean)
        total = torch.zeros((), device=self.mesh.device)
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            # all micro-batches but the last accumulate locally; the last one synchronizes everything
            with contextlib.nullcontext() if last else self.model.no_sync():  # type: ignore[operator]
                total += self._forward_backward(self._to_device(batch)).float()
            ids = batch.get("input_ids")
            self._tokens += ids.numel() if ids is not None else 0
        self._finish_step()
        return total.item() / len(batches)

    def _finish_step(self) -> None:
        """Clip, the learning rate, the optimizer step."""
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
                pipeline_loss = getattr(self.model, "pipeline_loss", None)
                for i in range(self.config.eval_batches):
                    batch = self._to_device(self.eval_data.batch(i))
                    total += (pipeline_loss([batch]) if pipeline_loss is not None
                              else _loss_of(self.model(**batch))).float()
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
            peak_rss_bytes=peak_rss_bytes(),
            # the engine stands for the model (accounting_holders: a ZeRO-3 placeholder is not "params")
            model_state_bytes=account(accounting_holders(self.model, (self.optimizer,))).model_state(),
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
        resumed = resume_trainer(self) if cfg.resume else None  # (memsave/checkpoint/resume.py)
        self._end_step = cfg.steps if cfg.resume else self.step + cfg.steps
        if resumed is None:  # a resumed run continues the random streams it saved
            torch.manual_seed(cfg.seed + self.mesh.dp_rank)
        elif self.is_main:
            print(f"resumed from {resumed} at step {self.step}", flush=True)
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
            for _ in range(self._end_step - self.step):
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
                if cfg.save_every and (step + 1) % cfg.save_every == 0:
                    save_trainer(self)
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
