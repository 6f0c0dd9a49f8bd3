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

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

__all__ = ["SavedBytes", "measure_saved_bytes", "note_held", "note_saved"]


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
    # storage -> bytes, to estimate other recompute choices (see estimate)
    _unit_keys: tuple[dict[int, int], ...] = field(default=(), repr=False, compare=False)
    _input_keys: tuple[dict[int, int], ...] = field(default=(), repr=False, compare=False)
    _outside_keys: dict[int, int] | None = field(default=None, repr=False, compare=False)

    def estimate(self, recomputed: set[int] | frozenset[int]) -> int:
        """Total saved bytes if the units at ``recomputed`` indices were fully recomputed and the others not
        (this measurement having been taken with none of them recomputed)."""
        keys: dict[int, int] = dict(self._outside_keys or {})
        for i in range(len(self.units)):
            keys.update(self._input_keys[i] if i in recomputed else self._unit_keys[i])
        return sum(keys.values())


class _Recorder:
    def __init__(self, num_units: int, exclude: set[int]) -> None:
        self.exclude = exclude  # storage data_ptrs of parameters and buffers
        self.stack: list[int] = []
        self.units: list[dict[int, int]] = [{} for _ in range(num_units)]
        self.inputs: list[dict[int, int]] = [{} for _ in range(num_units)]
        self.outside: dict[int, int] = {}
        self.keep: list[torch.Tensor] = []  # saved tensors stay alive while we count: no address is reused

    def _tensors(self, obj: Any) -> Iterator[tuple[int, int]]:
        for t in tree_leaves(obj):
            if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and t.device.type != "meta":
                storage = t.untyped_storage()
                ptr, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and ptr not in self.exclude:
                    self.keep.append(t)
                    yield ptr, nbytes

    def saved(self, obj: Any) -> None:
        target = self.units[self.stack[-1]] if self.stack else self.outside
        target.update(self._tensors(obj))

    def unit_inputs(self, i: int, args: tuple, kwargs: dict) -> None:
        self.inputs[i].update(self._tensors((args, kwargs)))

    def result(self) -> SavedBytes:
        every: dict[int, int] = dict(self.outside)
        for d in self.units:
            every.update(d)
        return SavedBytes(
            units=tuple(sum(d.values()) for d in self.units),
            inputs=tuple(sum(d.values()) for d in self.inputs),
            outside=sum(self.outside.values()),
            total=sum(every.values()),
            _unit_keys=tuple(self.units),
            _input_keys=tuple(self.inputs),
            _outside_keys=self.outside,
        )


_ACTIVE: list[_Recorder] = []  # the measurement in progress (at most one per thread of forward)


def note_saved(obj: Any) -> None:
    """Tensors in ``obj`` are kept for backward by other means than saved-tensor hooks (selective
    recomputation's cache): count them in the active measurement, if any."""
    if _ACTIVE:
        _ACTIVE[-1].saved(obj)


note_held = note_saved  # keyword inputs a checkpoint keeps by reference ([Note: what a checkpointed unit keeps])


def measure_saved_bytes(run: Callable[[], Any], units: Sequence[nn.Module], *,
                        model: nn.Module | None = None) -> SavedBytes:
    """Run ``run()`` (one forward, e.g. ``lambda: model(**batch)``) and count the bytes it leaves saved for
    backward, per unit of ``units``. Parameters and buffers of ``model`` (or of the units, without a model)
    do not count. The RNG state is restored afterwards, so dropout in the measured forward does not shift the
    random numbers of training; the graph it builds is dropped."""
    holders = [model] if model is not None else list(units)
    exclude = {t.untyped_storage().data_ptr() for m in holders for t in [*m.parameters(), *m.buffers()]}
    rec = _Recorder(len(units), exclude)
    index = {id(u): i for i, u in enumerate(units)}
    if len(index) != len(units):
        raise ValueError("units= lists a module twice")

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
        i = index[id(module)]
        rec.stack.append(i)
        rec.unit_inputs(i, args, kwargs)

    def post(module: nn.Module, args: tuple, output: Any) -> None:
        rec.stack.pop()

    def pack(t: torch.Tensor) -> torch.Tensor:
        rec.saved(t)
        return t

    handles = [h for u in units for h in (u.register_forward_pre_hook(pre, with_kwargs=True),
                                          u.register_forward_hook(post, always_call=True))]
    _ACTIVE.append(rec)
    try:
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            out = run()
        result = rec.result()
        del out
    finally:
        _ACTIVE.pop()
        for h in handles:
            h.remove()
    return result


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
