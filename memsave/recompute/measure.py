"""How many activation bytes autograd keeps for backward, per unit: what recomputation trades away.

One forward runs under ``torch.autograd.graph.saved_tensors_hooks``; every tensor autograd saves is
attributed to the unit whose forward was running (innermost, via forward pre/post hooks on the units) or to
"outside". Bytes are counted per distinct *storage* (a view of a saved storage adds nothing; views of the
same storage saved by two ops count once), and storages of parameters and buffers never count: they are
held anyway, not because of backward.

[Note: what a checkpointed unit keeps] Inside a recomputed unit the checkpoint's own saved-tensor hooks
replace the outer ones, so the outer hooks see only what the checkpoint keeps: its positional tensor inputs
(``torch.utils.checkpoint`` saves them through the hooks). Two more things are kept by reference and are
reported to the active measurement explicitly: the keyword tensors the unit was called with (held in the
recompute closure; see recompute/checkpoint.py), and under selective recomputation the outputs of the ops
it saves (held in the checkpoint's cache; see recompute/policy.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from memsave.memory.saved import note_kept

__all__ = ["ELEMENT_COST", "SavedBytes", "UnitCost", "measure_saved_bytes", "note_held", "note_saved"]

# [Note: the compute model of recomputation] What recomputing costs is estimated from one forward, op by op,
# in "FLOP-equivalents": an op with a FLOP formula in torch.utils.flop_counter (mm, addmm, bmm, baddbmm, the
# fused attention kernels; CPU flash attention is counted with the CUDA flash formula) costs its FLOPs; any other
# op that writes a new tensor (norms, activations, softmax, residual adds, dropout, copies) is memory-bound and
# costs ELEMENT_COST per element it writes; views cost nothing. Full recomputation of a unit costs the unit's
# whole forward; selective recomputation costs only the ops it does not save. ELEMENT_COST is about the machine
# balance of a memory-bound fp32 op (8 bytes read and written per element at tens of FLOPs per byte of
# bandwidth): with it a transformer block's elementwise ops come to roughly 5-15% of its forward, as measured on
# CPU and GPU, instead of the ~0.5% that pure FLOP counting gives them.
ELEMENT_COST = 64.0


@dataclass(frozen=True)
class UnitCost:
    """The estimated forward compute of one unit (see [Note: the compute model of recomputation]).

    flops: FLOPs of the ops with a FLOP formula (matmuls, attention).
    elements: elements written by the other ops (views excluded).
    forward: flops + ELEMENT_COST * elements: what full recomputation adds.
    selective: the part of ``forward`` from ops that selective recomputation does not save: what it adds.
    """

    flops: float
    elements: float
    forward: float
    selective: float


@dataclass(frozen=True)
class SavedBytes:
    """Activation bytes kept for backward after one forward (distinct storages, parameters excluded).

    units: per unit, the bytes saved while that unit's forward ran (with recomputation: what the unit keeps).
    inputs: per unit, the bytes of its tensor inputs: what the unit would keep if fully recomputed.
    outside: bytes saved outside every unit (embeddings, final norm, head, loss).
    total: bytes of every distinct storage saved, counted once even if several units saved it.
    """

    units: tuple[int, ...]
    inputs: tuple[int, ...]
    outside: int
    total: int
    costs: tuple[UnitCost, ...] = ()  # per unit, with ``measure_saved_bytes(..., costs=True)``; else empty
    # storage -> bytes, to estimate other recompute choices (see estimate)
    _unit_keys: tuple[dict[Hashable, int], ...] = field(default=(), repr=False, compare=False)
    _input_keys: tuple[dict[Hashable, int], ...] = field(default=(), repr=False, compare=False)
    # per unit, its positional tensor inputs (the hidden states a block is called with)
    _positional_keys: tuple[dict[Hashable, int], ...] = field(default=(), repr=False, compare=False)
    _outside_keys: dict[Hashable, int] | None = field(default=None, repr=False, compare=False)
    # per unit, what it keeps under selective recomputation besides its inputs (set by with_selective)
    _selective_keys: tuple[dict[Hashable, int], ...] = field(default=(), repr=False, compare=False)
    # the units in the order their forwards started, and per outside storage how many had started when it was
    # first saved (memsave.estimate under pp: which stage runs the code between two units)
    _calls: tuple[int, ...] = field(default=(), repr=False, compare=False)
    _outside_at: dict[Hashable, int] | None = field(default=None, repr=False, compare=False)

    def estimate(self, recomputed: set[int] | frozenset[int], selective: set[int] | frozenset[int] = frozenset()) -> int:
        """Total saved bytes if the units at ``recomputed`` indices were fully recomputed, those at ``selective``
        selectively (needs :meth:`with_selective`) and the others not (this measurement having been taken with
        none of them recomputed). Storages shared between units count once."""
        if selective and not self._selective_keys:
            raise ValueError("SavedBytes.estimate(selective=...) needs a measurement made with_selective()")
        keys: dict[Hashable, int] = dict(self._outside_keys or {})
        for i in range(len(self.units)):
            if i in recomputed:
                keys.update(self._input_keys[i])
            elif i in selective:
                keys.update(self._input_keys[i])
                keys.update(self._selective_keys[i])
            else:
                keys.update(self._unit_keys[i])
        return sum(keys.values())

    def with_selective(self, measured: SavedBytes) -> SavedBytes:
        """This measurement (nothing recomputed) combined with ``measured``, one taken with every unit selectively
        recomputed: per unit, what it keeps beyond its inputs (the outputs of the ops it saves). The storages of
        another forward cannot be matched to these, so they get keys of their own and never dedupe."""
        sel = tuple({cast(Hashable, ("selective", i, k)): v for k, v in measured._unit_keys[i].items() if k not in measured._input_keys[i]}
                    for i in range(len(measured.units)))
        return dataclasses.replace(self, _selective_keys=sel)

    def selective_units(self) -> tuple[int, ...]:
        """Per unit, the bytes it keeps under selective recomputation (its inputs and the saved op outputs)."""
        return tuple(sum({**self._input_keys[i], **self._selective_keys[i]}.values()) for i in range(len(self.units)))


class _Recorder:
    def __init__(self, num_units: int, exclude: set[int]) -> None:
        self.exclude = exclude  # StorageImpl addresses of parameters and buffers
        self.stack: list[int] = []
        self.units: list[dict[Hashable, int]] = [{} for _ in range(num_units)]
        self.inputs: list[dict[Hashable, int]] = [{} for _ in range(num_units)]
        self.positional: list[dict[Hashable, int]] = [{} for _ in range(num_units)]
        self.outside: dict[Hashable, int] = {}
        self.calls: list[int] = []
        self.outside_at: dict[Hashable, int] = {}
        self.keep: list[torch.Tensor] = []  # saved tensors stay alive while we count: no address is reused
        self.flops = [0.0] * num_units
        self.elements = [0.0] * num_units
        self.selective = [0.0] * num_units

    def _tensors(self, obj: Any) -> Iterator[tuple[int, int]]:
        for t in tree_leaves(obj):
            if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
                # keyed by the StorageImpl, not its data pointer: meta tensors (memsave.estimate measures a model
                # on the meta device) all have data pointer 0, and their views share the StorageImpl all the same
                storage = t.untyped_storage()
                key, nbytes = storage._cdata, storage.nbytes()
                if nbytes and key not in self.exclude:
                    self.keep.append(t)
                    yield key, nbytes

    def saved(self, obj: Any) -> None:
        target = self.units[self.stack[-1]] if self.stack else self.outside
        for key, nbytes in self._tensors(obj):
            target[key] = nbytes
            if not self.stack:
                self.outside_at.setdefault(key, len(self.calls))

    def unit_inputs(self, i: int, args: tuple, kwargs: dict) -> None:
        self.inputs[i].update(self._tensors((args, kwargs)))
        self.positional[i].update(self._tensors(args))

    def result(self, costs: bool) -> SavedBytes:
        every: dict[Hashable, int] = dict(self.outside)
        for d in self.units:
            every.update(d)
        return SavedBytes(
            units=tuple(sum(d.values()) for d in self.units),
            inputs=tuple(sum(d.values()) for d in self.inputs),
            outside=sum(self.outside.values()),
            total=sum(every.values()),
            costs=tuple(UnitCost(flops=f, elements=e, forward=f + ELEMENT_COST * e, selective=s)
                        for f, e, s in zip(self.flops, self.elements, self.selective)) if costs else (),
            _unit_keys=tuple(self.units),
            _input_keys=tuple(self.inputs),
            _positional_keys=tuple(self.positional),
            _outside_keys=self.outside,
            _calls=tuple(self.calls),
            _outside_at=self.outside_at,
        )


_FLOPS = dict(flop_registry)
_cpu_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
if _cpu_flash is not None and torch.ops.aten._scaled_dot_product_flash_attention in _FLOPS:
    _FLOPS[_cpu_flash] = _FLOPS[torch.ops.aten._scaled_dot_product_flash_attention]


class _CostCounter(TorchDispatchMode):
    """Adds each op's cost to the innermost running unit ([Note: the compute model of recomputation])."""

    def __init__(self, rec: _Recorder, saves: Callable[[Any, tuple, dict], bool] | None) -> None:
        super().__init__()
        self.rec, self.saves = rec, saves

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.rec.stack or not isinstance(func, torch._ops.OpOverload):
            return out
        i = self.rec.stack[-1]
        formula = _FLOPS.get(func._overloadpacket)
        cost = 0.0
        if formula is not None:
            try:
                flops = float(formula(*args, **kwargs, out_val=out))
            except Exception:  # a formula that does not know these arguments: count it as memory-bound
                formula = None
            else:
                self.rec.flops[i] += flops
                cost = flops
        if formula is None and not func.is_view:
            elements = float(sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)))
            self.rec.elements[i] += elements
            cost = ELEMENT_COST * elements
        if self.saves is None or not self.saves(func, args, kwargs):
            self.rec.selective[i] += cost
        return out


