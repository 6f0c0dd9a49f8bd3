"""Optimizer state off the device, streamed through a small window in fixed-size chunks (ZeRO-Offload, Ren et
al., 2021; ZeRO-Infinity, Rajbhandari et al., 2021).

The tensors an optimizer steps (ZeRO's row shards) are cut into row *pieces*, and consecutive pieces are packed
into *chunks* of about ``chunk_bytes`` of state. An elementwise optimizer (SGD, Adam, AdamW, ...) gives the same
update on any row slice of a tensor as on the whole tensor, so each chunk is stepped on its own: the user's
optimizer instance is pointed at the chunk's pieces (sub-parameters sharing the shards' storage, gradients
sharing the gradient's), its per-element state entries are views of a window buffer the chunk's region was read
into, and after the step the buffer is written back. ``param_groups`` keep their dicts (hyperparameters, LR
schedulers), only their ``params`` lists are swapped during the step and restored after it. Step hooks run once
per step, around all chunks (memsave/offload/stepping.py). The window buffers, a chunk's layout in one and its
pieces lent to the optimizer are memsave/offload/window.py; the state read back whole for a state dict is
memsave/offload/consolidated.py.

[Note: chunk pipeline] With ``prefetch = P >= 1`` there are ``P + 2`` window buffers; chunk ``k`` uses buffer
``k % (P + 2)``. While chunk ``k`` steps, the reads of chunks ``k+1 .. k+P`` are in flight and the writes of
``k-1`` and ``k-2`` may be. The read of chunk ``k+P`` goes into the buffer of chunk ``k-2``, so it is issued
only after that chunk's write has completed: a buffer is reused only after the write that last read it. The
in-memory chunks (``fraction < 1``) step first, in one call, while the first reads are in flight. Every read
and write is waited before :meth:`OffloadedState.step` returns, so nothing touches a buffer between steps.
``P = 0`` is synchronous: read, step, write, wait, one chunk at a time (the "prefetch off" baseline).

[Note: overlapped step] With ``overlap`` (stage 3, ``[offload] overlap``) the loop above runs on a background
thread and ``step()`` returns once the step pre-hooks ran and the step's inputs are captured: the hyperparameters
(a shadow of the optimizer's groups, so an LR scheduler stepping right after changes only the next step) and
each piece's gradient rows (views that keep them alive whatever ``zero_grad`` drops). The chunks are in unit
order, and an event per unit is set once its last chunk has stepped and its writes are issued. Whatever reads
a unit's rows first waits for that event and then for the unit's writes, since a failed write puts the rows
back ([Note: failed I/O]): the stage-3 gather of that unit (forward, ``state_dict``) through
:meth:`OffloadedState.wait_for`. Everything else that could see the state or overwrite the gradient buffers
waits for the whole step through :meth:`OffloadedState.settle`, which also runs the step post-hooks and raises a
failed step's error: the end of the next forward, ``backward``, ``step``, ``zero_grad`` without
``set_to_none``, the state dicts and ``close``. So the results are those of the synchronous step; what moves is
when the post-hooks run and where a failed transfer is raised (at the first wait after it).

[Note: failed I/O] On disk a chunk's state has two regions and a current one; the new state is written to the other
and becomes current only once the write succeeded, and the chunk's parameters are copied aside before its step
and put back if the write fails. A failed read skips the chunk. Either way the step stops with the error once
the transfers in flight are done, and every chunk's parameters and state agree (before or after the step; the
state's ``step`` count says which), so nothing half-written is ever read.

[Note: offloaded masters] Under mixed precision the optimizer steps fp32 masters, and they move with the state:
a chunk's layout holds each piece's master rows (entry ``MASTER``) beside its per-element state. A piece's
``sub`` is then pointed at the master rows in the window buffer for the step (its own copy in an in-memory
chunk), and after the step they are cast into ``low``, the model's rows of its low-precision shard. The full
master tensors keep their Parameters but their storage is freed once every chunk holds its rows (on CUDA they
are made on the host, so the device never holds them all: their Parameters then get an empty device tensor). Their ``.grad``
carries the unscaled fp32 gradients where a loss scale or ``clip_grad_norm`` needs them all at once; otherwise
(bf16 without clipping) no full fp32 copy is made: each piece casts its rows of the model's gradient
(``low_grad``) when its chunk steps, the same values a whole ``.float()`` gives. What a failed write restores ([Note: failed I/O]) is ``low``: the master
on the tier is still the one of the region that stays current.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from memsave.offload.chunks import (
    MASTER,
    MASTER_BYTES,
    Chunk,
    Piece,
    plan,
    row_pieces,
    window_bytes,
)
from memsave.offload.consolidated import Consolidated
from memsave.offload.host_step import HostStaging, HostStep, host_kernel
from memsave.offload.stepping import hooked, post_hooks, pre_hooks, raw_step, shadow
from memsave.offload.tiers import Handle, Tier, aligned_empty, round_up
from memsave.offload.whole import WholeStep
from memsave.offload.window import Run, Window

__all__ = ["OffloadedState"]


class OffloadedState(HostStep, WholeStep, Window, Consolidated):
    """The state of ``optimizer``'s tensors, chunked, a ``fraction`` of it on ``tier``.

    Args:
        optimizer: the user's instance; its ``param_groups`` hold the tensors to step (ZeRO's shards).
        tier: where offloaded chunks live (:class:`~memsave.offload.tiers.DiskTier` or ``HostTier``).
        group_of: the file a tensor's chunks go to (memsave: its ZeRO unit), and ``names`` for messages.
        fraction: share of the elements whose state is offloaded (whole chunks, in order).
        prefetch: chunks read ahead ([Note: chunk pipeline]); 0 is synchronous.
        chunk_bytes: state bytes per chunk (the window holds ``prefetch + 2`` of them).
        bytes_per_element: per-element state bytes (:func:`state_bytes_per_element`), for sizes.
        group_order: step the chunks grouped by file, in this order (offloaded parameters are loaded per file).
        hooks: with ``enter(file)`` (before a chunk of that file steps) and ``finish()`` (after the last).
        masters: master mode ([Note: offloaded masters]): stepped fp32 tensor -> the model's low-precision shard.
        offload_last: with ``fraction < 1``, offload the last chunks and keep the first in memory (overlapped: the
            next forward needs the first units first, before their transfers could hide behind anything).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, tier: Tier, *, group_of: Callable[[torch.Tensor], str],
                 names: dict[torch.Tensor, str], fraction: float, prefetch: int, chunk_bytes: int,
                 bytes_per_element: int, device: torch.device, group_order: list[str] | None = None,
                 hooks: Any = None, masters: dict[torch.Tensor, torch.Tensor] | None = None,
                 offload_last: bool = False,
                 low_grad: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
                 staging: HostStaging | None = None, whole: bool = False) -> None:
        self.optimizer, self.tier, self.prefetch, self.device, self.names = optimizer, tier, prefetch, device, names
        self._staging = staging  # [Note: host step]: the window and the state on the host, the model on the device
        self._slots = tier.slots
        self.masters = dict(masters or {})
        self._low_grad = low_grad
        per_elem = max(bytes_per_element + (MASTER_BYTES if self.masters else 0), 1)
        chunk_numel = max(1, chunk_bytes // per_elem)
        self._whole = whole  # [Note: whole-shard offload] in whole.py: one piece per tensor, one step over all
        alias = getattr(optimizer, "alias", None)  # Adafactor: a piece is cut like its tensor
        self.pieces_of: dict[torch.Tensor, list[Piece]] = {}
        pieces: list[tuple[str, Piece]] = []
        for gi, g in enumerate(optimizer.param_groups):
            for shard in g["params"]:
                own = self.pieces_of.setdefault(shard, [])
                rows = shard.shape[0] if shard.dim() else 1
                for start, stop in ([(0, rows)] if whole else
                                    row_pieces(shard.shape[0], math.prod(shard.shape[1:]), chunk_numel)):
                    sub = nn.Parameter(shard.detach()[start:stop] if shard.dim() else shard.detach(),
                                       requires_grad=shard.requires_grad)
                    if whole and alias is not None:
                        alias(sub, shard)
                    low = self.masters[shard][start:stop] if shard in self.masters else None
                    dev = sub.detach() if staging is not None and low is None else None
                    own.append(Piece(shard, gi, start, stop, sub, low, dev))
                    pieces.append((group_of(shard), own[-1]))
        if group_order is not None:
            pieces.sort(key=lambda fp: group_order.index(fp[0]))  # stable: group order within a file
        self.hooks = hooks
        chunks = plan([(f, p.numel) for f, p in pieces], chunk_numel, fraction, offload_last=offload_last)
        self.chunks = [Chunk(k, pieces[idx[0]][0], [pieces[i][1] for i in idx], offloaded=off)
                       for k, (idx, off) in enumerate(chunks)]
        self.window_bytes = round_up(max((window_bytes(c.numel, len(c.pieces), per_elem)
                                          for c in self.chunks if c.offloaded), default=0))
        self._buffers: list[torch.Tensor] = []
        self._snapshots: list[torch.Tensor] = []
        self._raw = raw_step(optimizer)
        self.wait_seconds = 0.0  # time the caller waited for reads and writes (the transfer time not hidden)
        self._run: Run | None = None  # a step running in the background ([Note: overlapped step])
        self._executor: ThreadPoolExecutor | None = None
        if self.masters:
            self._adopt_masters()

    @torch.no_grad()
    def _adopt_masters(self) -> None:
        """Each piece takes its fp32 master rows ([Note: offloaded masters]): a copy of its own in an in-memory
        chunk, its chunk's region on the tier otherwise (written now); then the full masters' storage is freed."""
        buf = aligned_empty(max(self.window_bytes, 1), self.device)
        for chunk in self.chunks:
            if not any(p.low is not None for p in chunk.pieces):
                continue
            if not chunk.offloaded:
                for p in chunk.pieces:
                    if p.low is not None:
                        p.sub.data = p.sub.detach().to(self.device, copy=True)
                continue
            self._pack(chunk, [{MASTER: p.sub.detach()} if p.low is not None else None for p in chunk.pieces], buf)
            self.tier.write_async(chunk.regions[0], buf).wait()
            chunk.slot = 0
            for p in chunk.pieces:
                if p.low is not None:
                    p.sub.data = torch.empty(0, dtype=p.sub.dtype, device=p.sub.device)
        self.tier.drain()
        for master, low in self.masters.items():
            if master.device != low.device:  # made on the host: an empty tensor on the device takes its place
                empty = torch.empty_like(master, device=low.device)
                empty.untyped_storage().resize_(0)
                master.data = empty
            master.untyped_storage().resize_(0)

    # -- stepping ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, *, overlap: bool = False) -> None:
        """One optimizer step over every chunk ([Note: chunk pipeline]); hooks once around it. ``overlap``: the
        step runs in the background and this returns at once ([Note: overlapped step])."""
        self.settle()
        grads: dict[int, torch.Tensor] = {}
        for shard, pieces in self.pieces_of.items():
            grad = shard.grad
            if grad is None and shard in self.masters and self._low_grad is not None:
                grad = self._low_grad(shard)  # [Note: offloaded masters]: cast to fp32 chunk by chunk
            if grad is not None:
                grads.update((id(p), grad[p.start : p.stop]) for p in pieces)
        run = Run(shadow(self.optimizer), grads)
        if self._staging is not None:
            self._staging.after_compute()
            for g in run.opt.param_groups:
                g.update(host_kernel(self.optimizer))
        if not overlap:
            hooked(self.optimizer, lambda: self._step_whole(run) if self._whole else self._step_chunks(run))
            self.wait_seconds += run.waited
            return
        pre_hooks(self.optimizer)
        run.done = {c.group_file: threading.Event() for c in self.chunks}
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memsave-offload-step")
        self._run = run
        run.future = self._executor.submit(self._background, run)

    def _background(self, run: Run) -> None:
        try:
            with torch.no_grad():
                self._step_chunks(run)
        except BaseException as exc:
            run.error = exc
            raise
        finally:
            for event in run.done.values():
                event.set()

    def wait_for(self, group_file: str) -> None:
        """[Note: overlapped step] Return once the background step has stepped every chunk of ``group_file`` (its
        rows are final); raise the step's error if it failed."""
        run = self._run
        if run is None:
            return
        start = time.perf_counter()
        event = run.done.get(group_file)
        if event is not None:
            event.wait()
        try:  # the file's writes: once they succeeded, a failed write can no longer put its rows back
            for handle in list(run.writes_of.get(group_file, ())):
                handle.wait()
        except BaseException:
            self.settle()  # waits for the step to put every chunk right, then raises its error
            raise
        finally:
            self.wait_seconds += time.perf_counter() - start
        if run.error is not None:
            self.settle()

    def settle(self) -> None:
        """Wait for a step running in the background, raise its error, run the step post-hooks (no-op when none
        runs)."""
        run, self._run = self._run, None
        if run is None or run.future is None:
            return
        start = time.perf_counter()
        try:
            run.future.result()
        finally:
            self.wait_seconds += time.perf_counter() - start
        post_hooks(self.optimizer)

    def _step_chunks(self, run: Run) -> None:
        self._ensure_buffers()
        active = [c for c in self.chunks if any(id(p) in run.grads for p in c.pieces)]
        memory = [c for c in active if not c.offloaded]
        remote = [c for c in active if c.offloaded]
        last_of = {c.group_file: k for k, c in enumerate(remote)}  # in file order when overlapped
        nbuf = max(len(self._buffers), 1)
        reads: dict[int, Handle] = {}
        writes: dict[int, tuple[Handle, Chunk, list[Any]]] = {}
        error: BaseException | None = None

        def issue_read(k: int) -> None:
            if k < len(remote) and remote[k].slot >= 0:
                self._finish_write(writes, k - nbuf, run)  # the buffer's previous chunk is written back
                reads[k] = self.tier.read_async(remote[k].regions[remote[k].slot], self._buffers[k % nbuf])

        try:
            for k in range(self.prefetch):
                issue_read(k)
            if self._staging is not None:
                self._staging.begin(memory + remote, run.grads)
            if memory and self._staging is not None:
                self._step_memory_host(memory, run)
            elif memory:
                self._step_in_memory([p for c in memory for p in c.pieces if self._attach(p, None, run)], run)
            for file, event in run.done.items():
                if file not in last_of:
                    event.set()
            for k, chunk in enumerate(remote):
                issue_read(k + self.prefetch) if self.prefetch else issue_read(k)
                if k in reads:
                    start = time.perf_counter()
                    reads.pop(k).wait()
                    run.waited += time.perf_counter() - start
                buf = self._buffers[k % nbuf]
                self._finish_write(writes, k - 2, run)  # bounds the write-behind (also the snapshot reuse)
                if self.hooks is not None:
                    self.hooks.enter(chunk.group_file)
                if self._staging is not None:
                    self._staging.fetch(chunk)
                writes[k] = self._step_one(chunk, buf, k % nbuf, run)
                run.writes_of.setdefault(chunk.group_file, []).extend(self._uploaded(writes[k][0]))
                if last_of[chunk.group_file] == k and chunk.group_file in run.done:
                    run.done[chunk.group_file].set()  # every chunk of the file stepped, its writes issued
                if not self.prefetch:
                    self._finish_write(writes, k, run)
        except BaseException as exc:
            error = exc
        for k in sorted(writes):  # drain: every transfer done before returning ([Note: failed I/O])
            try:
                self._finish_write(writes, k, run)
            except BaseException as exc:
                error = error or exc
        for handle in reads.values():
            try:
                handle.wait()
            except BaseException:
                pass  # a read ahead of a stopped step: its chunk was not stepped
        self.tier.drain()
        if self._staging is not None:
            self._staging.end()
        if self.hooks is not None:
            try:
                self.hooks.finish()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error

    def _step_one(self, chunk: Chunk, buf: torch.Tensor, index: int,
                  run: Run) -> tuple[Handle, Chunk, list[Any]]:
        if chunk.slot < 0:  # no read refilled the buffer: the compute side writes it ([Note: host tier ordering])
            self.tier.claim(buf)
        stepped = [p for p in chunk.pieces if self._attach(p, buf if chunk.slot >= 0 else None, run)]
        undo: list[Any] = [(chunk.regions, chunk.region_bytes, chunk.slot)]
        if self._snapshots:  # [Note: failed I/O]: the parameters as they were, and the scalar entries
            snap, offset = self._snapshots[index], 0
            for p in stepped:
                n = p.numel * p.visible.element_size()
                snap[offset : offset + n].view(p.visible.dtype).view(p.shape).copy_(self._before(p))
                undo.append((p, offset, {k: v.clone() if isinstance(v, torch.Tensor) else v
                                         for k, v in p.scalars.items()}, list(p.keys), list(p.entries)))
                offset += n
        try:
            self._call(stepped, run)
            self._cast(stepped)
        finally:  # the shadow never keeps a piece
            states: dict[int, dict[str, Any]] = {id(p): self._detach(p, run) for p in stepped}
        for p in stepped:
            if p.low is not None:  # the master rows (a view of ``buf``, stepped in place) stay in the layout
                states[id(p)] = {MASTER: p.sub.detach(), **states[id(p)]}
        self._pack(chunk, [states.get(id(p)) for p in chunk.pieces], buf)
        target = (chunk.slot + 1) % self._slots if chunk.slot >= 0 else 0
        return self.tier.write_async(chunk.regions[target], buf), chunk, [target, undo, index]

    def _finish_write(self, writes: dict[int, tuple[Handle, Chunk, list[Any]]], k: int, run: Run) -> None:
        if k not in writes:
            return
        handle, chunk, (target, undo, index) = writes.pop(k)
        start = time.perf_counter()
        try:
            handle.wait()
        except BaseException:
            if self._staging is not None:
                self._staging.synchronize()  # the step's copy up lands before the rows are put back
            snap = self._snapshots[index] if self._snapshots else None
            chunk.regions, chunk.region_bytes, chunk.slot = undo[0]
            for piece, offset, scalars, keys, entries in undo[1:]:  # back to the state before this step
                assert snap is not None
                v = piece.visible
                n = piece.numel * v.element_size()
                v.copy_(snap[offset : offset + n].view(v.dtype).view(piece.shape))
                piece.scalars, piece.keys, piece.entries = scalars, keys, entries
            raise
        finally:
            run.waited += time.perf_counter() - start
        chunk.slot = target

    # -- accounting and lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        try:
            self.settle()
        finally:
            if self._executor is not None:
                self._executor.shutdown()
                self._executor = None
            self.tier.close()
        self._buffers, self._snapshots = [], []
