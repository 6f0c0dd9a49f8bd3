"""Replaying the part of a recorded program that computes some storages ([Note: deferred-init recording])."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_map

from memsave.deferred.record import META_DEVICE, Op, Ref

__all__ = ["replay", "slice_ops"]


def slice_ops(ops: Sequence[Op], targets: Iterable[int]) -> list[int]:
    """Indices of the operations needed to compute the storages ``targets``, in program order: a backward walk
    keeps an operation when it writes a needed storage, and then needs everything it reads."""
    needed = set(targets)
    chosen = []
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i]
        if op.writes & needed:
            chosen.append(i)
            needed |= op.reads
    chosen.reverse()
    return chosen


def _view(storages: dict[int, torch.UntypedStorage], ref: Ref, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=ref.dtype, device=device).set_(storages[ref.key], ref.offset, ref.size, ref.stride)


def _allocate(ref: Ref, device: torch.device) -> torch.UntypedStorage:
    return torch.empty(ref.nbytes, dtype=torch.uint8, device=device).untyped_storage()


@torch.no_grad()
def replay(ops: Sequence[Op], targets: Iterable[int], external: dict[int, Ref],
           device: torch.device) -> dict[int, torch.UntypedStorage]:
    """Run the operations that compute ``targets`` on real memory of ``device``; returns their storages.

    A storage created before the log began (``external``: a parameter built under plain ``torch.device("meta")``)
    starts uninitialized. Random operations run from the generator state recorded before them; the caller saves
    and restores the generators around the whole materialization. Storages that only served as inputs are freed
    after their last use.
    """
    targets = set(targets)
    chosen = slice_ops(ops, targets)
    last: dict[int, int] = {}
    for i in chosen:
        for k in ops[i].reads | ops[i].writes:
            last[k] = i
    storages: dict[int, torch.UntypedStorage] = {}
    for key in targets | {k for i in chosen for k in ops[i].reads}:
        if key in external:
            storages[key] = _allocate(external[key], device)

    def real(x: object) -> object:
        if isinstance(x, Ref):
            return _view(storages, x, device)
        return device if x is META_DEVICE else x

    for i in chosen:
        op = ops[i]
        args, kwargs = tree_map(real, (op.args, op.kwargs))
        if op.rng is not None:
            op.rng[0].set_state(op.rng[1])
        out = op.func(*args, **kwargs)
        if op.creates:
            outs = tree_flatten(out)[0]
            for index, ref in op.creates:
                got = outs[index]
                st = got.untyped_storage()
                if (st.nbytes() == ref.nbytes and got.storage_offset() == ref.offset and
                        tuple(got.stride()) == ref.stride and got.device == device):
                    storages[ref.key] = st
                else:  # a layout the meta kernel did not predict: copy into the recorded one
                    storages[ref.key] = _allocate(ref, device)
                    _view(storages, ref, device).copy_(got)
        del args, kwargs, out
        for k in list(storages):
            if last.get(k) == i and k not in targets:
                del storages[k]
    return {k: storages[k] for k in targets if k in storages}
