"""What the planner knows of a model: its shape as a decoder transformer, and its parameter counts by part.

A :class:`ModelSpec` comes from the reference GPT's config (:func:`from_gpt`), from a Hugging Face
``config.json`` with no weights (:func:`from_hf_config`: Llama-family and GPT-2 keys), or from any module built on
the meta device (:func:`from_module`: the blocks memsave's units would be, their parameters counted). The counts
are exact (each ``nn.Linear``, bias and norm), so the model-state figures the planner derives are those of the
estimator, and of the tracker.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memsave.models import GPTConfig

__all__ = ["CLOSED_FORM_TYPES", "ModelSpec", "from_gpt", "from_hf_config", "from_module", "meta_model_from_hf_config"]

_LLAMA = ("llama", "mistral", "qwen2")  # Hugging Face model types with Llama's layer
CLOSED_FORM_TYPES = (*_LLAMA, "gpt2")  # config.json types the closed forms read


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A decoder transformer's shape. ``layer_params``: one block's parameters, of which ``layer_split`` are in
    matrices tensor parallelism cuts (the rest, norms and row-parallel biases, are replicated); ``embed_params``:
    token and position embeddings (the token table vocab-parallel under tp); ``head_params``: the LM head when it
    is not tied to the embedding; ``final_params``: the final norm. ``module``: the meta-device model, when the
    spec was made from one (the planner then checks its memory with :func:`memsave.estimate`)."""

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    max_seq: int
    layer_params: int
    layer_split: int
    embed_params: int
    head_params: int
    final_params: int
    tied: bool
    dropout: bool = False
    family: str = "gpt"  # the layer's activations: "gpt" (Korthikanti et al.'s) or "llama" (RMSNorm, SwiGLU, GQA)
    intermediate: int = 0  # llama: the MLP's width
    kv_heads: int = 0  # llama: key/value heads (grouped-query attention)
    head_dim: int = 0  # llama: each head's width when the config gives one (0: hidden // heads)
    module: nn.Module | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def num_params(self) -> int:
        return self.layers * self.layer_params + self.embed_params + self.head_params + self.final_params

    def stage_params(self, pp: int, stage: int, tp: int = 1) -> float:
        """Parameters held by pipeline ``stage`` of ``pp`` on one tensor-parallel rank of ``tp``: its share of the
        layers (the first stages take the remainder), the embedding on the first stage, the final norm and head on
        the last (a tied head: a copy of the embedding there, as memsave's pipeline keeps it)."""
        base, extra = divmod(self.layers, pp)
        n = base + (1 if stage < extra else 0)
        layer = self.layer_split / tp + (self.layer_params - self.layer_split)
        held = n * layer
        token = self.vocab * self.hidden
        embed = token / tp + (self.embed_params - token)
        if stage == 0:
            held += embed
        if stage == pp - 1:
            held += self.final_params + (self.head_params / tp if not self.tied  # (tied: what follows the blocks)
                                         else self.head_params + (token / tp if pp > 1 else 0))
        return held

    def stage_layers(self, pp: int, stage: int) -> int:
        base, extra = divmod(self.layers, pp)
        return base + (1 if stage < extra else 0)


def from_gpt(cfg: GPTConfig, name: str = "gpt") -> ModelSpec:
    """The reference GPT (memsave.models.GPT): per block two LayerNorms, qkv (h x 3h), attn_proj (h x h),
    mlp_fc (h x 4h), mlp_proj (4h x h), biases with ``cfg.bias``; token and position embeddings; final norm."""
    h, bias = cfg.d_model, int(cfg.bias)
    split = 3 * h * h + 3 * h * bias + h * h + 4 * h * h + 4 * h * bias + 4 * h * h  # column-parallel biases cut
    replicated = 2 * (h + h * bias) + h * bias + h * bias  # two norms; attn_proj's and mlp_proj's biases
    embed = cfg.vocab_size * h + cfg.block_size * h
    return ModelSpec(name=name, layers=cfg.n_layer, hidden=h, heads=cfg.n_head, vocab=cfg.vocab_size,
                     max_seq=cfg.block_size, layer_params=split + replicated, layer_split=split, embed_params=embed,
                     head_params=0 if cfg.tie_weights else cfg.vocab_size * h, final_params=h + h * bias,
                     tied=cfg.tie_weights, dropout=cfg.dropout > 0)


_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")  # a mixture-of-experts model's keys


def _get(cfg: dict[str, Any], key: str, kind: type | tuple[type, ...] = int, default: Any = ..., *,
         positive: bool = True) -> Any:
    """``cfg[key]`` checked: missing (without a default) or of the wrong type -> ValueError naming the key."""
    if key not in cfg or cfg[key] is None:
        if default is ...:
            raise ValueError(f"config.json: {key!r} is missing; a {cfg.get('model_type')!r} config needs it")
        return default
    value = cfg[key]
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind) or (
            positive and not isinstance(value, bool) and cfg[key] <= 0):
        want = "a positive integer" if kind is int else "true or false" if kind is bool else "a number"
        raise ValueError(f"config.json: {key} = {value!r} is not allowed; expected {want}")
    return value


