"""Recompute one unit: replace the *instance's* ``forward`` by one that runs the original under
``torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=True)``.

Unlike torch's ``checkpoint_wrapper`` the module is not put inside a container: the object, its class, its
``state_dict`` keys and the hooks registered on it stay exactly as they were.

[Note: hooks stay outside the recomputed region] ``nn.Module.__call__`` runs the module's forward pre-hooks,
then ``self.forward`` (ours: the checkpoint around the *original* forward), then its forward hooks. The
recomputation in backward replays only the original forward, so hooks on the unit itself (ZeRO-3's gather in
a pre-hook, reshard in a post-hook, the pre-backward hooks it puts on the outputs) run once per forward, never
during recomputation. ZeRO-3 gathers the unit again before its backward (a hook on the unit's outputs, which
fires before any of the unit's backward nodes and so before the recomputation), so the recomputation finds
the parameters gathered and adds no collective; the unit is freed when its gradients are reduced, as without
recomputation. Submodules *inside* a unit are called through ``__call__`` during recomputation, so their
hooks do run again: never make a module with communication hooks part of a recomputed unit.

[Note: a replay sees the inputs of the first call] torch's checkpoint saves a unit's positional tensor arguments
(through the saved-tensor hooks) but holds every other argument by reference, and the recomputation calls the
forward again with those objects as they are *then*. A model that threads a state object through its blocks
(``s.h = self.fc(s.h); return s``: a block returning the object it was given, holding its output) has changed them
by backward, so the replay would compute from later values: wrong gradients, or torch's ``CheckpointError``
("Recomputed values for the following tensors have different metadata") where the shapes differ. So before the
first call the containers and plain objects among the arguments that hold tensors are copied (shallowly, tensors
by reference), and every replay gets a fresh copy of that snapshot. The first call gets the caller's own objects,
so what the forward changes in them stays visible to the caller, as without recomputation.

torch also stashes the random state only of the devices of tensors it finds in the positional arguments (lists,
tuples, dicts): a unit whose tensors come as keyword arguments or inside an object would replay its GPU dropout
from another random state. An empty tensor per such device is passed along for it to see.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import inspect
import types
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from memsave._logging import warn_once
from memsave.models.units import attributes, output_tensors
from memsave.recompute.measure import note_held, note_saved
from memsave.recompute.policy import SelectivePolicy

__all__ = ["RecomputedForward", "RecomputedRegion", "is_recomputed", "recompute_unit", "restore_unit", "selective_contexts",
           "split_backward", "split_backward_supported"]


# [Note: selective recomputation under a split backward] A zero-bubble schedule runs a micro-batch's backward
# twice over the same graph: ``I`` (the input gradients, the graph retained) and later ``W`` (the weights).
# Each pass recomputes a recomputed unit; under selective recomputation the recompute reads the ops' outputs
# that forward cached, and torch marks each entry consumed at its first read ("Trying to backward an extra
# time"). Forwards run inside :func:`split_backward` get a storage that keeps its entries: the second recompute
# reads the same cached tensors (freed with the graph after ``W``). torch >= 2.12 indexes the entries per op
# call and marks a read one ``_CONSUMED`` (kept: :class:`_KeptEntries`); torch 2.11 keeps a list per op and pops
# its head (kept: :class:`_KeptListEntries` reads from its first entry at every recompute instead).
_SMALL_BUFFER = 1 << 20  # bytes: [Note: buffers a forward changes]
_SPLIT_BACKWARD: contextvars.ContextVar[bool] = contextvars.ContextVar("memsave_split_backward", default=False)
_LIST_LAYOUT = not hasattr(torch_checkpoint, "_CONSUMED")

# [Note: selective cache seen on every torch] The tracker and the estimator count what selective recomputation
# caches (a unit's saved op outputs) when the policy hands them over (policy.py: ``ctx.op_output``). torch 2.11
# calls the policy before the op runs and has no ``op_output``; there the cache's own lists report each entry as
# it is stored (``storage[func].append(wrapper)``, the value in ``wrapper.val``). Without this the cache was
# invisible on torch 2.11: selective recomputation was measured and estimated as full recomputation, 36% under
# the allocator's peak on an H100.
_POLICY_SEES_OUTPUT = "op_output" in inspect.signature(torch_checkpoint.SelectiveCheckpointContext).parameters


class _KeptEntries(dict):  # type: ignore[type-arg]
    def __setitem__(self, key: Any, value: Any) -> None:
        if value is getattr(torch_checkpoint, "_CONSUMED", None) and key in self:
            return  # kept for the second pass
        super().__setitem__(key, value)


class _ListEntries(list):  # type: ignore[type-arg]
    """One op's cached outputs in torch 2.11's layout: each reported as stored (unless the policy saw it), and
    under a split backward read in order from the first at each recompute rather than popped."""

    keep = False

    def __init__(self) -> None:
        super().__init__()
        self._read = 0

    def append(self, entry: Any) -> None:
        if not _POLICY_SEES_OUTPUT:
            note_saved([getattr(e, "val", e) for e in tree_leaves(entry)])
        super().append(entry)

    def pop(self, index: Any = -1) -> Any:
        if not self.keep:
            return super().pop(index)
        entry = self[self._read]
        self._read += 1
        return entry


class _KeptListEntries(_ListEntries):
    keep = True


class _RecomputingMutatedMode(getattr(torch_checkpoint, "_CachedTorchDispatchMode", object)):  # type: ignore[misc]
    """[Note: cached outputs the forward changed] Selective recomputation caches the outputs of the ops it saves
    (matmuls) and hands them to the recomputation. A model that changes one in place afterwards (Funnel's
    ``positional_attn *= cls_mask`` on an einsum's output) left the cache stale; torch then raised in backward
    ("Tensor cached during selective activation checkpoint has been mutated"). The recomputation replays the
    forward's ops, so such an op is recomputed from its replayed inputs instead (what the policy does for every op
    it does not save): the same value, and its in-place change is replayed after it. torch marks the entry read
    before it checks it (2.12 on) or pops it (2.11), so the cache stays in step either way."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except RuntimeError as exc:
            if "has been mutated" not in str(exc):
                raise
            return func(*args, **(kwargs or {}))


