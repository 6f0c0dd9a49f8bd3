"""The public types ``memsave.wrap`` returns, shared by every engine (plain data parallel and ZeRO 1-3).

The model is *not* put inside a container: like FSDP2's ``fully_shard``, memsave swaps the instance's class
for a subclass that also derives from :class:`MemsaveModule`, so attribute access, ``isinstance`` checks,
``state_dict`` keys and the ``forward`` signature are exactly those of the user's model.

The optimizer is a :class:`WrappedOptimizer` around the user's own optimizer instance; it is a
``torch.optim.Optimizer`` (LR schedulers accept it) whose ``param_groups`` *are* the inner optimizer's, so a
scheduler built on either object changes the learning rate that is used.

``copy.deepcopy`` of a wrapped model (an EMA copy) returns a plain instance of the user's class with the full
weights and none of memsave's engine or hooks; ``model.to`` / ``.half()`` / ``.float()`` that would change a
parameter's dtype or device after wrap are refused (the engine laid out its storage at wrap).
"""

from __future__ import annotations

import abc
import contextlib
import inspect
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn

from memsave.phases import MemoryCategory
from memsave.state_view import ParamStateAttribute

__all__ = [
    "MemsaveModule",
    "WrappedOptimizer",
    "check_still_frozen",
    "inner_step",
    "is_wrapped_optimizer",
    "route_user_optimizer",
    "swap_class",
    "sync_suspended",
    "unscaled_backward_error",
    "unswap_class",
    "user_class",
    "weak_method",
    "wrapped_model_of",
]

_CLASS_CACHE: dict[type, type] = {}
# What memsave wrapped, for the errors that name it (an optimizer or a parameter passed to a second wrap).
_WRAPPED_MODELS: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_WRAPPED_OPTIMIZERS: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


