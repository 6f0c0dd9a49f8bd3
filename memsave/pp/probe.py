"""The probe: one forward (no gradients) at the first step of each input shape, that finds what crosses stages.

[Note: the probe] Every rank runs the user's whole forward (and loss) once, under a ``TorchFunctionMode`` that
tags each tensor with the atom calls ([Note: atoms] in memsave/pp/split.py) it was computed from, propagating the
tags through every op of the user's code between atoms. An atom's output is tagged with that call alone. So the
tags of an atom call's inputs name the earlier atom calls whose outputs it reads, and the tags of the loss name
what the last stage reads: a stage receives exactly the outputs of earlier-stage atom calls that its own atoms
(or, on the last stage, its loss) read, each straight from the stage that produced it (a skip connection from
stage 0 to stage 2 is not relayed through stage 1, as torchgpipe's portals). Atoms held elsewhere run on the
meta device (their parameters are meta tensors) and hand zeros of the right shape on; local ones run for real.
The probe also records each atom call's output structure (the shapes and dtypes a receiver allocates, and the
placeholders a stage uses for earlier atoms it does not read), so nothing about shapes is exchanged per
micro-batch. The ranks then check that they found the same structure (one all-gather per input shape).

[Note: structures the meta device cannot find] Some atoms cannot run on the meta device: a mixture-of-experts
block (torch's meta ``_grouped_mm`` takes bf16 only, where the CPU kernel runs fp32), an op whose output shape
depends on values (``nonzero``, boolean masks, ``.item()``). The rank that holds such an atom has run it for real,
so each rank publishes the structure of every atom call it ran (a :class:`Share`: a store key per call, pickled,
deleted after the probe), and a rank whose meta run fails waits for the holder's instead. No rank waits on one
that waits on it: every rank runs the same forward, and a rank waits only for an atom it does not hold; the
earliest atom call not yet published belongs to a rank that has run every call before it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = ["CallKey", "Layout", "Probe", "Share", "Structure"]

CallKey = tuple[str, int]  # (atom name, how many times it was called before in this forward)
OUTPUT: CallKey = ("<output>", 0)  # the loss, read by the last stage
_TAG = "_memsave_pp_tag"
_SIDE = "_memsave_pp_side"  # made inside an atom another stage holds ([Note: side outputs])


@dataclasses.dataclass(frozen=True)
class Structure:
    """An atom call's output: its pytree spec and, per leaf, ``("t", shape, dtype)`` or ``("v", value)``."""

    spec: Any
    leaves: tuple[tuple[Any, ...], ...]
    _zeros: dict[torch.device, list[torch.Tensor]] = dataclasses.field(
        default_factory=dict, compare=False, repr=False, hash=False)  # placeholders per device

    def tensor_meta(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [(leaf[1], leaf[2]) for leaf in self.leaves if leaf[0] == "t"]

    def build(self, tensors: list[torch.Tensor]) -> Any:
        """The output with ``tensors`` at the tensor leaves (in order)."""
        it = iter(tensors)
        leaves = [next(it) if leaf[0] == "t" else leaf[1] for leaf in self.leaves]
        return tree_unflatten(leaves, self.spec)

    def placeholder(self, device: torch.device) -> Any:
        """Zeros of the right shapes, costing one element each (expanded views), made once per device: their
        values never reach a stage's result ([Note: the stage runner] in memsave/pp/runtime.py)."""
        zeros = self._zeros.get(device)
        if zeros is None:
            zeros = self._zeros[device] = [torch.zeros((), dtype=dt, device=device).expand(shape)
                                           for shape, dt in self.tensor_meta()]
        return self.build(zeros)

    def describe(self) -> list[tuple[Any, ...]]:
        return [(leaf[0], tuple(leaf[1]), str(leaf[2])) if leaf[0] == "t" else ("v", repr(leaf[1]))
                for leaf in self.leaves]


def _structure(out: Any) -> Structure:
    leaves, spec = tree_flatten(out)
    return Structure(spec, tuple(("t", tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else ("v", t)
                                 for t in leaves))


def _tags_of(*trees: Any) -> frozenset[CallKey]:
    out: set[CallKey] = set()
    for tree in trees:
        for t in tree_flatten(tree)[0]:
            if isinstance(t, torch.Tensor):
                out.update(getattr(t, _TAG, ()))
    return frozenset(out)


def _tag(tree: Any, tags: frozenset[CallKey]) -> None:
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor):
            try:
                setattr(t, _TAG, tags)
            except (AttributeError, RuntimeError):
                pass


class _Tagging(TorchFunctionMode):
    """Propagates the tags of [Note: the probe] through every op outside the atoms."""

    def __init__(self, probe: Probe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        probe = self.probe
        if probe.depth == 0:
            tags: set[CallKey] = set()
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor):
                    side = getattr(t, _SIDE, None)
                    if side is not None:
                        raise NotImplementedError(_side_message(side, probe.stage_of_atom[side], func))
                    tags.update(getattr(t, _TAG, ()))
            out = func(*args, **kwargs)
            if tags:
                _tag(out, frozenset(tags))
            return out
        out = func(*args, **kwargs)
        if probe.remote is not None:  # (a meta tensor only: an op may hand back a real one it was given)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.is_meta:
                    with contextlib.suppress(AttributeError, RuntimeError):
                        setattr(t, _SIDE, probe.remote)
        return out


def _side_message(atom: str, stage: int, func: Any) -> str:
    """[Note: side outputs] A tensor made inside an atom but handed on other than through its output (a forward
    hook that records it, an attribute) cannot cross stages: the stages exchange atom outputs, and an atom another
    stage holds does not run here (in the probe it ran on the meta device, so the tensor read is a meta one; in
    a step it would be missing). Hugging Face's ``output_router_logits`` (a mixture-of-experts model's auxiliary
    loss) records each router's logits so."""
    name = getattr(func, "__name__", repr(func))
    if name == "__get__":  # a property: .device, .shape
        name = "." + getattr(getattr(func, "__self__", None), "__name__", "?")
    return (f"pipeline split: the forward reads ({name}) a tensor that module {atom!r} (stage {stage}) made without "
            "returning it (a forward hook that records it, or an attribute), which the stages cannot exchange: they "
            "hand on modules' outputs only. For a Hugging Face mixture-of-experts model, its router logits "
            "(config.output_router_logits = True, for the auxiliary loss): set it False under pipeline "
            "parallelism, or add the auxiliary loss inside each layer")


@dataclasses.dataclass
class Layout:
    """What the probe found for one input shape: the atom calls in order, their stages and structures, and which
    stage reads which earlier call's output."""

    order: list[CallKey]
    stage_of: dict[CallKey, int]
    structure: dict[CallKey, Structure]
    reads: dict[int, list[CallKey]]  # stage -> the earlier-stage calls it receives, in call order
    readers: dict[CallKey, list[int]]  # call -> the later stages that receive it
    last_call: dict[int, CallKey]  # stage -> its last atom call (where its forward stops)

    def index(self, key: CallKey) -> int:
        return self.order.index(key)

    def digest(self) -> list[Any]:
        return [(k, self.stage_of[k], self.structure[k].describe(), self.readers.get(k, [])) for k in self.order]


class Share:
    """[Note: structures the meta device cannot find]: ``publish(key, bytes)`` and ``wait(key, what) -> bytes``
    over the store (memsave/dist/p2p.py), keys under ``prefix`` (one probe of one pipeline)."""

    def __init__(self, prefix: str, publish: Callable[[str, bytes], None], wait: Callable[[str, str], bytes]) -> None:
        self.prefix, self._publish, self._wait = prefix, publish, wait
        self.published: list[str] = []

    def _key(self, call: CallKey) -> str:
        return f"{self.prefix}/{call[0]}/{call[1]}"

    def put(self, call: CallKey, structure: Structure) -> None:
        try:
            value = b"s" + pickle.dumps((structure.spec, structure.leaves))
        except Exception as exc:  # a non-tensor leaf that does not pickle: the reader names it
            value = b"!" + f"{type(exc).__name__}: {exc}".encode()
        key = self._key(call)
        self._publish(key, value)
        self.published.append(key)

    def get(self, call: CallKey, why: str) -> Structure:
        value = self._wait(self._key(call), f"the pipeline probe, the structure of {call[0]!r}'s output")
        if value[:1] != b"s":
            raise NotImplementedError(f"{why}; the stage that holds it could not send its output's structure: "
                                      f"{value[1:].decode()}")
        with warnings.catch_warnings():  # torch 2.13's TreeSpec unpickling warns of its own LeafSpec check
            warnings.simplefilter("ignore", FutureWarning)
            spec, leaves = pickle.loads(value[1:])
        return Structure(spec, leaves)


class Probe:
    """Runs [Note: the probe]; the runner's atom wrappers call :meth:`call` while :attr:`active`."""

    def __init__(self, stage_of_atom: dict[str, int], local: Callable[[str], bool], device: torch.device,
                 share: Share | None = None) -> None:
        self.stage_of_atom, self.local, self.device, self.share = stage_of_atom, local, device, share
        self.depth = 0
        self.remote: str | None = None  # the atom another stage holds that runs on the meta device now
        self.active = False
        self.counts: dict[str, int] = {}
        self.deps: dict[CallKey, frozenset[CallKey]] = {}
        self.structure: dict[CallKey, Structure] = {}
        self.order: list[CallKey] = []

    def call(self, name: str, forward: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        idx = self.counts.get(name, 0)
        self.counts[name] = idx + 1
        key = (name, idx)
        self.deps[key] = _tags_of(args, kwargs)
        self.depth += 1
        try:
            if self.local(name):
                out = forward(*args, **kwargs)
            else:
                out = self._remote(name, key, forward, args, kwargs)
        finally:
            self.depth -= 1
        self.structure[key] = _structure(out)
        if self.share is not None and self.local(name):
            self.share.put(key, self.structure[key])
        self.order.append(key)
        _tag(out, frozenset([key]))
        return out

    def _remote(self, name: str, key: CallKey, forward: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """Zeros shaped as the output of an atom another stage holds: run on the meta device, or as the holder
        found it ([Note: structures the meta device cannot find])."""
        meta = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))
        self.remote = name
        try:
            out_meta = forward(*meta[0], **meta[1])
        except Exception as exc:
            self.remote = None
            why = (f"pipeline split: module {name!r} (held by stage {self.stage_of_atom[name]}) cannot run on the "
                   f"meta device, which the other stages need to learn the shapes of its outputs: "
                   f"{type(exc).__name__}: {exc}")
            if self.share is None:
                raise NotImplementedError(why) from exc
            structure = self.share.get(key, why)
            return structure.build([torch.zeros(shape, dtype=dt, device=self.device)
                                    for shape, dt in structure.tensor_meta()])
        finally:
            self.remote = None
        return tree_map(lambda t: _zeros_like(t, self.device) if isinstance(t, torch.Tensor) else t, out_meta)

    def run(self, forward_and_loss: Callable[[], Any], n_stages: int, model: torch.nn.Module | None = None) -> Layout:
        """``forward_and_loss()`` returns the loss (or the output the last stage reads). ``model``'s buffers are
        put back as they were: the probe's forward is not a training forward (BatchNorm's statistics moved once
        more per new input shape, 15% off plain training; a user's EMA read in forward left weights 2.3% off)."""
        self.active = True
        with torch.no_grad():
            kept = [(m, n, b, b.clone()) for m in (model.modules() if model is not None else ())
                    for n, b in m._buffers.items() if b is not None and not b.is_meta]
        hooks = self._watch_foreign_calls(model) if model is not None else []
        try:
            devices = [self.device] if self.device.type == "cuda" else []  # the probe draws no random numbers
            with torch.no_grad(), torch.random.fork_rng(devices=devices), _Tagging(self):
                out = forward_and_loss()
                self.deps[OUTPUT] = _tags_of(out)
        finally:
            self.active = False
            for h in hooks:
                h.remove()
            with torch.no_grad():
                for m, n, b, copy in kept:  # in place too: a forward may write through .data
                    m._buffers[n] = b
                    b.copy_(copy)
        return self._layout(n_stages)

    def _watch_foreign_calls(self, model: torch.nn.Module) -> list[Any]:
        """[Note: a part of another stage's module] Hooks on the submodules of the atoms this rank does not hold: the
        model's own code that calls one of them directly, not through its atom's forward (PaliGemma's forward embeds
        the ids with ``get_input_embeddings()``, a part of its language model, when the split is over the vision
        tower's layers), would run it on this rank's meta copy; the probe raised the meta device's own error there
        ("Tensor.item() cannot be called on meta tensors", on one rank, the others stopped by it). It now says which
        module and why."""
        hooks = []
        for atom, stage in self.stage_of_atom.items():
            if self.local(atom):
                continue
            root = model.get_submodule(atom)
            for name, sub in root.named_modules():
                if sub is not root:
                    hooks.append(sub.register_forward_pre_hook(functools.partial(
                        self._foreign_call, atom, f"{atom}.{name}", stage)))
        return hooks

    def _foreign_call(self, atom: str, name: str, stage: int, *_: Any) -> None:
        if self.remote != atom:
            raise NotImplementedError(
                f"pipeline split: the forward calls {name!r}, a part of {atom!r} (stage {stage}), outside that "
                f"module's own forward (the model's code reaches into it, as a Hugging Face model's forward may call "
                f"get_input_embeddings()); the other stages hold no values of {atom!r}, so this split cannot run. "
                "Split over the layer list whose modules the forward calls only through their own forward ([parallel] "
                "split, or the config's base_model_pp_plan), or train this model without pp")

    def _layout(self, n_stages: int) -> Layout:
        stage_of = {k: self.stage_of_atom[k[0]] for k in self.order}
        stage_of[OUTPUT] = n_stages - 1
        seen = -1
        for k in self.order:
            if stage_of[k] < seen:
                raise NotImplementedError(
                    f"pipeline split: the forward calls {k[0]!r} (stage {stage_of[k]}) after a module of stage {seen}; "
                    "stages must run in order. Either the module runs at two places of the forward (give [parallel] "
                    "split points that keep its calls on one stage), or it is registered on the other side of the "
                    "layer list than the forward calls it, which memsave learns only for a Hugging Face model (run "
                    "once on its dummy_inputs): register it after the list if it runs after it, before if before")
            seen = stage_of[k]
        missing = [s for s in range(n_stages) if s not in set(stage_of[k] for k in self.order)]
        if missing:
            raise NotImplementedError(f"pipeline split: the forward called no module of stage(s) {missing}")
        readers: dict[CallKey, set[int]] = {}
        for consumer, deps in self.deps.items():
            for p in deps:
                if p in stage_of and stage_of[p] < stage_of[consumer]:
                    readers.setdefault(p, set()).add(stage_of[consumer])
        reads = {s: [k for k in self.order if s in readers.get(k, ())] for s in range(n_stages)}
        last_call = {stage_of[k]: k for k in self.order}
        return Layout(list(self.order), stage_of, dict(self.structure), reads,
                      {k: sorted(v) for k, v in readers.items()}, last_call)


def _zeros_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Zeros in place of a meta output; a tensor subclass keeps its class and attributes (tp's vocab-parallel
    ``ShardedLogits``: the model's loss code then takes the same path as on the stage that holds the head)."""
    out = torch.zeros(t.shape, dtype=t.dtype, device=device)
    if type(t) is not torch.Tensor:
        with torch._C.DisableTorchFunctionSubclass():
            out = out.as_subclass(type(t))
        out.__dict__.update(t.__dict__)
    return out