def _refuse_experts(cfg: dict[str, Any]) -> None:
    experts = [k for k in _EXPERTS if cfg.get(k)]
    if experts:
        raise NotImplementedError(f"config.json model_type = {cfg.get('model_type', '')!r} has {experts[0]} = "
                                  f"{cfg[experts[0]]!r}: mixture-of-experts models are not planned from config.json "
                                  "(the closed forms count one MLP per layer; memsave's tensor parallelism does not "
                                  "cut experts, and the estimator's meta run of a grouped expert matmul needs bf16); "
                                  "give the model as MODULE:FUNCTION")


def from_hf_config(config: dict[str, Any] | str | Path, name: str | None = None) -> ModelSpec:
    """A Hugging Face ``config.json`` (a dict or its path), weights never read: Llama-family keys (``llama``,
    ``mistral``, ``qwen2``: RMSNorm, SwiGLU MLP, grouped KV heads, rotary positions) or GPT-2's. Any other
    ``model_type`` (and a mixture-of-experts config) is refused: plan it as ``MODULE:FUNCTION`` built on the meta
    device. Missing keys and values of the wrong type are refused naming the key."""
    cfg = json.loads(Path(config).read_text()) if not isinstance(config, dict) else config
    if not isinstance(cfg, dict):
        raise ValueError(f"config.json holds a {type(cfg).__name__}, not a JSON object of a model's settings")
    kind = cfg.get("model_type", "")
    label = name or kind or "hf"
    _refuse_experts(cfg)
    if kind == "gpt2":
        h, layers, vocab = _get(cfg, "n_embd"), _get(cfg, "n_layer"), _get(cfg, "vocab_size")
        heads, positions = _get(cfg, "n_head"), _get(cfg, "n_positions", default=1024)
        if h % heads:
            raise ValueError(f"config.json: n_head = {heads} does not divide n_embd = {h}")
        ffn = _get(cfg, "n_inner", default=4 * h)
        tied = _get(cfg, "tie_word_embeddings", bool, True)
        split = 3 * h * h + 3 * h + h * h + h * ffn + ffn + ffn * h
        replicated = 4 * h + h + h  # two LayerNorms (weight + bias), c_proj's two biases
        return ModelSpec(name=label, layers=layers, hidden=h, heads=heads, vocab=vocab, max_seq=positions,
                         layer_params=split + replicated, layer_split=split, embed_params=vocab * h + positions * h,
                         head_params=0 if tied else vocab * h, final_params=2 * h, tied=tied,
                         dropout=_get(cfg, "resid_pdrop", (int, float), 0.0, positive=False) > 0,
                         family="gpt2", intermediate=ffn)  # its own layer constants (LayerActivations.for_gpt2)
    if kind not in _LLAMA:
        raise ValueError(f"config.json model_type = {kind!r} is not allowed; expected one of {', '.join(_LLAMA)} "
                         "or gpt2 (any other model: give it as MODULE:FUNCTION, built on the meta device)")
    h, layers, vocab = _get(cfg, "hidden_size"), _get(cfg, "num_hidden_layers"), _get(cfg, "vocab_size")
    heads = _get(cfg, "num_attention_heads")
    kv = _get(cfg, "num_key_value_heads", default=heads)
    given = _get(cfg, "head_dim", default=0)
    if not given and h % heads:
        raise ValueError(f"config.json: num_attention_heads = {heads} does not divide hidden_size = {h} "
                         "(and there is no head_dim)")
    if heads % kv:
        raise ValueError(f"config.json: num_key_value_heads = {kv} does not divide num_attention_heads = {heads}")
    head_dim = given or h // heads
    ffn = _get(cfg, "intermediate_size")
    attn_bias = int(_get(cfg, "attention_bias", bool, kind == "qwen2"))
    q, kvd = heads * head_dim, kv * head_dim
    split = h * q + 2 * h * kvd + q * h + attn_bias * (q + 2 * kvd) + 3 * h * ffn
    tied = _get(cfg, "tie_word_embeddings", bool, False)
    return ModelSpec(name=label, layers=layers, hidden=h, heads=heads, vocab=vocab,
                     max_seq=_get(cfg, "max_position_embeddings", default=4096), layer_params=split + 2 * h,
                     layer_split=split, embed_params=vocab * h, head_params=0 if tied else vocab * h,
                     final_params=h, tied=tied,
                     dropout=_get(cfg, "attention_dropout", (int, float), 0.0, positive=False) > 0,
                     family="llama", intermediate=ffn, kv_heads=kv, head_dim=head_dim)


