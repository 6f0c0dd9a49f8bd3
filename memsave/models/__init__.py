"""Reference models and the embedded corpus (layer 0: torch and the standard library only)."""

from memsave.models.data import TokenBatches, corpus_text, corpus_tokens
from memsave.models.gpt import GPT, GPT_SIZES, Block, CausalLMOutput, GPTConfig, gpt_config

__all__ = [
    "GPT",
    "GPT_SIZES",
    "Block",
    "CausalLMOutput",
    "GPTConfig",
    "TokenBatches",
    "corpus_text",
    "corpus_tokens",
    "gpt_config",
]