class MemsaveModule:
    """Mixed into a wrapped model's class. ``memsave_engine`` is the engine that owns its hooks."""

    memsave_engine: Any

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication, for the backwards run inside the block.

        Same contract as DDP's ``no_sync``: the first backward *after* the block synchronizes everything
        accumulated so far. Use it for all micro-batches but the last of a gradient-accumulation step.
        """
        with self.memsave_engine.no_sync():
            yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, plus the gradients the engine keeps for the model's parameters (reduced shards,
        fp32 reduce buckets): after it the next backward starts from fresh gradients, as with the optimizer's."""
        self.memsave_engine.zero_grad(set_to_none)
        nn.Module.zero_grad(self, set_to_none)  # type: ignore[arg-type]
        for listener in self.memsave_engine.zero_grad_listeners:  # the optimizer forgets the cleared step
            listener()

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> Any:
        """Probed by ``DistributedDataParallel``'s constructor (``hasattr``, which lets this error through): a wrapped
        model wrapped again in torch's DDP (``accelerator.prepare(model)``, transformers' ``Trainer`` on several
        processes) would sync gradients twice, and DDP's hook ran after memsave's bucket had been divided or
        reduced: under ddp the last gradient of a bucket came out 0.5-0.7x, silently; ZeRO failed with torch's
        internal errors. Refused by name."""
        raise RuntimeError(
            "torch's DistributedDataParallel around a memsave-wrapped model: memsave already synchronizes the "
            "gradients over the data-parallel ranks (and under ZeRO holds them sharded), so a second wrapper would "
            "average them twice. With accelerate, leave the model out of prepare: accelerator.prepare(optimizer, "
            "dataloader, scheduler), accelerator.register_for_checkpointing(model) for save_state, and "
            "optimizer.clip_grad_norm(c) for clipping; with transformers' Trainer see README 'Hugging Face "
            "accelerate and Trainer'")

    def unshard(self) -> None:
        """ZeRO-3: gather every unit's full parameters (collective: call on every rank), to read or write weights
        outside the forward; :meth:`reshard` frees them again, keeping what was written ([Note: edits of gathered
        parameters] in memsave/zero/edit_window.py). No-op at other stages."""
        self.memsave_engine.unshard()
        zero = getattr(self.memsave_engine, "inner", self.memsave_engine)  # (a pipeline's: its stage's engine)
        if hasattr(zero, "edit_windows"):
            zero.edit_windows.open(zero.units)

    def reshard(self) -> None:
        """ZeRO-3: free the units gathered by :meth:`unshard` (or on access). No-op at other stages."""
        self.memsave_engine.reshard()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """What ``model.to(...)``, ``.half()``, ``.float()``, ``.cuda()`` run: refused when it would change a parameter
        (its dtype or device), whose storage the engine laid out (buckets, ZeRO shards and the gathered views
        of stage 3) beside the fp32 masters and the optimizer state; a conversion that leaves every parameter as it
        is (``.to(its device)``, ``.float()`` of an fp32 model) applies to the buffers only."""
        module = cast(nn.Module, self)
        checked: set[tuple[torch.dtype, torch.device]] = set()
        for name, p in module.named_parameters():
            if (p.dtype, p.device) in checked:
                continue
            probe = torch.empty(0, dtype=p.dtype, device=p.device)  # what fn does to a tensor like p, at no cost
            out = fn(probe)
            # by dtype and device, not identity: .to("cpu:0") (accelerate's CPU device) copies an fp32 CPU tensor
            # into another fp32 CPU tensor, which changes nothing
            if (out.dtype, out.device) != (p.dtype, p.device):
                raise NotImplementedError(
                    f"converting a model after memsave.wrap (model.to / .half / .float / .cuda ...) is not supported: "
                    f"it would replace parameter {name!r} ({p.dtype} on {p.device}) by a tensor of {out.dtype} on "
                    f"{out.device}, while memsave's engine and optimizer keep its storage, gradients and state as "
                    "they were laid out at wrap; move and cast the model before memsave.wrap (for mixed precision "
                    'use [precision] compute = "bf16" or "fp16")'
                )
            checked.add((p.dtype, p.device))
        for m in module.modules():
            for key, buffer in m._buffers.items():
                if buffer is not None:
                    m._buffers[key] = fn(buffer)
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        """``copy.deepcopy(model)`` (an EMA copy, say): a plain instance of the user's class holding the full
        weights, in the dtypes they had before wrap, without memsave's engine, hooks or recomputation
        (memsave/model_copy.py). At ZeRO-3 it gathers the parameters for the copy (a collective: deep-copy on
        every rank, between steps) and frees them again."""
        from memsave.model_copy import plain_copy  # (it reads this module's classes)

        return plain_copy(cast(nn.Module, self), memo)


