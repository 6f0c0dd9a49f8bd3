"""The pipeline engine: a stage's data-parallel or ZeRO engine, driven by a schedule over micro-batches.

``memsave.wrap`` with ``[parallel] pp > 1`` splits the model (memsave/pp/split.py) *before* the inner engine is
built, so ZeRO, the optimizer and clipping see only this rank's stages' parameters; then this engine wraps the
inner one. It is the inner engine for everything of the :class:`~memsave.engines.Engine` protocol except:
- :meth:`placement_of`: the inner placement, ``Shard`` along ``pp`` (each stage holds other parameters, so the
  global norm adds the stages' parts and the overflow check agrees over pp), and ``tie_copy`` on the later
  holders of a tied parameter (counted once);
- :meth:`pipeline_step`: one optimizer step's forwards and backwards, as a schedule over the micro-batches
  (memsave/pp/runtime.py), every backward but this rank's last under the inner ``no_sync``; then the gradients of
  tied parameters are summed over their holding stages. The mean loss is returned on every rank: the last stage
  sends it to the others ([Note: the loss by message] in memsave/pp/runtime_messages.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from memsave import dist as mdist
from memsave.dist.p2p import new_subgroups
from memsave.engines.protocol import Engine
from memsave.inputs import leaves
from memsave.phases import MemoryCategory
from memsave.pp import schedule as pp_schedule
from memsave.pp.runtime import StageRunner
from memsave.pp.split import StageSplit

__all__ = ["PipelineEngine", "build_schedule"]


def build_schedule(name: str, pp: int, micro_batches: int, virtual: int = 1) -> pp_schedule.Schedule:
    """The schedule ``name`` (``[parallel] schedule``) for ``pp`` ranks and ``micro_batches``."""
    build = getattr(pp_schedule, "build", None)
    if build is not None:
        return build(name, pp, micro_batches, virtual)  # type: ignore[no-any-return]
    if name == "gpipe" and virtual == 1:
        return pp_schedule.gpipe(pp, micro_batches)
    if name == "1f1b" and virtual == 1:
        return pp_schedule.one_f_one_b(pp, micro_batches)
    raise NotImplementedError(f"[parallel] schedule = {name!r} (virtual = {virtual}) has no generator in this build "
                              "of memsave.pp.schedule; use gpipe or 1f1b")


def _call(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):  # a dict, or a tokenizer's BatchEncoding (a UserDict)
        return model(**batch)
    if isinstance(batch, tuple | list):
        return model(*batch)
    return model(batch)


_FLAGS = (bool, str, type(None))


def _signature(batch: Any) -> Any:
    """A micro-batch's tensors' shapes and dtypes, and its other arguments' values where they are flags (a flag
    such as ``output_hidden_states`` changes what the stages hand on) or else their types (a number that changes
    every step, as a token count, must not make every step probe again)."""
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor)
                 else (type(t).__name__, repr(t)) if isinstance(t, _FLAGS) else type(t).__name__ for t in leaves(batch))


def _code_of(fn: Any) -> Any:
    """What decides which outputs a loss function reads: its code (the same for a lambda made anew each step),
    a partial's function's, or the class of a callable object."""
    if fn is None:
        return None
    if isinstance(fn, functools.partial):
        return ("partial", _code_of(fn.func))
    code = getattr(fn, "__code__", None)
    return code if code is not None else type(fn)


def _loss_of_output(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None and isinstance(out, torch.Tensor) and out.dim() == 0:
        loss = out
    if not isinstance(loss, torch.Tensor):
        hint = (" (a tuple, as a Hugging Face model returns with return_dict=False: its loss, if it computed one, is "
                "out[0]; pass loss_fn=lambda out, _: out[0] with targets=[None] * len(micro_batches))"
                if isinstance(out, tuple | list) else "")
        raise ValueError(f"pipeline_step: the model's output ({type(out).__name__}) has no loss{hint}; pass labels in "
                         "the micro-batches (a model that returns .loss), or loss_fn=(output, target) -> loss with "
                         "targets=")
    return loss


class PipelineEngine:
    """This rank's stages of a pipeline, over the ``inner`` engine that syncs their gradients over dp."""

    def __init__(self, inner: Engine, runner: StageRunner, split: StageSplit, *, schedule: str, virtual: int,
                 gather: str = "step") -> None:
        self.inner, self.runner, self.split = inner, runner, split
        self.model, self.mesh, self.agreement = inner.model, inner.mesh, inner.agreement
        self.load_listeners, self.zero_grad_listeners = inner.load_listeners, inner.zero_grad_listeners
        self.sync_listeners = inner.sync_listeners
        self.schedule_name, self.virtual, self.gather = schedule, virtual, gather
        self.balance: Any = None  # [parallel] balance = params / time: the memsave.pp.Balance (set by wrap)
        self.balance_by = "count"  # the [parallel] balance that chose the split (set by wrap)
        self._zero: Any = inner  # (a ZeroEngine where its stage-3 schedule is read)
        self.pp_size, self.pp_rank = self.mesh.degree("pp"), self.mesh.axis_rank("pp")
        self._replica_group = self.mesh.new_group("pp", "tp", owner=self)  # one model replica's ranks (same inputs)
        self.scale_loss: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss
        self._schedules: dict[int, pp_schedule.Schedule] = {}
        # ties: one group per tie over the pp ranks holding it (created on every rank alike, collectively)
        rank_sets = [sorted({s % self.pp_size for s in stages}) for _, stages in split.ties]
        groups = new_subgroups(self.mesh, "pp", rank_sets, owner=self)
        params = dict(self.model.named_parameters(remove_duplicate=False))
        self.ties: list[tuple[nn.Parameter, Any]] = []
        self._tie_copies: set[int] = set()
        for (names, _), ranks, group in zip(split.ties, rank_sets, groups):
            if self.pp_rank in ranks and len(ranks) > 1:
                p = self._local_param(names, params)
                self.ties.append((p, group))
                if self.pp_rank != ranks[0]:
                    self._tie_copies.add(id(p))
        self._stepped_param = {id(s): p for p, s in inner.stepped()}
        self._ties_summed = False  # the tied gradients hold a sum over their stages ([Note: tied gradients summed once])
        if getattr(inner, "stage", 0) == 3:
            self._skip_other_stages(list(getattr(inner, "units", ())))

    def _local_param(self, names: tuple[str, ...], params: dict[str, nn.Parameter]) -> nn.Parameter:
        """This rank's copy of a tied parameter (under whichever of its names this rank holds it)."""
        for name in names:
            if name in params:
                return params[name]
        raise AssertionError(f"tied parameter {names} not found on pp rank {self.pp_rank}")

    def whole_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict, on every rank of this pipeline (collective over pp): each stage's
        ``model.state_dict()`` (which holds this rank's stages), gathered, a tied weight's names sharing one
        tensor as in a plain model's. What ``model.save_pretrained`` writes under pp: it took rank 0's stages as
        the whole model, with no error (a review: the loaded model's logits 60-140% off)."""
        group = self.mesh.group("pp")
        mdist.expect_every_rank("model.save_pretrained() under pipeline parallelism", group)
        whole = mdist.gather_tensors(self.model.state_dict(), group, self.mesh.device)
        for names, _ in self.split.ties:
            held = [whole[n] for n in names if n in whole]
            for name in names:
                whole[name] = held[0]
        return whole

    # -- what differs from the inner engine ------------------------------------------------------------------
    def placement_of(self, stepped: torch.Tensor) -> mdist.Placement:
        pl = self.inner.placement_of(stepped).with_axis("pp", mdist.Shard(None))
        p = self._stepped_param.get(id(stepped))
        if p is not None and id(p) in self._tie_copies:
            pl = dataclasses.replace(pl, tie_copy=True)
        return pl

    def _check_schedule(self, schedule: pp_schedule.Schedule, m: int) -> None:
        want = (self.pp_size, self.virtual, m)
        have = (schedule.pp, schedule.virtual, schedule.micro_batches)
        if have != want:
            raise ValueError(f"pipeline_step: schedule {schedule.name!r} is for pp={have[0]}, virtual={have[1]}, "
                             f"{have[2]} micro-batches; this pipeline has pp={want[0]}, virtual={want[1]} and got "
                             f"{m} micro-batches")
        check = getattr(pp_schedule, "check", None)
        if check is not None:
            check(schedule)  # every action once, in order, and no deadlock: a ValueError before anything runs

    def schedule(self, micro_batches: int) -> pp_schedule.Schedule:
        s = self._schedules.get(micro_batches)
        if s is None:
            s = build_schedule(self.schedule_name, self.pp_size, micro_batches, self.virtual)
            self._check_schedule(s, micro_batches)
            self._schedules[micro_batches] = s
        return s

    def pipeline_step(self, micro_batches: Sequence[Any], *, targets: Sequence[Any] | None = None,
                      loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                      schedule: pp_schedule.Schedule | None = None) -> torch.Tensor:
        """Forwards and backwards of one optimizer step over ``micro_batches`` (each what ``model(...)`` takes: a
        dict of keyword arguments, a tuple of positional ones, or a tensor), as the configured schedule. The loss
        of micro-batch ``i`` is ``loss_fn(output, targets[i])``, or the output's ``.loss``; each is divided by the
        number of micro-batches (gradient accumulation). ``schedule``: a :class:`~memsave.pp.Schedule` to run
        instead of the configured one (schedules are data: any list of F/B/I/W actions per rank over this
        pipeline's stages). Returns the mean loss, on every rank. Collective over the whole mesh; call
        ``optimizer.step()`` after it."""
        m, run, loss_of = self._prepare(micro_batches, targets, loss_fn)
        if schedule is None:
            schedule = self.schedule(m)
        else:
            self._check_schedule(schedule, m)
        before = self.inner.num_syncs
        self._restart_tie_copies()
        self.inner.in_scaled_backward = True
        pinned = self._pin_units()
        try:
            total = self.runner.run(schedule, run, loss_of, backward_ctx=self._backward_ctx, scale=self.scale_loss)
            if self.inner.require_grad_sync and self.inner.num_syncs == before:
                self.inner.agreement.check("backward")  # no gradient reached this rank's parameters
                self.inner.sync_gradients()
        finally:
            self.inner.in_scaled_backward = False
            for u in pinned:
                u.pinned = False
            if pinned:
                self._zero.schedule.keep_root = False
                self.inner.reshard()
        if self.inner.require_grad_sync:
            self._sum_tied_grads()
        return total.detach().float()[0]

    def pipeline_loss(self, micro_batches: Sequence[Any], *, targets: Sequence[Any] | None = None,
                      loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> torch.Tensor:
        """The mean loss over ``micro_batches`` by forwards only, without autograd (an evaluation through the
        pipeline), on every rank. Arguments as :meth:`pipeline_step`; collective over the whole mesh."""
        m, run, loss_of = self._prepare(micro_batches, targets, loss_fn)
        return self.runner.run_forward(m, run, loss_of).float()[0]

    def _prepare(self, micro_batches: Sequence[Any], targets: Sequence[Any] | None,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> tuple[int, Any, Any]:
        m = len(micro_batches)
        if m < 1:
            raise ValueError("pipeline_step: micro_batches is empty; pass a list of at least one micro-batch")
        if targets is not None and len(targets) != m:
            raise ValueError(f"pipeline_step: {len(targets)} targets for {m} micro-batches; give one per micro-batch")
        if (targets is None) != (loss_fn is None):
            raise ValueError("pipeline_step: targets= and loss_fn= go together (the loss of micro-batch i is "
                             "loss_fn(output, targets[i])); give both or neither")
        signature = _signature(micro_batches[0])
        for i, mb in enumerate(micro_batches):
            if _signature(mb) != signature:
                raise ValueError(f"pipeline_step: micro-batch {i} has the shapes {_signature(mb)}, micro-batch 0 has "
                                 f"{signature}; every micro-batch of a step must have the same shapes (and the same "
                                 "values of its flag arguments)")

        def loss_of(i: int, out: Any) -> torch.Tensor:
            loss = loss_fn(out, targets[i]) if loss_fn is not None and targets is not None else _loss_of_output(out)
            return loss / m

        def run(i: int) -> Any:
            return _call(self.model, micro_batches[i])

        # [Note: one input per tp group] (and per pipeline): every stage must read the same micro-batches
        self.agreement.check_inputs(self._replica_group, (micro_batches, targets))
        # [Note: what the layout depends on] what crosses stages is probed once per input signature, train/eval
        # mode of every module and loss function (an auxiliary loss read in training only, or by one loss_fn)
        modes = tuple(mod.training for mod in self.model.modules())
        kind = self.mesh.device.type  # (and torch.autocast around the step: it changes what crosses stages)
        autocast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        self.runner.ensure_layout((signature, modes, _code_of(loss_fn), autocast), lambda: loss_of(0, run(0)))
        return m, run, loss_of

    def _skip_other_stages(self, units: list[Any]) -> None:
        """With virtual stages a rank holds several stages, and the forward of a later one calls the earlier one's
        modules only to pass the received activation through ([Note: the stage runner] in memsave/pp/runtime.py):
        their ZeRO-3 hooks (gather, the check that the output carries a gradient) must not run then."""
        stage_of: dict[int, int] = {}
        for u in units[1:]:
            stages = {self.split.stage_of[a] for a in self.split.atoms
                      if a == u.name or a.startswith(u.name + ".") or u.name.startswith(a + ".")}
            if len(stages) == 1:
                stage_of[u.index] = stages.pop()
        runner = self.runner

        def passes_through(unit: Any) -> bool:
            ctx = runner.ctx
            return ctx is not None and stage_of.get(unit.index, ctx.stage) != ctx.stage

        self._zero.schedule.passes_through = passes_through

    def _pin_units(self) -> list[Any]:
        """ZeRO-3 (``[parallel] gather``): ``"step"`` gathers this stage's units once for the whole step, held
        through it (the stage's full parameters, ZeRO-2's parameter memory), not around every micro-batch's forward
        and backward; ``"micro-batch"`` leaves the blocks to the stage-3 schedule (two all-gathers per block per
        micro-batch) and holds only the root unit. Freed after the last backward's reduce-scatters."""
        units = list(getattr(self.inner, "units", ())) if getattr(self.inner, "stage", 0) == 3 else []
        if units and self.gather == "micro-batch":  # the blocks gathered around each micro-batch's passes; the
            self._zero.schedule.keep_root = True  # root (embeddings, head) for the step, as in one ZeRO-3 step
            units[0].unshard_wait()
            units = units[:1]
        if units:
            self.inner.unshard()
            for u in units:
                u.pinned = True
        return units

    @contextlib.contextmanager
    def _backward_ctx(self, last: bool) -> Iterator[None]:
        if last:
            # [Note: a tie unused on its stage] A tied weight unused here (an embedding fed inputs_embeds) gets a zero
            # gradient, reduced as present: the tie's sum brings the other stages' part (None: never stepped).
            for p, _ in self.ties:
                if p.grad is None and p.requires_grad:  # (a frozen tie stays without one)
                    p.grad = torch.zeros_like(p)
            yield
        else:
            with self.inner.no_sync():
                yield

    @torch.no_grad()
    def _sum_tied_grads(self) -> None:
        stepped = dict(self.inner.stepped())
        for p, group in self.ties:
            g = self.inner.grad_of(stepped[p])  # (None: a frozen tie, the collective all the same)
            mdist.all_reduce(g if g is not None else torch.zeros_like(stepped[p]), group, count_as="pp_tie")
        self._ties_summed = bool(self.ties)

    @torch.no_grad()
    def _restart_tie_copies(self) -> None:
        """[Note: tied gradients summed once] After a step's backwards a tied parameter's gradient is the sum over its
        holding stages, the same on each. Gradients accumulated over more calls or steps add onto it; summed again,
        the earlier sum would count once per holder. So before such a step every holder but the first starts its
        tied gradient from zero, and the step's sum adds each holder's new part once (any zero_grad: no need)."""
        if not self._ties_summed:
            return
        self._ties_summed = False
        stepped = dict(self.inner.stepped())
        for p, _ in self.ties:
            g = self.inner.grad_of(stepped[p]) if id(p) in self._tie_copies else None
            if g is not None:
                g.zero_()

    # -- the rest of the Engine protocol: the inner engine's ------------------------------------------------
    @property
    def require_grad_sync(self) -> bool:
        return self.inner.require_grad_sync

    @require_grad_sync.setter
    def require_grad_sync(self, value: bool) -> None:
        self.inner.require_grad_sync = value

    @property
    def marks_part_grads(self) -> bool:
        return bool(getattr(self.inner, "marks_part_grads", False))

    @property
    def num_syncs(self) -> int:
        return self.inner.num_syncs

    @num_syncs.setter
    def num_syncs(self, value: int) -> None:
        self.inner.num_syncs = value

    @property
    def loss_scaled(self) -> bool:
        return self.inner.loss_scaled

    @loss_scaled.setter
    def loss_scaled(self, value: bool) -> None:
        self.inner.loss_scaled = value

    @property
    def in_scaled_backward(self) -> bool:
        return self.inner.in_scaled_backward

    @in_scaled_backward.setter
    def in_scaled_backward(self, value: bool) -> None:
        self.inner.in_scaled_backward = value

    def unshard(self, unit: Any = None) -> None:
        self.inner.unshard(unit)

    def reshard(self, unit: Any = None) -> None:
        self.inner.reshard(unit)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.inner.no_sync()

    def sync_gradients(self) -> None:
        self.inner.sync_gradients()

    def stepped(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return self.inner.stepped()

    def grad_of(self, stepped: torch.Tensor) -> torch.Tensor | None:
        return self.inner.grad_of(stepped)

    def zero_grad(self, set_to_none: bool) -> None:
        self._ties_summed = False
        self.inner.zero_grad(set_to_none)

    def before_step(self) -> None:
        self.inner.before_step()

    def after_step(self) -> None:
        self.inner.after_step()

    def memory_tensors(self) -> Iterator[tuple[MemoryCategory, torch.Tensor]]:
        return self.inner.memory_tensors()

    def remove(self) -> None:
        self.runner.remove()
        self.inner.remove()

    def __getattr__(self, name: str) -> Any:  # the inner engine's own extras (ZeRO's stage, units, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
