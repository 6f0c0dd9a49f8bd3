"""The offloaded optimizer step on the host while the model trains on CUDA (ZeRO-Offload, Ren et al., 2021:
``[offload] step = "host"``).

[Note: host step] The state (and under mixed precision the fp32 masters) never goes to the device: it lives in
host memory (``optimizer = "cpu"``: ordinary tensors, stepped in place) or in files read into host window buffers
(``optimizer = "disk"``, the chunk pipeline of memsave/offload/state.py with the window on the host). For each
chunk, in step order:

1. *down*: its pieces' gradient rows (and, without masters, their fp32 parameter rows) are copied from the device
   into a pinned *in* slot on the ``down`` stream, ``prefetch`` chunks ahead of the step (``prefetch + 1`` slots).
2. *step*: the host waits for that copy, points the pieces at the slot's rows and steps the chunk on the CPU with
   the optimizer class's own kernel; Adam, AdamW, SGD and Adagrad run fused (torch's vectorized, multi-threaded
   CPU kernel) whatever ``foreach``/``fused`` the user's groups say: those flags choose a kernel, not the update.
3. *up*: the new rows go back on the ``up`` stream: masters are cast by the CPU into a pinned *out* slot (2, used
   in turn; the host waits for the copy that last read one before refilling it) and copied into the model's
   low-precision rows; fp32 parameter rows are copied straight from their in slot, whose next fill on ``down``
   waits for that copy on the device.

Both streams wait for the compute stream when the step starts (the backward that made the gradients, and every
read of the parameters, comes first), and the compute stream waits for ``up`` when the step ends, or with
``[offload] overlap`` for each unit's own copies when its gather needs them ([Note: overlapped step] in
state.py). A gradient already on the host (fp32 master gradients made by a loss scaler or clipping on a host
master's device) is used where it is. What crosses PCIe per element is the gradient one way and the parameter the
other: 4 bytes under bf16 against 24 for the device step (``step = "device"``: state and masters both ways).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from memsave.offload.chunks import Chunk, Piece
from memsave.offload.tiers import EventHandle, Tier, round_up
from memsave.offload.window import Run
from memsave.phases import MemoryCategory

__all__ = ["FUSED_ON_CPU", "HostStaging", "HostStep", "host_kernel"]

FUSED_ON_CPU = ("Adam", "AdamW", "SGD", "Adagrad")  # torch optimizers with a fused CPU kernel
_ALIGN = 64


def host_kernel(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Group overrides that make a raw step of ``optimizer`` on CPU tensors take torch's fused CPU kernel (empty
    for other classes, and for a differentiable group, which the fused kernel does not serve)."""
    if type(optimizer).__name__ not in FUSED_ON_CPU or type(optimizer).__module__.split(".")[0] != "torch":
        return {}
    if any(g.get("differentiable") for g in optimizer.param_groups):
        return {}
    return {"fused": True, "foreach": False}