def _save_pretrained(self: nn.Module, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
    """Hugging Face's ``save_pretrained`` (put on the wrapped class only where the user's class has one), given
    the whole model's state dict under pipeline parallelism, where ``state_dict()`` holds this rank's stages
    (collective there: call it on every rank, with ``is_main_process`` for the one that writes). Other engines
    gather in ``state_dict()``."""
    whole = getattr(self.memsave_engine, "whole_state_dict", None)
    if whole is not None and kwargs.get("state_dict") is None:
        kwargs["state_dict"] = whole()
    save: Callable[..., Any] = user_class(self).save_pretrained  # type: ignore[attr-defined]
    return save(self, save_directory, *args, **kwargs)


def _generate(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Hugging Face's ``generate`` (put on the wrapped class only where the user's class has one), with
    ``synced_gpus=True`` where each forward communicates over dp (ZeRO-3 at dp > 1: the flag
    ``_is_fsdp_managed_module`` that :func:`memsave.parallelize` sets) and the call does not say otherwise.
    transformers turns it on by itself there (as for FSDP and DeepSpeed ZeRO-3), unless a model's own ``generate``
    defaults it to False: Whisper's, SeamlessM4T's, CSM's. Then a rank whose prompts ended first left the loop
    while its peers gathered for their next token, and both waited out the 600 s collective timeout."""
    if self.__dict__.get("_is_fsdp_managed_module") and "synced_gpus" not in kwargs:
        kwargs["synced_gpus"] = True
    generate: Callable[..., Any] = user_class(self).generate  # type: ignore[attr-defined]
    return generate(self, *args, **kwargs)


def _takes_synced_gpus(cls: type) -> bool:
    """Whether ``cls.generate`` is Hugging Face's kind (a ``synced_gpus`` parameter), not a user's own."""
    try:
        return "synced_gpus" in inspect.signature(cls.generate).parameters  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return False


def swap_class(module: nn.Module, engine: Any) -> nn.Module:
    """Make ``module`` an instance of a subclass of ``(Class, MemsaveModule)`` in place and attach ``engine``.

    The subclass keeps the class's name: Hugging Face's ``save_pretrained`` writes ``type(model).__name__`` into
    config.json's ``architectures``, which tools read to pick the class to load (transformers strips FSDP2's
    ``FSDP`` prefix for the same reason); ``isinstance(model, memsave.MemsaveModule)`` tells a wrapped model."""
    cls = type(module)
    if isinstance(module, MemsaveModule):
        raise ValueError(f"module of class {cls.__name__} is already wrapped by memsave; wrap it once")
    if cls not in _CLASS_CACHE:
        # MemsaveModule's methods come first: zero_grad must reach the engine whatever the user's class defines
        _CLASS_CACHE[cls] = type(cls.__name__, (cls, MemsaveModule), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, "zero_grad": MemsaveModule.zero_grad,
            "unshard": MemsaveModule.unshard, "reshard": MemsaveModule.reshard, "_apply": MemsaveModule._apply,
            "__deepcopy__": MemsaveModule.__deepcopy__,
            **({"save_pretrained": _save_pretrained} if hasattr(cls, "save_pretrained") else {}),
            **({"generate": _generate} if _takes_synced_gpus(cls) else {})})
    module.__class__ = _CLASS_CACHE[cls]
    module.memsave_engine = engine
    _WRAPPED_MODELS.add(module)
    return module


def unswap_class(module: nn.Module) -> nn.Module:
    """Undo :func:`swap_class` (used when an engine is removed)."""
    if isinstance(module, MemsaveModule):
        module.__class__ = module.__class__.__bases__[0]
        del module.memsave_engine
        _WRAPPED_MODELS.discard(module)
    return module


def user_class(module: nn.Module) -> type:
    """The class the user built ``module`` as (the one :func:`swap_class` derived from, if it ran)."""
    cls = type(module)
    return cls.__bases__[0] if isinstance(module, MemsaveModule) else cls


def shared_with_wrapped(model: nn.Module) -> tuple[str, nn.Module, str] | None:
    """A parameter of ``model`` that a wrapped model holds too: (its name here, that model, its name there)."""
    return _held({id(p): n for n, p in model.named_parameters(remove_duplicate=False)})


def wrapped_model_of(t: torch.Tensor) -> tuple[nn.Module, str] | None:
    """The wrapped model ``t`` is a parameter of, and its name there (``None``: none); scans them all, for errors."""
    found = _held({id(t): ""})
    return (found[1], found[2]) if found is not None else None


def _held(ids: dict[int, str]) -> tuple[str, nn.Module, str] | None:
    for model in list(_WRAPPED_MODELS):
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in ids:
                return ids[id(p)], model, name
    return None


def is_wrapped_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is a :class:`WrappedOptimizer` or the user's optimizer inside one."""
    return isinstance(optimizer, WrappedOptimizer) or optimizer in _WRAPPED_OPTIMIZERS


def check_still_frozen(frozen: list[tuple[str, nn.Parameter]], consequence: str) -> None:
    """Refuse a parameter frozen at wrap that is trainable now (engines call it before each forward): the engine
    laid out its buffers for the parameters trainable at wrap, so training it would go wrong as ``consequence``
    says."""
    for name, p in frozen:
        if p.requires_grad:
            raise NotImplementedError(
                f"parameter {name!r} was frozen (requires_grad=False) at memsave.wrap and is trainable now; "
                f"{consequence}. Set requires_grad before memsave.wrap; to unfreeze part of a model later, save a "
                "checkpoint and wrap again"
            )


