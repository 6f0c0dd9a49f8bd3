"""``MemsaveOptimizer``: the one optimizer ``memsave.wrap`` returns, over any :class:`~memsave.engines.Engine`.

It composes, in this order each step: the engine's gradient sync (driven by ``backward``), precision (fp32
masters and the loss scaler, :class:`~memsave.precision.MixedPrecisionOptimizer`), clipping by the global norm,
the non-finite check, offload of the optimizer state (ZeRO), and the user's own optimizer's step. It steps what
the engine says (:meth:`Engine.stepped`: the parameters, or this rank's rows of them); groups a norm or a
decision is reduced over follow the placements the engine reports (DP, ZeRO 1-3, TP, PP alike). The user's
instance is kept (class, hyperparameters, param groups, LR schedulers); only its tensors are replaced.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from memsave import dist as mdist
from memsave.config import OffloadConfig
from memsave.engines import part_grad
from memsave.engines import state as _state
from memsave.engines.grad_scaler import GradScalerSteps
from memsave.engines.protocol import Engine
from memsave.offload import OffloadedState
from memsave.optim import Adafactor
from memsave.optim.adafactor_shard import layout_of
from memsave.phases import MemoryCategory
from memsave.precision import LossScaler, MixedPrecisionOptimizer
from memsave.precision.edits import holder
from memsave.precision.nonfinite import NonfiniteGuard
from memsave.precision.optimizer import follow
from memsave.tp import tp_param
from memsave.wrapped import WrappedOptimizer, inner_step, route_user_optimizer, weak_method
from memsave.zero.engine import ZeroEngine
from memsave.zero.offload import build_offloaded_state
from memsave.zero.param_offload import ParamOffload
from memsave.zero.rows import check_shardable

__all__ = ["MemsaveOptimizer"]


def _alike_on_every_stage(axes: list[str], kinds: list[tuple[str, ...]]) -> tuple[list[str], list[tuple[str, ...]]]:
    """[Note: alike on every stage] Under pp each rank steps only its stages' tensors, and a stage may hold none
    (every parameter frozen: fine-tuning the top of a model) or other placements than another stage (tensor-
    parallel rows on one, only replicated norms on the other). The axes a decision is agreed over and the sets of
    sharded axes a norm sums over must still be the same on every rank, or one rank skips a collective that its
    peers wait in: their union over every rank (once, while the optimizer is made)."""
    per_rank = mdist.all_gather_object((axes, kinds))
    return (sorted({a for got, _ in per_rank for a in got}),
            sorted({tuple(k) for _, got in per_rank for k in got}))


class MemsaveOptimizer(GradScalerSteps, WrappedOptimizer):
    """The user's optimizer stepping what ``engine`` shards, with precision, clipping and offload composed."""

    def __init__(self, optimizer: torch.optim.Optimizer, engine: Engine, *, mixed_precision: bool = False,
                 scaler: LossScaler | None = None, offload: OffloadConfig | None = None,
                 nonfinite: NonfiniteGuard | None = None) -> None:
        super().__init__(optimizer)
        self.engine = engine
        self.nonfinite = nonfinite if nonfinite is not None else NonfiniteGuard()
        stepped: dict[torch.Tensor, torch.Tensor] = dict(engine.stepped())
        placements = {s: engine.placement_of(s) for s in stepped.values()}
        # Decisions from local gradients are agreed over the axes along which they differ ([Note: placements] in
        # memsave/dist/placement.py), and a norm is summed per set of sharded axes: alike on every rank
        axes = sorted({a for pl in placements.values() for a in pl.differs_along()})
        kinds = sorted({pl.sharded_axes() for pl in placements.values()})
        if hasattr(engine, "pipeline_step"):
            axes, kinds = _alike_on_every_stage(axes, kinds)
        self.any_sharded = any(kinds)
        if self.any_sharded:
            check_shardable(optimizer, getattr(engine, "stage", 0))
        self.scaler = scaler
        engine.loss_scaled = scaler is not None
        engine.load_listeners.append(weak_method(self._refresh_masters))
        if hasattr(windows := getattr(engine, "inner", engine), "edit_windows"):  # ZeRO-3: shards the user edited
            windows.edit_windows.edit_listeners.append(weak_method(self._follow_edits))
        engine.zero_grad_listeners.append(weak_method(self._forget_grads))
        route_user_optimizer(optimizer, self)
        self._full_of: dict[torch.Tensor, nn.Parameter] = {}  # what the inner optimizer steps -> the parameter
        for group in optimizer.param_groups:
            full = group["params"]
            if hasattr(engine, "pipeline_step"):  # pp: the other stages' parameters left this rank (parallelize)
                full = [p for p in full if p in stepped]
            group["params"] = [stepped[p] for p in full]
            self._full_of.update(zip(group["params"], full))
        # pp: where this rank's parameters stand among the whole model's (a whole optimizer state dict's indices)
        self.whole_positions: tuple[list[int], int] | None = vars(optimizer).pop("memsave_whole_positions", None)
        self.agree_over = engine.mesh.groups_for(axes)
        self._norm_groups = {a: engine.mesh.group(a) if engine.mesh.degree(a) > 1 else None for a in axes}
        # [Note: partial gradients] stepped tensors whose gradient is a partial sum over a non-data axis
        self._partial = [s for s in stepped.values() if placements[s].partial_grad]
        self._partial_axes = sorted({a for s in self._partial for a in placements[s].partial_grad})
        self._partial_at: int | None = None  # engine.num_syncs when they were last completed (None: since zero_grad)
        self._read_at: int | None = None  # engine.num_syncs when the step's gradients were last read ([Note: ...])
        # Mixed precision: fp32 masters (of the shards: 4/N bytes per parameter), cast into the parameters after
        # the step; with offload on CUDA made on the host for the tier ([Note: offloaded masters]).
        host_masters = offload is not None and offload.optimizer in ("cpu", "disk") and engine.mesh.device.type == "cuda"
        self.mp = (MixedPrecisionOptimizer(optimizer, scaler=scaler, group=self.agree_over, grad_of=engine.grad_of,
                                           master_device=torch.device("cpu") if host_masters else None,
                                           nonfinite=self.nonfinite, param_of=lambda s: holder(s, self._full_of[s]))
                   if mixed_precision or scaler is not None else None)
        # what the optimizer steps (a stepped tensor, or its master) -> the full parameter
        self._opt_full = {m: self._full_of[s] for m, s in self.mp.pairs} if self.mp is not None else dict(self._full_of)
        self._placement = {t: placements[stepped[p]] for t, p in self._opt_full.items()}
        # [Note: guarded param_groups] in memsave/engines/part_grad.py: what the user's param_groups hold, guarded
        split = any(engine.mesh.degree(a) > 1 for k in kinds for a in k)
        self._guards = part_grad.StepGuards(
            [t for t in self._opt_full if split and t in self._full_of and t is not self._full_of[t]],
            [t for t in self._opt_full if t not in self._full_of])
        if self._guards.shards or self._guards.masters:
            engine.sync_listeners.append(weak_method(self._guards.mark))
        # [Note: gradients cleared through the optimizer] in memsave/engines/freshness.py (fp32 shards; masters)
        self._held = {m: s for m, s in self.mp.pairs if m is not s} if self.mp is not None else {}
        if opt_of := {p: t for t, p in self._opt_full.items() if t in self._held or (not self.mp and t is not p)}:
            engine.set_cleared_check(lambda p: (t := opt_of.get(p)) is not None and t.grad is None)
        self._norm_parts = kinds  # the sets of sharded axes a norm sums over (some may hold nothing on this rank)
        self._unmarks = bool(getattr(engine, "marks_part_grads", False))  # (no pass over the grads where none is)
        # norms sum in the model's registration order, as torch's clip_grad_norm_(model.parameters()) does
        position = {p: i for i, p in enumerate(engine.model.parameters())}
        self._norm_order = sorted(self._opt_full, key=lambda t: position[self._opt_full[t]])
        if isinstance(optimizer, Adafactor) and self.any_sharded:  # its statistics sum over the cut rows/columns
            whole = {p: getattr(tp_param(p), "full_shape", None) or p.shape for p in self._opt_full.values()}
            optimizer.shard(lambda t, axes: mdist.all_reduce_over(t, engine.mesh.groups_for(axes),
                                                                  via=engine.mesh.device),
                            {s: layout_of(self._placement[s], s.dim(), whole[p]) for s, p in self._opt_full.items()})
        if hasattr(engine, "scale_loss") and self.mp is not None:  # the pipeline engine runs the backwards itself
            engine.scale_loss = self.mp.scale
        self.offloaded: OffloadedState | None = None
        self.param_offload: ParamOffload | None = None
        self.overlap = False
        self._settle_hook: Any = None
        if offload is not None and offload.optimizer != "none":
            self._attach_offload(offload)
            if self.mp is not None and self.offloaded is not None:  # the masters live in the state's chunks
                self.mp.edits.refresh_all = weak_method(self._refresh_masters)

    def _attach_offload(self, offload: OffloadConfig) -> None:
        """``[offload] optimizer``: the state of this rank's shards streamed from its tier (memsave/zero/offload.py);
        with ``overlap`` the chunks step in the background, a unit's gather waits for its rows and the end of the
        next forward for all of them ([Note: overlapped step] in memsave/offload/state.py)."""
        zero = getattr(self.engine, "inner", self.engine)  # under pp: the stage's ZeRO engine inside the pipeline's
        if not isinstance(zero, ZeroEngine):
            raise NotImplementedError("[offload] optimizer needs a ZeRO stage (zero.stage = 1, 2 or 3): the state it "
                                      "streams is the shards' state")
        if offload.overlap and zero is not self.engine:
            raise NotImplementedError("[offload] overlap = true with [parallel] pp > 1 is not implemented: the "
                                      "background step would race the next pipeline step's gathers; set "
                                      "offload.overlap = false")
        self.offloaded, self.param_offload = build_offloaded_state(self.optimizer, zero, offload, masters=self._held)
        self.overlap = self.offloaded is not None and offload.overlap
        if self.overlap:
            state = self.offloaded
            assert state is not None
            zero.attach_step_waiter(lambda unit: state.wait_for(f"unit{unit.index}"))
            zero.before_zero_in_place = weak_method(self.settle)
            self._settle_hook = zero.model.register_forward_hook(lambda *_: state.settle())

    # -- what the state dict and tests read ------------------------------------------------------------------
    @property
    def stepped_to_full(self) -> dict[torch.Tensor, nn.Parameter]:  # (a parameter, or this rank's rows of it)
        return self._full_of

    def full_of(self, t: torch.Tensor) -> nn.Parameter:  # of what the user's optimizer steps (or its master)
        return self._opt_full[t]

    def placement_of(self, t: torch.Tensor) -> mdist.Placement:  # (a stepped tensor, or its fp32 master: alike)
        return self._placement[t]

    # -- the step ------------------------------------------------------------------------------------------
    def settle(self) -> None:  # a step still running in the background ([offload] overlap); raise its error
        if self.offloaded is not None:
            self.offloaded.settle()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if hasattr(self.engine, "pipeline_step"):
            raise RuntimeError("under pipeline parallelism (pp > 1) model.pipeline_step(micro_batches, ...) runs the "
                               "forwards and backwards of a step; call optimizer.step() after it, not backward()")
        self.settle()  # the reduce-scatters write the gradient buffers a background step may still read
        before = self.engine.num_syncs
        self.engine.in_scaled_backward = True
        try:
            (self.mp.scale(loss) if self.mp is not None else loss).backward(**kwargs)
        finally:
            self.engine.in_scaled_backward = False
        if self.engine.require_grad_sync and self.engine.num_syncs == before:
            # No gradient reached this rank's parameters, so no hook queued the sync; the peers still need it.
            self.engine.agreement.check("backward")  # as the peers' first gradient hook does
            self.engine.sync_gradients()

    @torch.no_grad()
    def complete_partial_grads(self) -> None:
        """[Note: partial gradients] A parameter replicated over ``tp`` but used on sequence shards (a norm under
        sequence parallelism) has on each ``tp`` rank the gradient of its own tokens: they are summed over ``tp``
        once, the first time anything reads the gradients after backward (clipping, the step, ``full_grads``), in
        one flat all-reduce. The sum is linear, so gradient accumulation over several backwards is summed once."""
        if self._unmarks:  # the optimizer reads them now ([Note: a rank's part of the gradient])
            part_grad.unmark(self._full_of.values())
        made = self.mp is not None and self.mp.unscaled and (lambda m: self.engine.grad_of(self._held[m]) is not None)
        for m in self._guards.unmark(made):  # masters cleared before the step ([Note: a gradient cleared ...])
            self.engine.drop_grad(self._held[m])
        syncs = self.engine.num_syncs
        if self._read_at != syncs:  # [Note: what a step derives from its gradients]
            self._read_at = syncs
            self._forget_derived()
        if not self._partial:
            return
        if self._partial_at is not None:  # completed before: cleared since (by hand too), or accumulated onto
            if self._partial_at == syncs:
                return
            if not all(self.engine.restarted_since(s, self._partial_at) for s in self._partial
                       if self.engine.grad_of(s) is not None):
                raise NotImplementedError(
                    "gradients accumulated over an optimizer step without clearing them, where a gradient is summed "
                    "over tp (norms under sequence parallelism, key/value heads fewer than tp): the summed gradients "
                    "would be summed again; clear them after each step (optimizer.zero_grad(), model.zero_grad() "
                    "or p.grad = None)")
        grads = [g for g in (self.engine.grad_of(s) for s in self._partial) if g is not None]
        if grads:
            flat = torch.cat([g.reshape(-1).float() for g in grads])
            mdist.all_reduce_over(flat, self.engine.mesh.groups_for(self._partial_axes), count_as="tp_grad")
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))
        self._partial_at = syncs

    def _grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(what the optimizer steps, its gradient)`` for those with one, in the model's parameter order."""
        return [(t, t.grad) for t in self._norm_order if t.grad is not None]

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm of the full gradient (under mixed precision: of the unscaled fp32 master
        gradients; inf, on every rank, when any overflowed). Each parameter counts once: a sharded gradient adds
        its part on every rank of the sharded axis, a replicated one is not reduced at all."""
        self.complete_partial_grads()
        if self.mp is not None and self.mp.unscale():
            return torch.tensor(math.inf)
        pairs = self._grads()
        grads = [g for _, g in pairs]
        if not self.any_sharded:  # the local norm is the global one: torch's own, bit for bit
            norm = torch.nn.utils.clip_grad_norm_([t for t, _ in pairs], max_norm, norm_type=norm_type, foreach=True)
            self.nonfinite.norm = float(norm)  # the step's non-finite check reuses it
            return norm
        device = self.engine.mesh.device
        # one part per set of sharded axes, on every rank alike (empty ones too: the reductions must match)
        parts: dict[tuple[str, ...], list[torch.Tensor]] = {axes: [] for axes in self._norm_parts}
        for t, g in pairs:
            if g.numel() and not self._placement[t].tie_copy:  # a tied copy counts on its first stage only
                parts[self._placement[t].sharded_axes()].append(g)
        zero = torch.zeros((), device=device)
        if math.isinf(norm_type):
            local = {axes: torch.stack([g.abs().max() for g in gs]).max().to(device, torch.float32) if gs else zero
                     for axes, gs in parts.items()}
            norm = mdist.sum_over_shards(local, self._norm_groups, op=mdist.ReduceOp.MAX)
        else:
            local = {axes: torch.stack([n.float() ** norm_type for n in torch._foreach_norm(gs, norm_type)]).sum()
                     .to(device) if gs else zero for axes, gs in parts.items()}
            norm = mdist.sum_over_shards(local, self._norm_groups) ** (1.0 / norm_type)
        self.nonfinite.norm = float(norm)  # the step's non-finite check reuses this global norm
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        return norm

    def _follow_edits(self, rows: dict[torch.Tensor, torch.Tensor]) -> None:  # [Note: edits of gathered ...]
        self.settle()  # (the masters of an offloaded state: a background step may still hold them)
        self._refresh_masters(rows, only=True)

    @torch.no_grad()
    def _refresh_masters(self, loaded: dict[torch.Tensor, torch.Tensor] | None = None, only: bool = False) -> None:
        """After ``model.load_state_dict``, or (``only``) ZeRO-3 shards the user edited: the fp32 masters follow."""
        if self.mp is None:
            return
        if self.offloaded is None:
            self.mp.refresh_masters(loaded if only else None)
            return
        states, own = self.offloaded.local()
        rows = loaded if loaded is not None else {}  # [offload] params: the shards' rows, read while loaded
        for m, s in self.mp.pairs:
            if m is not s and (not only or s in rows):
                new = rows.get(s, s).detach()
                own[m] = follow(own[m], new) if m in own else new.float()
        self.offloaded.load_local_state(states, own)
        self.mp.edits.mark()

    def _step(self) -> None:
        agreement = self.engine.agreement
        mdist.doing(agreement.step, "optimizer.step()")
        agreement.check("optimizer")  # [Note: control-flow agreement] in memsave/dist/agreement.py
        try:
            self._stepped()
        finally:  # (a step that raised, an offload write, keeps the marks too: it may be stepped again)
            self._guards.rest(self._held, self.engine.grad_of)
        agreement.step += 1  # once it returned: a step that raised on one rank is named at the next phase

    def _stepped(self) -> None:
        self.engine.before_step()
        self.complete_partial_grads()
        offloaded = self.offloaded
        if self.mp is not None:
            self.mp.step_masters((lambda: offloaded.step(overlap=self.overlap)) if offloaded is not None else None)
            if self.mp.step_was_skipped:  # (or skips it, on every rank)
                self.step_was_skipped = True
                return
        else:
            grads = [g for _, g in self._grads()]
            skip = self.nonfinite.found(grads, self.agree_over, device=self.engine.mesh.device)
            self.nonfinite.after_step(skip)  # agreed over the placements' axes: every rank skips, or none
            if skip:
                self.step_was_skipped = True
                return
            if offloaded is not None:
                offloaded.step(overlap=self.overlap)
            else:
                inner_step(self.optimizer)
        if offloaded is not None and self.engine.mesh.device.type == "cpu":
            mdist.after_forward()  # the host policy's trim: the chunks' transients go back to the OS too
        self.engine.after_step()
        if self.mp is not None:
            self.mp.edits.mark()  # (ZeRO-1/2 wrote the gathered rows through .data)

    def _forget_derived(self) -> None:
        """[Note: what a step derives from its gradients] Clipping computes from this step's gradients the fp32
        unscaled master gradients, their overflow check and the global norm, which the step reuses. New gradients
        (``engine.num_syncs`` moved: also a bf16 ``loss.backward()`` outside the optimizer, or ``p.grad = None``)
        or a ``zero_grad`` (the optimizer's or the model's) drop them. Kept past a step the user skipped (``if
        spike: zero_grad(); continue``), the old finite norm passed the next step's NaN gradients as finite (NaN
        in every parameter); kept past ``model.zero_grad()``, the next step applied the last step's gradients."""
        self.nonfinite.norm = None
        if self.mp is not None:
            self.mp.forget()

    def _forget_grads(self) -> None:  # model.zero_grad() ran (the engine's listener): as zero_grad forgets
        self._partial_at = self._read_at = None
        self._forget_derived()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._forget_grads()
        self.engine.zero_grad(set_to_none)  # (in place, it first waits for a background step that reads them)
        if self.mp is not None:
            self.mp.zero_grad(set_to_none)
        else:  # the class's own: the instance's zero_grad is this method (route_user_optimizer)
            type(self.optimizer).zero_grad(self.optimizer, set_to_none=set_to_none)

    # -- state dicts ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state, in the plain optimizer's format (collective under ZeRO: call on every rank)."""
        if self.mp is not None:  # [Note: edits between steps] the masters saved hold the edits since the step
            self.mp.edits.sync()
        return _state.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full (plain-optimizer) state dict: every rank keeps its rows of what is sharded."""
        _state.load_state_dict(self, state_dict)

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """The averaged full gradient of every trainable parameter, by name (collective; for checks/debugging)."""
        self.complete_partial_grads()
        grads = _state.full_grads(self)
        self._guards.rest(self._held, self.engine.grad_of)
        return grads

    # -- memory ----------------------------------------------------------------------------------------------
    def memory_tensors(self) -> Iterator[tuple[MemoryCategory, torch.Tensor]]:
        yield from self.engine.memory_tensors()
        if self.mp is not None:
            yield from self.mp.master_tensors()
        yield from self._optimizer_state_tensors()
        if self.offloaded is not None:
            yield from self.offloaded.memory_tensors()  # the window buffers and the chunks kept in memory
        if self.param_offload is not None:
            yield from self.param_offload.memory_tensors()

    def offloaded_bytes(self) -> dict[str, int]:
        """Bytes held off the device now, by tier: optimizer state, and ``[offload] params``' parameter shards."""
        out = self.offloaded.offloaded_bytes() if self.offloaded is not None else {"host": 0, "disk": 0}
        if self.param_offload is not None:
            for tier, n in self.param_offload.offloaded_bytes().items():
                out[tier] += n
        return out

    def offloaded_param_bytes(self) -> int:
        """Stage 3 with ``[offload] params``: the parameter shard bytes held on the tier (disk or pinned host)."""
        return sum(self.param_offload.offloaded_bytes().values()) if self.param_offload is not None else 0

    def close(self) -> None:
        """Release the offload tier (its files are removed); the optimizer cannot step afterwards (it raises)."""
        self.closed = True
        if self._settle_hook is not None:
            self._settle_hook.remove()
        try:
            self.settle()
        finally:
            if self.param_offload is not None:
                self.param_offload.drain()
            if self.offloaded is not None:
                self.offloaded.close()
