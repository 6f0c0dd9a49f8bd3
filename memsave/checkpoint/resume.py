"""The trainer's checkpoints: ``TrainConfig.save_every`` / ``ckpt_dir`` / ``resume`` (``memsave demo --ckpt-dir
DIR --save-every N --resume``).

What makes a resumed run continue bit for bit: the model, optimizer and RNG states (:func:`memsave.save`), the
step (data position: micro-batch ``step * micro_batches`` is next, :class:`memsave.BatchSource` is indexed by it)
and the learning rates the schedule multiplies (``initial_lrs``). ``fit`` does not reseed after a resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memsave._logging import get_logger
from memsave.checkpoint.api import load, save
from memsave.checkpoint.commit import latest

__all__ = ["resume_trainer", "save_trainer"]


def save_trainer(trainer: Any) -> Path:
    """Save the trainer's model and optimizer as ``<ckpt_dir>/step<N>`` (collective)."""
    cfg = trainer.config
    path = Path(cfg.ckpt_dir) / f"step{trainer.step:08d}"
    extra = {"step": trainer.step, "data_position": trainer.step * cfg.micro_batches,
             "micro_batches": cfg.micro_batches, "initial_lrs": list(trainer.initial_lrs), "seed": cfg.seed}
    save(path, trainer.model, trainer.optimizer, extra=extra, keep_last=cfg.keep_last or None)
    return path


def resume_trainer(trainer: Any) -> Path | None:
    """Load ``config.resume`` ("latest": the newest committed checkpoint in ``ckpt_dir``, None if there is none
    yet; else a path) into the trainer (collective). Returns the checkpoint loaded."""
    cfg = trainer.config
    path = latest(cfg.ckpt_dir) if cfg.resume == "latest" else Path(cfg.resume)
    if path is None:
        return None
    configured = [float(v) for v in trainer.initial_lrs]  # the optimizer's lr as built for this run
    extra = load(path, trainer.model, trainer.optimizer).extra
    if "data_position" not in extra:
        raise ValueError(f"resume={str(path)!r}: the checkpoint has no trainer state (saved by memsave.save "
                         "without the Trainer); load it with memsave.load and set Trainer.step yourself")
    if extra["data_position"] % cfg.micro_batches:
        raise ValueError(f"resume={str(path)!r}: the checkpoint is at micro-batch {extra['data_position']}, not a "
                         f"multiple of micro_batches={cfg.micro_batches}; resume with micro_batches="
                         f"{extra['micro_batches']}")
    trainer.step = extra["data_position"] // cfg.micro_batches
    saved = [float(v) for v in extra["initial_lrs"]]
    # a learning rate set anew for the resumed run wins over the checkpoint's (it was silently replaced by the
    # saved one); the schedule's position comes from the checkpoint either way
    changed = configured != saved and len(configured) == len(saved)
    trainer.initial_lrs = configured if changed else saved
    if changed:
        if trainer.lr_schedule is None:  # no schedule sets it each step: the loaded groups keep the saved lr
            for group, lr in zip(trainer.optimizer.param_groups, configured):
                group["lr"] = lr
        get_logger().warning("resume=%r: the optimizer's lr %s differs from the checkpoint's %s; the resumed run "
                             "uses %s on the schedule from step %d", str(path), configured, saved, configured,
                             trainer.step)
    return path
