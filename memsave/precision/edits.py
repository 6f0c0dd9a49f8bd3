"""In-place edits of the model's low-precision weights between steps reach their fp32 masters.

[Note: edits between steps] Under bf16/fp16 the fp32 masters are the source of truth: each step steps them and
casts them into the model's parameters. Plain training loops edit the weights in place after ``step()``: WGAN's
weight clipping (``p.data.clamp_(-c, c)``), zeroing an embedding's padding row, a projection onto a constraint, a
dead unit re-initialized. Unseen, the next step would overwrite the edit from the unedited master. So before the
masters are read (the step, the state dicts, a checkpoint save) every parameter that may have been written since
memsave last wrote it has its master follow it *elementwise* (:func:`follow`): an element whose low-precision
value the user changed becomes that value in fp32; the others keep the master's extra bits, so a needless
refresh changes nothing.

What "may have been written" means, without a pass over the weights each step:

- torch bumps a tensor's version counter (``p._version``) on every in-place write through ``p`` itself
  (``with torch.no_grad(): p.clamp_(...)``, ``p[0] = 0``, ``p.copy_``, ``nn.init.*_``, ``torch._foreach_*_``);
- writes through ``p.data`` do *not* bump ``p``'s counter: ``.data`` is a new tensor whose counter starts at 0.
  So each watched parameter's class becomes :class:`WatchedParameter`, an ``nn.Parameter`` whose ``data``
  property keeps the tensors it hands out until the next mark: one whose counter moved was written (a read, as
  memsave's checkpoint layout does, refreshes nothing); setting ``p.data`` counts as an edit. Each hand-out
  first settles the ones kept: a written one is noted and let go, and so is one no one else holds any more
  (it can no longer be written), so reads between steps (``.data`` read every forward, or a loop that never
  steps) keep only the tensors the user still holds, not one per read. The class defines
  no ``__torch_function__``, so torch never calls into Python on the compute path; pickling
  (``torch.save(model)``) and ``copy.deepcopy`` give plain Parameters.

memsave's own writes (the cast after a step, ZeRO-1/2's gather of the stepped rows, loading) are followed by
:meth:`EditWatch.mark`, which records the counters and clears the notes. Checking is one comparison per
parameter. Not seen: a ``.data`` tensor kept from before the last step and written later (``w = p.data`` once,
``w.clamp_()`` every step); take ``p.data`` (or ``p`` under ``torch.no_grad()``) each time. Parameters of a class
of their own (an ``nn.Parameter`` subclass) keep it and are compared every step instead.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["EditWatch", "WatchedParameter", "follow", "holder"]

_DATA: Any = torch._C.TensorBase.__dict__["data"]  # the getset descriptor behind ``Tensor.data``
_HANDED = "_memsave_data_handed"  # the ``.data`` tensors handed out since the last mark, still held elsewhere
_SET = "_memsave_data_set"  # ``.data`` was set, or a handed-out tensor written, since the last mark


def follow(master: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``master`` where it still rounds to the low-precision ``p``, else ``p`` in fp32 (see [Note: edits between
    steps])."""
    low = p.to(master.device)  # a master on the host (offload's host step) follows a parameter on the device
    return torch.where(master.to(p.dtype) == low, master, low.float())


class WatchedParameter(nn.Parameter):
    """An ``nn.Parameter`` that sees writes through ``.data`` ([Note: edits between steps]); set by ``__class__``
    swap."""

    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        t = _DATA.__get__(self)
        handed = self.__dict__.setdefault(_HANDED, [])
        if handed:
            _settle(self.__dict__, handed)
        handed.append(t)
        return t

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        self.__dict__[_SET] = True
        _DATA.__set__(self, value)

    def __deepcopy__(self, memo: dict) -> Any:
        result = nn.Parameter.__deepcopy__(self, memo)
        if type(result) is WatchedParameter:
            result.__class__ = nn.Parameter  # type: ignore[assignment]
            _forget(result)
        return result


def _settle(d: dict, handed: list[torch.Tensor]) -> None:
    """Let go of the handed-out tensors that were written (noting it) or that no one else holds any more."""
    kept = []
    for t in handed:
        if t._version:
            d[_SET] = True
        elif sys.getrefcount(t) > 3:  # held elsewhere too (here: the list, ``t`` and the call's argument)
            kept.append(t)
    handed[:] = kept


def _forget(p: torch.Tensor) -> None:
    p.__dict__.pop(_HANDED, None)
    p.__dict__.pop(_SET, None)


def _written(p: torch.Tensor) -> bool:
    """Whether ``p`` was written through ``.data`` (or had it set) since the last mark."""
    d = p.__dict__
    return _SET in d or any(t._version for t in d.get(_HANDED, ()))


def _watch(p: torch.Tensor) -> bool:
    """Make ``p`` see writes through ``.data``; False where it keeps a class of its own (then it is compared every step)."""
    if type(p) is WatchedParameter:
        return True
    if type(p) is not nn.Parameter:
        return False
    p.__class__ = WatchedParameter
    return True


class EditWatch:
    """Which model parameters were written in place since memsave last wrote them, and their masters' refresh.

    entries: ``(fp32 master, stepped tensor, model parameter)``; the stepped tensor is the parameter itself or a
        view of its storage (ZeRO-1/2: this rank's rows), so it shows the user's edit of those rows.
    refresh_all: set where the masters cannot be refreshed one by one (offloaded: they live in the optimizer
        state's chunks): every master follows its stepped tensor (a read and write of the state's tier).
    """

    def __init__(self, entries: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        self.entries = list(entries)
        self._noted = [_watch(p) for _, _, p in self.entries]
        self._versions = [-1] * len(self.entries)
        self.refresh_all: Callable[[], None] | None = None
        self.num_refreshed = 0  # parameters whose master was refreshed for an edit
        self.mark()

    def mark(self) -> None:
        """memsave has just written the parameters (or their masters were just made to follow them)."""
        for k, (_, _, p) in enumerate(self.entries):
            self._versions[k] = p._version
            if self._noted[k]:
                _forget(p)

    def edited(self) -> list[int]:
        """The entries written in place since the last :meth:`mark` (every step: those not watched)."""
        return [k for k, (_, _, p) in enumerate(self.entries)
                if not self._noted[k] or p._version != self._versions[k] or _written(p)]

    @torch.no_grad()
    def sync(self) -> int:
        """Before the masters are read: the edited parameters' masters follow them; how many did."""
        edited = self.edited()
        if edited and self.refresh_all is not None:
            self.refresh_all()
        for k in edited if self.refresh_all is None else ():
            master, stepped, _ = self.entries[k]
            master.copy_(follow(master, stepped))
        self.num_refreshed += len(edited)
        self.mark()
        return len(edited)


def holder(stepped: torch.Tensor, param: torch.Tensor) -> torch.Tensor | None:
    """``param`` if ``stepped`` is it or a view of its storage (ZeRO-1/2's rows), so that an edit of ``param``
    shows in ``stepped``; else None (ZeRO-3's shard has a storage of its own, and rows of none)."""
    if stepped is param:
        return param
    try:
        same = stepped.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
    except RuntimeError:  # a storage that cannot be read (meta)
        return None
    return param if same and stepped.numel() > 0 else None

