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
    model: str = "gpt"  # "gpt", "llama" (tied), "llama-untied", "mixtral", "seq" (an nn.Sequential)

    def __str__(self) -> str:
        return f"{self.profile}/tp{self.tp}/{self.opt}/{self.model}"


def gpt(seed: int, dropout: float = 0.0) -> nn.Module:
    from memsave.models.gpt import GPT, gpt_config

    torch.manual_seed(seed)
    return GPT(gpt_config("tiny", vocab_size=VOCAB, tie_weights=True, dropout=dropout, n_head=2))


def llama(seed: int, tie: bool) -> nn.Module:
    """An unchanged Hugging Face LlamaForCausalLM from a small config (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                      max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def mixtral(seed: int) -> nn.Module:
    """An unchanged Hugging Face MixtralForCausalLM (4 experts, top-2): under tp its fused expert tensors are cut
    along their intermediate features ((experts, 2 x 48 / tp, 32) and (experts, 32, 48 / tp))."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return MixtralForCausalLM(cfg)


class _Seq(nn.Sequential):
    """An nn.Sequential language model whose forward takes ``labels=`` like the others."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:  # type: ignore[override]
        logits = super().forward(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        return dataclasses.make_dataclass("Out", ["loss"])(loss)


def seq(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return _Seq(nn.Embedding(VOCAB, 32), nn.Linear(32, 48), nn.GELU(), nn.LayerNorm(48), nn.Linear(48, VOCAB))


def build(layout: Layout, seed: int, dropout: float) -> nn.Module:
    if layout.model == "gpt":
        return gpt(seed, dropout)
    if layout.model.startswith("llama"):
        return llama(seed, tie=layout.model == "llama")
    if layout.model == "mixtral":
        return mixtral(seed)
    return seq(seed)


def loss_of(model: nn.Module, layout: Layout, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if layout.model.startswith("llama") or layout.model == "mixtral":
        return model(input_ids=x, labels=x).loss  # type: ignore[no-any-return]
    return model(x, labels=y).loss  # type: ignore[no-any-return]


def batches(steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(steps)]


def wrapped(layout: Layout, *, seed: int = 0, dropout: float = 0.0,
            scratch: Path | None = None) -> tuple[nn.Module, Any, mdist.Mesh]:
    """A fresh tiny model wrapped under ``layout`` (its weights from ``seed``: a load must replace them); a disk
    offload tier goes under ``scratch``."""
    preset, _, overrides = layout.profile.partition(":")  # "zero3-infinity:offload.params=\"disk\"": + overrides
    prof = load_profile(preset, overrides.split(",") if overrides else [])
    prof = dataclasses.replace(prof, parallel=dataclasses.replace(prof.parallel, tp=layout.tp))
    if prof.offload.optimizer == "disk":
        assert scratch is not None
        prof = dataclasses.replace(prof, offload=dataclasses.replace(prof.offload, path=str(scratch / "offload")))
    mesh = memsave.init(tp=layout.tp)
    model = build(layout, seed, dropout)
    if layout.opt == "adafactor":
        opt: torch.optim.Optimizer = memsave.optim.Adafactor(model.parameters(), lr=1e-2, beta1=0.9)
    else:
        # the usual two groups, of unequal sizes (no decay on norms and biases): the state of each parameter
        # must come back to it (numbered per group, the states went to other parameters with no error)
        params = list(model.parameters())
        opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1]},
                                 {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}],
                                lr=1e-2, weight_decay=0.1)
    torch.manual_seed(1234 + mesh.dp_rank)  # dropout streams per dp rank, as a launcher-started run has
    model, opt = memsave.wrap(model, opt, prof, mesh=mesh)
    return model, opt, mesh


def train(model: nn.Module, opt: Any, mesh: mdist.Mesh, data: list[tuple[torch.Tensor, torch.Tensor]],
          layout: Layout) -> list[float]:
    """Steps on the global batches (each dp rank its rows); the global mean loss of each."""
    losses = []
    for x, y in data:
        xs, ys = x.chunk(mesh.dp_size)[mesh.dp_rank], y.chunk(mesh.dp_size)[mesh.dp_rank]
        loss = loss_of(model, layout, xs, ys)
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
    model, opt, mesh = wrapped(layout, dropout=dropout, scratch=path.parent)
    train(model, opt, mesh, data[:before], layout)
    memsave.save(path, model, opt, extra={"step": before}, **save_kw)
    out = train(model, opt, mesh, data[before:], layout)
    opt.close()
    return out


def resume_run(layout: Layout, path: Path, *, before: int = 2, after: int = 3, dropout: float = 0.0) -> list[float]:
    """A fresh model (other initial weights) under ``layout``, loaded from ``path``, trained ``after`` steps."""
    data = batches(before + after)
    model, opt, mesh = wrapped(layout, seed=7, dropout=dropout, scratch=path.parent)
    loaded = memsave.load(path, model, opt)
    assert loaded.extra == {"step": before}, loaded.extra
    out = train(model, opt, mesh, data[before:], layout)
    opt.close()
    return out


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b, strict=True))
