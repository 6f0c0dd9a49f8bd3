"""The stage-3 schedule: when each unit is gathered and freed around forward and backward.

The schedule is one object with a named :class:`~memsave.phases.TrainingState`; its transitions are the table
``_TRANSITIONS`` below and happen only in :meth:`Stage3Schedule._enter`. Each unit's own lifecycle
(SHARDED -> GATHERING -> UNSHARDED) is in ``memsave/zero/unit.py`` ([Note: unit lifecycle]).

[Note: collective order] Collectives match across ranks by issue order, so every rank issues them in the
static unit order whatever its data does: gathers strictly in forward order during forward and backward order
during backward. A unit that some rank skips is still gathered there (and freed at once), so a skipped unit
costs a collective, not a hang. Each pass gathers a unit at most once: a gather is issued only from SHARDED.

[Note: root unit] The root holds what no block owns (embeddings, final norm, head; and any parameter shared
between units, e.g. tied embeddings). It is gathered when the model's forward starts and kept until its
gradients are reduced at the very end of backward: its parameters are used at both ends of forward and at the
start of backward, so freeing it in between would only cost an extra gather.

[Note: recomputed units] Units recomputed by ``memsave.recompute`` need nothing from this schedule: its hooks
sit on the unit module itself, so they run around the checkpoint, never inside the replayed forward, and the
pre-backward gather on a unit's outputs fires before the replay; keep stage-3 hooks on the unit module, not on
its submodules (see [Note: hooks stay outside the recomputed region] in memsave/recompute/checkpoint.py).

[Note: post-backward] A unit may be resharded in backward only once *all* of its backward has run, not when its
trainable gradients have arrived: backward nodes that use a frozen parameter (a frozen norm, LoRA's base
weight) may still be waiting. As FSDP2 does, the unit's forward inputs that require grad pass through an
identity autograd function whose backward runs once every gradient with respect to them was computed, i.e. after
every node of the unit on a path to its inputs; the trainable gradients cover the other nodes. A unit whose
inputs need no gradient (the first block under frozen embeddings) is resharded at the end of backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_unflatten

from memsave import dist as mdist
from memsave.models.units import output_tensors
from memsave.phases import TrainingState, UnitState
from memsave.zero.unit import Unit

if TYPE_CHECKING:
    from memsave.zero.engine import ZeroEngine

__all__ = ["Stage3Schedule"]

_S = TrainingState
_TRANSITIONS: dict[TrainingState, tuple[TrainingState, ...]] = {
    _S.IDLE: (_S.FORWARD, _S.BACKWARD),
    # FORWARD -> FORWARD: a forward that raised is followed by the next one
    _S.FORWARD: (_S.AWAIT_BACKWARD, _S.IDLE, _S.FORWARD),
    # -> FORWARD: a second training forward before one backward, or a no_grad forward in between (nested)
    _S.AWAIT_BACKWARD: (_S.BACKWARD, _S.FORWARD),
    # -> AWAIT_BACKWARD: the end of a create_graph backward; -> FORWARD: a forward in a backward hook
    _S.BACKWARD: (_S.IDLE, _S.AWAIT_BACKWARD, _S.BACKWARD, _S.FORWARD),
}



_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _replayed(unit: Unit) -> bool:
    """[Note: replayed by torch's checkpoint] Whether this forward of ``unit`` is the user's non-reentrant
    ``torch.utils.checkpoint`` replaying it inside the backward to rebuild saved tensors (under torch's
    ``_recomputation_hook``). Its graph is never differentiated, so a post-backward watch on its inputs would never
    close and keep the unit gathered to the end of backward: every block, with one checkpoint per block. (A
    reentrant checkpoint's replay is differentiated, in a backward of its own: it is watched as a forward.)"""
    if torch._C._current_graph_task_id() == -1:
        return False
    if _top_hooks is None:  # a torch without the query: a unit already gathered in backward is being replayed
        return unit.state is UnitState.UNSHARDED
    top = _top_hooks(True)
    return top is not None and getattr(top[0], "__qualname__", "").startswith("_recomputation_hook.")

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


@dataclasses.dataclass
class _Pass:
    """One forward or backward pass over the units: the order of its gathers, how many it issued, which units
    ran in it."""

    order: list[Unit]
    issued: int = 0
    ran: set[int] = dataclasses.field(default_factory=set)


class Stage3Schedule:
    """Gathers ahead (``[zero] prefetch`` units), frees after use, and keeps every rank's gathers in order."""

    def __init__(self, engine: ZeroEngine) -> None:
        self.engine = engine
        self.units = engine.units
        self.prefetch = engine.config.prefetch
        self.reshard_after_forward = engine.config.reshard_after_forward
        self.state = TrainingState.IDLE
        # the units in the order a forward calls them, the root first: registration order until the first step
        # tells otherwise ([Note: the units' call order] in engine.py); position: a unit's index -> its place there
        self.in_order: list[Unit] = list(self.units)
        self.position: dict[int, int] = {u.index: i for i, u in enumerate(self.units)}
        self.forward = _Pass(self.in_order)
        self.backward = _Pass(list(reversed(self.in_order[1:])))  # the root is gathered for the whole step
        self.nested: list[tuple[_Pass, _Pass, set[int]]] = []  # passes saved around a no_grad forward mid-step
        self.keep_gathered = False  # a create_graph backward ran: free nothing until a backward without it ends
        self.creating_graph = False  # the backward running now creates a graph (create_graph=True)
        self.gather_order: list[Unit] = self.in_order  # the order the next gathers come in (for disk reads ahead)
        self.keep_root = False  # a pipeline step: the root unit stays gathered across its micro-batches
        # a pipeline with virtual stages: a unit of this rank's other stage that the forward of this stage calls
        # only to pass the received activation through (memsave/pp/runtime.py); its hooks do nothing then
        self.passes_through: Callable[[Unit], bool] | None = None

    def _enter(self, state: TrainingState) -> None:
        if state not in _TRANSITIONS[self.state]:
            raise AssertionError(f"memsave ZeRO-3 schedule: {self.state.name} -> {state.name} is not a transition")
        self.state = state

    def register(self, model: nn.Module) -> list[Any]:
        """[Note: hooks outside compiled code] The gather, free and watch hooks run eagerly under
        ``torch.compile``: dynamo breaks the graph around each (``torch.compiler.disable``) instead of tracing
        into them, where it met sharded parameters and failed. So the whole model, ``model.compile()`` and
        each block's ``compile()`` work after ``wrap``: a unit's forward is traced with its parameters
        gathered (a graph per distinct block), and the units are freed as in eager mode."""
        eager = torch.compiler.disable
        hooks = [model.register_forward_pre_hook(eager(self._root_pre_forward), prepend=True),
                 model.register_forward_hook(eager(self._root_post_forward))]
        for u in self.units[1:]:
            hooks.append(u.module.register_forward_pre_hook(eager(self._make_pre_forward(u)), with_kwargs=True))
            hooks.append(u.module.register_forward_hook(eager(self._make_post_forward(u))))
        for m in self._root_owners(model):
            hooks.append(m.register_forward_pre_hook(eager(self._gather_root_on_access)))
        return hooks

    # -- forward -------------------------------------------------------------------------------------------
    def settled(self) -> bool:
        """Between steps: no pass in progress, nothing kept for a later backward."""
        return self.state is TrainingState.IDLE and not self.nested

    def adopt_order(self, in_order: list[Unit]) -> None:
        """Gather in ``in_order`` (the root first) from the next forward on; between steps, on every rank alike."""
        assert self.settled()
        self.in_order = in_order
        self.position = {u.index: i for i, u in enumerate(in_order)}
        self.forward = _Pass(in_order)
        self.backward = _Pass(list(reversed(in_order[1:])))
        self.gather_order = in_order

    def _issue_forward_through(self, p: int) -> None:
        """Issue gathers, in forward order, for every unit up to position ``p`` ([Note: collective order])."""
        fwd = self.forward
        while fwd.issued <= min(p, len(fwd.order) - 1):
            fwd.order[fwd.issued].unshard_async()
            fwd.issued += 1

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        agreement = self.engine.agreement
        mdist.doing(agreement.step, "forward", "<root>")
        agreement.check("forward")  # its gathers would pair with a peer's other collectives
        if self.state is TrainingState.AWAIT_BACKWARD and not torch.is_grad_enabled():
            # a no_grad forward (a metric or teacher pass) between a training forward and its backward: it must
            # leave every unit as that backward expects it
            kept = {u.index for u in self.units if u.state is UnitState.UNSHARDED}
            self.nested.append((self.forward, self.backward, kept))
        self._enter(TrainingState.FORWARD)
        self.forward = _Pass(self.in_order)
        self.gather_order = self.in_order
        with record_function("memsave::zero3::pre_forward"):
            self._issue_forward_through(self.prefetch)
            self.units[0].unshard_wait()
            self.forward.ran.add(0)

    def _make_pre_forward(self, unit: Unit) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
            if self.passes_through is not None and self.passes_through(unit):
                return None
            p = self.position[unit.index]
            replay = _replayed(unit)
            mdist.doing(self.engine.agreement.step, "forward", unit.name)
            with record_function("memsave::zero3::pre_forward"):
                self._issue_forward_through(p + self.prefetch)
                for before in self.forward.order[1:p]:  # gathered in order but skipped by this forward
                    if before.index not in self.forward.ran:
                        self._settle_skipped(before)
                unit.unshard_wait()
                self.forward.ran.add(unit.index)
            if torch.is_grad_enabled() and not replay:
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
        self.maybe_reshard_in_backward(unit)

    def maybe_reshard_in_backward(self, unit: Unit) -> None:
        """Free a unit once all of its backward ran ([Note: post-backward])."""
        if (not unit.is_root and unit.pending == 0 and unit.open_calls <= 0 and unit.blind_calls == 0
                and not self.keep_gathered):
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
        return torch.is_grad_enabled() and (not self.reshard_after_forward
                                            or self.position[unit.index] == len(self.units) - 1)

    def _make_post_forward(self, unit: Unit) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.passes_through is not None and self.passes_through(unit):
                return
            # a forward inside the backward is the user's checkpoint recomputing the unit, whose backward runs
            # next: it stays gathered for it (a reentrant region gathered it again), as FSDP2 keeps it
            recomputing = torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1
            if (not self._keep_for_backward(unit) and not recomputing
                    and not (self.nested and unit.index in self.nested[-1][-1])):
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
        for u in self.forward.order[1:]:
            if u.index not in self.forward.ran:
                self._settle_skipped(u)
        if self.nested:  # back to the training forward's state ([Note: collective order] holds: same on all ranks)
            self.forward, self.backward, kept = self.nested.pop()
            for u in self.units:
                if u.index not in kept:
                    u.reshard()
            self._enter(TrainingState.AWAIT_BACKWARD)
            self.gather_order = self.backward.order
            return
        if not torch.is_grad_enabled():
            for u in self.units:
                u.reshard()
            self._enter(TrainingState.IDLE)
            self.gather_order = self.in_order
            return
        self._enter(TrainingState.AWAIT_BACKWARD)
        self.backward = _Pass(list(reversed(self.in_order[1:])))
        self.gather_order = self.backward.order
        for t in output_tensors(output):
            if t.requires_grad:
                t.register_hook(self._root_pre_backward)

    def _root_pre_backward(self, grad: torch.Tensor) -> None:
        """A second backward through a graph whose first backward ended, and freed the root with every unit
        (``retain_graph=True``, or two losses of two forwards backwarded one by one): the root's backward runs
        first, before any unit's hook, on its saved views of freed parameters (a review: torch's "setStorage ...
        out of bounds"). So the root is gathered again as the gradient reaches the model's outputs (a no-op in
        the first backward, which finds it gathered since the forward); the units gather in their own hooks."""
        root = self.units[0]
        if root.state is UnitState.SHARDED:
            root.unshard_wait()

    # -- parameters read outside their unit's forward ([Note: guarded reads] in guards.py) ------------------
    def _root_owners(self, model: nn.Module) -> list[nn.Module]:
        """Modules holding root-unit parameters directly, outside every block unit (embeddings, final norm, head):
        calling one outside the model's forward (HF's ``get_input_embeddings()(ids)``) gathers the root."""
        root = set(self.units[0].params)
        inside = {id(m) for u in self.units[1:] for m in u.module.modules()}
        return [m for m in model.modules()
                if id(m) not in inside and any(p in root for p in m.parameters(recurse=False))]

    def _gather_root_on_access(self, module: nn.Module, args: Any) -> None:
        root = self.units[0]
        if root.state is UnitState.SHARDED:  # a collective: every rank makes the same call (SPMD)
            with record_function("memsave::zero3::gather_on_access"):
                root.unshard_wait()  # freed again at the end of the next backward, or after a no_grad forward

    # -- backward ------------------------------------------------------------------------------------------
    def _issue_backward_through(self, p: int) -> None:
        """Issue gathers, in backward order, for every non-root unit down to forward position ``p``."""
        bwd = self.backward
        while bwd.issued < len(bwd.order) and self.position[bwd.order[bwd.issued].index] >= max(p, 1):
            bwd.order[bwd.issued].unshard_async()
            bwd.issued += 1

    def _make_pre_backward(self, unit: Unit) -> Any:
        def hook(grad: torch.Tensor) -> None:
            k = unit.index
            if torch.is_grad_enabled():  # a create_graph backward (gradient penalty): its graph uses the parameters
                self.keep_gathered = self.creating_graph = True  # again in the next backward: free nothing
                self.engine.queue_sync()  # until that one ends
            if k in self.backward.ran:
                return
            mdist.doing(self.engine.agreement.step, "backward", unit.name)
            self.engine.queue_sync()
            with record_function("memsave::zero3::pre_backward"):
                self.backward.ran.add(k)
                p = self.position[k]
                self._issue_backward_through(p - self.prefetch)
                for after in self.in_order[p + 1:]:  # gathered in order, but not in this backward's graph
                    if after.index not in self.backward.ran:
                        after.reshard()
                unit.unshard_wait()
        return hook

    def begin_backward(self) -> None:
        if self.state is not TrainingState.BACKWARD:
            self._enter(TrainingState.BACKWARD)

    def before_reduces(self) -> None:
        """The end of backward, before the last reduce-scatters: the gathers no rank's backward reached."""
        if self.reshard_after_forward:
            self._issue_backward_through(1)

    def end_backward(self) -> None:
        """After the reduce-scatters: free every unit, unless a create_graph backward's graph still needs them."""
        for u in self.units:
            u.pending = len(u.trainable)
        if self.creating_graph:  # the end of a create_graph backward: the next backward reads the gathered
            self.creating_graph = False  # parameters again (through the graph this one made); keep them all
            self._enter(TrainingState.AWAIT_BACKWARD)
            return
        self.keep_gathered = False
        self._enter(TrainingState.IDLE)
        # a next backward without a forward in between (a pipeline runs several forwards, then their backwards)
        # gathers again what this one frees
        self.backward = _Pass(list(reversed(self.in_order[1:])))
        for u in self.units:
            u.open_calls = u.blind_calls = 0
            if not (u.is_root and self.keep_root):
                u.reshard()
