"""Tensors that refuse to be read while they hold no real values: a sharded ZeRO-3 parameter, and the full-shape
``.grad`` a ZeRO parameter shows once its gradient was reduced into this rank's shard.

[Note: guarded reads] Without these, two common user habits compute silently with wrong numbers:

- reading a ZeRO-3 parameter outside its unit's forward (``model.transformer.wte.weight @ x`` after the blocks
  ran, or a module owned by no block called outside the model's forward) reads the expanded-zero sentinel of
  [Note: stage-3 storage] in memsave/zero/unit.py;
- ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` or ``p.grad.norm()`` after a ZeRO backward reads
  gradients that live in the optimizer's shards (stages 2-3: the full parameter has none; stage 1: only this
  rank's rows of the full gradient are averaged).

So while a parameter is sharded its class is swapped for :class:`ShardedParameter`, and a reduced gradient is
shown as a :class:`ReducedGrad`. Both pass metadata through (shape, dtype, device, ``requires_grad``, hooks,
storage queries for memory accounting) and raise a ``RuntimeError`` that names the parameter and the fix for
anything that reads values. Swapping ``__class__`` costs nothing on the compute path: an unsharded parameter is
of its own class again, and torch never calls back into Python for it.

A :class:`ReducedGrad` is also how the engine tells fresh gradients from accumulated ones: ``model.zero_grad()``,
a loop setting ``p.grad = None`` and ``zero_grad(set_to_none=False)`` (its ``zero_()`` marks the guard cleared)
all mean "start afresh", while a guard still in place at the next backward means "accumulate onto the reduced
gradient" ([Note: gradient freshness] in memsave/zero/unit.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn
from torch._C import DisableTorchFunctionSubclass

__all__ = ["ReducedGrad", "ShardedParameter", "fresh_start", "is_guard", "mark_sharded", "mark_unsharded", "plain"]

# Property reads and writes that never look at the values (the descriptor's name, for ``Tensor.<name>.__get__``).
_META_PROPERTIES = frozenset({
    "shape", "dtype", "device", "requires_grad", "grad", "_grad", "is_leaf", "grad_fn", "ndim", "layout", "is_cuda",
    "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "names", "_version", "itemsize",
    "nbytes", "output_nr", "_post_accumulate_grad_hooks", "_backward_hooks", "is_mps", "is_xpu", "_base",
    "_is_view", "__dict__", "__class__",
})
_META_SETTERS = frozenset({"data", "grad", "_grad", "requires_grad", "_post_accumulate_grad_hooks",
                           "_backward_hooks", "__class__"})
_META_METHODS = frozenset({
    "size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "is_contiguous",
    "stride", "storage_offset", "data_ptr", "untyped_storage", "requires_grad_", "register_hook",
    "register_post_accumulate_grad_hook", "__hash__", "get_device", "is_shared", "is_pinned", "_is_view",
    "as_subclass", "__setstate__", "_typed_storage", "is_inference", "__len__",
})


def _describe(func: Any) -> tuple[str, str]:
    """``(kind, name)`` of what ``__torch_function__`` was called for: ``get``/``set`` of a property or a call."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        owner = getattr(func, "__self__", None)
        return ("get" if name == "__get__" else "set"), getattr(owner, "__name__", "")
    return "call", name


def _passes(func: Any) -> bool:
    kind, name = _describe(func)
    if kind == "get":
        return name in _META_PROPERTIES
    if kind == "set":
        return name in _META_SETTERS
    return name in _META_METHODS


COMPILE_MESSAGE = (
    "memsave ZeRO-3 under torch.compile: dynamo met a sharded parameter outside its unit's forward. Compile after "
    "memsave.wrap (model.compile(), torch.compile(model) or each block's compile()), and read parameters inside the "
    "forward of the module that owns them (README, 'torch.compile')")


def _under_dynamo() -> bool:
    """Whether dynamo is tracing (it describes a parameter it meets by calling its methods: ``is_conj``, ...)."""
    guards = sys.modules.get("torch._guards")
    return guards is not None and guards.TracingContext.try_get() is not None


def _arguments(args: tuple, kwargs: dict | None) -> Iterator[Any]:
    """The arguments of a call, a list's or tuple's items too: torch's ``_foreach_*`` ops (``clip_grad_norm_(...,
    foreach=True)``, ``get_total_norm``) take their tensors in lists, which a guard looking only at the top level
    let through (a review: the norm of un-averaged rows, a different clip factor per rank, silently)."""
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, list | tuple):
            yield from a
        else:
            yield a


