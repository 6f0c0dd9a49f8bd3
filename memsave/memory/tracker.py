"""The memory tracker: bytes held per category, sampled at every phase and unit boundary of training, per rank.

``MemoryTracker(model, optimizer)`` hooks a (wrapped or plain) model and its optimizer and takes a *sample*
at each boundary where memory changes direction: the model's forward start and end, each unit's forward start
(after a ZeRO-3 gather) and end (before the reshard), each unit's backward start (after the gather) and end (all
its gradients accumulated, the reduce-scatter launched), the end of backward, and either side of the optimizer
step and of ``zero_grad``. A sample is the storage-deduplicated account of what every holder reports through
:class:`~memsave.memory.accounting.HoldsMemory` (parameters sharded and gathered, gradients, masters, optimizer
state, buffers, communication staging, offloaded tiers), plus the activations kept for backward, counted live
by :class:`~memsave.memory.saved.SavedTensorCounter`, plus the process RSS (and on GPU the allocator's
allocated and reserved bytes, whose difference is the fragmentation). The tracker keeps, per category, the
current and peak bytes, the sample with the highest in-memory total (its step, phase and unit), the peak per
phase, and, unless ``timeline=False``, every sample in order.

Off, it costs nothing: no hook exists until a tracker is made, and :meth:`close` removes every hook. On, the
cost is one account per sample (a few dozen per step; measured by ``memsave bench --track``).

Components are never imported: the tracker reads ``memory_tensors()`` and, where present, ``offloaded_bytes()``
(``{"host": n, "disk": n}``), and finds the units through the model's engine (``model.memsave_engine.units``)
or, on a plain model, :func:`memsave.models.units.default_units`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memsave.memory.accounting import HoldsMemory, account, rss_bytes
from memsave.memory.saved import SavedTensorCounter
from memsave.models.units import default_units, output_tensors
from memsave.phases import MemoryCategory, Phase

__all__ = ["MemoryTracker", "Sample"]

_OFF_DEVICE = (MemoryCategory.OFFLOAD_HOST.value, MemoryCategory.OFFLOAD_DISK.value)

Sample = dict[str, Any]  # one timeline entry of the memsave.report/2 schema


def accounting_holders(model: nn.Module, holders: tuple[object, ...]) -> list[object]:
    """What to account for ``model`` and ``holders``. A memsave engine reports the model's parameters, gradients and
    buffers by their roles (a plain module's view of a ZeRO-3 parameter would call gathered memory "params"), so it
    stands for the model; the optimizer memsave returns reports its engine's tensors first, so then the engine is
    not asked twice. (``memsave.report`` without a tracker counted the model too: one element per parameter more.)"""
    engine = getattr(model, "memsave_engine", None)
    if isinstance(engine, HoldsMemory):
        reported = any(getattr(h, "engine", None) is engine for h in holders)
        return [*holders] if reported else [engine, *holders]
    return [*holders, model]


class MemoryTracker:
    """Samples the memory of ``model`` and ``holders`` (its optimizer, ...) at every phase and unit boundary; see
    the module doc. ``timeline=False`` keeps the peaks only; ``units`` overrides the units it labels samples by
    (default: the engine's, or the blocks of the model's largest ``nn.ModuleList``)."""

    def __init__(self, model: nn.Module, *holders: object, timeline: bool = True,
                 units: list[nn.Module] | None = None) -> None:
        self.model = model
        self.holders = accounting_holders(model, holders)
        self._optimizers = [h for h in holders if isinstance(h, torch.optim.Optimizer)]
        self.record_timeline = timeline
        self.counter = SavedTensorCounter()
        self.phase, self.step, self.unit = Phase.IDLE, 0, None  # type: tuple[Phase, int, str | None]
        self.current: dict[str, int] = {}
        self.category_peak: dict[str, int] = {}
        self.peak: dict[str, Any] = {"total": 0, "step": 0, "phase": Phase.IDLE.value, "unit": None, "bytes": {}}
        self.phase_peaks: dict[str, dict[str, Any]] = {}
        self.timeline: list[Sample] = []
        self.peak_rss = 0
        self.device_peak = self.device_peak_reserved = 0
        self.num_samples = 0
        self.sample_seconds = 0.0  # time spent sampling: the tracker's own overhead
        self._t0 = time.perf_counter()
        self._hooks: list[Any] = []
        self._patched: list[tuple[object, str]] = []
        self._forward_stack: list[contextlib.ExitStack] = []
        self._backward_queued = False
        self._pending: list[dict[str, int]] = []
        self._units = self._find_units(units)
        self._install()
        model.memsave_tracker = self  # type: ignore[assignment]  # memsave.report finds it here
        self.sample("attach")

    # -- units and hooks -----------------------------------------------------------------------------------
    def _find_units(self, units: list[nn.Module] | None) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
        names = {id(m): n for n, m in self.model.named_modules()}
        engine = getattr(self.model, "memsave_engine", None)
        if units is None and engine is not None and hasattr(engine, "units"):
            return [(u.name, u.module, list(u.params)) for u in engine.units if not u.is_root]
        modules = units if units is not None else default_units(self.model)
        found = []
        for m in modules:
            params = [p for p in m.parameters() if p.requires_grad]
            found.append((names.get(id(m), type(m).__name__), m, params))
        return found

    def _install(self) -> None:
        m = self.model
        # Root: after the engines' own pre-hooks (prepended), so the counter sits on top of memsave's compression /
        # activation offload hooks and chains to them; its post-hook runs first, before those are popped.
        self._hooks.append(m.register_forward_pre_hook(self._root_pre_forward))
        self._hooks.append(m.register_forward_hook(self._root_post_forward, prepend=True, always_call=True))
        for name, module, params in self._units:
            self._hooks.append(module.register_forward_pre_hook(self._unit_hook("pre_forward", name)))
            # prepended: sampled before a ZeRO-3 reshard frees the gathered parameters
            self._hooks.append(module.register_forward_hook(self._unit_post_forward(name), prepend=True))
            # appended: its tensor hooks are registered after the engine's, so they run after its backward gather
            self._hooks.append(module.register_forward_hook(self._unit_backward_hooks(name)))
            pending = {"left": len(params), "all": len(params)}
            self._pending.append(pending)
            for p in params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(name, pending)))
        for opt in self._optimizers:
            self._patch(opt, "step", self._wrap_step)
            self._patch(opt, "zero_grad", self._wrap_zero_grad)

    def _patch(self, obj: object, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        original = getattr(obj, name)
        setattr(obj, name, make(original))
        self._patched.append((obj, name))

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        self.phase, self.unit = Phase.FORWARD, None
        if torch.is_grad_enabled():
            self._forward_stack.append(self.counter.enter())
        self.sample("forward_start")

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        # the forward's outputs (logits, loss) are activations too while the caller holds them, as torch's
        # MemTracker counts them, though backward may keep something else (cross-entropy keeps a log-softmax)
        self.counter.add(list(output_tensors(output)))
        self.unit = None
        self.sample("forward_end")
        if self._forward_stack:
            self._forward_stack.pop().close()
        # what runs next (the loss, then backward) holds these activations until backward frees them
        self.phase = Phase.BACKWARD if torch.is_grad_enabled() else Phase.IDLE
        self._backward_queued = False

    def _unit_hook(self, event: str, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.unit = name
            self.sample(event)
        return hook

    def _unit_post_forward(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.unit = name
            self.sample("post_forward")
        return hook

    def _unit_backward_hooks(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled():
                return
            fired = [False]

            def pre_backward(grad: torch.Tensor) -> None:
                if not fired[0]:  # once per unit per backward, whichever output's gradient comes first
                    fired[0] = True
                    self._queue_backward_end()
                    self.phase, self.unit = Phase.BACKWARD, name
                    self.sample("pre_backward")

            for t in output_tensors(output):
                if t.requires_grad:
                    t.register_hook(pre_backward)
        return hook

    def _queue_backward_end(self) -> None:
        """One sample when the whole backward is done (after the engines' own end-of-backward callbacks, which
        were queued earlier in the same backward)."""
        if not self._backward_queued:
            self._backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)

    def _backward_end(self) -> None:
        self._backward_queued = False
        for pending in self._pending:  # a unit some parameters of which got no gradient starts afresh
            pending["left"] = pending["all"]
        self.unit = None
        self.sample("backward_end")

    def _grad_hook(self, name: str, pending: dict[str, int]) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            pending["left"] -= 1
            if pending["left"] <= 0:
                pending["left"] = pending["all"]
                self._queue_backward_end()
                self.phase, self.unit = Phase.BACKWARD, name
                self.sample("post_backward")
        return hook

    def _wrap_step(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.phase, self.unit = Phase.OPTIMIZER, None
            self.sample("step_start")
            out = step(*args, **kwargs)
            self.sample("step_end")
            self.phase = Phase.IDLE
            self.step += 1
            return out
        return wrapped

    def _wrap_zero_grad(self, zero_grad: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = zero_grad(*args, **kwargs)
            self.phase, self.unit = Phase.IDLE, None
            self.sample("zero_grad")
            return out
        return wrapped

    # -- sampling ------------------------------------------------------------------------------------------
    def account(self) -> dict[str, int]:
        """Bytes per category now: every holder's storages once (first category wins), then the activations."""
        acct = account(self.holders, by_device=False)
        out = acct.bytes
        activations = self.counter.live(skip=acct.storages)
        if activations:
            out[MemoryCategory.ACTIVATIONS.value] = activations
        return out

    def sample(self, event: str) -> Sample:
        """Take one sample now (also callable by hand, e.g. around a custom phase)."""
        t0 = time.perf_counter()
        nbytes = self.account()
        rss = rss_bytes()
        allocated = 0
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            allocated = torch.cuda.memory_allocated()
            self.device_peak = max(self.device_peak, torch.cuda.max_memory_allocated())
            self.device_peak_reserved = max(self.device_peak_reserved, torch.cuda.max_memory_reserved())
        total = sum(v for k, v in nbytes.items() if k not in _OFF_DEVICE)
        self.current = nbytes
        for k, v in nbytes.items():
            if v > self.category_peak.get(k, 0):
                self.category_peak[k] = v
        if total > self.peak["total"]:
            self.peak = {"total": total, "step": self.step, "phase": self.phase.value, "unit": self.unit,
                         "bytes": dict(nbytes)}
        ph = self.phase_peaks.get(self.phase.value)
        if ph is None or total > ph["peak_total"]:
            self.phase_peaks[self.phase.value] = {"peak_total": total, "bytes": dict(nbytes)}
        self.peak_rss = max(self.peak_rss, rss)
        entry: Sample = {"t": round(t0 - self._t0, 6), "step": self.step, "phase": self.phase.value,
                         "unit": self.unit, "event": event, "bytes": nbytes, "rss": rss, "device_allocated": allocated}
        if self.record_timeline:
            self.timeline.append(entry)
        self.num_samples += 1
        self.sample_seconds += time.perf_counter() - t0
        return entry

    def reset_peaks(self) -> None:
        """Forget peaks and the timeline (e.g. after warm-up steps); current values stay."""
        self.category_peak, self.phase_peaks, self.timeline = dict(self.current), {}, []
        self.peak = {"total": 0, "step": self.step, "phase": self.phase.value, "unit": None, "bytes": {}}
        self.peak_rss = self.device_peak = self.device_peak_reserved = 0
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()

    def close(self) -> None:
        """Remove every hook and restore the optimizer's methods; the figures stay readable."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for obj, name in reversed(self._patched):
            with contextlib.suppress(AttributeError):
                delattr(obj, name)  # the instance attribute shadowed the class's method
        self._patched.clear()
        while self._forward_stack:
            self._forward_stack.pop().close()
        if getattr(self.model, "memsave_tracker", None) is self:
            del self.model.memsave_tracker

    def __enter__(self) -> MemoryTracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