class _RewindingCachedMode(_RecomputingMutatedMode):
    """torch 2.11's recompute mode, reading each op's kept entries from the first at every recompute (a
    recompute may stop early, torch's ``_StopRecomputationError``, so reads cannot run on round and round)."""

    def __enter__(self) -> Any:
        for entries in self.storage.values():
            entries._read = 0
        return super().__enter__()


def split_backward_supported() -> bool:
    """Whether this torch's selective checkpoint can be kept for a second backward (see the Note above)."""
    return hasattr(torch_checkpoint, "_CachedTorchDispatchMode")


def selective_contexts(policy: Any, *, split: bool = False) -> tuple[Any, Any]:
    """torch's ``create_selective_checkpoint_contexts(policy)`` with a cache the memory tracker sees on every torch
    ([Note: selective cache seen on every torch]) and, with ``split``, that a second backward can read ([Note:
    selective recomputation under a split backward])."""
    contexts = create_selective_checkpoint_contexts(policy)
    storage: defaultdict[Any, Any] | None = None
    if _LIST_LAYOUT and (split or not _POLICY_SEES_OUTPUT):
        storage = defaultdict(_KeptListEntries if split else _ListEntries)
        if split:
            contexts[1].__class__ = _RewindingCachedMode
    elif split:
        storage = defaultdict(_KeptEntries)
    if storage is not None:
        for mode in contexts:
            mode.storage = storage
    if type(contexts[1]) is getattr(torch_checkpoint, "_CachedTorchDispatchMode", None):
        contexts[1].__class__ = _RecomputingMutatedMode  # [Note: cached outputs the forward changed]
    return contexts