def _run_plain(func: Callable[..., Any], args: tuple, kwargs: dict | None) -> Any:
    with DisableTorchFunctionSubclass():
        return func(*args, **(kwargs or {}))


class ShardedParameter(nn.Parameter):
    """A ZeRO-3 parameter whose unit is sharded: metadata only (see [Note: guarded reads]).

    Set on the instance by :func:`mark_sharded` (``__class__`` swap), never constructed. ``_memsave_guard`` holds
    the owner: a callable ``(what) -> None`` that raises the error (or gathers the unit and returns, where
    gathering is right), and ``_memsave_class`` the class to restore.
    """

    _memsave_guard: Callable[[str], None]
    _memsave_class: type

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if _describe(func) == ("set", "data") and args and isinstance(args[0], ShardedParameter):
            raise RuntimeError(  # [Note: replaced data] in memsave/zero/replaced.py
                "p.data = ... on a ZeRO-3 parameter while its unit is sharded: the unit's next gather would "
                "overwrite it. Gather first (model.unshard(), assign or write in place, model.reshard(): the "
                "edit is written back into the shards)")
        if not _passes(func):
            for a in _arguments(args, kwargs):
                if isinstance(a, ShardedParameter):  # each one: a list may span units
                    if _under_dynamo():
                        raise NotImplementedError(COMPILE_MESSAGE)
                    a._memsave_guard(_describe(func)[1] or str(func))
        return _run_plain(func, args, kwargs)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"ShardedParameter(shape={tuple(self.shape)}, dtype={self.dtype}: sharded by memsave ZeRO-3)"

    def __deepcopy__(self, memo: dict) -> Any:
        self._memsave_guard("copy.deepcopy")
        return super().__deepcopy__(memo)

    def __reduce_ex__(self, proto: Any) -> Any:
        self._memsave_guard("pickle")
        return super().__reduce_ex__(proto)


def mark_sharded(p: nn.Parameter, guard: Callable[[str], None]) -> None:
    """Make ``p`` refuse value reads (``guard(what)`` decides) until :func:`mark_unsharded`. Parameters of a class
    with a ``__torch_function__`` of its own, or that cannot change class, are left as they are."""
    cls = type(p)
    if cls is ShardedParameter:
        cast(ShardedParameter, p)._memsave_guard = guard
        return
    if cls.__torch_function__ is not nn.Parameter.__torch_function__:  # a user subclass that dispatches itself
        return
    try:
        p.__class__ = ShardedParameter
    except TypeError:  # a layout-incompatible subclass (slots): unguarded
        return
    sharded = cast(ShardedParameter, p)
    sharded._memsave_class = cls
    sharded._memsave_guard = guard


def mark_unsharded(p: nn.Parameter) -> None:
    if type(p) is ShardedParameter:
        p.__class__ = p._memsave_class


class ReducedGrad(torch.Tensor):
    """The ``.grad`` of a full ZeRO parameter after its gradient was reduced into the shards: metadata only.

    Attributes: ``_memsave_message`` (the error), ``_memsave_cleared`` (set by ``zero_()``, as
    ``zero_grad(set_to_none=False)`` calls it). At stage 1 it aliases the full gradient's storage (whose rows
    this rank does not own are not averaged); at stages 2-3 it is an expanded zero of the parameter's shape.
    """

    _memsave_message: str
    _memsave_cleared: bool
    _memsave_aliases: bool  # stage 1: the guard is the full gradient's storage (counted by memory reports)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kind, name = _describe(func)
        guards = [a for a in _arguments(args, kwargs) if isinstance(a, ReducedGrad)]
        guard = guards[0] if guards else None
        if guard is not None and kind == "call" and name in ("zero_", "detach_"):
            if name == "zero_":
                guard._memsave_cleared = True
            return guard
        if guard is not None and name == "_foreach_zero_":  # zero_grad(set_to_none=False) with foreach
            for g in guards:
                g._memsave_cleared = True
            rest = [t for t in args[0] if not isinstance(t, ReducedGrad)]
            return _run_plain(func, (rest,), None) if rest else None
        if guard is not None and not _passes(func):
            raise RuntimeError(f"{guard._memsave_message} (it was read by {name or func})")
        return _run_plain(func, args, kwargs)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"ReducedGrad(shape={tuple(self.shape)}: {self._memsave_message})"