def meta_model_from_hf_config(config: dict[str, Any], seq_len: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Any other ``config.json``: the model transformers builds from it (``AutoModelForCausalLM.from_config``) on
    the meta device, and a meta batch of one row of ``seq_len`` tokens, for :func:`from_module` and
    ``memsave.estimate``. ``ValueError`` naming the type when transformers cannot build it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kind = config.get("model_type")
    if not isinstance(kind, str) or not kind:
        raise ValueError("config.json has no model_type; expected a Hugging Face model's config.json")
    _refuse_experts(config)
    try:
        hf = AutoConfig.for_model(kind, **{k: v for k, v in config.items() if k != "model_type"})
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"config.json model_type = {kind!r}: transformers cannot read it "
                         f"({type(exc).__name__}: {str(exc)[:200]}); give the model as MODULE:FUNCTION") from None
    if getattr(hf, "is_encoder_decoder", False):
        # AutoModelForCausalLM builds the decoder alone from such a config (BART's: BartForCausalLM, 254M of
        # bart-large's 406M parameters), and the plan would price a model with no encoder, silently
        named = ", ".join(config.get("architectures") or []) or "an encoder-decoder model"
        raise ValueError(f"config.json model_type = {kind!r} describes an encoder and a decoder ({named}); memsave "
                         "plan builds causal language models from a config.json, and from this one transformers "
                         "builds at most the decoder; give the model as MODULE:FUNCTION returning (model, batch), "
                         "where its forward runs on the meta device")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"config.json model_type = {kind!r}: transformers cannot build a causal LM from it "
                         f"({type(exc).__name__}: {str(exc)[:200]}); give the model as MODULE:FUNCTION") from None
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


def _matmuls(block: nn.Module) -> list[tuple[int, int]]:
    """(input width, weight elements) of the block's ``nn.Linear`` layers and Hugging Face ``Conv1D`` ones (GPT-2's:
    a weight of (in, out))."""
    out = []
    for m in block.modules():
        weight = getattr(m, "weight", None)
        if isinstance(m, nn.Linear) or (type(m).__name__ == "Conv1D" and isinstance(weight, torch.Tensor)
                                        and weight.dim() == 2):
            assert isinstance(weight, torch.Tensor)
            out.append((int(weight.shape[1 if isinstance(m, nn.Linear) else 0]), weight.numel()))
    return out


def from_module(model: nn.Module, name: str | None = None) -> ModelSpec:
    """Any module (on the meta device is best): its blocks are memsave's units (the largest ``nn.ModuleList``,
    else ``nn.Sequential`` children), the hidden size the width of the first block's first ``nn.Linear`` input.
    Parameters outside the blocks count as the embedding (those registered before the first block) and the head
    (those after: the final norm and an untied output layer)."""
    from memsave.models.units import choose_units  # layer 0

    units = [u for u in choose_units(model).modules if u is not model]
    if not units:
        raise ValueError(f"{type(model).__name__}: no repeated blocks (nn.ModuleList, nn.Sequential children) to plan "
                         "over; pass units= or plan with a config")
    counts = [sum(p.numel() for p in u.parameters()) for u in units]
    linears = _matmuls(units[0])
    if not linears:
        raise ValueError(f"{type(model).__name__}: its block {type(units[0]).__name__} has no nn.Linear (or Hugging "
                         "Face Conv1D) to read the hidden size from; plan with its config.json instead")
    h = linears[0][0]
    in_blocks = {id(p) for u in units for p in u.parameters()}
    before = after = 0  # outside the blocks: registered before the first (the embedding) or after (norm, head)
    seen = False
    for p in model.parameters():
        if id(p) in in_blocks:
            seen = True
        elif seen:
            after += p.numel()
        else:
            before += p.numel()
    split = sum(n for _, n in linears)
    embeds = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    vocab = max((e.num_embeddings for e in embeds), default=0)
    config = getattr(model, "config", None)  # a Hugging Face model's, or the reference GPT's
    heads = next((int(v) for v in [getattr(config, k, None) for k in ("num_attention_heads", "n_head")]
                  + [getattr(units[0], k, None) for k in ("n_head", "num_heads", "num_attention_heads")]
                  if isinstance(v, int)), 1)
    # an output layer that shares an embedding's weight (a tied head: the pipeline keeps a copy on the last stage)
    tables = {id(e.weight) for e in embeds}
    tied = any(isinstance(m, nn.Linear) and id(m.weight) in tables for m in model.modules())
    llama = getattr(config, "model_type", "") in _LLAMA and hasattr(config, "intermediate_size")
    return ModelSpec(name=name or type(model).__name__, layers=len(units), hidden=h, heads=heads, vocab=vocab,
                     max_seq=0, layer_params=max(counts), layer_split=split, embed_params=before, head_params=after,
                     final_params=0, tied=tied, module=model, family="llama" if llama else "gpt",
                     intermediate=int(getattr(config, "intermediate_size", 0) or 0) if llama else 0,
                     kv_heads=int(getattr(config, "num_key_value_heads", 0) or heads) if llama else 0,
                     head_dim=int(getattr(config, "head_dim", 0) or 0) if llama else 0)
