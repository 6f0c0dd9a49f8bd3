"""The reference GPT: a small pre-LN decoder-only transformer, the model memsave trains in demos and tests.

Architecture after GPT-2 (Radford et al., 2019, "Language Models are Unsupervised Multitask Learners") as
written in Karpathy's nanoGPT (``model.py``): learned token and position embeddings, ``n_layer`` pre-LN
blocks of causal self-attention and a 4x GELU MLP, a final LayerNorm and an LM head tied to the token
embedding. ``GPT.blocks`` is one ``nn.ModuleList``, so its blocks are the default units memsave shards,
recomputes and offloads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPT", "GPT_SIZES", "Block", "CausalLMOutput", "GPTConfig", "gpt_config"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a GPT.

    Attributes:
        vocab_size: number of token ids (256 for the byte-level embedded corpus).
        block_size: longest sequence the model accepts (rows of the position embedding).
        n_layer: number of transformer blocks.
        n_head: attention heads per block; must divide ``d_model``.
        d_model: width of the residual stream.
        dropout: dropout probability on embeddings, attention weights and residual branches, in [0, 1).
        tie_weights: share one matrix between the token embedding and the LM head.
        bias: give Linear layers and LayerNorms a bias.
    """

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    dropout: float = 0.0
    tie_weights: bool = True
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{name}={value!r}: must be a positive int")
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} is not divisible by n_head={self.n_head}: "
                "choose d_model a multiple of n_head"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout!r}: allowed is 0 <= dropout < 1")


GPT_SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, d_model=64, n_head=2, vocab_size=256, block_size=64),
    "small": GPTConfig(n_layer=4, d_model=128, n_head=4, vocab_size=256, block_size=128),
    "medium": GPTConfig(n_layer=6, d_model=256, n_head=8, vocab_size=256, block_size=256),
    # 23,240,704 parameters with tied weights (27,435,008 untied: + the 8192 x 512 LM head).
    "bench": GPTConfig(n_layer=6, d_model=512, n_head=8, vocab_size=8192, block_size=256),
}


def gpt_config(size: str, **overrides: object) -> GPTConfig:
    """The preset ``GPT_SIZES[size]`` with ``overrides`` applied (validated again)."""
    if size not in GPT_SIZES:
        raise ValueError(f"unknown GPT size {size!r}: allowed are {sorted(GPT_SIZES)}")
    return replace(GPT_SIZES[size], **overrides)  # type: ignore[arg-type]


@dataclass
class CausalLMOutput:
    """What ``GPT.forward`` returns: the mean token loss when labels were given, and the logits."""

    loss: Tensor | None
    logits: Tensor


class Block(nn.Module):
    """One pre-LN transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.d_model
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.ln_1 = nn.LayerNorm(d, bias=config.bias)
        self.qkv = nn.Linear(d, 3 * d, bias=config.bias)
        self.attn_proj = nn.Linear(d, d, bias=config.bias)  # residual projection
        self.ln_2 = nn.LayerNorm(d, bias=config.bias)
        self.mlp_fc = nn.Linear(d, 4 * d, bias=config.bias)
        self.mlp_proj = nn.Linear(4 * d, d, bias=config.bias)  # residual projection
        self.resid_drop = nn.Dropout(config.dropout)

    def attention(self, x: Tensor) -> Tensor:
        # sizes from the projection's output, not the input: under tensor parallelism a rank holds n_head / tp
        # heads (its qkv rows of each of q, k and v), and under sequence parallelism x is its slice of the
        # sequence while qkv's output covers all of it (memsave/tp)
        q, k, v = self.qkv(x).chunk(3, dim=2)  # each (B, T, n_head * head_dim)
        B, T, _ = q.shape
        # (B, T, n_head * head_dim) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, n_head, T, head_dim)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, n_head * head_dim)
        return self.resid_drop(self.attn_proj(y))

    def mlp(self, x: Tensor) -> Tensor:
        h = F.gelu(self.mlp_fc(x))  # (B, T, 4C)
        return self.resid_drop(self.mlp_proj(h))  # (B, T, C)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class GPT(nn.Module):
    """Decoder-only language model after GPT-2 (Radford et al., 2019) and nanoGPT (Karpathy).

    ``forward(input_ids, labels=None)`` returns a ``CausalLMOutput``. Labels are already shifted by the data
    pipeline (``labels[:, t]`` is the token after ``input_ids[:, t]``); positions labelled -100 are ignored.
    Construction works under ``torch.device("meta")``; after ``to_empty`` call ``init_weights`` to fill the
    parameters and the non-persistent ``pos`` buffer (same seed, same values as an eagerly built GPT).
    """

    pos: Tensor  # (block_size,) position ids, a non-persistent buffer

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        # The layers' default inits draw from the CPU RNG; fork it so that init_weights alone decides the
        # values: GPT(config) equals a meta-built GPT after to_empty and init_weights from the same seed.
        with torch.random.fork_rng(devices=[]):
            self.wte = nn.Embedding(config.vocab_size, config.d_model)
            self.wpe = nn.Embedding(config.block_size, config.d_model)
            self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
            self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # Position ids; derived from the config, so not saved in checkpoints.
        self.register_buffer("pos", torch.arange(config.block_size), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialize every parameter and the ``pos`` buffer; the same values for the same RNG state.

        Also ties the LM head to the token embedding again, since ``to_empty`` gives each its own tensor.
        """
        if self.config.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.pos.copy_(torch.arange(self.config.block_size, device=self.pos.device))
        self.apply(self._init_weights)
        # GPT-2: scale the projections that write into the residual stream by 1/sqrt(2 * n_layer).
        std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            assert isinstance(block, Block)
            nn.init.normal_(block.attn_proj.weight, mean=0.0, std=std)
            nn.init.normal_(block.mlp_proj.weight, mean=0.0, std=std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear | nn.LayerNorm) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)

    def num_parameters(self) -> int:
        """Number of parameters, a tied (shared) tensor counted once."""
        return sum(p.numel() for p in self.parameters())  # parameters() yields a shared tensor once

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> CausalLMOutput:
        T = input_ids.shape[1]  # input_ids: (B, T)
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds block_size={self.config.block_size}: "
                "shorten the input or build the model with a larger block_size"
            )
        x = self.drop(self.wte(input_ids) + self.wpe(self.pos[:T]))  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab_size)
        loss = None
        if labels is not None:
            # in fp32 whatever the compute dtype (a no-op in fp32): a bf16 softmax over the vocabulary loses the
            # loss's low bits, as Hugging Face's models avoid the same way
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)
