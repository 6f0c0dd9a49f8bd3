"""Reference models, the embedded corpus and the default units (layer 0: torch and the standard library only)."""

from memsave.models.data import TokenBatches, corpus_text, corpus_tokens
from memsave.models.gpt import GPT, GPT_SIZES, Block, CausalLMOutput, GPTConfig, gpt_config
from memsave.models.units import default_units

__all__ = [
    "GPT",
    "GPT_SIZES",
    "Block",
    "CausalLMOutput",
    "GPTConfig",
    "TokenBatches",
    "corpus_text",
    "corpus_tokens",
    "default_units",
    "gpt_config",
]