def make_reduced_grad(like: torch.Tensor, message: str, storage: torch.Tensor | None = None,
                      cls: type[ReducedGrad] = ReducedGrad) -> ReducedGrad:
    """A guard of ``like``'s shape; ``storage`` (stage 1: the full gradient) is aliased, else an expanded zero."""
    with DisableTorchFunctionSubclass():
        base = storage if storage is not None else torch.zeros((), dtype=like.dtype, device=like.device).expand(
            like.shape)
        guard = base.as_subclass(cls)
    guard._memsave_message = message
    guard._memsave_cleared = False
    guard._memsave_aliases = storage is not None
    return guard


def is_guard(t: torch.Tensor | None) -> bool:
    return isinstance(t, ReducedGrad)


def fresh_start(grad: torch.Tensor | None, cleared: Callable[[nn.Parameter], bool] | None, p: nn.Parameter,
                otherwise: bool) -> bool:
    """Whether ``p``'s next gradient starts afresh: ``.grad`` cleared (None, or a guard zeroed in place), or the
    optimizer's tensor for it cleared; else ``otherwise`` ([Note: gradients cleared through the optimizer] in
    memsave/engines/freshness.py)."""
    if grad is None or (is_guard(grad) and grad._memsave_cleared):  # type: ignore[attr-defined]
        return True
    return (cleared is not None and cleared(p)) or otherwise


def plain(t: torch.Tensor) -> torch.Tensor:
    """The same tensor as a plain ``torch.Tensor`` (an alias; for engine code that must read a guarded value)."""
    if type(t) is torch.Tensor:
        return t
    with DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor)


def check_grads_at_step(engine: Any) -> None:
    """[Note: gradients a step would ignore] The optimizer steps the shards, whose gradients only the engine's
    reduction at the end of a synced backward fills. Two loops left them empty and stepped nothing, with no
    error (a review: 0 of 22 parameters moved):

    - the step's last backward ran inside ``model.no_sync()``: its gradients were accumulated locally, never
      reduced (DDP would step each rank's own, FSDP2 nothing);
    - ``grads = torch.autograd.grad(loss, params)`` and then ``p.grad = g`` by hand (stages 1-2; at stage 3 the
      assignment itself is refused while the unit is sharded).

    Both raise here, before the optimizer runs, on every rank alike (the engine's state is the same on all).

    [Note: a gradient cleared before the step] ``p.grad = None``, ``p.grad.zero_()`` or a submodule's
    ``zero_grad()`` between the backward and the step: torch's optimizer skips the parameter, or steps it with a
    zero gradient. Here they cleared only the guard, and the shard's reduced rows were stepped all the same (a
    review: a weight plain torch leaves alone moved by 0.16). So its rows are dropped, or zeroed, first."""
    where = f"memsave ZeRO stage {engine.stage}: optimizer.step()"
    for unit in engine.units:  # [Note: a gradient cleared before the step]
        for i in unit.trainable:
            grad = unit.params[i].grad
            if grad is None:
                engine.drop_grad(unit.shards[i])
            elif is_guard(grad) and grad._memsave_cleared and (rows := unit.shard_grad(i)) is not None:
                rows.zero_()
    if engine.unsynced:
        raise RuntimeError(
            f"{where} after a backward inside model.no_sync(): its gradients were accumulated on this rank only, "
            "never reduced into the shards the optimizer steps, so nothing would change. Run each step's last "
            "backward outside no_sync() (with accelerate: step where accelerator.sync_gradients is True), or "
            "clear them with optimizer.zero_grad()")
    if engine.stage == 3:
        return
    for unit in engine.units:
        for i in unit.trainable:
            grad = unit.params[i].grad
            if grad is not None and not is_guard(grad):
                raise RuntimeError(
                    f"{where}: the .grad of {unit.names[i]!r} was set by hand (e.g. from torch.autograd.grad); "
                    "the optimizer steps this rank's shard, whose gradient only a backward through the model fills "
                    "(reduced over the ranks), so it would be ignored. Backpropagate with loss.backward() (or "
                    "torch.autograd.backward(loss, inputs=params) for some parameters only)")
