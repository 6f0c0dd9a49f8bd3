"""ZeRO: a parameter whose ``.data`` the user replaced keeps training from the new values.

[Note: replaced data] Under ZeRO-1/2 the optimizer steps this rank's rows as views of each parameter's storage,
and at stage 3 the full parameters of a gathered unit are views of its ``full_flat``. A loop that edits weights
by assignment (``p.data = p.data.clamp(-c, c)``: WGAN's weight clipping as often written; ``w.data =
torch.randn(...)`` to re-initialize) points the parameter at a new tensor that none of those views see: the step
went on from the old rows and the gather after it wrote them back over the edit, with no error (a review: WGAN
clipping 1.84 off plain torch at stages 1-2; at stage 3, inside ``unshard()``/``reshard()``, the edit dropped
entirely). In-place writes (``p.data.clamp_``, ``p.copy_``) always worked.

So an assignment is taken as the in-place write it stands for: before the step (stages 1-2) and when the user's
edit window closes (stage 3: ``reshard()``, memsave/zero/edit_window.py), a parameter no longer on the storage
memsave gave it has the new values copied into that storage and is pointed back at it; under bf16/fp16 the
masters then follow it as after any edit ([Note: edits between steps] in memsave/precision/edits.py). A new tensor
of another shape, dtype or device cannot be taken so: refused, naming the parameter. At stage 3 an assignment
while the unit is sharded is refused at once (memsave/zero/guards.py): the next gather would overwrite it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["adopt_replaced", "adopt_replaced_in_units"]


@torch.no_grad()
def adopt_replaced(names: Sequence[str], params: Sequence[nn.Parameter], storages: Sequence[torch.Tensor]) -> None:
    """Each parameter not on its storage any more: the new values copied into it, and pointed back at it."""
    for name, p, own in zip(names, params, storages):
        if p.data_ptr() == own.data_ptr() or own.numel() == 0:
            continue
        if p.shape != own.shape or p.dtype != own.dtype or p.device != own.device:
            raise RuntimeError(
                f"parameter {name!r}: its .data was replaced by a tensor of shape {tuple(p.shape)}, {p.dtype} on "
                f"{p.device}, where memsave ZeRO holds {tuple(own.shape)}, {own.dtype} on {own.device} (its shards "
                "and gathers are views of that storage). Write new values in place instead: under torch.no_grad(), "
                "p.copy_(new) or p.data.copy_(new)")
        own.copy_(p.detach())
        p.data = own


def adopt_replaced_in_units(units: Sequence[Any]) -> None:
    """Stages 1-2, before the step: every unit's parameters ([Note: replaced data])."""
    for u in units:
        adopt_replaced(u.names, u.params, u.originals)
