"""The optimizer a profile's ``[optimizer]`` section describes."""

from __future__ import annotations

from typing import Any

import torch

from memsave.config import OptimizerConfig
from memsave.optim.adafactor import Adafactor

__all__ = ["build_optimizer"]


def build_optimizer(params: Any, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """``params`` (parameters or param groups) under the optimizer ``cfg`` names."""
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.name == "adafactor":
        return Adafactor(
            params, lr=cfg.lr, relative_step=False, scale_parameter=cfg.scale_parameter,
            clip_threshold=cfg.clip_threshold, decay_rate=cfg.decay_rate, weight_decay=cfg.weight_decay,
            beta1=cfg.beta1 or None, momentum_dtype=torch.bfloat16 if cfg.momentum_dtype == "bf16" else None,
        )
    raise ValueError(f"profile key 'optimizer.name' = {cfg.name!r} is not allowed; expected adamw, adam, sgd or "
                     "adafactor")
