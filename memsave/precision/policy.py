"""The ``[precision]`` policy: compute dtype, the loss scaler it asks for, and the parameter cast.

Under ``compute = "bf16" | "fp16"`` every floating-point *parameter* is stored and computed in that dtype
(frozen ones too; so a unit's flat buffers keep one dtype), gradients are produced and communicated in it
(``reduce = "compute"``), and the optimizer steps fp32 master copies (``master = "fp32"``), sharded by ZeRO
stage like its state. Buffers keep their dtype: running statistics, position indices and the like stay as the
model made them, as under FSDP2's ``MixedPrecisionPolicy``; a model that must run a part in fp32 (a norm, the
loss) upcasts there itself, as it would under autocast.

Floating-point *inputs* of the model's forward (positional and keyword, inside tuples, lists and dicts) are cast
to the compute dtype, as FSDP2's ``cast_forward_inputs`` does: an fp32 image batch meets bf16 convolution weights
otherwise. Integer inputs (token ids, labels for classification) are left alone; float targets are cast too, so a
regression loss that needs fp32 upcasts them itself.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memsave._logging import warn_once
from memsave.config import PrecisionConfig
from memsave.inputs import map_tensors
from memsave.precision.scaler import LossScaler

__all__ = ["DTYPES", "cast_forward_inputs", "cast_parameters", "compute_dtype", "reduce_dtype_for", "scaler_for"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(cfg: PrecisionConfig) -> torch.dtype:
    return DTYPES[cfg.compute]


def reduce_dtype_for(cfg: PrecisionConfig) -> torch.dtype | None:
    """The dtype gradients are communicated (and kept sharded) in; None: the compute dtype."""
    if cfg.reduce in ("compute", cfg.compute):
        return None
    return DTYPES[cfg.reduce]


def scaler_for(cfg: PrecisionConfig) -> LossScaler | None:
    """``loss_scale = "dynamic"``: a dynamic scaler; a number: a fixed scale (overflowed steps still skip);
    ``"none"``: no scaling."""
    if cfg.loss_scale == "none":
        return None
    if cfg.loss_scale == "dynamic":
        return LossScaler()
    scale = float(cfg.loss_scale)
    return LossScaler(scale, dynamic=False, min_scale=scale, max_scale=scale)


@torch.no_grad()
def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Store every floating-point parameter of ``model`` in ``dtype``, keeping the Parameter objects (so an
    optimizer built over them still holds them); and the buffers torch's kernels read with them and refuse in
    fp32 beside 16-bit weights (:func:`_paired_buffers`). Every other buffer keeps its dtype."""
    _say_kept_in_fp32(model, dtype)
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    for m, name in _paired_buffers(model):
        b = m._buffers[name]
        if b is not None and b.is_floating_point() and b.dtype != dtype:
            m._buffers[name] = b.to(dtype)


def _say_kept_in_fp32(model: nn.Module, dtype: torch.dtype) -> None:
    """A Hugging Face model that asks to keep modules in fp32 under this dtype (``_keep_in_fp32_modules`` under
    fp16, ``_keep_in_fp32_modules_strict`` under fp16 and bf16: T5's ``wo``, whose outputs overflow fp16) is told
    that memsave stores them in ``dtype`` too (one dtype per unit): its loss may overflow (skipped steps)."""
    keys: set[str] = set()
    names: list[str] = []  # (an HF model inside the user's module too)
    for prefix, m in model.named_modules():
        own = set(getattr(m, "_keep_in_fp32_modules_strict", None) or ())
        if dtype == torch.float16:
            own |= set(getattr(m, "_keep_in_fp32_modules", None) or ())
        keys |= own
        names += [f"{prefix}.{n}" if prefix else n for n, p in m.named_parameters() if p.is_floating_point()
                  and any(k in n.split(".") or n.startswith(k + ".") for k in own)]
    names = list(dict.fromkeys(names))
    if names:
        short = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
        warn_once(f"{type(model).__name__}: Hugging Face keeps {sorted(keys)} in fp32 under {short} "
                  f"(_keep_in_fp32_modules: {len(names)} parameters, e.g. {names[0]!r}); memsave stores and computes "
                  f"every parameter in {short}, those too: if the loss overflows (skipped steps), use [precision] "
                  f"compute = {'bf16' if dtype == torch.float16 else 'fp32'}")


def _paired_buffers(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """BatchNorm's running statistics beside its weight (its CPU kernel: "expected scalar type BFloat16 but found
    Float"), spectral_norm's power-iteration vectors (both forms: "addmv input tensors must have the same dtype"):
    plain torch's ``model.bfloat16()`` casts them too."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.utils.spectral_norm import SpectralNorm

    out: list[tuple[nn.Module, str]] = []
    for m in model.modules():
        if isinstance(m, _BatchNorm) and m.affine:
            out += [(m, "running_mean"), (m, "running_var")]
        elif type(m).__name__ == "_SpectralNorm":  # torch.nn.utils.parametrizations.spectral_norm
            out += [(m, "_u"), (m, "_v")]
        out += [(m, f"{h.name}{s}") for h in m._forward_pre_hooks.values() if isinstance(h, SpectralNorm)
                for s in ("_u", "_v")]
    return [(m, n) for m, n in out if n in m._buffers]


def cast_forward_inputs(model: nn.Module, dtype: torch.dtype) -> Any:
    """Cast the floating-point tensors among ``model``'s forward arguments to ``dtype`` (see the module docstring);
    returns the hook's handle."""

    def cast(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
            return t.to(dtype)
        return t

    def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        return map_tensors(cast, args), map_tensors(cast, kwargs)  # dataclasses and BatchEncoding too

    return model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
