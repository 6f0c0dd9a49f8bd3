"""``[offload] optimizer``: ZeRO's optimizer state on the host tier or on disk (ZeRO-Offload, Ren et al., 2021;
ZeRO-Infinity, Rajbhandari et al., 2021).

What moves where, by device:

- ``optimizer = "disk"`` on CPU: the state of a ``fraction`` of this rank's shards lives in files under
  ``[offload] path`` (one per ZeRO unit) and is streamed through a window of ``prefetch + 2`` chunks during the
  step (:mod:`memsave.offload.state`). On CUDA: not implemented (it needs pinned bounce buffers).
- ``optimizer = "cpu"`` on CUDA: the state lives in pinned host memory and is streamed to the device in chunks
  on a side stream; the step runs on the device. On CPU there is nothing to move: said once, no offload.
- ``params = "disk"`` on CPU, stage 3, with ``optimizer = "disk"`` and ``fraction = 1``: each unit's parameter
  shard lives in a file between uses too (memsave/zero/param_offload.py). ``params = "cpu"`` on CUDA, stage 3,
  with ``optimizer = "cpu"`` and ``fraction = 1``: each unit's shard lives in pinned host memory between uses
  and is copied in ahead of its gathers and its step on the host tier's side stream. ``params = "cpu"`` on CPU:
  nothing to move, said once.

Under mixed precision the fp32 master weights move with the optimizer state (12 bytes per element for AdamW:
ZeRO-Offload's split, the model's bf16/fp16 shards stay): [Note: offloaded masters] in memsave/offload/state.py.
Offload needs an elementwise optimizer (each chunk is stepped alone); anything else is refused before the model
is touched.
"""

from __future__ import annotations

import os

import torch

from memsave._logging import warn_once
from memsave.config import OffloadConfig, Profile
from memsave.offload import DiskTier, HostTier, OffloadedState, check_disk_path, state_bytes_per_element
from memsave.offload.chunks import MASTER_BYTES
from memsave.offload.tiers import Tier
from memsave.optim import Adafactor
from memsave.zero.engine import ZeroEngine
from memsave.zero.param_offload import ParamOffload, StepHooks

__all__ = ["build_offloaded_state", "check_offload", "effective_offload", "estimate_state_bytes"]

ELEMENTWISE = {"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop", "Adadelta", "ASGD", "Rprop"}


def cpu_noop(device: torch.device) -> str:
    """What ``optimizer = "cpu"`` on a non-CUDA device says, once per process."""
    return (f'[offload] optimizer = "cpu" on a {device.type} device: the optimizer state already lives in host '
            'memory, nothing is moved (optimizer = "disk" moves it to files)')


def effective_offload(profile: Profile, device: torch.device) -> OffloadConfig | None:
    """The ``[offload]`` settings that move something on ``device`` (None: nothing moves); refuses what is not
    implemented and says once what is ignored on this hardware."""
    off = profile.offload
    name = profile.name
    if off.params == "cpu" and device.type == "cuda" and (off.optimizer != "cpu" or off.fraction != 1.0
                                                          or profile.zero.stage != 3):
        raise NotImplementedError(
            f"profile {name!r}: [offload] params = \"cpu\" on a CUDA device is not implemented with optimizer = "
            f"{off.optimizer!r}, fraction = {off.fraction}, zero.stage = {profile.zero.stage}: it needs optimizer = "
            '"cpu", fraction = 1 and zero.stage = 3 (the step streams each unit\'s parameters with its optimizer '
            "state)")
    if off.params == "disk" and (device.type != "cpu" or off.optimizer != "disk" or off.fraction != 1.0):
        raise NotImplementedError(
            f"profile {name!r}: [offload] params = \"disk\" is not implemented with optimizer = {off.optimizer!r}, "
            f"fraction = {off.fraction} on a {device.type} device: it needs optimizer = \"disk\" and fraction = 1 "
            "on a CPU device (the step streams each unit's parameters with its optimizer state)")
    if off.params == "cpu" and device.type != "cuda":
        warn_once(f'[offload] params = "cpu" on a {device.type} device: the parameters already live in host '
                  "memory, nothing is moved")
    if off.overlap and (profile.zero.stage != 3 or device.type != "cpu"):
        raise NotImplementedError(
            f"profile {name!r}: [offload] overlap = true with optimizer = {off.optimizer!r}, zero.stage = "
            f"{profile.zero.stage} on a {device.type} device is not implemented: it overlaps the offloaded "
            "optimizer step with the next forward, whose stage-3 gathers wait for each unit's rows; it needs "
            'optimizer = "disk", zero.stage = 3 and a CPU device (set overlap = false)')
    if off.optimizer == "none":
        return None
    if profile.zero.stage == 0:
        raise NotImplementedError(
            f"profile {name!r}: [offload] optimizer = {off.optimizer!r} with zero.stage = 0 is not implemented: "
            "offload streams ZeRO's optimizer shards; use zero.stage = 1, 2 or 3")
    if off.optimizer == "cpu" and device.type != "cuda":
        warn_once(cpu_noop(device))
        return None
    if off.optimizer == "disk" and device.type != "cpu":
        raise NotImplementedError(
            f"profile {name!r}: [offload] optimizer = \"disk\" on a {device.type} device is not implemented (it "
            'needs pinned bounce buffers between the files and the device); use optimizer = "cpu"')
    return off