# [Note: regions released in the weight pass] The weight pass (memsave/pp/split_backward.py) recomputes each unit
# once for all its autograd calls (torch's GraphExecGroup), and torch keeps every tensor of that recomputation until
# it is read. The weight pass reads only what the weights' gradients need (a Linear's input), not what the input
# gradients needed (an activation's input, attention's scores): those stayed until the graph was dropped, 0.64x a
# GPT stage's activations of one micro-batch at the pass's end. So each recomputed call made under a split backward
# is noted with torch's checkpoint frame and the autograd sequence numbers of the nodes its forward created; the
# weight pass drops a frame's recomputed tensors after the last of its calls that runs one of those nodes.
_REGIONS: contextvars.ContextVar[list[RecomputedRegion] | None] = contextvars.ContextVar("memsave_regions",
                                                                                          default=None)


@dataclasses.dataclass
class RecomputedRegion:
    """One recomputed call of a unit: torch's checkpoint frame, and the sequence numbers ``[start, end)`` of the
    autograd nodes its forward created."""

    frame: Any
    start: int
    end: int

    def release(self, group: Any) -> None:
        """Drop what the recomputation under ``group`` (a ``GraphExecGroup``) left unread."""
        self.frame.recomputed.pop(group, None)


def _checkpoint_frame() -> Any:
    """torch's checkpoint frame of the call being made (its saved-tensor hooks close over it), or None."""
    frame_type = getattr(torch_checkpoint, "_CheckpointFrame", None)
    for fn in torch._C._autograd._top_saved_tensors_default_hooks(False) or ():
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                obj = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if frame_type is not None and isinstance(obj, frame_type) and hasattr(obj, "recomputed"):
                return obj
    return None


@contextlib.contextmanager
def split_backward(regions: list[RecomputedRegion] | None = None) -> Iterator[None]:
    """Forwards run inside are backpropagated twice (input gradients, then weight gradients); their recomputed
    calls are appended to ``regions`` ([Note: regions released in the weight pass])."""
    token = _SPLIT_BACKWARD.set(True)
    noted = _REGIONS.set(regions)
    try:
        yield
    finally:
        _REGIONS.reset(noted)
        _SPLIT_BACKWARD.reset(token)


class RecomputedForward:
    """What a recomputed unit's ``forward`` attribute holds; also the handle that restores it.

    ``original`` is the forward the instance had in its own ``__dict__`` before (None: the class's).
    ``selective``: the op-level policy of selective recomputation, or None for full recomputation.
    """

    def __init__(self, module: nn.Module, original: Callable[..., Any] | None,
                 selective: SelectivePolicy | None) -> None:
        self.module, self.original, self.selective = module, original, selective

    def _context_fn(self) -> tuple[Any, Any]:
        if self.selective is None:
            return noop_context_fn()
        return selective_contexts(self.selective, split=_SPLIT_BACKWARD.get())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.original if self.original is not None else types.MethodType(type(self.module).forward,
                                                                                   self.module)
        if not torch.is_grad_enabled():  # eval / no_grad: nothing is saved, so nothing to recompute
            return forward(*args, **kwargs)
        # Keyword arguments and non-tensor positional ones are held by reference until backward (in the closure
        # below: a unit's keyword may not collide with checkpoint's own, debug, context_fn, ...).
        held = [a for a in args if not isinstance(a, torch.Tensor)]
        if held or kwargs:
            note_held(list(output_tensors((held, kwargs))))
        # [Note: a replay sees the inputs of the first call]. The positional tensors are not in the snapshot, nor
        # held by `run` after the first call: checkpoint keeps them through the saved-tensor hooks (offloaded or
        # compressed there) and hands them back to the replay.
        is_tensor = [isinstance(a, torch.Tensor) for a in args]
        frozen = snapshot(([None if t else a for a, t in zip(args, is_tensor, strict=True)], kwargs))
        first_call = [(args, kwargs)]
        regions, frame = _REGIONS.get(), []  # frame: emptied below (the frame holds `run`: no cycle through it)
        note, start = regions is not None, torch._C._autograd._get_sequence_nr()
        before = _buffers_before(self.module)  # [Note: buffers a forward changes]: outside the checkpoint's modes
        replayed: list[tuple[nn.Module, str, torch.Tensor]] = []

        def run(*saved: Any) -> Any:
            if first_call:
                if note:
                    frame.append(_checkpoint_frame())
                call_args, call_kwargs = first_call.pop()
                return forward(*call_args, **call_kwargs)
            old_args, old_kwargs = snapshot(frozen)
            replay = [s if t else a for a, s, t in zip(old_args, saved, is_tensor)]  # saved: + the anchors
            with _buffers_as_before(replayed):
                return forward(*replay, **old_kwargs)

        out = checkpoint(run, *args, *_device_anchors(args, kwargs), use_reentrant=False, preserve_rng_state=True,
                         context_fn=self._context_fn)
        replayed.extend(_replayed_buffers(before))
        if regions is not None:
            found = frame.pop() if frame else None
            if found is not None:
                regions.append(RecomputedRegion(found, start, torch._C._autograd._get_sequence_nr()))
            else:
                warn_once(f"torch {torch.__version__}: the checkpoint frame of a recomputed unit was not found; the "
                          "weight pass of a zero-bubble schedule keeps its recomputed activations until it ends")
        return out


