"""Small models for engine tests: what real user models do that a reference GPT does not."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.nn import functional as F


@dataclasses.dataclass
class ToyOutput:
    loss: torch.Tensor
    logits: torch.Tensor


class ToyBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ToyLM(nn.Module):
    """Keyword-argument forward, dataclass output, tied embedding / head, a frozen part, a non-persistent
    buffer, an optional branch skipped on some calls (``use_extra=False``) and a block that can be skipped
    (``skip_block=i``)."""

    def __init__(self, vocab: int = 32, d: int = 16, n_blocks: int = 3, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, d)
        self.frozen_proj = nn.Linear(d, d)
        self.frozen_proj.requires_grad_(False)
        self.blocks = nn.ModuleList(ToyBlock(d) for _ in range(n_blocks))
        self.extra = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.tensor(0.5), persistent=False)

    def forward(
        self, input_ids: torch.Tensor, *, labels: torch.Tensor, use_extra: bool = True, skip_block: int = -1
    ) -> ToyOutput:
        x = self.embed(input_ids)  # (B, T, d)
        x = x + self.scale * self.frozen_proj(x)
        for i, block in enumerate(self.blocks):
            if i != skip_block:
                x = block(x)
        if use_extra:
            x = x + self.extra(x)
        logits = self.head(x)  # (B, T, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return ToyOutput(loss=loss, logits=logits)


def toy_batch(step: int, rows: int, seq: int = 8, vocab: int = 32, seed: int = 1234) -> dict[str, torch.Tensor]:
    """A deterministic global batch for ``step``."""
    g = torch.Generator().manual_seed(seed + step)
    ids = torch.randint(0, vocab, (rows, seq + 1), generator=g)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def param_groups(model: nn.Module) -> list[dict]:
    """Two groups with different hyperparameters: matrices with weight decay, the rest without."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 2e-3}]


def hf_gpt2(n_positions: int = 32) -> nn.Module:
    """A Hugging Face GPT-2 from a small config (no download), dropout off so runs compare exactly."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=n_positions,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def hf_llama(tied: bool = False, n_layer: int = 2) -> nn.Module:
    """An unchanged Hugging Face Llama from a small config (no download): RMSNorm, rotary, GQA, SwiGLU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layer,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=tied, attn_implementation="eager")
    return LlamaForCausalLM(config)


def hf_bart() -> nn.Module:
    """A Hugging Face BART from a small config: an encoder's layer list beside a decoder's, one embedding table tied
    to both and to the head."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=32,
                        dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2)
    return BartForConditionalGeneration(config)


def hf_clip() -> nn.Module:
    """A Hugging Face CLIP from a small config: two towers, the text one registered first and run second."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    tower = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    config = CLIPConfig(text_config=dict(vocab_size=64, max_position_embeddings=16, **tower),
                        vision_config=dict(image_size=16, patch_size=4, **tower), projection_dim=16)
    return CLIPModel(config)


def hf_whisper() -> nn.Module:
    """A Hugging Face Whisper from a small config: an encoder-decoder whose own ``generate`` defaults
    ``synced_gpus`` to False."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(vocab_size=64, num_mel_bins=8, d_model=32, encoder_layers=1, decoder_layers=1,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
                           max_source_positions=8, max_target_positions=16, decoder_start_token_id=1, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2, dropout=0.0)
    return WhisperForConditionalGeneration(config)


def hf_funnel() -> nn.Module:
    """A Hugging Face Funnel Transformer from a small config: its encoder's layers sit in a list of lists."""
    from transformers import FunnelConfig, FunnelForMaskedLM

    torch.manual_seed(0)
    config = FunnelConfig(vocab_size=64, block_sizes=[1, 1], d_model=32, n_head=4, d_head=8, d_inner=48,
                          hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    return FunnelForMaskedLM(config)


class LoRALinear(nn.Module):
    """PEFT's LoRA in miniature: a frozen base linear plus a trainable low-rank update ``B @ A``."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)  # (PEFT starts it at 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def add_lora(model: nn.Module, names: tuple[str, ...]) -> nn.Module:
    """Freeze ``model`` and put a :class:`LoRALinear` around every linear whose attribute name is in ``names``."""
    torch.manual_seed(1)
    model.requires_grad_(False)
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if child_name in names and isinstance(child, nn.Linear):
                setattr(module, child_name, LoRALinear(child))
    return model
