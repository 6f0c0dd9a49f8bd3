"""Shared pieces of the checkpoint tests (tests/test_checkpoint.py): build a wrapped tiny model under a layout,
train it on a fixed global batch, save, load into another layout and continue.

A continuation after ``memsave.load`` is compared with the uninterrupted run of the saving layout: bit for bit
when the layout is the same (fp32, CPU), else within FP32_TOL relative (ZeRO-3 and TP sum in another order:
DESIGN.md "Equivalence").
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

import memsave
from memsave import dist as mdist
from memsave.config import load_profile

BATCH, SEQ, VOCAB = 4, 16, 250
FP32_TOL = 1e-6


@dataclasses.dataclass(frozen=True)
class Layout:
    """A profile preset, a tp degree and an optimizer ('adamw' or 'adafactor')."""

    profile: str
    tp: int = 1
    opt: str = "adamw"

    def __str__(self) -> str:
        return f"{self.profile}/tp{self.tp}/{self.opt}"


def gpt(seed: int, dropout: float = 0.0) -> nn.Module:
    from memsave.models.gpt import GPT, gpt_config

    torch.manual_seed(seed)
    return GPT(gpt_config("tiny", vocab_size=VOCAB, tie_weights=True, dropout=dropout, n_head=2))


def batches(steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(steps)]


def wrapped(layout: Layout, *, seed: int = 0, dropout: float = 0.0) -> tuple[nn.Module, Any, mdist.Mesh]:
    """A fresh tiny GPT wrapped under ``layout`` (its weights from ``seed``: a load must replace them)."""
    prof = load_profile(layout.profile)
    prof = dataclasses.replace(prof, parallel=dataclasses.replace(prof.parallel, tp=layout.tp))
    mesh = memsave.init(tp=layout.tp)
    model = gpt(seed, dropout)
    if layout.opt == "adafactor":
        opt: torch.optim.Optimizer = memsave.optim.Adafactor(model.parameters(), lr=1e-2, beta1=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    torch.manual_seed(1234 + mesh.dp_rank)  # dropout streams per dp rank, as a launcher-started run has
    model, opt = memsave.wrap(model, opt, prof, mesh=mesh)
    return model, opt, mesh


def train(model: nn.Module, opt: Any, mesh: mdist.Mesh, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """Steps on the global batches (each dp rank its rows); the global mean loss of each."""
    losses = []
    for x, y in data:
        xs, ys = x.chunk(mesh.dp_size)[mesh.dp_rank], y.chunk(mesh.dp_size)[mesh.dp_rank]
        loss = model(xs, labels=ys).loss
        opt.backward(loss)
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
        total = loss.detach().reshape(1).clone()
        mdist.all_reduce(total, mesh.dp_group)
        losses.append(float(total[0]) / mesh.dp_size)
    return losses


def save_run(layout: Layout, path: Path, *, before: int = 2, after: int = 3, dropout: float = 0.0,
             **save_kw: Any) -> list[float]:
    """Train ``before`` steps, save to ``path``, train ``after`` more: the uninterrupted losses after the save."""
    data = batches(before + after)
    model, opt, mesh = wrapped(layout, dropout=dropout)
    train(model, opt, mesh, data[:before])
    memsave.save(path, model, opt, extra={"step": before}, **save_kw)
    out = train(model, opt, mesh, data[before:])
    opt.close()
    return out


def resume_run(layout: Layout, path: Path, *, before: int = 2, after: int = 3, dropout: float = 0.0) -> list[float]:
    """A fresh model (other initial weights) under ``layout``, loaded from ``path``, trained ``after`` steps."""
    data = batches(before + after)
    model, opt, mesh = wrapped(layout, seed=7, dropout=dropout)
    loaded = memsave.load(path, model, opt)
    assert loaded.extra == {"step": before}, loaded.extra
    out = train(model, opt, mesh, data[before:])
    opt.close()
    return out


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b, strict=True))