def unscaled_backward_error() -> RuntimeError:
    """fp16 with a loss scale: a backward that did not come through ``optimizer.backward(loss)``."""
    return RuntimeError(
        "memsave fp16: this backward did not go through optimizer.backward(loss), so the loss was not multiplied "
        "by the loss scale that optimizer.step() divides by; call optimizer.backward(loss) instead of loss.backward(). "
        "If it did go through another model's optimizer (a GAN's generator step through the discriminator), "
        "this model's own optimizer did not scale it: freeze this model for that step (requires_grad_(False), "
        "as the DCGAN example does), or wrap both in one module with one optimizer"
    )


@contextlib.contextmanager
def sync_suspended(engine: Any) -> Iterator[None]:
    """An engine's ``no_sync()``: its ``require_grad_sync`` is False inside the block, as it was after."""
    previous, engine.require_grad_sync = engine.require_grad_sync, False
    try:
        yield
    finally:
        engine.require_grad_sync = previous


def route_user_optimizer(inner: torch.optim.Optimizer, wrapper: WrappedOptimizer) -> None:
    """Make the user's own optimizer instance act as the wrapper where it matters, for loops that kept the
    original object (held weakly: the inner optimizer does not keep the wrapper, and its offload files, alive):

    - ``zero_grad()`` clears the engine's gradients too (else the next step would add them up);
    - ``add_param_group()`` is refused as on the wrapper (a head added there trained with unreduced gradients);
    - ``step()`` is the wrapper's, ``scaler.step(optimizer)`` included: what the user's optimizer steps are
      ZeRO's rows or the fp32 masters, which only the wrapper's step fills and copies back (a review:
      ``scaler.step(optimizer)`` or ``accelerator.prepare`` with the old name moved nothing under bf16, and left
      zero1/2 0.24 off plain at 2 ranks, no error). A bound method, so an LR scheduler built on either object can
      wrap it; memsave's own calls take the class's (:func:`inner_step`).

    The class's methods stay reachable as ``type(inner).zero_grad(inner, ...)`` and so on."""
    route = weak_method(wrapper.zero_grad, fallback=lambda *a, **k: type(inner).zero_grad(inner, *a, **k))
    inner.zero_grad = route  # type: ignore[method-assign]
    inner.add_param_group = weak_method(  # type: ignore[method-assign]
        wrapper.add_param_group, fallback=lambda group: type(inner).add_param_group(inner, group))
    ref = weakref.ref(wrapper)

    def step(self: torch.optim.Optimizer, closure: Any = None, grad_scaler: Any = None) -> Any:
        outer = ref()
        if outer is None:
            return type(self).step(self, closure)
        return outer.step(closure, grad_scaler=grad_scaler)

    inner.step = types.MethodType(step, inner)  # type: ignore[method-assign]
    # scaler.step(inner) hands the step to the wrapper too ([Note: one skip decision for GradScaler]): torch's
    # own path would unscale and decide on this rank's rows alone
    inner._step_supports_amp_scaling = True  # type: ignore[attr-defined]


def inner_step(optimizer: torch.optim.Optimizer) -> None:
    """The user's optimizer's own step (its class's: its instance's ``step`` is the wrapper's,
    :func:`route_user_optimizer`), marked for an LR scheduler built on it, as its step wrapper would."""
    optimizer._opt_called = True  # type: ignore[attr-defined]
    type(optimizer).step(optimizer)


