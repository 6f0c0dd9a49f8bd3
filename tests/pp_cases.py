"""Shared pieces of the pipeline-parallel tests (tests/test_pp.py): tiny unchanged models, the single-process
reference and the pipelined training loop whose losses, clip norms and parameters are compared with it.

``rel(a, b) = max|a - b| / max|b|``. A pipeline computes every op as one process does (the same micro-batches,
the same kernels, stage by stage), but the gradient of a micro-batch-accumulated step is summed in another order
and tied gradients are summed across stages, so fp32 results may differ by a few ulps: FP32_TOL.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

import memsave
from memsave.config import Profile, load_profile
from tests.compare import rel

STEPS = 2
BATCH, SEQ, MICRO = 8, 8, 4  # the global batch: BATCH rows of SEQ tokens, in MICRO micro-batches per step
LR, MOMENTUM, CLIP = 0.2, 0.9, 0.5
FP32_TOL = 1e-5


# -- models ---------------------------------------------------------------------------------------------------------
def gpt(tie: bool = True, n_layer: int = 4) -> nn.Module:
    from memsave.models.gpt import GPT, gpt_config

    torch.manual_seed(0)
    return GPT(gpt_config("tiny", vocab_size=64, d_model=32, n_layer=n_layer, tie_weights=tie, block_size=16))


def llama(tie: bool, n_layer: int = 4) -> nn.Module:
    """An unchanged Hugging Face LlamaForCausalLM from a small config (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layer,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                      max_position_embeddings=32, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def opt() -> nn.Module:
    """An unchanged Hugging Face OPTForCausalLM: its decoder registers ``final_layer_norm`` before ``layers`` and
    calls it after them (the split learns the call order from a meta run on the model's dummy inputs)."""
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4, ffn_dim=64, num_attention_heads=4,
                    max_position_embeddings=32, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
                    enable_bias=False)  # (k_proj's bias has a zero gradient: Adam steps it on rounding noise alone)
    torch.manual_seed(0)
    return OPTForCausalLM(cfg)