# [Note: buffers a forward changes] A forward updating a buffer (BatchNorm's statistics, spectral_norm, an EMA)
# updated it again in its replay in backward, which computed from the new value (num_batches_tracked 6 after 3
# steps; spectral_norm's weights 6.5e-2 off). So the first call copies the unit's buffers of up to 1 MiB, kept to
# backward; each replay runs on fresh copies (one per tensor: a shared buffer stays shared), the buffers put back
# after. Larger ones (masks, tables) are watched: one the forward changes is said once (its replay sees it).


def _buffers_before(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor, int, torch.Tensor | None]]:
    with torch.no_grad():
        kept = {id(b): b.clone() for b in module.buffers() if b.numel() * b.element_size() <= _SMALL_BUFFER}
    return [(m, name, b, b._version, kept.get(id(b))) for m in module.modules() for name, b in m._buffers.items()
            if b is not None]


def _replayed_buffers(before: list[tuple[nn.Module, str, torch.Tensor, int, torch.Tensor | None]]
                     ) -> list[tuple[nn.Module, str, torch.Tensor]]:
    for m, name, b, version, kept in before:
        if kept is None and (m._buffers.get(name) is not b or b._version != version):
            warn_once(f"[recompute]: buffer {name!r} of {type(m).__name__} (over 1 MiB) changed in a recomputed "
                      "forward; its replay in backward sees the new value ([Note: buffers a forward changes])")
    return [(m, name, kept) for m, name, _, _, kept in before if kept is not None]


@contextlib.contextmanager
def _buffers_as_before(replayed: list[tuple[nn.Module, str, torch.Tensor]]) -> Iterator[None]:
    now = [m._buffers[name] for m, name, _ in replayed]
    with torch.no_grad(), _disable_current_modes() if replayed else contextlib.nullcontext():  # not an op of the
        fresh = {id(kept): kept.clone() for _, _, kept in replayed}  # replay; each replay from the first values
    for m, name, kept in replayed:
        m._buffers[name] = fresh[id(kept)]
    try:
        yield
    finally:
        for (m, name, _), b in zip(replayed, now, strict=True):
            m._buffers[name] = b


# never copied nor looked into by snapshot(): hold no argument tensors of their own
_ATOMS = (nn.Module, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
          str, bytes, int, float, complex, torch.dtype, torch.device)


def snapshot(obj: Any) -> Any:
    """``obj`` with every list, tuple, dict and plain object that holds a tensor (at any depth) replaced by a
    shallow copy; tensors, and whatever holds none, as they are. Shared references stay shared; an object that
    cannot be copied is kept as it is ([Note: a replay sees the inputs of the first call])."""
    return _snapshot(obj, {})