def weak_method(method: Callable[..., Any], fallback: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """A callable that calls the bound ``method`` while its object lives (else ``fallback``, or nothing): for
    callbacks an engine or the user's optimizer keeps, which must not keep a wrapper alive. [Note: hooks held by
    tensors] A parameter's post-accumulate-grad hook is held on the tensor's C++ side, where the garbage collector
    does not look: an engine method there kept engine, model and gradients alive after ``del model, opt`` (a
    sweep or a notebook grew by the model per wrap), so the engines register these weakly."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        if bound is not None:
            return bound(*args, **kwargs)
        return fallback(*args, **kwargs) if fallback is not None else None
    return call


class WrappedOptimizer(torch.optim.Optimizer, abc.ABC):
    """A ``torch.optim.Optimizer`` facade over the user's optimizer instance, with the training-loop API:
    ``backward(loss)``, ``clip_grad_norm(max_norm)``, ``step()``, ``zero_grad()``, ``state_dict()`` and
    ``load_state_dict()``. :class:`memsave.engines.MemsaveOptimizer` (what ``memsave.wrap`` returns) and
    :class:`memsave.precision.MixedPrecisionOptimizer` implement it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        # Deliberately not calling Optimizer.__init__: the state lives in the wrapped optimizer.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"optimizer must be a torch.optim.Optimizer instance, got {type(optimizer).__name__}; "
                "build it over model.parameters() before calling memsave.wrap"
            )
        if isinstance(optimizer, WrappedOptimizer):
            raise ValueError("optimizer is already wrapped by memsave; pass the original optimizer")
        self.optimizer = optimizer
        self.step_was_skipped = False  # the last step() skipped the update (an overflow; on every rank alike)
        _WRAPPED_OPTIMIZERS.add(optimizer)
        self._optimizer_step_pre_hooks = optimizer._optimizer_step_pre_hooks
        self._optimizer_step_post_hooks = optimizer._optimizer_step_post_hooks

    # -- what LR schedulers and user code read -------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    # keyed by the model's parameters ([Note: state by parameter] in memsave/state_view.py); the raw: optimizer.state
    state = ParamStateAttribute()  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(f"{type(self).__name__} cannot be pickled; use memsave.save / state_dict()")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "add_param_group after memsave.wrap is not supported: the engine has laid out its buffers for the "
            "parameters it was given; add the group to the optimizer before wrapping"
        )

    # -- the training-loop API -----------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` plus whatever the engine needs around it (loss scaling, gradient sync)."""
        loss.backward(**kwargs)

    @abc.abstractmethod
    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients in place by their global norm over every rank; returns that norm (before clipping)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None,  # type: ignore[override]
             grad_scaler: Any = None) -> float | None:
        """``grad_scaler``: passed by ``torch.amp.GradScaler.step`` where the optimizer handles the scaling
        ([Note: one skip decision for GradScaler] in memsave/engines/grad_scaler.py)."""
        if closure is not None:
            raise NotImplementedError(
                "step(closure) is not supported by memsave engines: a closure would re-run forward and backward "
                "outside the engine's communication schedule; call backward and step yourself"
            )
        if getattr(self, "closed", False):  # an overlapped step would fail later, in another call, or never
            raise RuntimeError("optimizer.step() after optimizer.close(): what it held (an offload tier and its "
                               "folder, if any) was released; wrap the model and optimizer again to go on training")
        self.step_was_skipped = grad_scaler is not None and not self._scaler_says_step(grad_scaler)
        if not self.step_was_skipped:
            self._step()
        return None

    def _scaler_says_step(self, scaler: Any) -> bool:
        raise NotImplementedError(f"{type(self).__name__} does not take a GradScaler")

    @abc.abstractmethod
    def _step(self) -> None: ...

    @abc.abstractmethod
    def zero_grad(self, set_to_none: bool = True) -> None: ...

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]: ...  # type: ignore[override]

    @abc.abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    def _optimizer_state_tensors(self) -> Iterator[tuple[MemoryCategory, torch.Tensor]]:
        """The wrapped optimizer's state tensors (sharded or not), for ``memory_tensors``."""
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    yield MemoryCategory.OPTIMIZER_STATE, v

