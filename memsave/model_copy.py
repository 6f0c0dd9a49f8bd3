"""``copy.deepcopy`` of a wrapped model: a plain instance of the user's class (an EMA copy, a frozen reference).

The copy holds the full weights (gathered at ZeRO-3) and none of memsave's machinery: the engine and other
``memsave_*`` attributes, its hooks and a recomputed unit's ``forward`` are mapped to a marker in the deep copy's
memo, so they are never copied, and removed from the copy afterwards.

[Note: the copy's dtypes] Under a bf16/fp16 profile memsave casts the model's parameters at wrap, but the
user's model was fp32, and an EMA kept in a bf16 copy silently stops moving (``ema.lerp_(p, 0.001)``: most
updates are below bf16's resolution; a review saw 13.6% of the elements ever change). So the copy's parameters
get back the dtypes they had before wrap (as FSDP2's sharded parameters keep theirs): the low-precision values,
widened; an fp32 EMA then follows them exactly.

One exception: ``torch.optim.swa_utils.AveragedModel`` averages with ``torch._foreach_lerp_`` unless given an
``avg_fn``, and that kernel needs the copy and the model in one dtype: an fp32 copy of a bf16 model raised in its
second ``update_parameters`` (with a ``multi_avg_fn``, or with neither function on CUDA). A copy made for such an
``AveragedModel`` keeps the wrapped model's dtypes (what it
gets on a model cast with ``model.bfloat16()``), with a warning that its average is held in bf16; given an
``avg_fn`` (``get_ema_avg_fn``, ``get_swa_avg_fn``: plain arithmetic, which promotes) it is widened as any copy.
"""

from __future__ import annotations

import copy
import functools
import sys
import types
from typing import Any, cast

import torch
from torch import nn
from torch.nn.modules.module import _WrappedHook

from memsave._logging import warn_once

__all__ = ["DTYPES_ATTR", "plain_copy"]

DTYPES_ATTR = "memsave_param_dtypes"  # on the wrapped model: each parameter's (and buffer's) dtype before wrap
_LEFT_OUT = object()  # what memsave attached to a module, in a deep copy's memo: not copied
# a module's hook dicts whose keys are flags on hooks of another dict: (flags, hooks)
_HOOK_FLAGS = (("_forward_hooks_with_kwargs", "_forward_hooks"), ("_forward_hooks_always_called", "_forward_hooks"),
               ("_forward_pre_hooks_with_kwargs", "_forward_pre_hooks"))