def mixtral() -> nn.Module:
    """An unchanged Hugging Face MixtralForCausalLM (top-1 of 4 experts): its experts cannot run on the meta
    device in fp32 (torch's meta ``_grouped_mm`` takes bf16 only), so the probe learns their output's structure
    from the stage that holds them ([Note: structures the meta device cannot find] in memsave/pp/probe.py)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=1,
                        max_position_embeddings=32)
    torch.manual_seed(0)
    return MixtralForCausalLM(cfg)


class _MaskedMoE(nn.Module):
    """Top-1 routing by boolean masks, as hand-written mixtures of experts do: the block's output shape is static,
    ``h[mask]``'s is not, so it cannot run on the meta device."""

    def __init__(self, d: int, experts: int = 3) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList([nn.Linear(d, d) for _ in range(experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        weight, choice = self.router(h).softmax(-1).max(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            mask = choice == e
            if mask.any():  # an expert no row chose gets no gradient
                out[mask] = expert(h[mask]) * weight[mask, None]
        return x + out


class MoENet(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.stem = nn.Linear(12, d)
        self.blocks = nn.ModuleList([_MaskedMoE(d) for _ in range(4)])
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def moe() -> nn.Module:
    torch.manual_seed(0)
    return MoENet()


def sequential() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.GELU(),
                         nn.Linear(32, 3))


class UNetLike(nn.Module):
    """A stem and four blocks; the stem's output skips to block 2 (stage 2 of 4), past block 1 (stage 1)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.stem = nn.Linear(12, d)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(4)])
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0 = self.stem(x)
        e0 = self.blocks[0](x0)
        e1 = self.blocks[1](e0)
        d = self.blocks[2](e1 + x0)  # the skip: stage 0 -> stage 2
        return self.head(self.blocks[3](d))


def unet() -> nn.Module:
    torch.manual_seed(0)
    return UNetLike()


# -- data and losses --------------------------------------------------------------------------------------------------
def lm_data(vocab: int = 64, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def dense_data(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 12, generator=g), torch.randn(BATCH, 3, generator=g)) for _ in range(STEPS)]


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, y)


@dataclasses.dataclass
class Kind:
    """How a model takes a micro-batch: ``split(batch, i, n)`` is micro-batch i of n as (inputs, target)."""

    build: Callable[[], nn.Module]
    data: Callable[[], list[Any]]
    lm: bool  # a language model: the micro-batch is kwargs with labels, the loss is output.loss


def _rows(t: torch.Tensor, i: int, n: int) -> torch.Tensor:
    k = t.shape[0] // n
    return t[i * k:(i + 1) * k]


def micro(kind: Kind, batch: Any, n: int, dp: int = 1, dp_rank: int = 0) -> tuple[list[Any], list[Any] | None]:
    """This dp rank's rows of ``batch`` in ``n`` micro-batches: (inputs, targets or None)."""
    if kind.lm:
        rows = _rows(batch, dp_rank, dp)
        return [{"input_ids": _rows(rows, i, n), "labels": _rows(rows, i, n)} for i in range(n)], None
    x, y = (_rows(t, dp_rank, dp) for t in batch)
    return [_rows(x, i, n) for i in range(n)], [_rows(y, i, n) for i in range(n)]


KINDS = {
    "gpt": Kind(lambda: gpt(True), lm_data, True),
    "gpt-untied": Kind(lambda: gpt(False), lm_data, True),
    "llama": Kind(lambda: llama(True), lm_data, True),
    "llama-untied": Kind(lambda: llama(False), lm_data, True),
    "opt": Kind(opt, lm_data, True),
    "seq": Kind(sequential, dense_data, False),
    "unet": Kind(unet, dense_data, False),
    "mixtral": Kind(mixtral, lm_data, True),
    "moe": Kind(moe, dense_data, False),
}


# -- hand-made schedules (the IR of memsave/pp/schedule.py), so the runtime is tested on shapes the generators may
# not produce: virtual stages, and the backward split into I and W ------------------------------------------------
def looped(pp: int, m: int, virtual: int) -> Any:
    """Virtual stages (stage s on rank s % pp): every forward, stage by stage, then every backward in reverse."""
    from memsave.pp.schedule import Action, Schedule

    acts = []
    for r in range(pp):
        stages = [s for s in range(pp * virtual) if s % pp == r]
        seq = [Action("F", s, mb) for s in stages for mb in range(m)]
        seq += [Action("B", s, mb) for s in reversed(stages) for mb in reversed(range(m))]
        acts.append(tuple(seq))
    return Schedule("looped", pp, m, tuple(acts), virtual)


def split_backward(pp: int, m: int) -> Any:
    """1F1B with each backward split into I (input gradients, sent on at once) and W (weight gradients), the Ws
    deferred to the end of the step, as zero-bubble schedules fill the drain with them."""
    from memsave.pp.schedule import Action, Schedule, one_f_one_b

    acts = []
    for seq in one_f_one_b(pp, m).actions:
        out = [Action("I", a.stage, a.mb) if a.kind == "B" else a for a in seq]
        out += [Action("W", a.stage, a.mb) for a in seq if a.kind == "B"]
        acts.append(tuple(out))
    return Schedule("1f1b-iw", pp, m, tuple(acts))


def greedy_interleaved(pp: int, m: int, virtual: int) -> Any:
    """Virtual stages with forwards and backwards interleaved: ranks advance in lockstep ticks, each running one
    action whose inputs an earlier tick produced, a backward before a forward, at most ``pp * virtual`` forwards
    ahead of their backwards (an interleaved 1F1B in spirit; messages of both directions cross between the same
    two ranks in an order no chain schedule has)."""
    from memsave.pp.schedule import Action, Schedule

    n = pp * virtual
    done: set[tuple[str, int, int]] = set()
    todo = {r: [("F", s, mb) for mb in range(m) for s in range(n) if s % pp == r]
               + [("B", s, mb) for mb in range(m) for s in range(n) if s % pp == r] for r in range(pp)}
    acts: list[list[Action]] = [[] for _ in range(pp)]
    while any(todo.values()):
        ran = []
        for r in range(pp):
            inflight = sum(1 for a in acts[r] if a.kind == "F") - sum(1 for a in acts[r] if a.kind == "B")

            def ready(a: tuple[str, int, int], inflight: int = inflight) -> bool:
                kind, st, mb = a
                if kind == "F":
                    return inflight < n and (st == 0 or ("F", st - 1, mb) in done)
                return ("F", st, mb) in done and (st == n - 1 or ("B", st + 1, mb) in done)

            pick = next((a for a in todo[r] if a[0] == "B" and ready(a)), None) or next(
                (a for a in todo[r] if a[0] == "F" and ready(a)), None)
            if pick is not None:
                todo[r].remove(pick)
                acts[r].append(Action(*pick))
                ran.append(pick)
        assert ran, "greedy_interleaved stalled"
        done.update(ran)
    return Schedule("greedy-interleaved", pp, m, tuple(tuple(a) for a in acts), virtual)


# -- runs -----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    losses: list[float]
    norms: list[float]
    params: dict[str, np.ndarray]


def reference(kind: Kind, n: int = MICRO) -> Run:
    """Single-process fp32 training on the global batch in ``n`` accumulated micro-batches."""
    model = kind.build()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses, norms = [], []
    for batch in kind.data():
        inputs, targets = micro(kind, batch, n)
        total = 0.0
        for i, mb in enumerate(inputs):
            loss = (model(**mb).loss if kind.lm else mse(model(mb), targets[i])) / n  # type: ignore[index]
            loss.backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return Run(losses, norms, {k: v.detach().clone().numpy() for k, v in model.state_dict().items()})


def profile(base: str = "ddp", *, pp: int, schedule: str = "1f1b", virtual: int = 1,
            split: tuple[str, ...] = (), gather: str = "step") -> Profile:
    prof = load_profile(base)
    return dataclasses.replace(prof, parallel=dataclasses.replace(prof.parallel, pp=pp, schedule=schedule,
                                                                  virtual=virtual, split=split, gather=gather))


def pipelined(kind: Kind, mesh: memsave.Mesh, prof: Profile, n: int = MICRO, schedule: Any = None,
              tp_plan: dict[str, str] | None = None) -> tuple[Run, nn.Module, Any]:
    """The same training under ``prof`` on ``mesh``: each dp rank its rows, in ``n`` micro-batches per step. The
    parameters returned are this rank's (its stages'), whole (unsharded)."""
    model = kind.build()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    model, opt = memsave.wrap(model, opt, prof, mesh=mesh, tp_plan=tp_plan)
    dp, r = mesh.degree("dp"), mesh.axis_rank("dp")
    losses, norms = [], []
    for batch in kind.data():
        inputs, targets = micro(kind, batch, n, dp, r)
        loss = (model.pipeline_step(inputs, schedule=schedule) if kind.lm
                else model.pipeline_step(inputs, targets=targets, loss_fn=mse, schedule=schedule))
        norms.append(float(opt.clip_grad_norm(CLIP)))
        opt.step()
        opt.zero_grad()
        mean = loss.detach().reshape(1).clone()
        memsave.dist.all_reduce(mean, mesh.dp_group, count_as="test")
        losses.append(mean.item() / dp)
    return Run(losses, norms, {k: v.detach().float().clone().numpy() for k, v in model.state_dict().items()}), model, opt




def compare(run: Run, ref: Run) -> dict[str, tuple[float, str]]:
    """Worst relative differences: losses, clip norms, and this rank's parameters (each must be the reference's)."""
    missing = [k for k in run.params if k not in ref.params]
    assert not missing, f"parameters not in the reference: {missing}"
    worst = max(((rel(run.params[k], ref.params[k]), k) for k in run.params), default=(0.0, ""))
    return {"loss": (rel(run.losses, ref.losses), f"{run.losses} vs {ref.losses}"),
            "norm": (rel(run.norms, ref.norms), f"{run.norms} vs {ref.norms}"),
            "param": worst}
