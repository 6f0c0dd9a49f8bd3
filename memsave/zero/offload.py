"""``[offload] optimizer``: ZeRO's optimizer state on the host tier or on disk (ZeRO-Offload, Ren et al., 2021;
ZeRO-Infinity, Rajbhandari et al., 2021).

What moves where, by device:

- ``optimizer = "disk"``: the state of a ``fraction`` of this rank's shards lives in files under
  ``[offload] path`` (one per ZeRO unit) and is streamed through a window of ``prefetch + 2`` chunks in host
  memory during the step (:mod:`memsave.offload.state`); on CUDA the step runs on the host, the gradients and
  parameters crossing through pinned buffers ([Note: host step] in memsave/offload/host_step.py).
- ``optimizer = "cpu"`` on CUDA, ``step = "host"``: the state lives in host memory and is stepped there, chunk
  by chunk, as for the disk tier. ``step = "device"``: it lives in pinned host memory and is streamed to the
  device in chunks on a side stream; the step runs on the device. On CPU there is nothing to move: said once,
  no offload.
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

import torch

from memsave._logging import warn_once
from memsave.config import OffloadConfig
from memsave.offload import DiskTier, HostTier, OffloadedState, state_bytes_per_element
from memsave.offload.chunks import MASTER_BYTES
from memsave.offload.host_step import HostStaging
from memsave.offload.tiers import Tier
from memsave.optim import Adafactor
from memsave.zero.engine import ZeroEngine
from memsave.zero.param_offload import ParamOffload, StepHooks

__all__ = ["build_offloaded_state", "estimate_state_bytes"]


def cpu_noop(device: torch.device) -> str:
    """What ``optimizer = "cpu"`` on a non-CUDA device says, once per process."""
    return (f'[offload] optimizer = "cpu" on a {device.type} device: the optimizer state already lives in host '
            'memory, nothing is moved (optimizer = "disk" moves it to files)')


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


def build_offloaded_state(optimizer: torch.optim.Optimizer, engine: ZeroEngine, off: OffloadConfig, *,
                          masters: dict[torch.Tensor, torch.Tensor] | None = None,
                          ) -> tuple[OffloadedState | None, ParamOffload | None]:
    """The chunked, offloaded state of a ZeRO engine's shards (its ``param_groups`` hold them already, or their
    fp32 ``masters``: master -> the model's shard, offloaded with the state); None when nothing moves on this
    device (said once)."""
    device = engine.mesh.device
    if off.optimizer == "cpu" and device.type != "cuda":
        warn_once(cpu_noop(device))
        return None, None
    host_step = device.type == "cuda" and off.steps_on_host(device.type, mixed=bool(masters))  # [Note: host step]
    if device.type == "cuda" and not host_step and off.optimizer == "disk":
        raise NotImplementedError('[offload] optimizer = "disk" with step = "device" on CUDA is not implemented: '
                                  'the files are read into host buffers; use step = "host" or "auto"')
    # stage-3 parameter shards on the optimizer state's tier: files on a CPU device, pinned memory on CUDA
    moves_params = off.params == "disk" or (off.params == "cpu" and device.type == "cuda")
    masters = masters or {}
    master_elements = sum(m.numel() for m in masters)
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
    units: dict[torch.Tensor, int] = {s: u.index for u in engine.units for s in u.shards}
    units |= {m: units[s] for m, s in masters.items()}
    names = dict(engine.name_of) | {m: engine.name_of[s] for m, s in masters.items()}
    # the host step keeps host-tier state in host memory as it is (no chunk is moved: each steps in place)
    fraction = 0.0 if host_step and off.optimizer == "cpu" else off.fraction
    chunk = off.chunk_bytes(device.type, mixed=bool(masters))
    state = OffloadedState(optimizer, tier, group_of=lambda s: f"unit{units[s]}", names=names,
                           fraction=fraction, prefetch=off.prefetch, chunk_bytes=chunk,
                           bytes_per_element=per_elem, device=torch.device("cpu") if host_step else device,
                           staging=HostStaging(device, off.prefetch) if host_step else None,
                           group_order=([f"unit{u.index}" for u in engine.units]
                                        if moves_params or off.overlap else None),
                           masters=masters, offload_last=off.overlap, whole=isinstance(optimizer, Adafactor),
                           low_grad=lambda master: engine.grad_of(masters[master]))
    params = None
    if moves_params:  # last: the step's row pieces are views of the shards, made while they are in memory
        if engine.stage != 3:
            raise NotImplementedError(f"[offload] params = {off.params!r} needs zero.stage = 3, not {engine.stage}")
        params = ParamOffload(engine.units, tier, prefetch=off.prefetch)
        engine.attach_param_offload(params)
        state.hooks = StepHooks(params)
    return state, params
