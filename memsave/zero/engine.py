"""The ZeRO engine: units, the hooks that drive them, and the end-of-backward settlement (Rajbhandari et al.,
2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models").

Units are ``[root, *blocks]`` in *forward order*; gradients are reduced in the reverse (*backward order*).

[Note: collective order] Collectives match across ranks by issue order, so every rank issues them in the
static unit order whatever its data does: reduce-scatters strictly in backward order (a unit whose gradients
are complete waits for the earlier ones), and, at stage 3, gathers strictly in forward order during forward
and backward order during backward. A unit that some rank skips is still gathered there (and freed at once),
and its gradients are reduced as zeros at the end of backward, so a skipped unit costs a collective, not a hang.

[Note: root unit] The root holds what no block owns (embeddings, final norm, head; and any parameter shared
between units, e.g. tied embeddings). At stage 3 it is gathered when the model's forward starts and kept until
its gradients are reduced at the very end of backward: its parameters are used at both ends of forward and at
the start of backward, so freeing it in between would only cost an extra gather. Its reduce-scatter is last.

[Note: recomputed units] Units recomputed by ``memsave.recompute`` need nothing from this engine: its hooks sit
on the unit module itself, so they run around the checkpoint, never inside the replayed forward, and the
pre-backward gather on a unit's outputs fires before the replay; keep stage-3 hooks on the unit module, not on
its submodules (see [Note: hooks stay outside the recomputed region] in memsave/recompute/checkpoint.py).

[Note: post-backward] A stage-3 unit may be resharded in backward only once *all* of its backward has run, not
when its trainable gradients have arrived: backward nodes that use a frozen parameter (a frozen norm, LoRA's
base weight) may still be waiting. As FSDP2 does, the unit's forward inputs that require grad pass through an
identity autograd function whose backward runs once every gradient with respect to them was computed, i.e. after
every node of the unit on a path to its inputs; the trainable gradients cover the other nodes. A unit whose
inputs need no gradient (the first block under frozen embeddings) is resharded at the end of backward.

[Note: unused parameters] As in the DP engine, one flag per trainable parameter is all-reduced at the end of
backward; a parameter that got no gradient on any rank keeps ``grad = None`` so the optimizer skips it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_unflatten

from memsave import dist as mdist
from memsave.config import ZeroConfig
from memsave.dist import Mesh
from memsave.models.units import (  # layer 0, shared with recompute/ and memory/
    default_units,
    output_tensors,
    unit_parameters,
)
from memsave.phases import MemoryCategory, ShardedState
from memsave.wrapped import check_still_frozen, unscaled_backward_error
from memsave.zero.unit import Unit

__all__ = ["ZeroEngine", "default_units"]

_REDUCES_IN_FLIGHT = 2


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward runs once all their gradients were computed
    ([Note: post-backward])."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


class ZeroEngine:
    """Shards a model's parameters into units and runs ZeRO stage 1, 2 or 3 over the mesh's dp axis."""

    def __init__(self, model: nn.Module, mesh: Mesh, config: ZeroConfig, units: Sequence[nn.Module] | None, *,
                 reduce_dtype: torch.dtype | None = None) -> None:
        if config.stage not in (1, 2, 3):
            raise ValueError(f"zero.stage={config.stage} is not a ZeRO stage; expected 1, 2 or 3")
        self.model, self.mesh, self.config, self.stage = model, mesh, config, config.stage
        # [Note: collective order] Gathers and reduce-scatters travel on separate groups: each kind is issued in
        # the static unit order on every rank, but how the two interleave depends on what each rank's backward
        # skips, so on one group they could pair up the wrong operations (a hang).
        self.group, self.dp_size = mesh.dp_group, mesh.dp_size
        self.reduce_dtype = reduce_dtype  # None: the parameters' own dtype ([Note: reduce dtype] in unit.py)
        self.reduce_group = mesh.new_group("dp")
        self.agreement = mdist.Agreement(mesh.new_group("dp"), mesh.device)  # [Note: control-flow agreement]
        self.require_grad_sync = True
        self.units = self._build_units(list(units) if units is not None else default_units(model))
        self.shard_of: dict[nn.Parameter, nn.Parameter] = {}
        self.name_of: dict[torch.Tensor, str] = {}
        for u in self.units:
            for n, p, s in zip(u.names, u.params, u.shards):
                self.shard_of[p], self.name_of[s] = s, n
        self._unit_of = {p: u for u in self.units for p in u.params}
        self._slot_of: dict[torch.Tensor, tuple[Unit, int]] = {s: (u, i) for u in self.units
                                                               for i, s in enumerate(u.shards)}
        self._trainable = [p for u in self.units for i, p in enumerate(u.params) if i in u.trainable]
        self._frozen = [(n, p) for u in self.units for i, (n, p) in enumerate(zip(u.names, u.params))
                        if i not in u.trainable]
        self._trainable_slot = {u.params[i]: (u, j) for u in self.units for j, i in enumerate(u.trainable)}
        self._used = torch.zeros(len(self._trainable), dtype=torch.int32, device=mesh.device)
        self._used_index = {p: k for k, p in enumerate(self._trainable)}
        self._backward_order = list(reversed(self.units))  # root last
        self._ready: set[int] = set()
        self._next_reduce = 0
        self._inflight: list[Unit] = []  # launched reduce-scatters not yet waited on, oldest first
        self._callback_queued = False
        self.num_syncs = 0
        self._fwd_issued = 0  # stage 3: units whose gather was issued in this forward (forward order)
        self._fwd_ran: set[int] = set()
        self._bwd_issued = len(self.units)  # stage 3: gathers issued in this backward, counting down
        self._bwd_ran: set[int] = set()
        self._graph_pending = False  # stage 3: a grad-enabled forward ran and its backward has not ended
        self._nested: list[tuple[Any, ...]] = []  # stage 3: state saved around a no_grad forward mid-step
        self._keep_gathered = False  # stage 3: a create_graph backward ran; keep units until the next one ends
        self._creating_graph = False  # stage 3: the backward running now creates a graph (create_graph=True)
        self.loss_scaled = False  # fp16: gradients must come from optimizer.backward (a scaled loss)
        self.in_scaled_backward = False
        # called after model.load_state_dict, with the new rows of shards that are offloaded (else None)
        self.load_listeners: list[Callable[[dict[torch.Tensor, torch.Tensor] | None], None]] = []
        self.before_zero_in_place: Callable[[], None] | None = None  # set by the optimizer (offload overlap)
        for u in self.units:
            u.on_sharded_read = self._sharded_read
        self._hooks: list[Any] = []
        self._register_hooks()
        self.param_offload: Any = None  # [offload] params = "disk" | "cpu" (attach_param_offload)
        self.step_waiter: Callable[[Unit], None] | None = None  # [offload] overlap (attach_step_waiter)
        self._gather_order: list[Unit] = self.units  # the order the next gathers come in (for disk reads ahead)

    # -- construction --------------------------------------------------------------------------------------
    def _build_units(self, modules: list[nn.Module]) -> list[Unit]:
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
        units = [Unit("<root>", root, groups[0], is_root=True, **kw)]  # possibly empty-handed
        for k, m in enumerate(modules):
            if groups[k + 1]:
                units.append(Unit(module_names[id(m)], m, groups[k + 1], is_root=False, **kw))
        for index, u in enumerate(units):
            u.index = index
        return units

    def _register_hooks(self) -> None:
        for p in self._trainable:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
            self._hooks.append(p.register_hook(self._make_before_accumulate(p)))
        if self.mesh.device.type == "cpu":
            self._hooks.append(self.model.register_forward_hook(lambda *_: mdist.after_forward()))
        if self.stage == 3:
            self._hooks.append(self.model.register_forward_pre_hook(self._root_pre_forward, prepend=True))
            self._hooks.append(self.model.register_forward_hook(self._root_post_forward))
            for u in self.units:
                if not u.is_root:
                    self._hooks.append(u.module.register_forward_pre_hook(self._make_pre_forward(u), with_kwargs=True))
                    self._hooks.append(u.module.register_forward_hook(self._make_post_forward(u)))
            for m in self._root_owners():
                self._hooks.append(m.register_forward_pre_hook(self._gather_root_on_access))
            self._hooks.append(self.model.register_state_dict_pre_hook(self._pre_state_dict))
            self._hooks.append(self.model._register_state_dict_hook(self._post_state_dict))
        self._hooks.append(self.model._register_load_state_dict_pre_hook(self._pre_load_state_dict))
        self._hooks.append(self.model.register_load_state_dict_post_hook(self._post_load_state_dict))
        self._hooks.append(self.model.register_forward_pre_hook(self._check_trainable, prepend=True))  # runs first

    def _make_before_accumulate(self, p: nn.Parameter) -> Callable[[torch.Tensor], None]:
        unit, j = self._trainable_slot[p]

        def hook(grad: torch.Tensor) -> None:
            unit.before_accumulate(j)  # [Note: gradient freshness] in unit.py
        return hook

    def _check_trainable(self, module: nn.Module, args: Any) -> None:
        """A parameter frozen at wrap has no gradient shard, no reduce and no optimizer state: training it later
        would silently never update it (and under plain data parallelism would let replicas diverge)."""
        check_still_frozen(self._frozen, "ZeRO laid out gradient shards and optimizer state only for the "
                                         "parameters trainable at wrap, so it would never be updated")

    # -- stage 3 forward -----------------------------------------------------------------------------------
    def _issue_forward_through(self, k: int) -> None:
        """Issue gathers, in forward order, for every unit up to index ``k`` (see [Note: collective order])."""
        while self._fwd_issued <= min(k, len(self.units) - 1):
            self.units[self._fwd_issued].unshard_async()
            self._fwd_issued += 1

    def attach_param_offload(self, offload: Any) -> None:
        """Stage 3, ``[offload] params`` (``"disk"``, or ``"cpu"`` on CUDA): the units' shards are loaded before each gather (reading
        ``offload.prefetch`` units ahead in the order of the gathers) and evicted after it."""
        self.param_offload = offload
        for u in self.units:
            u.before_gather = self._before_gather
            u.after_gather = offload.release

    def attach_step_waiter(self, wait: Callable[[Unit], None]) -> None:
        """Stage 3, ``[offload] overlap``: a unit's gather first waits for the optimizer step of its rows, which
        runs in the background ([Note: overlapped step] in memsave/offload/state.py)."""
        self.step_waiter = wait
        for u in self.units:
            u.before_gather = self._before_gather

    def _before_gather(self, unit: Unit) -> None:
        if self.step_waiter is not None:
            self.step_waiter(unit)
        if self.param_offload is None:
            return
        order = self._gather_order
        at = next((i for i, u in enumerate(order) if u is unit), len(order))
        self.param_offload.load(unit, ahead=order[at + 1 :])

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        mdist.doing(self.agreement.step, "forward", "<root>")
        self.agreement.check("forward")  # its gathers would pair with a peer's other collectives
        if self._graph_pending and not torch.is_grad_enabled():
            # a no_grad forward (a metric or teacher pass) between a training forward and its backward: it must
            # leave every unit as that backward expects it
            kept = {u.index for u in self.units if u.state is ShardedState.UNSHARDED}
            self._nested.append((self._fwd_issued, self._fwd_ran, self._bwd_issued, self._bwd_ran,
                                 self._gather_order, kept))
        self._fwd_issued, self._fwd_ran = 0, set()
        self._gather_order = self.units
        root = self.units[0]
        with record_function("memsave::zero3::pre_forward"):
            self._issue_forward_through(self.config.prefetch)
            root.unshard_wait()
            self._fwd_ran.add(0)

    def _make_pre_forward(self, unit: Unit) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
            k = unit.index
            mdist.doing(self.agreement.step, "forward", unit.name)
            with record_function("memsave::zero3::pre_forward"):
                self._issue_forward_through(k + self.config.prefetch)
                for j in range(1, k):  # gathered in order but skipped by this forward
                    if j not in self._fwd_ran:
                        self._settle_skipped(self.units[j])
                unit.unshard_wait()
                self._fwd_ran.add(k)
            if torch.is_grad_enabled():
                return self._watch_inputs(unit, args, kwargs)
            return None
        return hook

    def _watch_inputs(self, unit: Unit, args: Any, kwargs: dict[str, Any]) -> Any:
        """[Note: post-backward] Route the inputs that require grad through :class:`_PostBackward`."""
        flat, spec = tree_flatten((args, kwargs))
        where = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not where:
            unit.blind_calls += 1  # nothing tells when this call's backward ends: reshard at the end of backward
            return None
        unit.open_calls += 1
        outs = _PostBackward.apply(lambda: self._post_backward(unit), *(flat[i] for i in where))
        for i, t in zip(where, outs):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def _post_backward(self, unit: Unit) -> None:
        unit.open_calls -= 1
        self._maybe_reshard_in_backward(unit)

    def _maybe_reshard_in_backward(self, unit: Unit) -> None:
        """Stage 3: free a unit once all of its backward ran ([Note: post-backward])."""
        if (self.stage == 3 and not unit.is_root and unit.pending == 0 and unit.open_calls <= 0
                and unit.blind_calls == 0 and not self._keep_gathered):
            unit.reshard()

    def _settle_skipped(self, unit: Unit) -> None:
        """A unit this rank's forward skipped ends forward in the state it would have after running, so the
        backward gathers stay the same on every rank ([Note: collective order])."""
        if self._keep_for_backward(unit):
            unit.unshard_wait()
        else:
            unit.reshard()

    def _keep_for_backward(self, unit: Unit) -> bool:
        """The last unit of forward is the first of backward: freeing it would only buy one more gather."""
        return torch.is_grad_enabled() and (not self.config.reshard_after_forward or unit.index == len(self.units) - 1)

    def _make_post_forward(self, unit: Unit) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self._keep_for_backward(unit) and not (self._nested and unit.index in self._nested[-1][-1]):
                unit.reshard()
            if torch.is_grad_enabled():
                hooked = False
                for t in output_tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._make_pre_backward(unit))
                        hooked = True
                if not hooked and unit.trainable:  # its backward would run on freed parameters
                    raise NotImplementedError(
                        f"ZeRO-3 unit {unit.name!r} ({type(module).__name__}) returned a {type(output).__name__} in "
                        "which memsave finds no tensor that requires grad (it looks into tensors, tuples, lists, "
                        "dicts, dataclasses and objects' __dict__ / __slots__), so it cannot gather the unit again "
                        "before its backward; return the tensors in one of those, or pass units= without this module"
                    )
        return hook

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        # Units no rank-local forward reached are still gathered, in order, and freed ([Note: collective order]).
        self._issue_forward_through(len(self.units) - 1)
        for j in range(1, len(self.units)):
            if j not in self._fwd_ran:
                self._settle_skipped(self.units[j])
        if self._nested:  # back to the training forward's state ([Note: collective order] holds: same on all ranks)
            *saved, kept = self._nested.pop()
            for u in self.units:
                if u.index not in kept:
                    u.reshard()
            self._fwd_issued, self._fwd_ran, self._bwd_issued, self._bwd_ran, self._gather_order = saved
            return
        if not torch.is_grad_enabled():
            for u in self.units:
                u.reshard()
        else:
            self._graph_pending = True
        self._bwd_issued, self._bwd_ran = len(self.units), set()
        self._gather_order = list(reversed(self.units[1:])) if torch.is_grad_enabled() else self.units

    # -- stage 3: parameters read outside their unit's forward ([Note: guarded reads] in guards.py) ----------
    def _root_owners(self) -> list[nn.Module]:
        """Modules holding root-unit parameters directly, outside every block unit (embeddings, final norm, head):
        calling one outside the model's forward (HF's ``get_input_embeddings()(ids)``) gathers the root."""
        root = set(self.units[0].params)
        inside = {id(m) for u in self.units[1:] for m in u.module.modules()}
        return [m for m in self.model.modules()
                if id(m) not in inside and any(p in root for p in m.parameters(recurse=False))]

    def _gather_root_on_access(self, module: nn.Module, args: Any) -> None:
        root = self.units[0]
        if root.state is ShardedState.SHARDED:  # a collective: every rank makes the same call (SPMD)
            with record_function("memsave::zero3::gather_on_access"):
                root.unshard_wait()  # freed again at the end of the next backward, or after a no_grad forward

    def _sharded_read(self, unit: Unit, i: int, what: str) -> None:
        raise RuntimeError(
            f"memsave ZeRO-3: parameter {unit.names[i]!r} was read ({what}) while its unit {unit.name!r} is sharded "
            "(it holds no values outside that unit's forward and backward). Read it inside the forward of the "
            "module that owns it, or gather first on every rank: model.unshard(), then model.reshard(); for a copy "
            "of the weights use model.state_dict() (collective)"
        )

    def reshard_all(self) -> None:
        """Stage 3: free every gathered unit (units gathered on access, before the optimizer changes the shards)."""
        if self.stage == 3:
            for u in self.units:
                u.reshard()

    # -- stage 3 backward ----------------------------------------------------------------------------------
    def _issue_backward_through(self, k: int) -> None:
        """Issue gathers, in backward order, for every non-root unit down to index ``k``."""
        while self._bwd_issued - 1 >= max(k, 1):
            self._bwd_issued -= 1
            self.units[self._bwd_issued].unshard_async()

    def _make_pre_backward(self, unit: Unit) -> Any:
        def hook(grad: torch.Tensor) -> None:
            k = unit.index
            if torch.is_grad_enabled():  # a create_graph backward (gradient penalty): its graph uses the parameters
                self._keep_gathered = self._creating_graph = True  # again in the next backward: free nothing
                self._queue_callback()  # until that one ends
            if k in self._bwd_ran:
                return
            mdist.doing(self.agreement.step, "backward", unit.name)
            self._queue_callback()
            with record_function("memsave::zero3::pre_backward"):
                self._bwd_ran.add(k)
                self._issue_backward_through(k - self.config.prefetch)
                for j in range(k + 1, len(self.units)):  # gathered in order, but not in this backward's graph
                    if j not in self._bwd_ran:
                        self.units[j].reshard()
                unit.unshard_wait()
        return hook

    # -- gradients -----------------------------------------------------------------------------------------
    def _queue_callback(self) -> None:
        if not self._callback_queued:
            mdist.doing(self.agreement.step, "backward (gradient reduce-scatters)")
            if self.require_grad_sync:
                self.agreement.check("backward")  # before its first reduce-scatter
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if self.loss_scaled and not self.in_scaled_backward:
            raise unscaled_backward_error()
        self._queue_callback()
        unit = self._unit_of[param]  # type: ignore[index]
        unit.pending -= 1
        if unit.pending == 0:
            self._ready.add(unit.index)
            if self.require_grad_sync:
                self._launch_ready_reduces()
            self._maybe_reshard_in_backward(unit)

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
            while len(self._inflight) > _REDUCES_IN_FLIGHT:  # bound the staging memory held by in-flight reduces
                self._inflight.pop(0).wait_reduce()

    def _finalize_backward(self) -> None:
        """End of backward: reduce what is left in order, settle unused parameters, free gathered units."""
        self._callback_queued = False
        if self.stage == 3 and self.config.reshard_after_forward:
            self._issue_backward_through(1)
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
        self._ready.clear()
        for u in self.units:
            u.pending = len(u.trainable)
        if self._creating_graph:  # the end of a create_graph backward: the next backward reads the gathered
            self._creating_graph = False  # parameters again (through the graph this one made); keep them all
            return
        self._keep_gathered = self._graph_pending = False
        for u in self.units:
            u.open_calls = u.blind_calls = 0
            u.reshard()

    # -- optimizer side ------------------------------------------------------------------------------------
    def gather_params_after_step(self) -> None:
        """Stages 1-2: every rank stepped its rows; all-gather them so all ranks hold the full parameters."""
        if self.stage == 3:
            return
        inflight: list[tuple[Unit, Any]] = []
        for u in self.units:
            inflight.append((u, u.launch_param_gather()))
            if len(inflight) > _REDUCES_IN_FLIGHT:  # bound the transient staging memory
                done, handle = inflight.pop(0)
                done.finish_param_gather(handle)
        for u, handle in inflight:
            u.finish_param_gather(handle)

    def shard_grad(self, shard: torch.Tensor) -> torch.Tensor | None:
        """The averaged gradient rows for an optimizer shard, in the reduce dtype (see :meth:`Unit.shard_grad`)."""
        unit, i = self._slot_of[shard]
        return unit.shard_grad(i)

    def zero_grad(self, set_to_none: bool) -> None:
        if not set_to_none and self.before_zero_in_place is not None:
            self.before_zero_in_place()  # [offload] overlap: a background step may still read the gradients
        for u in self.units:
            u.zero_grad(set_to_none)

    # -- stage 3 state dicts -------------------------------------------------------------------------------
    def unshard_all(self) -> None:
        for u in self.units:
            u.unshard_async()
        for u in self.units:
            u.unshard_wait()

    def _pre_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        mdist.expect_every_rank("model.state_dict() under ZeRO-3", self.group)  # not a 600 s hang on rank 0 alone
        self.unshard_all()

    def _post_state_dict(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> dict:
        for key, value in state_dict.items():
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in self._full_ptrs():
                state_dict[key] = value.detach().clone()
        for u in self.units:
            u.reshard()
        return state_dict

    def _full_ptrs(self) -> set[int]:
        return {u.full_flat.untyped_storage().data_ptr() for u in self.units}

    def _pre_load_state_dict(self, *args: Any, **kwargs: Any) -> None:
        if self.stage == 3:
            mdist.expect_every_rank("model.load_state_dict() under ZeRO-3", self.group)
            self.unshard_all()

    def _post_load_state_dict(self, module: nn.Module, incompatible_keys: Any) -> None:
        loaded: dict[torch.Tensor, torch.Tensor] | None = None  # shards that leave memory: their new rows
        if self.stage == 3:
            if self.param_offload is not None and self.load_listeners:
                loaded = {}
            for u in self.units:
                if self.param_offload is not None:
                    self.param_offload.enter(u)  # the shard changes: loaded, written back below
                u.write_back_full()
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
