"""ZeRO-3: what the user writes into gathered parameters reaches the shards, and the fp32 masters.

[Note: edits of gathered parameters] At stage 3 a unit's full parameters exist only while it is gathered, and
``flat_shard`` (this rank's rows) is the only persistent copy. The user gathers them by hand (``model.unshard()``
... ``model.reshard()``, as FSDP2's ``unshard``/``reshard`` or FSDP1's ``summon_full_params``) and writes into
them there: WGAN's clipping (``p.data.clamp_``), a zeroed
padding row, a re-initialized layer, ``copy_`` from another model. Freeing the full parameters used to drop
those writes without a word, and the next step went on from the old rows. Now a unit gathered for the user
carries an *edit window* (``Unit.closing``). When it is freed (the user's ``reshard()``, the optimizer step, the
end of the next backward, whichever comes first), each parameter's own rows are compared with its shard, and
rows that differ are copied into it: the shard then holds the edit, as FSDP1's ``summon_full_params(writeback=
True)`` does. With ``[offload] params`` the shard is read back in to compare, and written out when it changed.
Under bf16/fp16 the fp32 masters of the changed shards follow them elementwise (``edit_listeners``: an element
the user changed becomes that value; the others keep their extra bits), as after ``load_state_dict``.

Each rank writes back its own rows from its own copy, so the ranks must make the same edit (any deterministic
edit does). The gathers memsave makes for itself (forward, backward, ``state_dict``, a pipeline step) open no
window: nothing is compared there. A closed window costs one comparison of the unit's rows on each rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from memsave.phases import UnitState
from memsave.zero.replaced import adopt_replaced
from memsave.zero.unit import Unit

__all__ = ["EditWindows", "write_back"]


@torch.no_grad()
def write_back(unit: Unit, only: Sequence[int] | None = None) -> None:
    """While ``unit`` is gathered: copy this rank's rows of its full parameters (those of ``only``) into the shard."""
    for i in range(len(unit.params)) if only is None else only:
        unit.shards[i].copy_(unit._own_rows(unit.full_views[i], i))


class EditWindows:
    """Opens edit windows on gathered units; closing one writes the changed rows back ([Note: edits of gathered
    parameters])."""

    def __init__(self, param_offload: Callable[[], Any]) -> None:
        self._param_offload = param_offload  # the engine's [offload] params (None without), read when a window closes
        self.edit_listeners: list[Callable[[dict[torch.Tensor, torch.Tensor]], None]] = []  # the masters follow
        self.num_written_back = 0  # parameters whose shard took an edit (tests read it)

    def open(self, units: Sequence[Unit]) -> None:
        for u in units:
            if u.stage == 3 and u.state is UnitState.UNSHARDED:
                u.closing = self._close

    @torch.no_grad()
    def _close(self, u: Unit) -> None:
        u.closing = None
        offload = self._param_offload()
        if offload is not None:
            offload.load(u)  # the shard in memory, to compare
        adopt_replaced(u.names, u.params, u.full_views)  # [Note: replaced data] in memsave/zero/replaced.py
        changed = [i for i in range(len(u.params)) if not torch.equal(u.shards[i], u._own_rows(u.full_views[i], i))]
        if not changed:
            if offload is not None:
                offload.release(u)
            return
        if offload is not None:
            offload.enter(u)
        write_back(u, changed)
        rows: dict[torch.Tensor, torch.Tensor] = {
            u.shards[i]: u.shards[i].detach().clone() if offload is not None else u.shards[i] for i in changed}
        if offload is not None:
            offload.finish([u])
        self.num_written_back += len(changed)
        for listener in self.edit_listeners:
            listener(rows)
