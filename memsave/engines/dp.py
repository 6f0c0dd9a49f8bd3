"""Plain data parallelism (``[zero] stage = 0``): every rank holds everything, gradients are averaged.

The engine follows torch DDP's reducer (Li et al., 2020, "PyTorch Distributed"): trainable parameters are
laid out, in reverse registration order (roughly the order backward produces their gradients), in flat
*buckets* of about ``bucket_mb``. A post-accumulate-grad hook moves each gradient into its bucket (the gradient
then *is* a view of the bucket, so the all-reduce result needs no copy back); when a bucket is complete its
all-reduce is launched asynchronously while backward goes on. One end-of-backward callback launches what is
left and waits for everything, so when ``loss.backward()`` returns the gradients are averaged.

[Note: bucket order] Buckets are launched strictly in index order, on every rank alike, so the collectives
match across ranks even when gradients become ready in different orders or some are never produced.

[Note: reduce dtype] With ``[precision] reduce = "fp32"`` under bf16/fp16 compute the buckets are fp32: a
gradient cannot be a view of them, so the hook copies (casts) it into its bucket and drops it, and the
averaged fp32 rows reach the fp32 master through :meth:`DataParallelEngine.grad_of` with no rounding. The
parameter's ``.grad`` is then a guard (memsave/zero/guards.py, as under ZeRO) that refuses reads and tells
the next backward whether to add to the bucket (the guard is still there) or start afresh (cleared: by
``zero_grad``, by ``p.grad = None``, or through the optimizer's tensors: [Note: gradients cleared through the
optimizer] in memsave/engines/freshness.py). Before, ``.grad`` was None after every backward, so a loop
clearing ``p.grad = None`` by hand changed nothing and the next step's gradient was the sum of both steps'.

[Note: unused parameters] A parameter that got no gradient on this rank contributes zeros. A flag per
parameter is all-reduced with the last bucket so every rank agrees which parameters were used anywhere:
those used on some rank get the average as their gradient on every rank (so replicas stay identical); those
used on none keep ``grad = None`` (so the optimizer skips them, as it does under DDP).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from memsave import dist as mdist
from memsave.dist import Mesh
from memsave.engines import part_grad
from memsave.engines.freshness import pre_accumulate_hooks
from memsave.outer_backward import OuterBackward, grad_hooks_last, repeated_gradient_error
from memsave.phases import MemoryCategory
from memsave.wrapped import check_still_frozen, sync_suspended, unscaled_backward_error, weak_method
from memsave.zero.guards import fresh_start, is_guard, make_reduced_grad

__all__ = ["DataParallelEngine", "trainable_parameters"]


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Named parameters that require grad, each shared (tied) parameter once, in registration order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


@dataclasses.dataclass(eq=False)
class _Bucket:
    index: int
    buffer: torch.Tensor  # (numel,) flat gradients of the parameters below
    params: list[nn.Parameter]
    offsets: list[int]
    pending: int = 0
    handle: mdist.Handle | None = None

    def view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.buffer[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)


class DataParallelEngine:
    """Bucketed, overlapped gradient averaging over the mesh's ``dp`` axis (see module docstring)."""

    def __init__(self, model: nn.Module, mesh: Mesh, *, bucket_mb: float,
                 reduce_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.mesh = mesh
        self.group = mesh.dp_group
        self.dp_size = mesh.dp_size
        # tp or pp: this rank's gradients are its part of the model's, marked after each sync ([Note: a rank's part
        # of the gradient] in memsave/engines/part_grad.py; the optimizer unmarks them where marks_part_grads)
        self._holds_part = mesh.degree("tp") > 1 or mesh.degree("pp") > 1
        self.require_grad_sync = True
        # [Note: control-flow agreement]
        self.agreement = mdist.Agreement(mesh.new_group("dp", owner=self), mesh.device)
        named = trainable_parameters(model)
        self.param_names = {p: n for n, p in named}
        self.buckets = self._make_buckets([p for _, p in reversed(named)], int(bucket_mb * 2**20), reduce_dtype)
        self._slot = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._used = torch.zeros(len(self._slot), dtype=torch.int32, device=mesh.device)  # got a gradient here?
        self._used_handle: mdist.Handle | None = None
        self._order = {p: k for k, p in enumerate(self._slot)}
        self._next_launch = 0
        self._callback_queued = False
        self._fired: set[nn.Parameter] = set()  # whose gradient hook ran in this backward
        self._outer = OuterBackward(self.sync_gradients)  # [Note: one sync per outer backward]
        # [Note: reduce dtype] buckets of another dtype than their parameters: which hold an averaged gradient,
        # and whether they start the next backward from zero (set_to_none) or accumulate into what they hold
        self._averaged: set[nn.Parameter] = set()
        self._fresh = True
        # [Note: gradients cleared through the optimizer] per parameter, decided at its first gradient of a sync
        self._fresh_of: dict[nn.Parameter, bool] = {}
        # tp/pp (partial gradients): the sync whose gradient last started afresh, per parameter
        self._started: dict[nn.Parameter, int] = {}
        self.cleared_elsewhere: Callable[[nn.Parameter], bool] | None = None
        self.num_syncs = 0  # completed gradient synchronizations (one per synchronizing backward)
        self.loss_scaled = False  # fp16: gradients must come from optimizer.backward (a scaled loss)
        self.in_scaled_backward = False
        self.load_listeners: list[Callable[[Any], None]] = []  # called after model.load_state_dict (with None)
        self.zero_grad_listeners: list[Callable[[], None]] = []  # called by model.zero_grad()
        self.sync_listeners: list[Callable[[], None]] = []  # called after each sync (the optimizer's guards)
        self._frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
        # [Note: hooks held by tensors] weakly: a tensor's hook is held where the collector cannot see it
        on_grad = weak_method(self._on_grad_ready)
        self._grad_hooks = [p.register_post_accumulate_grad_hook(on_grad) for p in self._slot]
        self._hooks = list(self._grad_hooks)
        self._pre_hooked = any(b.buffer.dtype != b.params[0].dtype for b in self.buckets)
        if self._pre_hooked:
            self._hooks += pre_accumulate_hooks(self, list(self._slot))
        self._hooks.append(model.register_forward_pre_hook(self._check_trainable, prepend=True))
        self._hooks += [*mdist.watch_loads(model, "model.load_state_dict()", mesh.every_rank_group),
                        model.register_load_state_dict_post_hook(self._after_load)]
        if mesh.degree("tp") > 1 and mesh.degree("pp") == 1:  # every forward communicates over tp
            self._hooks.append(self.agreement.watch_forwards(model, mesh.new_group("tp", owner=self)))
        self._hooks.extend(self._outer.register(model))
        if mesh.device.type == "cpu":
            self._hooks.append(model.register_forward_hook(lambda *_: mdist.after_forward()))

    @staticmethod
    def _make_buckets(params: list[nn.Parameter], cap_bytes: int, reduce_dtype: torch.dtype | None) -> list[_Bucket]:
        groups: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in params:
            key = (p.dtype, p.device)
            nbytes = p.numel() * p.element_size()
            current = groups[-1]
            if current and (size + nbytes > cap_bytes or (current[0].dtype, current[0].device) != key):
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += nbytes
        buckets = []
        for index, group in enumerate(g for g in groups if g):
            offsets, total = [], 0
            for p in group:
                offsets.append(total)
                total += p.numel()
            dtype = reduce_dtype if reduce_dtype is not None and group[0].is_floating_point() else group[0].dtype
            buffer = torch.zeros(total, dtype=dtype, device=group[0].device)
            buckets.append(_Bucket(index, buffer, group, offsets, pending=len(group)))
        return buckets

    # -- hooks -----------------------------------------------------------------------------------------------
    def _after_load(self, module: nn.Module, incompatible_keys: Any) -> None:
        for listener in self.load_listeners:  # the optimizer's fp32 masters follow the loaded parameters
            listener(None)

    def _check_trainable(self, module: nn.Module, args: Any) -> None:
        if self._callback_queued and torch._C._current_graph_task_id() == -1:
            self._drop_backward()  # [Note: a backward that raised] in memsave/outer_backward.py
        mdist.doing(self.agreement.step, "forward")  # (tp's collectives inside it name it when they fail)
        # it has no bucket: each rank would step it with its own local gradient
        check_still_frozen(self._frozen, "its gradient would never be averaged over ranks, so the replicas would "
                                         "diverge")
        grad_hooks_last(self._grad_hooks)  # [Note: the user's gradient hooks first] in memsave/outer_backward.py

    def _drop_backward(self) -> None:
        """The last backward raised before its synchronization: finish the all-reduces it launched (every rank
        that raised alike launched them) and start the next one afresh."""
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
                b.handle = None
            b.pending = len(b.params)
        if self._used_handle is not None:
            self._used_handle.wait()
            self._used_handle = None
        self._used.zero_()
        self._next_launch, self._callback_queued = 0, False
        self._fired.clear()
        self._fresh_of.clear()

    def set_cleared_check(self, cleared: Callable[[nn.Parameter], bool]) -> None:
        """[Note: gradients cleared through the optimizer] ``cleared(p)``: the tensor the optimizer steps for ``p``
        (its fp32 master) had its ``.grad`` cleared since the last sync, so ``p``'s next gradient starts afresh."""
        self.cleared_elsewhere = cleared
        if not self._pre_hooked:
            self._pre_hooked = True
            self._hooks += pre_accumulate_hooks(self, list(self._slot))

    def drop_grad(self, p: torch.Tensor) -> None:
        """The optimizer's tensor for ``p`` (its master) was cleared before the step: ``p``'s gradient is gone."""
        self._averaged.discard(p)  # type: ignore[arg-type]
        p.grad = None

    def restarted_since(self, p: torch.Tensor, sync: int) -> bool:
        """Whether ``p``'s gradient started afresh after sync number ``sync`` (what that sync left is not in it)."""
        return self._started.get(p, 0) > sync  # type: ignore[call-overload]

    def before_accumulate(self, p: nn.Parameter) -> None:
        """``p``'s gradient is about to be accumulated into ``.grad`` (a tensor pre-hook): decide freshness while
        the guard (or the bucket view) is still there, then drop what torch must not add to."""
        self._fresh_for(p)
        if is_guard(p.grad):
            p.grad = None  # torch starts a new .grad; _adopt copies (or adds) it into the bucket

    def _fresh_for(self, p: nn.Parameter) -> bool:
        """Whether ``p``'s gradient in this sync replaces what its bucket holds (once per sync)."""
        fresh = self._fresh_of.get(p)
        if fresh is None:
            cast = self._slot[p][0].buffer.dtype != p.dtype
            fresh = self._fresh_of[p] = fresh_start(p.grad, self.cleared_elsewhere, p, cast and (
                self._fresh or p not in self._averaged))
            if fresh and not cast and p.grad is not None:
                p.grad = None  # the bucket view the last sync left: torch starts anew, or the bucket from zero
        return fresh

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if self.loss_scaled and not self.in_scaled_backward:
            raise unscaled_backward_error()
        if not self.require_grad_sync:
            return
        if not self._callback_queued:
            mdist.doing(self.agreement.step, "backward (gradient bucket all-reduces)")
            self.agreement.check("backward")  # before its first all-reduce
            self._callback_queued = True
            self._outer.request()
        bucket, i = self._slot[param]  # type: ignore[index]
        if param in self._fired:  # a parameter in several reentrant checkpoints: one backward each
            if bucket.handle is not None:
                raise repeated_gradient_error(self.param_names[param], "bucket's all-reduce")  # type: ignore[index]
            self._adopt(bucket, i, again=True)
            return
        self._fired.add(param)  # type: ignore[arg-type]
        self._adopt(bucket, i)
        bucket.pending -= 1
        self._launch_ready()

    def _adopt(self, bucket: _Bucket, i: int, again: bool = False) -> None:
        """Make the parameter's gradient a view of its bucket (copying it there once), and mark it used.
        ``again``: its second gradient in this backward, added to what the bucket holds."""
        p = bucket.params[i]
        view = bucket.view(i)
        if view.dtype != p.dtype:  # [Note: reduce dtype]
            fresh = self._fresh_for(p)
            if fresh and not again and self._holds_part:
                self._started[p] = self.num_syncs + 1
            if p.grad is not None and not is_guard(p.grad):
                view.copy_(p.grad) if fresh and not again else view.add_(p.grad)
                p.grad = None
                self._used[self._order[p]] = 1
            elif fresh:
                view.zero_()
            return
        if self.cleared_elsewhere is not None:
            self._fresh_for(p)  # (no pre-hook ran, no gradient here: cleared, the bucket starts from zero)
        if self._holds_part and (p.grad is None or p.grad.data_ptr() != view.data_ptr()):
            self._started[p] = self.num_syncs + 1  # (not the gradient the last sync left: a fresh one)
        if p.grad is None:
            view.zero_()
            return
        if p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view
        self._used[self._order[p]] = 1

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            self._launch(self.buckets[self._next_launch])

    def _launch(self, bucket: _Bucket) -> None:
        if self.dp_size > 1:  # (one data-parallel rank, a pipeline stage's: no pass over the gradients for nothing)
            bucket.buffer.div_(self.dp_size)  # pre-divide, as DDP does: the sum is then the average
        bucket.handle = mdist.all_reduce(bucket.buffer, self.group, async_op=True)
        self._next_launch += 1
        if self._next_launch == len(self.buckets):
            self._used_handle = mdist.all_reduce(self._used, self.group, async_op=True)

    def sync_gradients(self) -> None:
        """End of backward: launch what the hooks did not (unused parameters), wait, settle unused grads. The
        autograd engine calls it after a backward; a rank whose backward reached none of its parameters calls it
        (after the agreement check) so that its peers' all-reduces are matched."""
        self._callback_queued = False
        self._fired.clear()
        for bucket in self.buckets[self._next_launch :]:
            for i in range(len(bucket.params)):
                self._adopt(bucket, i)  # idempotent for those whose hook already ran
            bucket.pending = 0
        self._launch_ready()
        for bucket in self.buckets:
            assert bucket.handle is not None
            bucket.handle.wait()
            bucket.handle = None
            bucket.pending = len(bucket.params)
        if self._used_handle is not None:  # (none without a bucket: every parameter here frozen, a pipeline stage's)
            self._used_handle.wait()
            self._used_handle = None
        used = self._used.tolist()
        for p, k in self._order.items():
            bucket, i = self._slot[p]
            if bucket.buffer.dtype != p.dtype:
                if used[k]:
                    self._averaged.add(p)
                if p in self._averaged and p.grad is None:  # [Note: reduce dtype] the guard
                    p.grad = make_reduced_grad(p, self._reduced_message(p))
                continue
            if used[k]:
                if p.grad is None:  # used elsewhere only: the average is its gradient here too
                    p.grad = bucket.view(i)
            else:
                p.grad = None
        self._fresh = False
        self._fresh_of.clear()
        self._used.zero_()
        self._next_launch = 0
        self.num_syncs += 1
        if self.marks_part_grads:  # [Note: a rank's part of the gradient]
            part_grad.mark(self._order, part=self._holds_part, scaled=self.loss_scaled)
        for listener in self.sync_listeners:
            listener()

    @property
    def marks_part_grads(self) -> bool:
        """Whether ``.grad`` is marked after each sync: this rank's part (tp or pp), or scaled by fp16's loss
        scale (set by the optimizer, before it reads this)."""
        return self._holds_part or self.loss_scaled

    # -- the Engine protocol (memsave/engines/protocol.py) ---------------------------------------------------
    def unshard(self, unit: Any = None) -> None:
        """Every rank holds every parameter: nothing to gather."""

    def reshard(self, unit: Any = None) -> None:
        """Nothing is ever gathered."""

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backwards inside accumulate locally; the first one after the block averages everything (as DDP)."""
        return sync_suspended(self)

    def stepped(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """The optimizer steps the parameters themselves."""
        return [(p, p) for p in self.model.parameters()]

    def placement_of(self, stepped: torch.Tensor) -> mdist.Placement:
        """Replicated over dp, and so is its gradient once averaged; over tp as the TP transform cut it."""
        return mdist.param_placement(stepped)

    def before_step(self) -> None:
        pass

    def after_step(self) -> None:
        pass

    def grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """The averaged gradient of ``p`` in the reduce dtype ([Note: reduce dtype]); ``p.grad`` otherwise."""
        slot = self._slot.get(p)  # type: ignore[call-overload]
        if slot is None:  # frozen: in the optimizer, but no bucket
            return p.grad
        bucket, i = slot
        if bucket.buffer.dtype == p.dtype:
            return p.grad
        if p not in self._averaged or p.grad is None:  # (None: cleared after the sync, as torch skips it)
            return None
        if is_guard(p.grad) and p.grad._memsave_cleared:  # type: ignore[attr-defined]  # zeroed: a zero gradient
            bucket.view(i).zero_()
        return bucket.view(i)

    def _reduced_message(self, p: nn.Parameter) -> str:
        return (f"memsave: the averaged gradient of {self.param_names[p]!r} is kept in fp32 ([precision] reduce = "
                f"\"fp32\"), not in this {p.dtype} parameter's .grad; clip with optimizer.clip_grad_norm(max_norm), "
                "read the gradients with optimizer.full_grads(), clear them with optimizer.zero_grad(), "
                "model.zero_grad() or p.grad = None")

    def zero_grad(self, set_to_none: bool) -> None:
        self._fresh_of.clear()
        if set_to_none:
            self._averaged.clear()
            self._fresh = True
        else:
            for b in self.buckets:
                if b.buffer.dtype != b.params[0].dtype:
                    b.buffer.zero_()
        for p in self._slot:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def memory_tensors(self) -> Iterator[tuple[MemoryCategory, torch.Tensor]]:
        for p in self.model.parameters():
            yield MemoryCategory.PARAMS, p
            if p.grad is not None and not is_guard(p.grad):
                yield MemoryCategory.GRADS, p.grad
        for b in self.buckets:
            yield MemoryCategory.GRADS, b.buffer
        for buf in self.model.buffers():
            yield MemoryCategory.BUFFERS, buf

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
