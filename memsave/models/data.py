"""An embedded byte-level corpus and deterministic batches split across data-parallel ranks.

The corpus is the help-topic documentation that ships with Python (``pydoc_data.topics``), so demos and
tests train on real English text with no download.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = ["TokenBatches", "corpus_text", "corpus_tokens"]

_SPLITS = ("train", "val")


@functools.cache
def corpus_text() -> str:
    """Python's help-topic docs (``pydoc_data.topics.topics``), in sorted key order, blank-line separated."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


@functools.cache
def corpus_tokens() -> Tensor:
    """The corpus as UTF-8 bytes, int64 in 0..255, shape (N,). Cached and shared: do not modify in place."""
    data = bytearray(corpus_text().encode("utf-8"))
    return torch.frombuffer(data, dtype=torch.uint8).to(torch.int64)


def _check_int(name: str, value: int, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"TokenBatches {name}={value!r}: must be an int >= {low}")


def _step_seed(seed: int, step: int) -> int:
    """A 32-bit generator seed for ``(seed, step)`` (splitmix64 finalizer).

    torch's CPU generator keeps only the low 32 bits of a seed, so packing ``seed << 32 | step`` would make
    every seed draw the same batches; mixing both into the low bits keeps them apart.
    """
    mask = (1 << 64) - 1
    x = (seed * 0x9E3779B97F4A7C15 + step + 1) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return (x ^ (x >> 31)) & 0xFFFF_FFFF


class TokenBatches:
    """Random windows of the corpus, the same global batch on every rank, each rank taking its rows.

    Step ``s`` draws ``batch_size * dp_size`` window starts from a ``torch.Generator`` seeded by
    ``(seed, s)``; rank ``r`` takes rows ``[r * batch_size, (r + 1) * batch_size)``. The global batch
    depends only on ``batch_size * dp_size``, ``seed`` and the step, so concatenating the ranks' batches gives
    exactly what one process with ``batch_size * dp_size`` and ``dp_size=1`` sees: the reference that
    distributed runs are compared against. The first ``1 - val_fraction`` of the tokens is the train split,
    the rest the val split.
    """

    def __init__(
        self,
        *,
        seq_len: int,
        batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        split: str = "train",
        seed: int = 0,
        val_fraction: float = 0.05,
    ) -> None:
        _check_int("seq_len", seq_len, 1)
        _check_int("batch_size", batch_size, 1)
        _check_int("dp_size", dp_size, 1)
        _check_int("dp_rank", dp_rank, 0)
        _check_int("seed", seed, 0)
        if dp_rank >= dp_size:
            raise ValueError(f"TokenBatches dp_rank={dp_rank}: must be in [0, dp_size={dp_size})")
        if split not in _SPLITS:
            raise ValueError(f"TokenBatches split={split!r}: allowed are {list(_SPLITS)}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"TokenBatches val_fraction={val_fraction!r}: allowed is 0 <= val_fraction < 1")
        tokens = corpus_tokens()
        num_train = int(len(tokens) * (1.0 - val_fraction))
        self.tokens = tokens[:num_train] if split == "train" else tokens[num_train:]  # (N,)
        if len(self.tokens) < seq_len + 1:
            raise ValueError(
                f"TokenBatches seq_len={seq_len}: the {split} split has only {len(self.tokens)} tokens, "
                f"a window needs seq_len + 1; use a shorter seq_len or another val_fraction"
            )
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.split = split
        self.seed = seed

    def _starts(self, step: int) -> Tensor:
        """Window starts of the global batch at ``step``, shape (batch_size * dp_size,)."""
        _check_int("step", step, 0)
        generator = torch.Generator().manual_seed(_step_seed(self.seed, step))
        high = len(self.tokens) - self.seq_len  # a window is seq_len + 1 tokens
        return torch.randint(0, high, (self.batch_size * self.dp_size,), generator=generator)

    def _windows(self, starts: Tensor) -> dict[str, Tensor]:
        offsets = torch.arange(self.seq_len + 1)
        windows = self.tokens[starts[:, None] + offsets]  # (B, T + 1)
        return {"input_ids": windows[:, :-1].contiguous(), "labels": windows[:, 1:].contiguous()}

    def global_batch(self, step: int) -> dict[str, Tensor]:
        """The unsplit batch of every rank at ``step``: tensors of shape (batch_size * dp_size, seq_len)."""
        return self._windows(self._starts(step))

    def batch(self, step: int) -> dict[str, Tensor]:
        """This rank's rows at ``step``: ``input_ids`` and next-token ``labels``, each (batch_size, seq_len)."""
        lo = self.dp_rank * self.batch_size
        return self._windows(self._starts(step)[lo : lo + self.batch_size])

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        """Batches for step 0, 1, 2, ... forever."""
        return (self.batch(step) for step in itertools.count())
