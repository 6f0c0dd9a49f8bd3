"""torch's own checkpointing, as ``memsave bench --checkpoint`` measures it against ``memsave.save``/``load``:
FSDP2 (``fully_shard`` per block, then the root; memsave/dist/baselines.py) saved and loaded with
``torch.distributed.checkpoint`` the way torch's tutorials and torchtitan do it: ``get_state_dict`` of the model
and the optimizer (DTensor shards, nothing gathered), ``dcp.save`` / ``dcp.load`` with its default
``FileSystemWriter`` (one file per rank, ``fsync`` on every file, one writer thread) and ``set_state_dict``.

Imported inside the bench's workers only ([Note: baselines import cost] in baselines.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

__all__ = ["dcp_load", "dcp_save", "local_state_bytes"]


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def dcp_save(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``dcp.save`` of FSDP2's model and optimizer state dicts into directory ``path`` (collective)."""
    dcp.save(_state(model, optimizer), checkpoint_id=os.fspath(path))


def dcp_load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``dcp.load`` into FSDP2's state dicts in place, then ``set_state_dict`` (collective)."""
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=os.fspath(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def local_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors this rank holds in the model's and the optimizer's state dicts (local shards)."""
    total = 0
    stack: list[Any] = [_state(model, optimizer)]
    while stack:
        obj = stack.pop()
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, torch.Tensor):
            local = obj.to_local() if isinstance(obj, DTensor) else obj
            total += local.numel() * local.element_size()
    return total