class _Now:
    """A copy on a CPU device is done when it returns (the same chunk logic is tested without CUDA)."""

    def record(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None


class HostStaging:
    """The pinned slots and the two copy streams of the host step ([Note: host step]). On a CPU ``device`` the
    copies are plain synchronous ones (no streams, no pinning): what the CPU tests exercise."""

    def __init__(self, device: torch.device, prefetch: int) -> None:
        self.device = device
        self.ahead = max(prefetch, 0)
        self.cuda = device.type == "cuda"
        self.down: Any = torch.cuda.Stream(device) if self.cuda else None
        self.up: Any = torch.cuda.Stream(device) if self.cuda else None
        self._compute: Any = None
        self.ins: list[torch.Tensor] = []
        self.in_free: list[Any] = []  # per in slot: the up copy that last read it (fp32 rows), or None
        self.outs: list[torch.Tensor] = []
        self.out_free: list[Any] = [None, None]
        self._next_out = 0
        self._order: list[Chunk] = []
        self._pos: dict[int, int] = {}
        self._slot = 0  # the in slot of the chunk being stepped
        self._casts = torch.empty(0, dtype=torch.uint8)
        self._cast_used = 0
        self._cast_need = 0
        self._spare: list[torch.Tensor] = []
        self._ahead_now = self.ahead
        self._pending: dict[int, tuple[Any, dict[int, tuple[torch.Tensor, torch.Tensor | None]]]] = {}
        self._issued = 0
        self._grads: dict[int, torch.Tensor] = {}
        self.bytes_down = 0
        self.bytes_up = 0

    # -- slots ---------------------------------------------------------------------------------------------
    @staticmethod
    def _in_bytes(chunk: Chunk, grads: dict[int, torch.Tensor]) -> int:
        n = 0
        for p in chunk.pieces:
            g = grads.get(id(p))
            if g is not None and g.device.type != "cpu":
                n += round_up(g.numel() * g.element_size(), _ALIGN)
            if g is not None and p.dev is not None:
                n += round_up(p.numel * p.dev.element_size(), _ALIGN)
        return n

    @staticmethod
    def _out_bytes(pieces: Sequence[Piece]) -> int:
        return sum(round_up(p.numel * p.low.element_size(), _ALIGN) for p in pieces if p.low is not None)

    def _grow(self, slots: list[torch.Tensor], count: int, nbytes: int) -> None:
        if len(slots) < count or (slots and slots[0].numel() < nbytes):
            self.synchronize()  # nothing in flight reads the old slots
            slots[:] = [torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self.cuda) for _ in range(count)]

    def synchronize(self) -> None:
        if self.cuda:
            self.down.synchronize()
            self.up.synchronize()

    def _event(self) -> Any:
        return torch.cuda.Event() if self.cuda else _Now()

    def _on(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def tensors(self) -> list[torch.Tensor]:
        return [*self.ins, *self.outs, self._casts, *self._spare]

    # -- one step ------------------------------------------------------------------------------------------
    def after_compute(self) -> None:
        """In ``optimizer.step()``, on the caller's thread: both streams wait for the compute stream's work so far
        (the backward that made the gradients, every read of the parameters)."""
        if self.cuda:
            self._compute = torch.cuda.current_stream(self.device)
            self.down.wait_stream(self._compute)
            self.up.wait_stream(self._compute)

    def begin(self, order: list[Chunk], grads: dict[int, torch.Tensor], *, at_once: bool = False) -> None:
        """A step over ``order`` (the chunks, in step order) with ``grads`` (piece id -> its gradient rows, on the
        device; fetched rows replace them): the slots sized. ``at_once``: every chunk is fetched before one step
        over all of them ([Note: whole-shard offload] in whole.py), and uploaded in one go."""
        self._order, self._grads, self._issued, self._pending = order, grads, 0, {}
        self._pos = {c.index: k for k, c in enumerate(order)}
        self._ahead_now = len(order) if at_once else self.ahead
        self._grow(self.ins, self._ahead_now + 1, max((self._in_bytes(c, grads) for c in order), default=0))
        if len(self.in_free) != len(self.ins):
            self.in_free = [None] * len(self.ins)
        outs = [self._out_bytes(c.pieces) for c in order]
        self._grow(self.outs, 2, (sum(outs) if at_once else max(outs, default=0)))
        # fp32 casts of low-precision gradients: a chunk's at a time, every chunk's when stepped at once
        casts = [2 * self._out_bytes(c.pieces) for c in order]
        self._cast_need = sum(casts) if at_once else max(casts, default=0)
        self._spare = []

    def _issue(self, k: int) -> None:
        chunk = self._order[k]
        slot = k % len(self.ins)
        buf, offset = self.ins[slot], 0
        if self.in_free[slot] is not None:
            if self.cuda:
                self.down.wait_event(self.in_free[slot])  # its fp32 rows were copied up
            self.in_free[slot] = None
        rows: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

        def take(src: torch.Tensor) -> torch.Tensor:
            nonlocal offset
            n = src.numel() * src.element_size()
            dst = buf[offset : offset + n].view(src.dtype).view(src.shape)
            offset += round_up(n, _ALIGN)
            dst.copy_(src, non_blocking=True)
            self.bytes_down += n
            return dst

        with self._on(self.down):
            for p in chunk.pieces:
                g = self._grads.get(id(p))
                if g is None:
                    continue
                grad = g if g.device.type == "cpu" else take(g)
                rows[id(p)] = (grad, take(p.dev) if p.dev is not None else None)
            event = self._event()
            event.record(self.down)
        self._pending[chunk.index] = (event, rows)

    def fetch(self, chunk: Chunk) -> None:
        """Before ``chunk`` steps: the copies of the next ``prefetch`` chunks issued, this one's waited, and its
        pieces pointed at the host rows (gradients in ``grads``, fp32 parameters as ``sub``)."""
        k = self._pos[chunk.index]
        while self._issued <= min(k + self._ahead_now, len(self._order) - 1):
            self._issue(self._issued)
            self._issued += 1
        event, rows = self._pending.pop(chunk.index)
        event.synchronize()
        self._slot = k % len(self.ins)
        for p in chunk.pieces:
            if id(p) in rows:
                grad, param = rows[id(p)]
                if grad.dtype != p.sub.dtype:  # low-precision gradients, cast for an fp32 master's step
                    grad = self._cast_into(grad, p.sub.dtype)
                self._grads[id(p)] = grad
                if param is not None:
                    p.sub.data = param

    def _cast_into(self, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``grad`` cast into a host buffer kept from step to step (a fresh tensor each step would fault in new
        pages: about as long as the optimizer's own step on large chunks)."""
        n = round_up(grad.numel() * dtype.itemsize, _ALIGN)
        if self._cast_used + n > self._casts.numel():
            if self._cast_used:  # this step's earlier casts are in use: a further buffer beside them
                self._spare.append(self._casts)
            self._casts = torch.empty(max(n, self._cast_need), dtype=torch.uint8)
            self._cast_used = 0
        out = self._casts[self._cast_used : self._cast_used + grad.numel() * dtype.itemsize]
        self._cast_used += n
        return out.view(dtype).view(grad.shape).copy_(grad)

    def upload(self, pieces: Sequence[Piece]) -> Any:
        """After the step: the pieces' new rows copied into the model's rows on ``up``; returns the copy's event."""
        slot = self._next_out
        self._next_out = (slot + 1) % 2
        self._cast_used = 0  # the step that read this chunk's casts is over
        if self.out_free[slot] is not None:
            self.out_free[slot].synchronize()  # the host refills it: the copy that read it must be done
        buf, offset = self.outs[slot], 0
        casts: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p in pieces:
            if p.low is not None:
                n = p.numel * p.low.element_size()
                staged = buf[offset : offset + n].view(p.low.dtype).view(p.shape)
                offset += round_up(n, _ALIGN)
                staged.copy_(p.sub.detach())  # the cast, on the CPU
                casts.append((p.low, staged))
            elif p.dev is not None:
                casts.append((p.dev, p.sub.detach()))
        event = self._event()
        with self._on(self.up):
            for dst, src in casts:
                dst.copy_(src, non_blocking=True)
                self.bytes_up += src.numel() * src.element_size()
            event.record(self.up)
        self.out_free[slot] = event
        for p in pieces:
            if p.dev is not None:  # its in slot is refilled after this copy ([Note: host step] 3.)
                p.sub.data = p.dev
        if any(p.dev is not None for p in pieces):
            self.in_free[self._slot] = event
        return event

    def end(self) -> None:
        """The compute stream waits for every copy up; the copies down that no step took are waited."""
        self._pending.clear()
        self._grads = {}
        if self.cuda:
            self.down.synchronize()
            (self._compute or torch.cuda.current_stream(self.device)).wait_stream(self.up)



class HostStep:
    """The host-step side of :class:`~memsave.offload.state.OffloadedState` (a mixin), and what the state holds
    where: on the device (:meth:`memory_tensors`) or off it (:meth:`offloaded_bytes`)."""

    chunks: list[Chunk]
    tier: Tier
    hooks: Any
    _staging: HostStaging | None
    _buffers: list[torch.Tensor]
    _snapshots: list[torch.Tensor]
    _last_upload: Any = None

    if TYPE_CHECKING:  # Window's, beside this one in OffloadedState
        def _attach(self, piece: Piece, buf: torch.Tensor | None, run: Run) -> bool: ...
        def _call(self, pieces: list[Piece], run: Run) -> None: ...
        @staticmethod
        def _detach(piece: Piece, run: Run) -> dict[str, Any]: ...

    def _cast(self, pieces: list[Piece]) -> None:
        """The stepped rows into the model's: master mode casts the fp32 masters into its low-precision rows; the
        host step copies them up ([Note: host step])."""
        if self._staging is not None:
            self._last_upload = self._staging.upload(pieces)
            return
        for p in pieces:
            if p.low is not None:
                p.low.copy_(p.sub)

    def _uploaded(self, write: Any) -> list[Any]:
        """What a unit's first reader waits for after a chunk's step: its write, and its copy up."""
        return [write] if self._staging is None else [write, EventHandle(self._last_upload)]

    def _before(self, piece: Piece) -> torch.Tensor:
        """The rows a failed write puts back, as they are before the step ([Note: failed I/O] in state.py): on the
        host when the step is there (the master cast, or the fetched fp32 rows: equal to the device's rows)."""
        if self._staging is not None and piece.sub.device.type == "cpu":
            return piece.sub.detach()
        return piece.visible

    def _step_in_memory(self, pieces: list[Piece], run: Run) -> None:
        """One raw step over attached pieces whose state is kept in memory; the new rows go to the model's (cast,
        or copied up); the state is taken back, and an fp32 piece points at the device's rows again."""
        try:
            self._call(pieces, run)
            self._cast(pieces)
        finally:
            for p in pieces:
                p.state = self._detach(p, run) or p.state
                if p.dev is not None:
                    p.sub.data = p.dev

    def _step_memory_host(self, memory: list[Chunk], run: Run) -> None:
        """The chunks whose state lives in host memory, one at a time through the staging slots."""
        assert self._staging is not None
        last = {c.group_file: c for c in memory}
        for chunk in memory:
            self._staging.fetch(chunk)
            if self.hooks is not None:
                self.hooks.enter(chunk.group_file)
            pieces = [p for p in chunk.pieces if self._attach(p, None, run)]
            self._step_in_memory(pieces, run)
            if pieces:
                run.writes_of.setdefault(chunk.group_file, []).append(EventHandle(self._last_upload))
            if last[chunk.group_file] is chunk and chunk.group_file in run.done:
                run.done[chunk.group_file].set()

    # -- accounting ------------------------------------------------------------------------------------------
    def _host_held(self) -> Iterator[torch.Tensor]:
        """Host step: everything this state holds in host memory."""
        assert self._staging is not None
        yield from itertools.chain(self._buffers, self._snapshots, self._staging.tensors())
        for c in self.chunks:
            for p in c.pieces:
                if p.low is not None and not c.offloaded:
                    yield p.sub
                for v in itertools.chain((p.state or {}).values(), p.scalars.values()):
                    if isinstance(v, torch.Tensor):
                        yield v

    def offloaded_bytes(self) -> dict[str, int]:
        held = sum(c.region_bytes for c in self.chunks if c.offloaded and c.slot >= 0)
        out = {"host": held if self.tier.kind == "host" else 0, "disk": held if self.tier.kind == "disk" else 0}
        if self._staging is not None:
            out["host"] += sum(t.untyped_storage().nbytes() for t in {id(t): t for t in self._host_held()}.values())
        return out

    def memory_tensors(self) -> Iterator[tuple[MemoryCategory, torch.Tensor]]:
        if self._staging is not None:
            return  # [Note: host step]: nothing on the device
        for b in self._buffers:
            yield MemoryCategory.OPTIMIZER_STATE, b
        for s in self._snapshots:
            yield MemoryCategory.COMM, s
        for c in self.chunks:
            for p in c.pieces:
                if p.low is not None and not c.offloaded:
                    yield MemoryCategory.MASTER, p.sub
                for v in itertools.chain((p.state or {}).values(), p.scalars.values()):
                    if isinstance(v, torch.Tensor):
                        yield MemoryCategory.OPTIMIZER_STATE, v
