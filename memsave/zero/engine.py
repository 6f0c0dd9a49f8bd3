"""The ZeRO engine: units, their gradients, and the end-of-backward settlement (Rajbhandari et al., 2020,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models").

Units are ``[root, *blocks]`` in *forward order*; gradients are reduced in the reverse (*backward order*). At
stage 3 the :class:`~memsave.zero.schedule.Stage3Schedule` gathers and frees them around forward and backward.

[Note: collective order] (gradients) Reduce-scatters are issued strictly in backward order on every rank (a
unit whose gradients are complete waits for the earlier ones), and a unit whose gradients some rank never
produced is reduced as zeros at the end of backward. Gathers and reduce-scatters travel on separate groups (the
gathers' half of the note: memsave/zero/schedule.py). [Note: unused parameters] As in the DP engine, a flag per
trainable parameter is all-reduced at the end of backward; one no rank used keeps ``grad = None``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.profiler import record_function

from memsave import dist as mdist
from memsave.config import ZeroConfig
from memsave.dist import Mesh
from memsave.models.units import REDUCES_IN_FLIGHT, default_units, unit_parameters  # (the estimator's too)
from memsave.outer_backward import OuterBackward, grad_hooks_last, repeated_gradient_error
from memsave.phases import MemoryCategory
from memsave.wrapped import check_still_frozen, sync_suspended, unscaled_backward_error, weak_method
from memsave.zero.edit_window import EditWindows, write_back
from memsave.zero.guards import check_grads_at_step
from memsave.zero.replaced import adopt_replaced_in_units
from memsave.zero.schedule import Stage3Schedule
from memsave.zero.unit import Unit

__all__ = ["ZeroEngine", "default_units"]

_ROWS = mdist.Placement(dp=mdist.Shard(0))


class ZeroEngine:
    """Shards a model's parameters into units and runs ZeRO stage 1, 2 or 3 over the mesh's dp axis."""

    def __init__(self, model: nn.Module, mesh: Mesh, config: ZeroConfig, units: Sequence[nn.Module] | None, *,
                 reduce_dtype: torch.dtype | None = None,
                 before_unit: Callable[[list[nn.Parameter]], None] | None = None) -> None:
        if config.stage not in (1, 2, 3):
            raise ValueError(f"zero.stage={config.stage} is not a ZeRO stage; expected 1, 2 or 3")
        self.model, self.mesh, self.config, self.stage = model, mesh, config, config.stage
        # [Note: collective order] Gathers and reduce-scatters travel on separate groups: each kind comes in unit
        # order on every rank, but their interleaving follows what each backward skips (one group: a hang).
        self.group, self.dp_size = mesh.dp_group, mesh.dp_size
        self.reduce_dtype = reduce_dtype  # None: the parameters' own dtype ([Note: reduce dtype] in unit.py)
        self.reduce_group, agreed = mesh.new_group("dp", owner=self), mesh.new_group("dp", owner=self)
        self.agreement = mdist.Agreement(agreed, mesh.device)  # [Note: control-flow agreement]
        self.require_grad_sync = True
        # before_unit(params): before a unit takes them ([Note: materialization] in memsave/deferred/materialize.py)
        self.units = self._build_units(list(units) if units is not None else default_units(model), before_unit)
        self.shard_of: dict[nn.Parameter, nn.Parameter] = {}
        self.name_of: dict[torch.Tensor, str] = {}
        for u in self.units:
            for n, p, s in zip(u.names, u.params, u.shards):
                self.shard_of[p], self.name_of[s] = s, n
        self._param_of: dict[torch.Tensor, nn.Parameter] = {s: p for p, s in self.shard_of.items()}
        self._unit_of = {p: u for u in self.units for p in u.params}
        self._slot_of: dict[torch.Tensor, tuple[Unit, int]] = {s: (u, i) for u in self.units for i, s in enumerate(u.shards)}
        self._trainable = [p for u in self.units for i, p in enumerate(u.params) if i in u.trainable]
        self._frozen = [(u.names[i], p) for u in self.units for i, p in enumerate(u.params) if i not in u.trainable]
        self._trainable_slot = {u.params[i]: (u, j) for u in self.units for j, i in enumerate(u.trainable)}
        self._used = torch.zeros(len(self._trainable), dtype=torch.int32, device=mesh.device)
        self._used_index = {p: k for k, p in enumerate(self._trainable)}
        self._backward_order = list(reversed(self.units))  # root last ([Note: the units' call order])
        self._called: list[Unit] | None = []  # the units in the order of their first call; None once settled
        self._ready: set[int] = set()
        self._next_reduce = 0
        self._inflight: list[Unit] = []  # launched reduce-scatters not yet waited on, oldest first
        self._callback_queued = False
        self._fired: set[nn.Parameter] = set()  # whose gradient hook ran in this backward
        self._outer = OuterBackward(self.sync_gradients)  # [Note: one sync per outer backward]
        self.num_syncs, self.unsynced = 0, False  # unsynced: the last backward ran inside no_sync()
        self.schedule = Stage3Schedule(self) if self.stage == 3 else None
        self.loss_scaled = False  # fp16: gradients must come from optimizer.backward (a scaled loss)
        self.in_scaled_backward = False
        # called after model.load_state_dict, with the new rows of shards that are offloaded (else None)
        self.load_listeners: list[Callable[[dict[torch.Tensor, torch.Tensor] | None], None]] = []
        self.zero_grad_listeners: list[Callable[[], None]] = []  # called by model.zero_grad()
        self.sync_listeners: list[Callable[[], None]] = []  # called after each sync (the optimizer's guards)
        self.before_zero_in_place: Callable[[], None] | None = None  # set by the optimizer (offload overlap)
        for u in self.units:
            u.on_sharded_read = weak_method(self._sharded_read)  # [Note: hooks held by tensors]
        self._hooks: list[Any] = []
        self._register_hooks()
        self.param_offload: Any = None  # [offload] params = "disk" | "cpu" (attach_param_offload)
        self.edit_windows = EditWindows(lambda: self.param_offload)  # [Note: edits of gathered parameters]
        self.step_waiter: Callable[[Unit], None] | None = None  # [offload] overlap (attach_step_waiter)

    # -- construction --------------------------------------------------------------------------------------
    def _build_units(self, modules: list[nn.Module],
                     before_unit: Callable[[list[nn.Parameter]], None] | None = None) -> list[Unit]:
        root = self.model
        for m in modules:
            if m is root:
                raise ValueError("units= must not contain the model itself: the root unit is always added")
            if not any(m is sub for sub in root.modules()):
                raise ValueError(f"units= holds a {type(m).__name__} that is not a submodule of the model")
        module_names = {id(m): n for n, m in root.named_modules()}
        groups = unit_parameters(root, modules)  # shared or unowned -> root (the estimator's grouping too)
        kw: dict[str, Any] = dict(stage=self.stage, group=self.group, reduce_group=self.reduce_group,
                                  dp_rank=self.mesh.dp_rank, dp_size=self.dp_size, reduce_dtype=self.reduce_dtype)
        def prepared(group: list[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
            if before_unit is not None:
                before_unit([p for _, p in group])
            return group

        units = [Unit("<root>", root, prepared(groups[0]), is_root=True, **kw)]  # possibly empty-handed
        for k, m in enumerate(modules):
            if groups[k + 1]:
                units.append(Unit(module_names[id(m)], m, prepared(groups[k + 1]), is_root=False, **kw))
        for index, u in enumerate(units):
            u.index = index
        return units

    def _register_hooks(self) -> None:
        hook = weak_method(self._on_grad_ready)  # [Note: hooks held by tensors]: weakly
        self._grad_hooks = [p.register_post_accumulate_grad_hook(hook) for p in self._trainable]
        self._hooks += [*self._grad_hooks, *(p.register_hook(self._make_before_accumulate(p)) for p in self._trainable)]
        if self.mesh.device.type == "cpu":
            self._hooks.append(self.model.register_forward_hook(lambda *_: mdist.after_forward()))
        if self.mesh.degree("tp") > 1 and self.mesh.degree("pp") == 1:  # [Note: one input per tp group]
            self._hooks.append(self.agreement.watch_forwards(self.model, self.mesh.new_group("tp", owner=self)))
        if self.schedule is not None:
            self._hooks.extend(self.schedule.register(self.model))
            self._hooks.append(self.model.register_state_dict_pre_hook(self._pre_state_dict))
            self._hooks.append(self.model._register_state_dict_hook(self._post_state_dict))
        self._hooks += mdist.watch_loads(self.model, f"model.load_state_dict() under ZeRO-{self.stage}",
                                         self.mesh.every_rank_group)  # (first: before stage 3's unshard)
        self._hooks.append(self.model._register_load_state_dict_pre_hook(self._pre_load_state_dict))
        self._hooks.append(self.model.register_load_state_dict_post_hook(self._post_load_state_dict))
        check = torch.compiler.disable(self._check_trainable)  # [Note: hooks outside compiled code]
        self._hooks.append(self.model.register_forward_pre_hook(check, prepend=True))  # runs first
        record = torch.compiler.disable(weak_method(self._record_call))
        self._unit_by_module = {id(u.module): u for u in self.units[1:]}
        self._order_hooks = [u.module.register_forward_pre_hook(record) for u in self.units[1:]]
        self._hooks += self._order_hooks
        self._hooks.extend(self._outer.register(self.model))

    # [Note: the units' call order] Units are gathered (stage 3) and their gradients reduced (stages 1-3) in a
    # static order, the same on every rank ([Note: collective order] in schedule.py): forward order for gathers,
    # its reverse for backward gathers and reduce-scatters. Registration order is that order for a layer list, not
    # always for a model: CLIP registers its text tower before its vision tower and runs the vision tower first.
    # There a unit called out of order was gathered twice (once as skipped), the backward prefetch gathered the
    # wrong tower, and the text tower's reduce-scatters waited for the vision tower's. So the units' first calls in
    # the training forwards before the first synchronizing backward are recorded; at the end of that backward
    # (every rank is there) the ranks exchange them, and where all saw the same order, with every unit in it,
    # the next steps use it (DeepSpeed ZeRO-3 traces its first step likewise; FSDP1 records its execution order).
    # The first step keeps registration order.
    def _record_call(self, module: nn.Module, args: Any) -> None:
        if self._called is None or not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return  # settled, an evaluation, or a recomputation inside backward
        unit = self._unit_by_module.get(id(module))
        if unit is not None and unit not in self._called:
            self._called.append(unit)

    def _settle_order(self) -> None:
        """[Note: the units' call order] Collective over dp, at the end of the first synchronizing backward."""
        assert self._called is not None
        mine = [u.index for u in self._called]
        self._called = None
        for h in self._order_hooks:
            h.remove()
        everyone = mdist.all_gather_object(mine, self.agreement.group)
        if any(o != mine for o in everyone) or sorted(mine) != list(range(1, len(self.units))) or mine == sorted(mine):
            return  # seen differently, incomplete (a unit some forward skipped), or registration order already
        in_order = [self.units[0], *(self.units[i] for i in mine)]
        self._backward_order = [*reversed(in_order[1:]), self.units[0]]
        if self.schedule is not None:
            self.schedule.adopt_order(in_order)

    def _make_before_accumulate(self, p: nn.Parameter) -> Callable[[torch.Tensor], None]:
        unit, j = self._trainable_slot[p]
        return lambda grad: unit.before_accumulate(j)  # [Note: gradient freshness] in unit.py

    def _check_trainable(self, module: nn.Module, args: Any) -> None:
        """A parameter frozen at wrap has no gradient shard, reduce or optimizer state: training it later would
        never update it. A backward that raised before its synchronization is dropped ([Note: a backward ...])."""
        if self._callback_queued and torch._C._current_graph_task_id() == -1:
            for u in self._inflight:  # (launched alike on every rank that raised alike)
                u.wait_reduce()
            self._inflight.clear()
            self._fired.clear()
            self._ready.clear()
            self._used.zero_()
            self._next_reduce, self._callback_queued = 0, False
            if self.schedule is not None:
                self.schedule.end_backward()  # every unit freed, the passes afresh
            for u in self.units:
                u.pending = len(u.trainable)
        check_still_frozen(self._frozen, "ZeRO laid out gradient shards and optimizer state only for the "
                                         "parameters trainable at wrap, so it would never be updated")
        grad_hooks_last(self._grad_hooks)  # [Note: the user's gradient hooks first] in memsave/outer_backward.py

    def attach_param_offload(self, offload: Any) -> None:
        """Stage 3, ``[offload] params``: shards loaded before each gather (``prefetch`` ahead), evicted after."""
        self.param_offload = offload
        for u in self.units:
            u.before_gather = self._before_gather
            u.after_gather = offload.release

    def attach_step_waiter(self, wait: Callable[[Unit], None]) -> None:
        """Stage 3, ``[offload] overlap``: a gather waits for its rows' background step ([Note: overlapped step])."""
        self.step_waiter = wait
        for u in self.units:
            u.before_gather = self._before_gather

    def _before_gather(self, unit: Unit) -> None:
        if self.step_waiter is not None:
            self.step_waiter(unit)
        if self.param_offload is None:
            return
        assert self.schedule is not None
        order = self.schedule.gather_order
        at = next((i for i, u in enumerate(order) if u is unit), len(order))
        self.param_offload.load(unit, ahead=order[at + 1 :])

    def _sharded_read(self, unit: Unit, i: int, what: str) -> None:
        raise RuntimeError(
            f"memsave ZeRO-3: parameter {unit.names[i]!r} was read ({what}) while its unit {unit.name!r} is sharded "
            "(it holds no values outside that unit's forward and backward). Read it inside the forward of the "
            "module that owns it, or gather first on every rank: model.unshard(), then model.reshard(); for a copy "
            "of the weights use model.state_dict() (collective)"
        )

    # -- the Engine protocol (memsave/engines/protocol.py) ---------------------------------------------------
    def unshard(self, unit: Unit | None = None) -> None:
        """Stage 3: gather ``unit`` (every unit when None) now; it stays gathered until :meth:`reshard` or the end
        of the next backward. Collective over dp: every rank makes the same calls. A no-op at stages 1-2."""
        units = self.units if unit is None else [unit]
        for u in units:
            u.unshard_async()
        for u in units:
            u.unshard_wait()

    def reshard(self, unit: Unit | None = None) -> None:  # stage 3: free ``unit``'s full parameters (None: all)
        for u in self.units if unit is None else [unit]:
            u.reshard()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:  # the first backward after it reduces all
        return sync_suspended(self)

    def stepped(self) -> list[tuple[nn.Parameter, torch.Tensor]]:  # (parameter, this rank's rows of it)
        return list(self.shard_of.items())

    def placement_of(self, stepped: torch.Tensor) -> mdist.Placement:
        """A shard holds this rank's dim-0 rows (its gradient the averaged rows): Shard(0) along dp, of the tensor the
        TP transform left on this rank (tp is applied first: a dim-0 shard of a TP shard)."""
        return mdist.param_placement(self._param_of[stepped]).with_axis("dp", _ROWS.dp)

    def before_step(self) -> None:
        """Refuse gradients the shards never got ([Note: gradients a step would ignore]); stage 3: reshard."""
        check_grads_at_step(self)
        adopt_replaced_in_units(self.units)  # [Note: replaced data] (stages 1-2; at stage 3 in the edit windows)
        self.reshard()

    def after_step(self) -> None:  # stages 1-2: every rank stepped its rows; gathered, all hold the parameters
        self.gather_params_after_step()

    # -- gradients -----------------------------------------------------------------------------------------
    def queue_sync(self) -> None:
        """The first gradient hook of a backward: settle its gradients when autograd finishes."""
        if not self._callback_queued:  # (the per-parameter gradient hooks after the first do nothing here)
            if self.schedule is not None:
                self.schedule.begin_backward()
            mdist.doing(self.agreement.step, "backward (gradient reduce-scatters)")
            if self.require_grad_sync:
                self.agreement.check("backward")  # before its first reduce-scatter
            self._callback_queued = True
            self._outer.request()

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if self.loss_scaled and not self.in_scaled_backward:
            raise unscaled_backward_error()
        self.queue_sync()
        unit = self._unit_of[param]  # type: ignore[index]
        if param in self._fired:  # a parameter in several reentrant checkpoints: one backward each
            if unit in self._backward_order[: self._next_reduce]:
                name = next(n for n, q in zip(unit.names, unit.params, strict=True) if q is param)
                raise repeated_gradient_error(name, "unit's reduce-scatter")
            return
        self._fired.add(param)  # type: ignore[arg-type]
        unit.pending -= 1
        if unit.pending == 0:
            self._ready.add(unit.index)
            if self.require_grad_sync:
                self._launch_ready_reduces()
            if self.schedule is not None:
                self.schedule.maybe_reshard_in_backward(unit)

    def _launch_ready_reduces(self) -> None:
        order = self._backward_order
        while self._next_reduce < len(order) and order[self._next_reduce].index in self._ready:
            unit = order[self._next_reduce]
            with record_function("memsave::zero::reduce_scatter"):
                had_grad = unit.launch_reduce()
            for i, had in zip(unit.trainable, had_grad):
                if had:
                    self._used[self._used_index[unit.params[i]]] = 1
            self._inflight.append(unit)
            self._next_reduce += 1
            while len(self._inflight) > REDUCES_IN_FLIGHT:  # bound the staging memory held by in-flight reduces
                self._inflight.pop(0).wait_reduce()

    def sync_gradients(self) -> None:
        """End of backward: reduce what is left in order, settle unused parameters, free gathered units. The
        autograd engine calls it after a backward; a rank whose backward reached none of its parameters calls it
        (after the agreement check) so that its peers' reduce-scatters are matched."""
        self._callback_queued = False
        self._fired.clear()
        self.unsynced = not self.require_grad_sync  # [Note: gradients a step would ignore]
        if self.schedule is not None:
            self.schedule.begin_backward()
            self.schedule.before_reduces()
        if self.require_grad_sync:
            self._ready.update(u.index for u in self.units)
            self._launch_ready_reduces()
            handle = mdist.all_reduce(self._used, self.reduce_group, async_op=True)
            for u in self._inflight:
                u.wait_reduce()
            self._inflight.clear()
            handle.wait()
            used = (self._used > 0).tolist()
            offset = 0
            for u in self.units:
                u.settle_grads(used[offset : offset + len(u.trainable)])
                offset += len(u.trainable)
            self._used.zero_()
            self._next_reduce = 0
            self.num_syncs += 1
            for listener in self.sync_listeners:  # the optimizer's guards ([Note: guarded param_groups])
                listener()
        self._ready.clear()
        if self.schedule is not None:
            self.schedule.end_backward()
        else:
            for u in self.units:
                u.pending = len(u.trainable)
        if (self._called is not None and self.require_grad_sync
                and (self.schedule is None or self.schedule.settled())):
            self._settle_order()

    # -- optimizer side ------------------------------------------------------------------------------------
    def gather_params_after_step(self) -> None:
        """Stages 1-2: every rank stepped its rows; all-gather them so all ranks hold the full parameters."""
        if self.stage == 3:
            return
        inflight: list[tuple[Unit, Any]] = []
        for u in self.units:
            inflight.append((u, u.launch_param_gather()))
            if len(inflight) > REDUCES_IN_FLIGHT:  # bound the transient staging memory
                done, handle = inflight.pop(0)
                done.finish_param_gather(handle)
        for u, handle in inflight:
            u.finish_param_gather(handle)

    def grad_of(self, shard: torch.Tensor) -> torch.Tensor | None:  # the averaged rows, in the reduce dtype
        unit, i = self._slot_of[shard]
        return unit.shard_grad(i)

    def drop_grad(self, shard: torch.Tensor) -> None:  # [Note: a gradient cleared before the step] in guards.py
        unit, i = self._slot_of[shard]
        unit.shards[i].grad = unit._shard_grads[i] = None

    def restarted_since(self, shard: torch.Tensor, sync: int) -> bool:  # as the DP engine's
        return (slot := self._trainable_slot[self._param_of[shard]])[0].started[slot[1]] > sync

    def set_cleared_check(self, cleared: Callable[[nn.Parameter], bool]) -> None:  # memsave/engines/freshness.py
        for u in self.units:
            u.cleared_elsewhere = cleared

    def zero_grad(self, set_to_none: bool) -> None:
        if not set_to_none and self.before_zero_in_place is not None:
            self.before_zero_in_place()  # [offload] overlap: a background step may still read the gradients
        self.unsynced = False
        for u in self.units:
            u.zero_grad(set_to_none)

    # -- stage 3 state dicts -------------------------------------------------------------------------------
    def _pre_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        mdist.expect_every_rank("model.state_dict() under ZeRO-3", self.group)  # not a 600 s hang on rank 0 alone
        self.unshard()

    def _post_state_dict(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> dict:
        # one copy per gathered tensor: a tied weight's names share it, as in a plain model's state dict (two
        # copies hid the tie from Hugging Face's save_pretrained, which wrote the weight twice)
        copies: dict[tuple[Any, ...], torch.Tensor] = {}
        full = self._full_ptrs()
        for key, value in state_dict.items():
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in full:
                where = (value.data_ptr(), tuple(value.shape), value.stride(), value.dtype)
                if where not in copies:
                    copies[where] = value.detach().clone()
                state_dict[key] = copies[where]
        for u in self.units:
            u.reshard()
        return state_dict

    def _full_ptrs(self) -> set[int]:
        return {u.full_flat.untyped_storage().data_ptr() for u in self.units}

    def _pre_load_state_dict(self, *args: Any, **kwargs: Any) -> None:
        if self.stage == 3:  # (after the arrival check: mdist.watch_loads)
            self.unshard()

    def _post_load_state_dict(self, module: nn.Module, incompatible_keys: Any) -> None:
        loaded: dict[torch.Tensor, torch.Tensor] | None = None  # shards that leave memory: their new rows
        if self.stage == 3:
            if self.param_offload is not None and self.load_listeners:
                loaded = {}
            for u in self.units:
                if self.param_offload is not None:
                    self.param_offload.enter(u)  # the shard changes: loaded, written back below
                write_back(u)
                if loaded is not None:
                    loaded.update((s, s.detach().clone()) for s in u.shards)
                u.reshard()
            if self.param_offload is not None:
                self.param_offload.finish()
        for listener in self.load_listeners:  # the optimizer's fp32 masters follow the loaded parameters
            listener(loaded)

    # -- bookkeeping ---------------------------------------------------------------------------------------
    def memory_tensors(self) -> Iterator[tuple[MemoryCategory, torch.Tensor]]:
        for u in self.units:
            yield from u.memory_tensors()
        for b in self.model.buffers():
            yield MemoryCategory.BUFFERS, b

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
