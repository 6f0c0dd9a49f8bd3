"""``optimizer.state`` of a wrapped optimizer, keyed by the model's parameters.

The user's optimizer steps other tensors than the model's parameters: under ZeRO this rank's rows of each one
(``MemsaveOptimizer``: ``group["params"] = [stepped[p] ...]``), under bf16/fp16 their fp32 masters
(``MixedPrecisionOptimizer``), and keeps its state under those. Code written for plain torch resets or reads a
parameter's state by the parameter (``opt.state.pop(layer.weight, None)`` after re-initializing a layer,
dead-neuron resampling): handed the inner optimizer's raw state, such a pop was a silent no-op and
``opt.state[p]["exp_avg"]`` a bare ``KeyError`` (with an empty entry inserted). :class:`ParamState` translates:
``opt.state[p]`` is the state of the tensor stepped for ``p`` (under ZeRO this rank's rows' state, under mixed
precision the fp32 master's), ``pop``/``del`` drop it (the next step starts it fresh, as plain torch does).

[Note: state by parameter] The keys are the model's parameters (what the user put in the param groups); the
tensors in ``opt.param_groups`` (what is stepped) are accepted too, so a loop over the groups reads the same
dicts. A parameter stepped on another rank only (another pipeline stage) has no entry here; popping it is a
no-op, and every rank doing the same pop (SPMD) resets every slice (a ZeRO rank holding no rows of a parameter
steps an empty slice: its entry holds empty tensors). What cannot be honoured is refused by name: full-shape
tensors assigned where this rank steps rows or an fp32 master, and reading or changing state that offload keeps
in chunks on its tier. The inner optimizer's own dict stays ``opt.optimizer.state`` (what memsave's state
dicts, checkpoints and offload use).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import torch

__all__ = ["ParamState", "ParamStateAttribute"]

_CACHE = "_memsave_param_state"  # the view, kept on the wrapped optimizer


def _name(p: Any) -> str:
    shape = tuple(p.shape) if isinstance(p, torch.Tensor) else None
    return f"{type(p).__name__} of shape {shape}" if shape is not None else repr(p)


class ParamState(MutableMapping):  # type: ignore[type-arg]
    """The state of a wrapped optimizer ``opt`` by model parameter (see the module docstring), over ``raw``: the
    inner optimizer's state dict when the view was made (``opt.state = view`` puts that dict back)."""

    def __init__(self, opt: Any, raw: dict[torch.Tensor, Any]) -> None:
        self.opt, self.raw = opt, raw
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # (model parameter, stepped tensor)
        self._keys: dict[torch.Tensor, torch.Tensor] = {}  # a model parameter or stepped tensor -> stepped tensor

    @staticmethod
    def of(opt: Any) -> ParamState:
        """``opt``'s view over its inner optimizer's state dict (kept on ``opt`` while that dict is the same)."""
        view = vars(opt).get(_CACHE)
        if view is None or view.raw is not opt.optimizer.state:
            view = vars(opt)[_CACHE] = ParamState(opt, opt.optimizer.state)
        return view  # type: ignore[no-any-return]

    def _build(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model parameter, the tensor the inner optimizer steps for it: itself, its rows or its fp32 master)."""
        opt = self.opt
        full_of: Callable[[torch.Tensor], torch.Tensor] | None = getattr(opt, "full_of", None)  # MemsaveOptimizer
        if full_of is None:  # MixedPrecisionOptimizer on its own: (master, parameter) pairs; else itself
            back: dict[torch.Tensor, torch.Tensor] = {m: p for m, p in getattr(opt, "pairs", ())}
            full_of = lambda t: back.get(t, t)  # noqa: E731
        self._pairs = [(full_of(t), t) for g in opt.optimizer.param_groups for t in g["params"]]
        self._keys = {s: s for _, s in self._pairs} | {p: s for p, s in self._pairs}
        return self._pairs

    def _stepped(self, p: Any) -> torch.Tensor | None:
        """What the inner optimizer keeps ``p``'s state under (``p`` a model parameter or a stepped tensor)."""
        if not isinstance(p, torch.Tensor):
            return None
        if self._pairs is None or p not in self._keys:  # built once; again on a miss (param groups changed)
            self._build()
        return self._keys.get(p)

    def _missing(self, p: Any, what: str) -> KeyError:
        if self._stepped(p) is None:
            return KeyError(f"{what}: {_name(p)} is not a parameter of this optimizer's param groups on this rank "
                            "(frozen, not given to the optimizer, or stepped by another pipeline stage)")
        return KeyError(f"{what}: parameter ({_name(p)}) has no optimizer state yet: its first optimizer.step() "
                        "with a gradient creates it (or it was popped since)")

    def _refuse_offloaded(self, what: str) -> None:
        if getattr(self.opt, "offloaded", None) is not None:
            raise NotImplementedError(
                f"optimizer.state{what} with the optimizer state offloaded ([offload] optimizer = cpu/disk): it lives "
                "in chunks on its tier, not in dicts of tensors that could be read, changed or dropped in place. To "
                "reset a parameter, go through the state dict (collective: on every rank): sd = "
                "optimizer.state_dict(); del sd['state'][i] (i: the parameter's position in the param groups); "
                "optimizer.load_state_dict(sd)")

    def _have(self) -> Any:
        """The stepped tensors with state: the raw dict's keys, or offloaded, from the chunks' layout (the tier is
        not read; ``memsave.master``: the master rows an offloaded chunk holds, not optimizer state)."""
        if getattr(self.opt, "offloaded", None) is None:
            return self.raw
        keys, scalars = self.opt.offloaded.stream_layout()
        return {s for s in keys if scalars.get(s) or any(k != "memsave.master" for k in keys[s])}

    # -- the mapping ------------------------------------------------------------------------------------------
    def __getitem__(self, p: Any) -> dict[str, Any]:
        self._refuse_offloaded(f"[{_name(p)}]")
        s = self._stepped(p)
        state = self.raw.get(s) if s is not None else None
        if state is None:
            raise self._missing(p, "optimizer.state[p]")
        return state  # type: ignore[no-any-return]

    def __setitem__(self, p: Any, value: Any) -> None:
        self._refuse_offloaded(f"[{_name(p)}] = ...")
        s = self._stepped(p)
        if s is None:
            raise self._missing(p, "optimizer.state[p] = ...")
        if not isinstance(value, Mapping):
            raise TypeError(f"optimizer.state[p] = {type(value).__name__}: a parameter's state is a dict")
        for key, v in value.items():
            if isinstance(v, torch.Tensor) and v.dim() and tuple(v.shape) == tuple(p.shape) and (
                    v.shape != s.shape or (v.is_floating_point() and v.dtype != s.dtype)):
                raise NotImplementedError(
                    f"optimizer.state[p] = {{{key!r}: tensor of shape {tuple(v.shape)}, {v.dtype}, ...}}: this "
                    f"optimizer steps {tuple(s.shape)} rows in {s.dtype} for this parameter (ZeRO: this rank's rows; "
                    "mixed precision: its fp32 master), not the parameter itself. Change the state in place "
                    "(optimizer.state[p][key] is that tensor), or pop it (optimizer.state.pop(p, None)) to restart it")
        self.raw[s] = value

    def __delitem__(self, p: Any) -> None:
        self._refuse_offloaded(f": del / pop of {_name(p)}")
        s = self._stepped(p)
        if s is None or s not in self.raw:
            raise self._missing(p, "del optimizer.state[p]")
        del self.raw[s]

    def __contains__(self, p: object) -> bool:
        s = self._stepped(p)
        return s is not None and s in self._have()

    def __iter__(self) -> Iterator[torch.Tensor]:
        have = self._have()
        return iter([p for p, s in (self._pairs if self._pairs is not None else self._build()) if s in have])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def clear(self) -> None:
        self._refuse_offloaded(".clear()")
        self.raw.clear()

    def __repr__(self) -> str:
        return f"ParamState({len(self)} parameters with optimizer state, keyed by the model's parameters)"


class ParamStateAttribute:
    """``WrappedOptimizer.state``: a :class:`ParamState`. Assigning one of this optimizer's views puts its dict
    back (save-and-restore code); assigning a mapping (by model parameter or stepped tensor) replaces the state."""

    def __get__(self, opt: Any, owner: type | None = None) -> Any:
        return self if opt is None else ParamState.of(opt)

    def __set__(self, opt: Any, value: Any) -> None:
        if isinstance(value, ParamState) and value.opt is opt:
            opt.optimizer.state = value.raw
            return
        ParamState.of(opt)._refuse_offloaded(" = ...")
        fresh = ParamState(opt, collections.defaultdict(dict))
        for p, st in value.items():
            fresh[p] = st
        opt.optimizer.state = fresh.raw
