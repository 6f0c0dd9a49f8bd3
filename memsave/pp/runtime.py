"""The pipeline runtime: runs a schedule's actions (memsave/pp/schedule.py) on this rank's stages of an unchanged
model, with the user's own ``forward``.

[Note: the stage runner] Every rank runs the user's whole ``forward`` for each of its forward actions ``F s.mb``;
the atom wrappers ([Note: atoms] in memsave/pp/split.py) decide what each atom call does for stage ``s``:
- an atom of stage ``s`` runs;
- an atom of an earlier stage whose output stage ``s`` reads ([Note: the probe] in probe.py) returns the tensors
  received from the stage that ran it (leaves that require grad: their gradients go back in the backward);
- any other atom of an earlier stage returns a placeholder of the right structure (expanded zeros);
- after the last atom call of stage ``s`` the forward stops (an internal exception, caught by the root's
  wrapped forward, so the root's hooks still run); the last stage runs to the end, and its loss is the output.

A backward action ``B s.mb`` runs autograd from what stage ``s`` sent on (with the gradients its readers sent
back) or from its loss; the zero-bubble split runs ``I`` (``torch.autograd.grad`` to the received tensors only,
keeping the graph) and later ``W`` (the backward into the parameters). Messages between stages on one rank (a
virtual stage's neighbour, a skip) are handed over in memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from memsave import dist as mdist
from memsave.dist.p2p import (
    P2P,
    PeerFailed,
    announce_failure,
    arrive,
    drop_published,
    publish,
    set_failure_scope,
    wait_published,
)
from memsave.pp.message_order import evaluation_schedule
from memsave.pp.probe import CallKey, Layout, Probe, Share
from memsave.pp.runtime_messages import AUTOCAST_HINT, Messages, is_grad_dtype
from memsave.pp.schedule import Action, Schedule
from memsave.pp.split import StageSplit
from memsave.pp.split_backward import WeightPass, backward_input
from memsave.recompute.checkpoint import RecomputedRegion, split_backward

__all__ = ["StageRunner"]


_RUNNERS = itertools.count()


class _StageDone(Exception):
    """Raised after a stage's last atom call: the rest of the forward belongs to later stages."""


@dataclasses.dataclass
class _Ctx:
    """The forward action being run."""

    stage: int
    received: dict[CallKey, Any]
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    produced: dict[CallKey, list[torch.Tensor]] = dataclasses.field(default_factory=dict)
    done: bool = False


@dataclasses.dataclass
class _Held:
    """What a forward action keeps until its backward: the tensors it sent on, the tensors it received."""

    produced: dict[CallKey, list[torch.Tensor]]
    received: dict[CallKey, list[torch.Tensor]]
    loss: torch.Tensor | None
    weight_pass: WeightPass | None = None  # after an I: what W runs ([Note: the I/W split])
    regions: list[RecomputedRegion] = dataclasses.field(default_factory=list)  # the forward's recomputed calls