def estimate_state_bytes(optimizer: torch.optim.Optimizer, dp_size: int) -> tuple[int, int]:
    """``(bytes per element, this rank's per-element state bytes)`` of ``optimizer`` under ZeRO on ``dp_size``."""
    per_elem, total = 0, 0
    for g in optimizer.param_groups:
        probed: dict[torch.dtype, int] = {}
        for p in g["params"]:
            if p.dtype not in probed:
                probed[p.dtype] = state_bytes_per_element(optimizer, g, p.dtype, p.device)
            b = probed[p.dtype]
            per_elem = max(per_elem, b)
            rows = p.shape[0] if p.dim() else 1
            total += b * (-(-rows // dp_size)) * (p.numel() // max(rows, 1))
    return per_elem, total


def check_offload(optimizer: torch.optim.Optimizer, off: OffloadConfig, dp_size: int, *,
                  master_elements: int | None = None) -> None:
    """Before anything changes: the optimizer can be streamed in chunks, and the disk has room (for the state, and
    ``master_elements`` fp32 masters on this rank; None: as many as it has elements, an upper bound)."""
    name = type(optimizer).__name__
    if isinstance(optimizer, Adafactor):
        raise NotImplementedError(
            f"[offload] optimizer = {off.optimizer!r} with memsave.optim.Adafactor is not implemented: its column "
            "statistics span every row of a shard (and are reduced over dp in one call per step), so the state "
            "cannot be stepped chunk by chunk; use AdamW/Adam/SGD, or Adafactor without offload (its state is "
            "~0.2% of AdamW's)")
    if name not in ELEMENTWISE:
        raise NotImplementedError(
            f"[offload] optimizer = {off.optimizer!r} with {name} is not implemented: offload steps the state chunk "
            f"by chunk, which is exact only for elementwise optimizers ({', '.join(sorted(ELEMENTWISE))})")
    if off.optimizer == "disk":
        per_elem, total = estimate_state_bytes(optimizer, dp_size)
        if master_elements is None:
            master_elements = total // max(per_elem, 1)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        check_disk_path(off.path, int(2 * (total + MASTER_BYTES * master_elements) * off.fraction * local))


def build_offloaded_state(optimizer: torch.optim.Optimizer, engine: ZeroEngine, off: OffloadConfig, *,
                          masters: dict[torch.Tensor, torch.Tensor] | None = None,
                          ) -> tuple[OffloadedState | None, ParamOffload | None]:
    """The chunked, offloaded state of a ZeroOptimizer's shards (its ``param_groups`` hold them already, or their
    fp32 ``masters``: master -> the model's shard, offloaded with the state); None when nothing moves on this
    device (said once)."""
    device = engine.mesh.device
    if off.optimizer == "cpu" and device.type != "cuda":
        warn_once(cpu_noop(device))
        return None, None
    if off.optimizer == "disk" and device.type != "cpu":
        raise NotImplementedError(f'[offload] optimizer = "disk" on a {device.type} device is not implemented (it '
                                  'needs pinned bounce buffers between the files and the device); use "cpu"')
    # stage-3 parameter shards on the optimizer state's tier: files on a CPU device, pinned memory on CUDA
    moves_params = off.params == "disk" or (off.params == "cpu" and device.type == "cuda")
    masters = masters or {}
    master_elements = sum(m.numel() for m in masters)
    check_offload(optimizer, off, engine.dp_size, master_elements=master_elements)
    per_elem, total = estimate_state_bytes(optimizer, 1)  # the groups hold this rank's shards already
    total += MASTER_BYTES * master_elements
    tier: Tier
    if off.optimizer == "disk":
        param_bytes = sum(u.flat_shard.numel() * u.flat_shard.element_size() for u in engine.units
                          if off.params == "disk")
        tier = DiskTier(off.path, rank=engine.mesh.rank, needed_bytes=int(2 * (total * off.fraction + param_bytes)),
                        direct=None if off.direct else False)
    else:
        tier = HostTier(device)
    units = {s: u.index for s, (u, _) in engine._slot_of.items()}
    units |= {m: units[s] for m, s in masters.items()}
    names = dict(engine.name_of) | {m: engine.name_of[s] for m, s in masters.items()}
    state = OffloadedState(optimizer, tier, group_of=lambda s: f"unit{units[s]}", names=names,
                           fraction=off.fraction, prefetch=off.prefetch, chunk_bytes=int(off.chunk_mb * 2**20),
                           bytes_per_element=per_elem, device=device,
                           group_order=([f"unit{u.index}" for u in engine.units]
                                        if moves_params or off.overlap else None),
                           masters=masters, offload_last=off.overlap,
                           low_grad=lambda master: engine.shard_grad(masters[master]))
    params = None
    if moves_params:  # last: the step's row pieces are views of the shards, made while they are in memory
        if engine.stage != 3:
            raise NotImplementedError(f"[offload] params = {off.params!r} needs zero.stage = 3, not {engine.stage}")
        params = ParamOffload(engine.units, tier, prefetch=off.prefetch)
        engine.attach_param_offload(params)
        state.hooks = StepHooks(params)
    return state, params