def _snapshot(obj: Any, memo: dict[int, Any]) -> Any:
    if obj is None or isinstance(obj, (torch.Tensor, *_ATOMS)):
        return obj
    if id(obj) in memo:
        return memo[id(obj)]
    memo[id(obj)] = obj  # a cycle leads back to the original
    try:
        memo[id(obj)] = new = _copy(obj, memo)
    except Exception:  # a type that refuses to be copied or rebuilt: as without the snapshot
        return obj
    return new


def _changed(old: list[Any], new: list[Any]) -> bool:
    return any(isinstance(a, torch.Tensor) or a is not b for a, b in zip(old, new, strict=True))


def _copy(obj: Any, memo: dict[int, Any]) -> Any:
    if isinstance(obj, list | tuple):
        items = list(obj)
        new = [_snapshot(x, memo) for x in items]
        if not _changed(items, new):
            return obj
        if type(obj) is list or type(obj) is tuple:
            return type(obj)(new)
        if isinstance(obj, tuple):  # a namedtuple, or a structseq (torch.return_types)
            make = getattr(type(obj), "_make", None)
            return make(new) if make is not None else type(obj)(new)
        seq = copy.copy(obj)  # a list subclass
        seq[:] = new
        return seq
    if isinstance(obj, dict):
        keys = list(obj)
        old, new = [obj[k] for k in keys], [_snapshot(obj[k], memo) for k in keys]
        if not _changed(old, new):
            return obj
        if type(obj) is dict:
            return dict(zip(keys, new, strict=True))
        mapping = copy.copy(obj)  # a dict subclass (an OrderedDict, a ModelOutput)
        for k, a, b in zip(keys, old, new, strict=True):
            if a is not b:
                mapping[k] = b
        return mapping
    attrs = attributes(obj)  # a plain object (a dataclass, a SimpleNamespace, a small class instance)
    old = list(attrs.values())
    new = [_snapshot(x, memo) for x in old]
    if not attrs or not _changed(old, new):
        return obj
    out = copy.copy(obj)
    inside = getattr(out, "__dict__", {})
    for k, x in zip(attrs, new, strict=True):
        if k in inside:
            inside[k] = x
        else:  # a slot
            object.__setattr__(out, k, x)
    return out


def _device_anchors(args: tuple, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """An empty tensor on each accelerator that tensors inside ``args``'s objects or in ``kwargs`` live on, but no
    tensor torch's checkpoint sees does, so it saves and restores that device's random state too ([Note: a replay
    sees the inputs of the first call])."""
    visible = {t.device for t in tree_leaves(args) if isinstance(t, torch.Tensor)}
    hidden = {t.device for t in output_tensors((args, kwargs)) if t.device.type not in ("cpu", "meta")}
    return [torch.empty(0, device=d) for d in sorted(hidden - visible, key=str)]


def is_recomputed(module: nn.Module) -> bool:
    """Whether ``module``'s forward is recomputed (by :func:`recompute_unit` / ``memsave.recompute.apply``)."""
    return isinstance(module.__dict__.get("forward"), RecomputedForward)


def recompute_unit(module: nn.Module, selective: SelectivePolicy | None = None) -> RecomputedForward:
    """Make ``module``'s activations recomputed in backward (fully, or selectively with ``selective``)."""
    if is_recomputed(module):
        raise ValueError(f"{type(module).__name__} is already recomputed; memsave.recompute.remove it first")
    handle = RecomputedForward(module, module.__dict__.get("forward"), selective)
    module.forward = handle  # type: ignore[method-assign]  # the instance attribute; the class is untouched
    return handle


def restore_unit(module: nn.Module) -> bool:
    """Give ``module`` back the forward it had before :func:`recompute_unit`; False if it was not recomputed."""
    handle = module.__dict__.get("forward")
    if not isinstance(handle, RecomputedForward):
        return False
    if handle.original is None:
        del module.forward
    else:
        module.forward = handle.original  # type: ignore[method-assign]
    return True
