"""A communication unit: the parameters that are gathered and reduced together (one collective each).

Storage per stage (Ψ_u = the unit's parameter count, N = dp size, C = padded elements per rank):

- stage 1: the module keeps full parameters; full gradients stay in ``p.grad``; after the reduce-scatter this
  rank's rows of ``p.grad`` hold the averaged gradient, and the optimizer's shard is a row-view of the param.
- stage 2: as stage 1, but gradients are reduce-scattered into ``flat_grad`` (C elements) and ``p.grad`` freed.
- stage 3: ``flat_shard`` (C elements) is the only persistent copy of the parameters; ``full_flat`` (Ψ_u) is
  allocated between unshard and reshard.

[Note: reduce dtype] Gradients are communicated in ``reduce_dtype`` (``[precision] reduce``). When it differs
from the parameters' dtype (bf16 parameters, fp32 reduction), the staging buffer is in ``reduce_dtype`` (the
cast happens while packing) and the averaged rows are kept in a ``flat_grad`` of that dtype at *every* stage
(stage 1 too, beside its full low-precision ``p.grad``): a bf16 shard cannot carry an fp32 ``.grad``, so the
rows are handed to the fp32 master through :meth:`Unit.shard_grad` instead, with no rounding in between.

[Note: stage-3 storage] Each parameter's ``.data`` is a view of ``full_flat`` while UNSHARDED. To reshard we
shrink ``full_flat``'s *storage* to 0 bytes instead of dropping it: views autograd saved during forward (e.g.
``weight.t()`` for a matmul) keep pointing at that storage, and see the right values again once it is
re-grown and refilled before backward. Reading a 0-byte storage would crash, so while SHARDED ``.data`` is an
expanded zero tensor of the full shape: shape queries work, writes raise, and Python-level reads raise too, since
the parameter is a :class:`~memsave.zero.guards.ShardedParameter` then ([Note: guarded reads] in guards.py).

[Note: gradient freshness] Whether a backward's reduced gradient replaces the one held or adds to it is decided
per parameter, as torch decides for ``.grad``: after a synchronizing backward the full parameter's ``.grad`` is a
:class:`~memsave.zero.guards.ReducedGrad`. If it is still there (not cleared) when the next gradient of that
parameter arrives, the user accumulates over steps and the new rows are added; if it is gone (``zero_grad()``
of the wrapper, the model or the inner optimizer, or ``p.grad = None`` by hand) or was zeroed in place, they
replace the old ones. The decision is taken at the parameter's first gradient since the last reduce (before
torch accumulates into ``.grad``) and kept through ``no_sync`` micro-batches. Stage 1 keeps the held full
``.grad`` aside (``_carry``) while torch starts a new one, and adds its reduced rows after the reduce.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from memsave import dist as mdist
from memsave.phases import MemoryCategory, UnitState
from memsave.zero.guards import fresh_start, is_guard, make_reduced_grad, mark_sharded, mark_unsharded, plain
from memsave.zero.layout import ShardLayout

__all__ = ["Unit"]


class Unit:
    """One unit's parameters, their shards, and the collectives that move them."""

    def __init__(
        self, name: str, module: nn.Module, params: list[tuple[str, nn.Parameter]], *, stage: int,
        group: mdist.ProcessGroup, reduce_group: mdist.ProcessGroup, dp_rank: int, dp_size: int, is_root: bool,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        # Staging buffers are allocated per collective and dropped right after: measured, a pool that keeps
        # them (the root's is 2x its parameters) raised ZeRO-2/3 peak RSS by 30-80 MiB on the bench GPT.
        self.reduce_group = reduce_group
        self.name, self.module, self.stage, self.is_root = name, module, stage, is_root
        self.index = -1  # position in the engine's forward order
        self.group, self.rank, self.world = group, dp_rank, dp_size
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        dtypes = {(p.dtype, p.device) for p in self.params}
        if not self.params:  # a root that owns nothing: every parameter lives in a block
            dtypes = {(torch.get_default_dtype(), torch.device("cpu"))}
        if len(dtypes) > 1:
            raise NotImplementedError(f"unit {name!r} mixes parameter dtypes/devices {sorted(map(str, dtypes))}; one "
                                      "flat buffer needs one dtype: cast the model, or pass units= that separate them")
        self.dtype, self.device = next(iter(dtypes))
        self.reduce_dtype = reduce_dtype if reduce_dtype is not None else self.dtype
        # the averaged rows live in flat_grad (not in rows of p.grad): stages 2-3, or a reduce dtype of its own
        self._sharded_grads = stage >= 2 or self.reduce_dtype != self.dtype
        self._shard_grads: list[torch.Tensor | None] = [None] * len(self.params)  # see shard_grad()
        self.param_layout = ShardLayout([p.shape for p in self.params], dp_size)
        self.grad_layout = ShardLayout([self.params[i].shape for i in self.trainable], dp_size)
        self.state = UnitState.UNSHARDED
        # [offload] params = "disk" | "cpu": called before a gather reads flat_shard and after it completed
        # ([Note: parameter residency] in memsave/zero/param_offload.py)
        self.before_gather: Callable[[Unit], None] | None = None
        self.after_gather: Callable[[Unit], None] | None = None
        self._gather: tuple[mdist.Handle, torch.Tensor] | None = None
        self._reduce: tuple[mdist.Handle, torch.Tensor, torch.Tensor] | None = None
        self.pending = len(self.trainable)  # gradients still to arrive in this backward
        # stage 3 ([Note: post-backward] in schedule.py): forward calls whose backward has not reached their inputs
        # yet, and calls whose inputs needed no gradient (so nothing says when their backward ends)
        self.open_calls = 0
        self.blind_calls = 0
        # [Note: gradient freshness] per trainable parameter: replace (True) or add to (False) the reduced rows
        # held; None until its first gradient since the last reduce (and [Note: gradients cleared through the
        # optimizer] in memsave/engines/freshness.py)
        self.fresh: list[bool | None] = [None] * len(self.trainable)
        self.cleared_elsewhere: Callable[[nn.Parameter], bool] | None = None
        self.syncs, self.started = 0, [0] * len(self.trainable)  # settled syncs; the last that started afresh
        self._carry: dict[int, torch.Tensor] = {}  # stage 1: the full .grad whose reduced rows are added to
        # stage 3: what a read of a sharded parameter does (the engine gathers or raises; [Note: guarded reads])
        self.on_sharded_read: Callable[[Unit, int, str], None] | None = None
        # a pipeline step holds its stage's units gathered across its micro-batches (memsave/engines/pipeline.py):
        # the stage-3 schedule's frees are skipped while pinned
        self.pinned = False
        self.closing: Callable[[Unit], None] | None = None  # [Note: edits of gathered parameters] in edit_window.py
        self._read_guards = [self._make_read_guard(i) for i in range(len(self.params))]
        with torch.no_grad():
            if stage == 3:
                self._init_stage3()
            self.shards = [self._make_shard(i) for i in range(len(self.params))]
        self.originals = [p.detach() for p in self.params] if stage < 3 else []  # [Note: replaced data]
        # stages 2-3 (or a reduce dtype of its own): the averaged rows of this rank; allocated by the first reduce
        # after zero_grad(set_to_none=True), freed by it (as torch frees .grad)
        self.flat_grad: torch.Tensor | None = None

    # -- storage -------------------------------------------------------------------------------------------
    def _init_stage3(self) -> None:
        layout = self.param_layout
        # this rank's rows straight into its chunk (zero padding): no full staging buffer beside the full parameters,
        # so building the units of a model materialized one unit at a time peaks at one unit plus the shards
        self.flat_shard = torch.zeros(layout.chunk_numel, dtype=self.dtype, device=self.device)
        for i, p in enumerate(self.params):
            layout.copy_rows(self.flat_shard, i, p.data, self.rank)
        self.full_flat = torch.empty(sum(p.numel() for p in self.params), dtype=self.dtype, device=self.device)
        self._full_bytes = self.full_flat.untyped_storage().nbytes()
        self.full_views, offset = [], 0
        for p in self.params:
            self.full_views.append(self.full_flat[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        self._sentinels = [torch.zeros((), dtype=self.dtype, device=self.device).expand(p.shape) for p in self.params]
        self.reshard()

    def _make_shard(self, i: int) -> nn.Parameter:
        """The tensor the optimizer steps for parameter ``i``: this rank's rows, sharing storage."""
        p = self.params[i]
        if self.stage == 3:
            view = self.param_layout.shard_view(self.flat_shard, i, self.rank)
        else:
            slot = self.param_layout.slots[i]
            start, stop = slot.local_rows(self.rank)
            view = p.data.view(slot.rows, *p.shape[1:])[start:stop] if p.dim() else p.data.view(1)[start:stop]
        return nn.Parameter(view, requires_grad=p.requires_grad)

    # -- stage 3: the unit's lifecycle ----------------------------------------------------------------------
    # [Note: unit lifecycle] SHARDED -> GATHERING (all-gather issued) -> UNSHARDED (full views installed) ->
    # SHARDED (storage freed). A gather issued ahead (prefetch) and never used is completed and dropped, so
    # GATHERING -> SHARDED too: the ranks stay in step. Every change of state goes through _enter.
    _TRANSITIONS = {
        UnitState.SHARDED: (UnitState.GATHERING,),
        UnitState.GATHERING: (UnitState.UNSHARDED, UnitState.SHARDED),
        UnitState.UNSHARDED: (UnitState.SHARDED,),
    }

    def _enter(self, state: UnitState) -> None:
        if state not in self._TRANSITIONS[self.state]:
            raise AssertionError(f"unit {self.name!r}: {self.state.name} -> {state.name} is not a transition")
        self.state = state

    def unshard_async(self) -> None:
        """Start gathering the full parameters (no-op unless SHARDED)."""
        if self.stage != 3 or self.state is not UnitState.SHARDED:
            return
        if self.before_gather is not None:
            self.before_gather(self)
        staging = torch.empty(self.param_layout.padded_numel, dtype=self.dtype, device=self.device)
        self._gather = (mdist.all_gather_into(staging, self.flat_shard, self.group, async_op=True), staging)
        self._enter(UnitState.GATHERING)

    def _complete_gather(self) -> torch.Tensor:
        assert self._gather is not None
        handle, staging = self._gather
        handle.wait()
        self._gather = None
        if self.after_gather is not None:
            self.after_gather(self)
        return staging

    @torch.no_grad()
    def unshard_wait(self) -> None:
        """Finish the gather (issuing it if needed) and point every parameter at its full view."""
        if self.stage != 3 or self.state is UnitState.UNSHARDED:
            return
        self.unshard_async()
        staging = self._complete_gather()
        self.full_flat.untyped_storage().resize_(self._full_bytes)
        for i, p in enumerate(self.params):
            self.param_layout.unpack(staging, i, self.full_views[i])
            mark_unsharded(p)
            p.data = self.full_views[i]
        self._enter(UnitState.UNSHARDED)

    def reshard(self) -> None:
        """Free the full parameters (see [Note: stage-3 storage]); a gather in flight is completed and dropped."""
        if self.stage != 3 or self.state is UnitState.SHARDED or self.pinned:
            return
        if self.state is UnitState.GATHERING:
            self._complete_gather()
        else:
            if self.closing is not None:  # gathered for the user: their writes reach the shard first
                self.closing(self)
            for p, sentinel, guard in zip(self.params, self._sentinels, self._read_guards):
                p.data = sentinel
                mark_sharded(p, guard)
            self.full_flat.untyped_storage().resize_(0)
        self._enter(UnitState.SHARDED)

    def _make_read_guard(self, i: int) -> Callable[[str], None]:
        def guard(what: str) -> None:
            if self.on_sharded_read is None:
                raise RuntimeError(f"parameter {self.names[i]!r} of ZeRO-3 unit {self.name!r} was read ({what}) while "
                                   "the unit is sharded")
            self.on_sharded_read(self, i, what)
        return guard

    def _own_rows(self, full: torch.Tensor, i: int) -> torch.Tensor:
        """This rank's rows of a parameter-shaped ``full``, as a view (in any memory format: channels_last too)."""
        start, stop = self.param_layout.slots[i].local_rows(self.rank)
        return (full if full.dim() else full.view(1))[start:stop].view_as(self.shards[i])

    # -- gradients -----------------------------------------------------------------------------------------
    def _accumulates(self, j: int) -> bool:
        """[Note: gradient freshness] Decide (once per reduce) whether trainable param ``j`` adds to its rows."""
        fresh = self.fresh[j]
        if fresh is None:
            p = self.params[self.trainable[j]]
            fresh = self.fresh[j] = not is_guard(p.grad) or fresh_start(p.grad, self.cleared_elsewhere, p, False)
            self.started[j] = self.syncs + 1 if fresh else self.started[j]
            if not fresh and not self._sharded_grads:  # stage 1: the held rows are added after the reduce
                self._carry[j] = plain(p.grad)  # type: ignore[arg-type]
        return not fresh

    def before_accumulate(self, j: int) -> None:
        """A tensor pre-hook: decide freshness while the guard is there, then drop it so torch starts a ``.grad``."""
        self._accumulates(j)
        if is_guard((p := self.params[self.trainable[j]]).grad):
            p.grad = None

    def _zero_rows(self, j: int) -> None:
        self.grad_layout.shard_view(self.flat_grad, j, self.rank).zero_()  # type: ignore[arg-type]

    @torch.no_grad()
    def launch_reduce(self) -> list[bool]:
        """Reduce-scatter the unit's gradients (averaging over dp); returns which trainable params had one."""
        if not self.trainable:
            return []
        accumulate = [self._accumulates(j) for j in range(len(self.trainable))]
        layout = self.grad_layout
        staging = torch.empty(layout.padded_numel, dtype=self.reduce_dtype, device=self.device)
        had_grad = []
        for j, i in enumerate(self.trainable):
            p = self.params[i]
            g = p.grad
            # a gradient kept (zeroed) by zero_grad(set_to_none=False) counts as present, as under DDP; so does a
            # reduced one the user accumulates onto
            had_grad.append(g is not None or self.shards[i].grad is not None)
            if g is None or is_guard(g):
                layout.pack(staging, j, torch.zeros(p.shape, dtype=self.dtype, device=self.device))
            else:
                layout.pack(staging, j, g)
            if self.stage >= 2:
                p.grad = None  # free the full gradient as soon as it is staged
        staging.div_(self.world)  # pre-divide, as DDP does
        out: torch.Tensor
        if self._sharded_grads and not any(accumulate):
            if self.flat_grad is None:
                self.flat_grad = torch.empty(layout.chunk_numel, dtype=self.reduce_dtype, device=self.device)
            out = self.flat_grad  # reduce straight into the persistent shard
        else:
            out = torch.empty(layout.chunk_numel, dtype=self.reduce_dtype, device=self.device)
        self._reduce = (mdist.reduce_scatter_into(out, staging, self.reduce_group, async_op=True), out, staging)
        return had_grad

    @torch.no_grad()
    def wait_reduce(self) -> None:
        """Wait for the reduce-scatter, keep the averaged rows, and drop the staging buffer."""
        if self._reduce is None:
            return
        handle, out, _staging = self._reduce  # the tuple kept the staging buffer alive while in flight
        handle.wait()
        self._reduce = None
        if self._sharded_grads:
            if out is not self.flat_grad:  # some rows accumulate: replace the others, add to all
                if self.flat_grad is None:
                    self.flat_grad = torch.zeros_like(out)
                for j, fresh in enumerate(self.fresh):
                    if fresh:
                        self._zero_rows(j)
                self.flat_grad.add_(out)
        else:
            for j, i in enumerate(self.trainable):
                p, held = self.params[i], self._carry.pop(j, None)
                if p.grad is None or is_guard(p.grad):  # none yet, or a guard: a cleared one, or one carried
                    p.grad = torch.zeros_like(p)
                rows = self._own_rows(p.grad, i)
                rows.copy_(self.grad_layout.shard_view(out, j, self.rank).view_as(self.shards[i]))
                if held is not None:
                    rows.add_(self._own_rows(held, i))
        self.fresh = [None] * len(self.trainable)

    def _reduced_message(self, i: int) -> str:
        where = ("this rank's rows of .grad are averaged, the others are not" if not self._sharded_grads else
                 "the full parameter's .grad holds no values")
        return (f"memsave ZeRO stage {self.stage}: the gradient of {self.names[i]!r} was reduced into this rank's "
                f"optimizer shard, so {where}; clip with optimizer.clip_grad_norm(max_norm) (the global norm over "
                "every rank), read full gradients with optimizer.full_grads() (collective), and clear them with "
                "optimizer.zero_grad() or model.zero_grad() (transformers' Trainer and accelerator.clip_grad_norm_ "
                "call torch's clip: README, 'Hugging Face accelerate and Trainer'). A second optimizer over the "
                "model's parameters cannot step them: memsave steps the one passed to wrap (one optimizer, with a "
                "param group per part)")

    def settle_grads(self, used: list[bool]) -> None:
        """Expose the averaged rows as the shards' ``.grad``; ``used[j]``: trainable param ``j`` got a gradient
        on some rank (else its grad stays None, so the optimizer skips it as it would under DDP). The full
        parameters' ``.grad`` become guards ([Note: gradient freshness])."""
        self.syncs += 1
        for j, i in enumerate(self.trainable):
            shard, p = self.shards[i], self.params[i]
            grad: torch.Tensor | None
            if not used[j]:
                grad = None
                p.grad = None
            elif not self._sharded_grads:
                full = p.grad
                assert full is not None  # wait_reduce allocated it
                full = plain(full)
                grad = self._own_rows(full, i)
                p.grad = make_reduced_grad(p, self._reduced_message(i), storage=full)
            else:
                assert self.flat_grad is not None
                grad = self.grad_layout.shard_view(self.flat_grad, j, self.rank).view_as(shard)
                local = p.grad if p.grad is not None and not is_guard(p.grad) else None  # stage 1, reduce dtype
                p.grad = make_reduced_grad(p, self._reduced_message(i), storage=local)
            self._shard_grads[i] = grad
            shard.grad = grad if grad is None or grad.dtype == shard.dtype else None  # [Note: reduce dtype]

    def shard_grad(self, i: int) -> torch.Tensor | None:
        """The averaged gradient rows of parameter ``i`` (in ``reduce_dtype``), or None; equals the shard's
        ``.grad`` unless the dtypes differ ([Note: reduce dtype])."""
        shard = self.shards[i]
        if shard.grad is not None or self.reduce_dtype == shard.dtype:
            return shard.grad  # the user may have replaced or dropped it
        return self._shard_grads[i]

    def zero_grad(self, set_to_none: bool) -> None:
        for i in self.trainable:
            p, shard = self.params[i], self.shards[i]
            if set_to_none:
                shard.grad = None
                p.grad = None
                self._shard_grads[i] = None
            else:
                for g in (shard.grad, p.grad, self._shard_grads[i]):
                    if g is not None:
                        g.zero_()  # a guard is marked cleared ([Note: gradient freshness])
        if set_to_none:
            self.flat_grad = None  # as torch frees .grad: stages 2-3 hold no gradient memory through forward
        elif self.flat_grad is not None:
            self.flat_grad.zero_()
        self.fresh, self._carry = [None] * len(self.trainable), {}

    # -- stages 1-2: after the optimizer step ----------------------------------------------------------------
    @torch.no_grad()
    def launch_param_gather(self) -> tuple[mdist.Handle, torch.Tensor, torch.Tensor] | None:
        """Stages 1-2: all-gather the updated rows of the trainable parameters."""
        if not self.trainable:
            return None
        layout = self.grad_layout
        chunk = torch.empty(layout.chunk_numel, dtype=self.dtype, device=self.device)
        chunk.zero_()  # padding rows
        for j, i in enumerate(self.trainable):
            layout.shard_view(chunk, j, self.rank).view_as(self.shards[i]).copy_(self.shards[i])
        out = torch.empty(layout.padded_numel, dtype=self.dtype, device=self.device)
        return mdist.all_gather_into(out, chunk, self.group, async_op=True), out, chunk

    @torch.no_grad()
    def finish_param_gather(self, pending: tuple[mdist.Handle, torch.Tensor, torch.Tensor] | None) -> None:
        if pending is None:
            return
        handle, out, _chunk = pending  # the tuple kept the input chunk alive while in flight
        handle.wait()
        for j, i in enumerate(self.trainable):
            self.grad_layout.unpack(out, j, self.params[i].data)

    def memory_tensors(self) -> Iterator[tuple[MemoryCategory, torch.Tensor]]:
        if self.stage == 3:
            yield MemoryCategory.PARAMS, self.flat_shard
            yield MemoryCategory.PARAMS_GATHERED, self.full_flat
        else:
            for p in self.params:
                yield MemoryCategory.PARAMS, p
        for p in self.params:
            g = p.grad
            if g is not None and (not is_guard(g) or g._memsave_aliases):  # type: ignore[attr-defined]
                yield MemoryCategory.GRADS, plain(g)
        if self.flat_grad is not None:
            yield MemoryCategory.GRADS, self.flat_grad
        if self._gather is not None:  # a prefetch in flight: its staging buffer
            yield MemoryCategory.COMM, self._gather[1]
        if self._reduce is not None:  # a reduce-scatter in flight: its staging buffer (and output, if not flat_grad)
            _, out, staging = self._reduce
            yield MemoryCategory.COMM, staging
            yield MemoryCategory.COMM, out