class StageRunner(Messages):
    """Executes schedules for the stages ``local_stages`` of ``model`` ([Note: the stage runner]).

    ``peer(pp_rank)``: the global rank of a pp rank of this rank's slice. Installed once (:meth:`install`)."""

    def __init__(self, model: nn.Module, split: StageSplit, *, pp_rank: int, pp_size: int,
                 peer: Callable[[int], int], pp_group: Any, device: torch.device) -> None:
        self.model, self.split, self.device = model, split, device
        self.pp_rank, self.pp_size, self.peer, self.pp_group = pp_rank, pp_size, peer, pp_group
        self.n_stages = split.n_stages
        self.local_stages = [s for s in range(self.n_stages) if s % pp_size == pp_rank]
        # [Note: no step after a failed one] a step that raised inside its schedule (after the probe) leaves its
        # messages in flight: gloo's posted receives and undrained sends, NCCL's order. The next step's would pair
        # with them: it hung for the collective timeout, or a stage computed on a peer's other step with no error
        # (a review). So every later step raises at once, naming the first error, on every rank of the pipeline.
        self.broken: str | None = None
        self.p2p = P2P(device)
        self.ctx: _Ctx | None = None
        self.probe: Probe | None = None
        self.layouts: dict[Any, Layout] = {}
        self.layout: Layout | None = None
        self._mailbox: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        self._posted: dict[tuple[Any, ...], list[Any]] = {}
        self._orders = {}
        self._ops, self._position, self._cursor, self._ready, self._early = [], {}, 0, {}, set()
        self._loss_m, self._loss_recv = None, None
        self._held: dict[tuple[int, int], _Held] = {}
        self._originals: list[tuple[nn.Module, Any]] = []
        self._hooks: list[Any] = []
        self._stops: set[str] = set()  # atoms with the stop hook
        self.last_losses: list[torch.Tensor] = []
        self.freed_bytes = 0  # sent activations freed ([Note: freed sends])
        self.max_in_flight = 0  # the most (stage, micro-batch) forwards held for their backward at once
        self.uid = next(_RUNNERS)  # the same on every rank: pipelines are built in the same order everywhere
        self.steps = 0
        # [Note: action timing] None, or a list the runner appends one (kind, stage, mb, start, end, waited) to
        # per action of :meth:`run` (kind "drain" for the closing wait on sends): perf_counter seconds, waited the
        # part of it spent in receive waits. memsave bench --pp feeds these to memsave.pp.simulate.
        self.timing: list[tuple[str, int, int, float, float, float]] | None = None
        self._waited = 0.0

    # -- installation ----------------------------------------------------------------------------------------
    def install(self) -> None:
        """Wrap every atom's ``forward`` and the root's ([Note: the stage runner]); :meth:`remove` undoes it."""
        for name in self.split.atoms:
            module = self.model.get_submodule(name)
            self._originals.append((module, module.__dict__.get("forward")))
            module.forward = self._atom_forward(name, module.forward)
        root = self.model
        self._originals.append((root, root.__dict__.get("forward")))
        inner = root.forward

        def root_forward(*args: Any, **kwargs: Any) -> Any:
            try:
                return inner(*args, **kwargs)
            except _StageDone:
                return None

        root.forward = root_forward

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        for module, forward in reversed(self._originals):
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward
        self._hooks.clear()
        self._stops.clear()
        self._originals.clear()

    def _atom_forward(self, name: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        stage = self.split.stage_of[name]

        def run(*args: Any, **kwargs: Any) -> Any:
            probe, ctx = self.probe, self.ctx
            if probe is not None and probe.active:
                return probe.call(name, forward, args, kwargs)
            if ctx is None:
                raise RuntimeError(
                    f"{name!r} was called outside a pipeline step: under pipeline parallelism (pp > 1) each rank "
                    "holds only its stages, so the model (or one of its parts) cannot run a forward by itself. "
                    "Train with model.pipeline_step(micro_batches, ...) (or memsave.Trainer), evaluate with "
                    "model.pipeline_loss(micro_batches, ...); for generate() or other forwards, "
                    "model.save_pretrained(folder) (every rank) and load it in a process without pp")
            idx = ctx.counts.get(name, 0)
            ctx.counts[name] = idx + 1
            key = (name, idx)
            if stage == ctx.stage:
                out = forward(*args, **kwargs)
                assert self.layout is not None
                if key in self.layout.readers:
                    ctx.produced[key] = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
                ctx.done = key == self.layout.last_call[ctx.stage] and ctx.stage != self.n_stages - 1
                return out
            if stage < ctx.stage:
                if key in ctx.received:
                    return ctx.received[key]
                assert self.layout is not None
                return self.layout.structure[key].placeholder(self.device)  # (cached expanded zeros)
            raise AssertionError(f"pipeline runtime: {name!r} of stage {stage} called in the forward of stage "
                                 f"{ctx.stage} after its last module")

        return run

    def _stop_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        """After the stage's last atom call (and the hooks registered before this one: ZeRO's), end the forward."""
        ctx = self.ctx
        if ctx is not None and ctx.done:
            raise _StageDone()

    # -- the probe -------------------------------------------------------------------------------------------
    def ensure_layout(self, signature: Any, forward_and_loss: Callable[[], Any]) -> Layout:
        """The layout for this input signature, probed (and agreed over pp) the first time it is seen. Called at
        the start of every step: a failure announced in a step ends that step's waits only."""
        self.steps += 1
        set_failure_scope(f"{self.uid}/{self.steps}")
        if self.broken is not None:  # [Note: no step after a failed one]
            announce_failure(f"an earlier pipeline step raised ({self.broken})")  # (a peer waiting in this step)
            raise RuntimeError(
                f"memsave pipeline: an earlier pipeline_step or pipeline_loss raised inside its schedule ({self.broken}"
                "); that step's messages to and from the other stages may still be in flight, and the next step's "
                "would pair with them (a hang, or one stage's activations with another step's labels). Unlike a loop "
                "without pipeline parallelism, a pipeline cannot skip a step that raised: end the run and resume "
                "from the last checkpoint")
        layout = self.layouts.get(signature)
        if layout is None:
            local = set(self.local_stages)
            share = None
            if self.pp_size > 1:  # [Note: structures the meta device cannot find] in probe.py
                ranks = "-".join(str(self.peer(r)) for r in range(self.pp_size))
                share = Share(f"memsave/pp/probe/{self.uid}/{self.steps}/{ranks}", publish, wait_published)
            self.probe = Probe(self.split.stage_of, lambda n: self.split.stage_of[n] in local, self.device, share)
            try:
                layout = self.probe.run(forward_and_loss, self.n_stages, self.model)
            except BaseException as exc:
                announce_failure(f"{type(exc).__name__}: {exc}")
                raise
            finally:
                self.probe = None
            arrive("the pipeline probe", self.pp_group)  # a peer whose probe failed ends this rank too
            if share is not None:  # every rank has read what it needed
                drop_published(share.published)
            digests = mdist.all_gather_object(repr(layout.digest()), self.pp_group)
            if any(d != digests[0] for d in digests):
                bad = [r for r, d in enumerate(digests) if d != digests[0]]
                autocast = torch.is_autocast_enabled(self.device.type)
                raise RuntimeError(f"pipeline probe: pp ranks {bad} found another structure of the stages' outputs "
                                   f"than pp rank 0 ({AUTOCAST_HINT if autocast else 'the forward differs across ranks'})")
            self.layouts[signature] = layout
            for name in {k[0] for s, k in layout.last_call.items() if s != self.n_stages - 1} - self._stops:
                # the stop only where a stage can end: a hook keeps every call of its module off torch's fast path
                self._stops.add(name)
                self._hooks.append(self.model.get_submodule(name).register_forward_hook(self._stop_hook))
        self.layout = layout
        return layout

    # -- actions ---------------------------------------------------------------------------------------------
    def forward(self, stage: int, mb: int, run: Callable[[], Any], loss_of: Callable[[Any], torch.Tensor], *,
                keep: bool = True, regions: list[RecomputedRegion] | None = None) -> None:
        layout = self.layout
        assert layout is not None
        received: dict[CallKey, Any] = {}
        leaves: dict[CallKey, list[torch.Tensor]] = {}
        for key in layout.reads[stage]:
            structure = layout.structure[key]
            got = self._recv(layout.stage_of[key], stage, mb, key, backward=False)
            got = [t.detach().requires_grad_(is_grad_dtype(t)) for t in got]
            leaves[key] = got
            received[key] = structure.build(got)
        ctx = self.ctx = _Ctx(stage, received)
        try:
            mdist.doing(0, f"pipeline forward of stage {stage}, micro-batch {mb}")
            out = run()
        finally:
            self.ctx = None
        loss = None
        if stage == self.n_stages - 1:
            loss = loss_of(out)
            self.last_losses.append(loss.detach().float())
        elif not ctx.done:
            raise AssertionError(f"pipeline runtime: the forward of stage {stage} did not reach its last module")
        for key, tensors in ctx.produced.items():
            free = self._freeable(stage, key, tensors) if keep else frozenset()
            for dst in layout.readers[key]:
                self._send(tensors, stage, dst, mb, key, backward=False, free=free)
        if keep:
            self._held[(stage, mb)] = _Held(ctx.produced, leaves, loss, regions=regions or [])
            self.max_in_flight = max(self.max_in_flight, len(self._held))

    def _roots(self, stage: int, mb: int, held: _Held, scale: Callable[[torch.Tensor], torch.Tensor]
               ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """What the backward of (stage, mb) runs from: its loss, or what it sent on, with the readers' gradients."""
        if held.loss is not None:
            return [scale(held.loss)], [None]
        layout = self.layout
        assert layout is not None
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        for key, tensors in held.produced.items():
            total: list[torch.Tensor] | None = None
            graded = [t for t in tensors if is_grad_dtype(t)]  # the receivers send a gradient for each of these
            for dst in layout.readers[key]:
                got = self._recv(stage, dst, mb, key, backward=True)
                total = got if total is None else [a + b for a, b in zip(total, got)]
            for t, g in zip(graded, total or []):
                if t.requires_grad:
                    roots.append(t)
                    grads.append(g)
        return roots, grads

    def _post_ahead(self, a: Action) -> None:
        """Post the receives action ``a`` will wait for ([Note: receives posted ahead] in runtime_messages.py): a
        forward's inputs, or a backward's gradients."""
        layout = self.layout
        assert layout is not None
        if a.kind == "F":
            self._post_ahead_of([(a.mb, key, a.stage, False) for key in layout.reads[a.stage]])
        elif a.kind != "W":
            self._post_ahead_of([(a.mb, key, dst, True) for key, dsts in layout.readers.items()
                                 if layout.stage_of[key] == a.stage for dst in dsts])

    def _send_input_grads(self, stage: int, mb: int, held: _Held, grads: dict[CallKey, list[torch.Tensor]]
                          ) -> None:
        layout = self.layout
        assert layout is not None
        for key, tensors in held.received.items():
            out = [g if g is not None else torch.zeros_like(t) for t, g in zip(
                [t for t in tensors if t.requires_grad], grads[key])]
            self._send(out, layout.stage_of[key], stage, mb, key, backward=True)

    def backward(self, kind: str, stage: int, mb: int, scale: Callable[[torch.Tensor], torch.Tensor],
                 quiet: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext) -> None:
        """``B`` (full), ``I`` (to the received tensors only) or ``W`` (into the parameters, after an ``I``; its
        autograd calls but the last inside ``quiet()``, the engine's ``no_sync``)."""
        mdist.doing(0, f"pipeline backward ({kind}) of stage {stage}, micro-batch {mb}")
        held = self._held[(stage, mb)]
        if kind == "W":
            assert held.weight_pass is not None, f"W{stage}.{mb} before its I"
            held.weight_pass.run(quiet)
            del self._held[(stage, mb)]
            return
        roots, grads = self._roots(stage, mb, held, scale)
        inputs = [t for ts in held.received.values() for t in ts if t.requires_grad]
        if kind == "I":
            got, held.weight_pass = backward_input(roots, [g.detach() if g is not None else None for g in grads],
                                                   inputs, held.regions)
            self._send_input_grads(stage, mb, held, self._split_by_key(held, got))
            return
        if roots:
            torch.autograd.backward(roots, grads)
        self._send_input_grads(stage, mb, held, self._split_by_key(held, [t.grad for t in inputs]))
        del self._held[(stage, mb)]

    # -- a step ----------------------------------------------------------------------------------------------
    def run_forward(self, micro_batches: int, run_mb: Callable[[int], Any],
                    loss_of: Callable[[int, Any], torch.Tensor]) -> torch.Tensor:
        """Forwards only, without autograd (an evaluation): each micro-batch through this rank's stages in order.
        Returns the sum of the losses, shape (1,), on every rank ([Note: the loss by message])."""
        self.last_losses = []
        try:
            self._begin(evaluation_schedule(self.pp_size, self.n_stages // self.pp_size, micro_batches),
                        forward_only=True)
            with torch.no_grad(), mdist.trim_held():  # [Note: no trim in a pipeline step]
                for mb in range(micro_batches):
                    for stage in self.local_stages:
                        self.forward(stage, mb, functools.partial(run_mb, mb), functools.partial(loss_of, mb),
                                     keep=False)
            total = self._drain(self._send_loss(micro_batches))
        except BaseException as exc:
            if not isinstance(exc, PeerFailed):
                announce_failure(f"{type(exc).__name__}: {exc}")
            self.broken = f"{type(exc).__name__}: {exc}"
            self._forget_step()
            raise
        return total

    def run(self, schedule: Schedule, run_mb: Callable[[int], Any], loss_of: Callable[[int, Any], torch.Tensor],
            *, backward_ctx: Callable[[bool], contextlib.AbstractContextManager[None]],
            scale: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Run this rank's actions of ``schedule``; return the sum of the micro-batches' losses, shape (1,), on every
        rank ([Note: the loss by message]). ``backward_ctx(last)`` wraps each backward action (the engine's
        ``no_sync`` for all but this rank's last one)."""
        actions = schedule.actions[self.pp_rank]
        last_bwd = max((i for i, a in enumerate(actions) if a.kind in ("B", "W")), default=-1)
        # a split backward (I, then W) goes through each forward's graph twice: recomputed units keep what their
        # selective recompute cached for the second pass, and note their calls for W to release
        # (memsave/recompute/checkpoint.py)
        split = any(a.kind == "W" for a in actions)
        self.last_losses = []
        timing, clock = self.timing, time.perf_counter
        m = schedule.micro_batches
        try:
            self._begin(schedule, forward_only=False)
            for i, a in enumerate(actions):
                if i + 1 < len(actions):
                    self._post_ahead(actions[i + 1])
                t0, self._waited = clock(), 0.0
                if a.kind == "F":
                    regions: list[RecomputedRegion] | None = [] if split else None
                    with (split_backward(regions) if split else contextlib.nullcontext()), mdist.trim_held():
                        # [Note: no trim in a pipeline step] (dist/host_memory.py)
                        self.forward(a.stage, a.mb, functools.partial(run_mb, a.mb),
                                     functools.partial(loss_of, a.mb), regions=regions)
                else:
                    with backward_ctx(i == last_bwd):
                        self.backward(a.kind, a.stage, a.mb, scale, quiet=lambda: backward_ctx(False))
                if timing is not None:
                    timing.append((a.kind, a.stage, a.mb, t0, clock(), self._waited))
            t0 = clock()
            total = self._drain(self._send_loss(m))
            if timing is not None:
                timing.append(("drain", -1, -1, t0, clock(), clock() - t0))
        except BaseException as exc:
            if not isinstance(exc, PeerFailed):
                announce_failure(f"{type(exc).__name__}: {exc}")
            self.broken = f"{type(exc).__name__}: {exc}"  # [Note: no step after a failed one]
            self._held.clear()
            self._forget_step()
            raise
        if self._held or self._mailbox:
            left = sorted(self._held)
            self._held.clear()
            self._mailbox.clear()
            raise RuntimeError(f"pipeline schedule {schedule.name!r} left forwards without a backward: {left}")
        return total