_ACTIVE: list[_Recorder] = []  # the measurement in progress (at most one per thread of forward)


def note_saved(obj: Any) -> None:
    """Tensors in ``obj`` are kept for backward by other means than saved-tensor hooks (selective
    recomputation's cache): count them in the active measurement, if any."""
    if _ACTIVE:
        _ACTIVE[-1].saved(obj)
    note_kept(obj)  # and in a memory tracker's live count, if one is tracking this forward


note_held = note_saved  # keyword inputs a checkpoint keeps by reference ([Note: what a checkpointed unit keeps])


def measure_saved_bytes(run: Callable[[], Any], units: Sequence[nn.Module], *,
                        model: nn.Module | None = None, costs: bool = False,
                        saves: Callable[[Any, tuple, dict], bool] | None = None) -> SavedBytes:
    """Run ``run()`` (one forward, e.g. ``lambda: model(**batch)``) and count the bytes it leaves saved for
    backward, per unit of ``units``. Parameters and buffers of ``model`` (or of the units, without a model)
    do not count. The RNG state is restored afterwards, so dropout in the measured forward does not shift the
    random numbers of training; the graph it builds is dropped.

    ``costs=True`` also estimates each unit's forward compute (:class:`UnitCost`); ``saves(func, args, kwargs)``
    says which ops selective recomputation would save (their cost is not in ``UnitCost.selective``)."""
    holders = [model] if model is not None else list(units)
    exclude = {t.untyped_storage()._cdata for m in holders for t in [*m.parameters(), *m.buffers()]}
    rec = _Recorder(len(units), exclude)
    index = {id(u): i for i, u in enumerate(units)}
    if len(index) != len(units):
        raise ValueError("units= lists a module twice")

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
        i = index[id(module)]
        rec.stack.append(i)
        rec.calls.append(i)
        rec.unit_inputs(i, args, kwargs)

    def post(module: nn.Module, args: tuple, output: Any) -> None:
        rec.stack.pop()

    def pack(t: torch.Tensor) -> torch.Tensor:
        rec.saved(t)
        # Not ``t`` itself: a saved *output* of an op returned as is makes a cycle through autograd's C++ graph
        # (tensor -> grad_fn -> saved tensor -> tensor) that Python's collector cannot see, and every
        # measurement leaked a whole forward's activations. The graph is never run backward; values suffice.
        return t.detach()

    handles = [h for u in units for h in (u.register_forward_pre_hook(pre, with_kwargs=True),
                                          u.register_forward_hook(post, always_call=True))]
    _ACTIVE.append(rec)
    try:
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, _unpack))
            if costs:
                stack.enter_context(_CostCounter(rec, saves))
            out = run()
        result = rec.result(costs)
        del out
    finally:
        _ACTIVE.pop()
        for h in handles:
            h.remove()
        # the saved tensors were kept only while counting; a dispatch mode object may outlive this call (torch
        # keeps a reference to the last mode it ran), so do not let it hold a whole forward's activations
        rec.keep.clear()
    return result


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
