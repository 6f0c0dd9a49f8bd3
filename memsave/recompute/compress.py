"""Compressed saved activations: what autograd keeps for backward is stored in fewer bits (Gist, Jain et al.,
2018, with bf16 / fp8 in place of Gist's delayed-precision-reduction encodings).

Opt-in with ``[recompute] compress = "bf16" | "fp8"``, or by hand with :func:`compress_saved`. Under
``torch.autograd.graph.saved_tensors_hooks``, each fp32 activation (:func:`memsave.offload.is_activation`:
large enough, not a parameter or a view of one, not a leaf that requires grad, not a buffer of ``module``) is
stored on pack as bf16 (2 bytes an element instead of 4) or as ``float8_e4m3fn`` with one fp32 scale per
tensor (``amax / 448``: the tensor's largest magnitude maps to fp8's largest value), and restored to fp32 on
unpack. Everything else passes through untouched. The same storage saved twice in one forward (a tensor that
two ops save, or ``x * x``) is compressed once.

This changes the numbers: backward sees activations rounded to 8 (bf16) or 3 (fp8) mantissa bits. Forward
values are exact (only what is kept for backward is rounded), so the loss of a step is that of uncompressed
training from the same parameters; the gradients differ by the rounding.

[Note: compression inside a recomputed unit] Inside a checkpointed unit the checkpoint's own saved-tensor
hooks replace ours, so the unit's intermediates are recomputed in full precision and only what the checkpoint
keeps through the outer hooks, its positional tensor inputs, is compressed: the recomputation then starts from
the rounded input. Recomputation and compression compose; nothing is saved twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

from memsave.offload.activations import MIN_NUMEL, is_activation, module_storages

__all__ = ["COMPRESS_DTYPES", "CompressionStats", "SavedTensorCompressor", "check_compress", "compress_saved"]

COMPRESS_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
_FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


@dataclass
class CompressionStats:
    """Bytes of the distinct tensors compressed since the last reset: ``covered`` as they were (fp32),
    ``stored`` as kept (compressed data plus fp8 scales); ``num_tensors`` of them."""

    covered: int = 0
    stored: int = 0
    num_tensors: int = 0

    @property
    def ratio(self) -> float:
        """Stored over covered bytes (0.5 for bf16, about 0.25 for fp8); 1.0 when nothing was covered."""
        return self.stored / self.covered if self.covered else 1.0


def check_compress(kind: str, device: torch.device | str = "cpu") -> torch.dtype:
    """The storage dtype for ``kind`` ("bf16" or "fp8"); NotImplementedError if ``device`` cannot cast to it."""
    if kind not in COMPRESS_DTYPES:
        raise ValueError(f"compression {kind!r} is not allowed; expected one of {', '.join(map(repr, COMPRESS_DTYPES))}")
    dtype = COMPRESS_DTYPES[kind]
    try:
        probe = torch.ones(4, device=device).to(dtype).to(torch.float32)
    except (RuntimeError, TypeError) as exc:
        raise NotImplementedError(
            f'[recompute] compress = "{kind}" is not implemented on {torch.device(device)}: this torch cannot cast '
            f'float32 to {dtype} there ({exc}); use compress = "bf16" or "none"'
        ) from exc
    if not torch.equal(probe, torch.ones(4, device=device)):
        raise NotImplementedError(f'[recompute] compress = "{kind}": a cast to {dtype} and back on '
                                  f"{torch.device(device)} does not round-trip 1.0; use compress = \"bf16\" or \"none\"")
    return dtype


class SavedTensorCompressor:
    """The pack / unpack pair of saved-activation compression; one per forward (it caches per storage)."""

    def __init__(self, kind: str, *, min_numel: int = MIN_NUMEL, exclude: frozenset[int] = frozenset()) -> None:
        if kind not in COMPRESS_DTYPES:
            raise ValueError(f"compression {kind!r} is not allowed; expected one of "
                             f"{', '.join(map(repr, COMPRESS_DTYPES))}")
        self.kind, self.dtype = kind, COMPRESS_DTYPES[kind]
        self.min_numel, self.exclude = min_numel, exclude
        self.stats = CompressionStats()
        # root tensor (weakly) -> {(offset, shape, stride): packed}: a storage saved twice is compressed once
        self._seen: WeakTensorKeyDictionary = WeakTensorKeyDictionary()

    def _compress(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.kind == "bf16":
            return t.to(self.dtype), None
        amax = t.detach().abs().amax().to(torch.float32)
        scale = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))  # (): no host sync on GPU
        return (t / scale).to(self.dtype), scale

    def pack(self, t: torch.Tensor) -> Any:
        if not is_activation(t, self.min_numel, self.exclude, dtypes=(torch.float32,)):
            return t
        root = t._base if t._base is not None else t
        key = (t.storage_offset(), tuple(t.shape), t.stride(), t._version)  # an in-place update is a new value
        views = self._seen.get(root)
        if views is not None and key in views:
            return views[key]
        data, scale = self._compress(t.detach())
        packed = (data, scale, t.dtype)
        self._seen.setdefault(root, {})[key] = packed
        self.stats.covered += t.numel() * t.element_size()
        self.stats.stored += data.numel() * data.element_size() + (scale.element_size() if scale is not None else 0)
        self.stats.num_tensors += 1
        return packed

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        data, scale, dtype = packed
        out = data.to(dtype)
        return out * scale if scale is not None else out


@contextlib.contextmanager
def compress_saved(kind: str, module: nn.Module | None = None, *,
                   min_numel: int = MIN_NUMEL) -> Iterator[SavedTensorCompressor]:
    """Within this context, fp32 activations saved for backward are stored as ``kind`` ("bf16" or "fp8").

    ``module``: its parameters and buffers are never compressed (parameters and leaves that require grad never
    are anyway). Yields the :class:`SavedTensorCompressor`, whose ``stats`` count the bytes it covered.
    """
    compressor = SavedTensorCompressor(kind, min_numel=min_numel, exclude=module_storages(module))
    with torch.autograd.graph.saved_tensors_hooks(compressor.pack, compressor.unpack):
        yield compressor