def plain_copy(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """What ``copy.deepcopy`` of the wrapped ``module`` returns (see the module docstring)."""
    from memsave.wrapped import user_class  # (wrapped.py imports this module when a copy is made)

    if (mesh := getattr(getattr(module, "memsave_engine", None), "mesh", None)) and mesh.degree("tp") > 1:
        raise NotImplementedError(
            f"copy.deepcopy of a model under tensor parallelism (tp = {mesh.degree('tp')}) is not supported: its "
            "layers hold this rank's slices and run over the tp group. For an EMA, keep this rank's slices (ema = "
            "[p.detach().clone() for p in model.parameters()], updated with ema_p.lerp_(p, 1 - decay)), or "
            "build a plain model and load model.state_dict() (whole tensors; collective: on every rank) into it")
    forwards = _mark_left_out(module, memo)
    clone = cast(nn.Module, object.__new__(user_class(module)))
    memo[id(module)] = clone
    module.unshard()  # type: ignore[operator]
    try:
        clone.__dict__.update(copy.deepcopy(module.__dict__, memo))
    finally:
        module.reshard()  # type: ignore[operator]
    for m in clone.modules():
        attrs = vars(m)
        for key in [k for k, v in attrs.items() if v is _LEFT_OUT or k.startswith("memsave_")]:
            del attrs[key]
        for name, hooks_of in attrs.items():
            if isinstance(hooks_of, dict) and "hooks" in name:
                for key in [k for k, v in hooks_of.items() if v is _LEFT_OUT]:
                    del hooks_of[key]
        for flags, hooks in _HOOK_FLAGS:
            for key in [k for k in attrs.get(flags, {}) if k not in attrs.get(hooks, {})]:
                del attrs[flags][key]
    for m, original in forwards:  # a recomputed unit: the forward it had before, if an instance one
        vars(memo[id(m)])["forward"] = copy.deepcopy(original, memo)

    dtypes = vars(module).get(DTYPES_ATTR, {})
    widened = [p for n, p in clone.named_parameters() if dtypes.get(n, p.dtype) != p.dtype]
    if widened and _for_foreach_average(widened[0].device):
        warn_once("torch.optim.swa_utils.AveragedModel of a model wrapped with a bf16/fp16 profile holds its average "
                  "in the model's dtype (its foreach update needs one dtype on both sides), where an update smaller "
                  "than the format's resolution rounds away (an EMA with decay 0.999 barely moves in bf16); for an "
                  "fp32 average pass avg_fn=torch.optim.swa_utils.get_ema_avg_fn(decay) (or get_swa_avg_fn())")
        dtypes = {}
    with torch.no_grad():  # [Note: the copy's dtypes]
        for name, p in clone.named_parameters():
            if dtypes.get(name, p.dtype) != p.dtype:
                p.data = p.data.to(dtypes[name])
        for name, b in clone.named_buffers():  # BatchNorm's statistics, cast with its weight
            if dtypes.get(name, b.dtype) != b.dtype:
                owner, _, attr = name.rpartition(".")
                clone.get_submodule(owner)._buffers[attr] = b.to(dtypes[name])
    return clone


def _for_foreach_average(device: torch.device) -> bool:
    """Whether this copy is made by ``AveragedModel.__init__`` for an update that runs torch's foreach kernels,
    which need one dtype ([Note: the copy's dtypes]): a ``multi_avg_fn``, or neither function on a device with
    foreach kernels (elsewhere its default update is plain arithmetic, which promotes)."""
    from torch.optim.swa_utils import AveragedModel
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    code = AveragedModel.__init__.__code__
    frame = sys._getframe(1)
    for _ in range(12):  # plain_copy <- __deepcopy__ <- copy.deepcopy <- AveragedModel.__init__ (or a subclass's)
        if frame is None:
            return False
        if frame.f_code is code:
            args = frame.f_locals
            if args.get("avg_fn") is not None:
                return False
            where = torch.device(args["device"]) if args.get("device") is not None else device
            return args.get("multi_avg_fn") is not None or where.type in _get_foreach_kernels_supported_devices()
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _is_memsave(obj: Any) -> bool:
    """Whether ``obj`` (a hook, an instance's ``forward``, a ``memsave_*`` attribute's value) is memsave's
    machinery: a function, method or object defined in a memsave module (the reference models aside)."""
    if isinstance(obj, _WrappedHook):  # torch's wrapper of some module hooks (load_state_dict pre-hooks)
        obj = obj.hook
    if isinstance(obj, functools.partial):
        obj = obj.func
    obj = getattr(obj, "__func__", obj)  # a bound method: its function
    where = (getattr(obj, "__module__", None) if isinstance(obj, types.FunctionType) else type(obj).__module__) or ""
    return where.split(".")[0] == "memsave" and not where.startswith("memsave.models")


def _mark_left_out(module: nn.Module, memo: dict[int, Any]) -> list[tuple[nn.Module, Any]]:
    """Map what memsave attached to ``module`` and its submodules (the engine and other ``memsave_*`` attributes,
    hooks, a recomputed unit's ``forward``) to ``_LEFT_OUT`` in a deep copy's ``memo``, so it is never copied.
    Returns ``(submodule, forward)`` for recomputed units whose forward before was an instance attribute."""
    forwards = []
    for m in module.modules():
        for key, value in vars(m).items():
            if key.startswith("memsave_") or key == "forward":
                found = [value]
            elif isinstance(value, dict) and "hooks" in key:
                found = list(value.values())
            else:
                continue
            for obj in found:
                if _is_memsave(obj):
                    memo[id(obj)] = _LEFT_OUT
                    if key == "forward" and getattr(obj, "original", None) is not None:
                        forwards.append((m, obj.original))
    return forwards
