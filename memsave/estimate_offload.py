"""The offload half of ``memsave.estimate``: the offloaded share of the optimizer state on its tier and the
streaming window that stays in memory, from shapes alone (the same chunk plan as ``memsave.offload``)."""

from __future__ import annotations

from typing import Any

from memsave.config import Profile
from memsave.memory.schema import format_bytes
from memsave.offload.chunks import MASTER_BYTES, plan, row_pieces, window_bytes
from memsave.offload.tiers import BOUNCE, IO_THREADS, round_up

__all__ = ["offload_states"]


def _chunks(pieces: list[tuple[int, int, int]], per_elem: int, chunk_bytes: int,
            fraction: float, offload_last: bool = False) -> tuple[int, int, int]:
    """The chunk plan of ``memsave.offload.OffloadedState`` from shapes alone (the same
    :func:`memsave.offload.chunks.plan`): ``pieces`` are ``(unit, local rows, row numel)`` of every trainable shard
    in step order. Returns the window buffer's bytes, the largest offloaded chunk's elements and the offloaded
    elements."""
    chunk_numel = max(1, chunk_bytes // per_elem)
    cut = [(unit, (stop - start) * row) for unit, rows, row in pieces
           for start, stop in row_pieces(rows, row, chunk_numel)]
    sizes = [(sum(cut[i][1] for i in idx), len(idx))
             for idx, offloaded in plan(cut, chunk_numel, fraction, offload_last=offload_last) if offloaded]
    window = max((window_bytes(numel, n, per_elem) for numel, n in sizes), default=0)
    return round_up(window), max((numel for numel, _ in sizes), default=0), sum(numel for numel, _ in sizes)


def offload_states(held: dict[str, int], states: dict[str, Any], prof: Profile, device_type: str,
                   notes: list[str]) -> int:
    """``[offload]``: the offloaded share of the optimizer state on its tier, and the streaming window that stays
    in memory: ``prefetch + 2`` window buffers (one without prefetch) as big as the largest offloaded chunk, and
    on disk as many snapshots of a chunk's parameters (memsave/offload/state.py). Offloaded parameters (stage 3:
    on disk, or in pinned host memory on CUDA) move the shards there, but for the ``prefetch + 1`` largest
    resident around their use (and, on disk, the I/O threads' bounce buffers). Returns the bytes of those
    resident shards (in ``held["params"]``, transient: not model state as the ZeRO formula counts it)."""
    off = prof.offload
    if not (off.optimizer == "disk" or (off.optimizer == "cpu" and device_type == "cuda")) or off.fraction == 0:
        if off.optimizer == "cpu":
            notes.append('[offload] optimizer = "cpu" on a CPU device: nothing moves')
        return 0
    tier = "offload_disk" if off.optimizer == "disk" else "offload_host"
    per_elem = max(1, round(sum(states["unit_state"]) / max(sum(states["unit_elems"]), 1)))
    masters = MASTER_BYTES if held.get("master") else 0  # mixed precision: the fp32 masters move with the state
    pieces = states["pieces"]
    moves_params = off.params == "disk" or (off.params == "cpu" and device_type == "cuda")
    resident = 0
    if moves_params or off.overlap:  # stepped unit by unit (a stable sort, as OffloadedState's)
        pieces = sorted(pieces, key=lambda piece: piece[0])
    chunk = off.chunk_bytes(device_type, mixed=bool(masters))
    window, chunk_elems, elems = _chunks(pieces, per_elem + masters, chunk, off.fraction, offload_last=off.overlap)
    moved = elems * per_elem
    moved_masters = min(held.get("master", 0), elems * masters)
    held[tier] = held.get(tier, 0) + moved + moved_masters
    held["master"] = held.get("master", 0) - moved_masters
    buffers = off.prefetch + 2 if off.prefetch else 1
    host_step = device_type == "cuda" and off.steps_on_host(device_type, mixed=bool(masters))
    if host_step:  # [Note: host step]: the window, the snapshots and the pinned slots are host memory
        held["optimizer_state"] -= moved
    else:
        held["optimizer_state"] += buffers * window - moved
    if off.optimizer == "disk" and not host_step:
        held["comm"] = held.get("comm", 0) + buffers * chunk_elems * states["param_bytes"]
    if moves_params:  # [Note: parameter residency] in memsave/zero/param_offload.py: in memory around its use,
        # a unit's shard and the `prefetch` read ahead of it; on disk, read and written through each I/O thread's
        # bounce buffer (shards are not aligned)
        held[tier] += held["params"]
        held["params"] = resident = sum(sorted(states["unit_shard"], reverse=True)[: off.prefetch + 1])
        if off.params == "disk":
            held["comm"] = held.get("comm", 0) + IO_THREADS * BOUNCE
    notes.append(f"optimizer offload to {off.optimizer}: {format_bytes(moved)} of state"
                 + (f" and {format_bytes(moved_masters)} of fp32 masters" if moved_masters else "")
                 + (" off the device, stepped on the host" if host_step else " off the device; streaming "
                    f"window {buffers} x {format_bytes(window)}")
                 + (f"; parameters on {off.params}, {off.prefetch + 1} unit shard(s) resident around their use"
                    if moves_params else ""))
    return resident
