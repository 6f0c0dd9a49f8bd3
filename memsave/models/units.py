"""Which submodules act as units by default: the blocks that ZeRO gathers together and recompute checkpoints
(layer 0, so that ``zero/``, ``recompute/``, the memory tracker and the estimator use one definition without
importing each other).

[Note: the default units] :func:`choose_units` picks, in this order:

1. the blocks of the model's largest ``nn.ModuleList`` (by parameter count): a transformer's layers; and those of
   every other ``nn.ModuleList`` outside it that holds at least half of one of its blocks' parameters (the
   encoder's layers beside the decoder's, a vision tower's beside the language model's: [Note: every tower's
   blocks]); an element that is itself an ``nn.ModuleList`` or ``nn.ModuleDict`` (never called) gives its elements
   instead;
2. else the children with parameters of an ``nn.Sequential`` that holds more than half of the model's parameters,
   unless one of those children holds more than two units' worth (``2 * unit_num_params``, below) and has
   children of its own to split it by (step 3 then splits it finer); among several such, the one whose largest
   child is smallest (the inner ``Sequential`` of ``Sequential(embedding, Sequential(*blocks), head)``);
3. else a size-based split in the spirit of FSDP's ``size_based_auto_wrap_policy``: from the root down, a
   submodule with more than ``unit_num_params`` parameters (default: the model's parameters divided by
   ``target_units`` = 16, so that typical models get about 8-32 units) is split into its children, and the
   submodules left over, each at most that big or indivisible, are the units, in registration order. FSDP may group a parent's leftover parameters into the
   parent's own unit because its units nest; ours do not (a unit is a module whose forward the hooks wrap), so
   consecutive small siblings cannot be merged into one unit without a container that would change the model's
   structure and ``state_dict`` keys. Instead the smallest stragglers (each under 1/8 of a unit, a norm between two
   big layers) stay in the root while they add up to at most one unit: at stage 3 the root is gathered
   throughout, so it then holds at most about one unit more.

Units never nest and never contain the root; a parameter shared between units, or in none, belongs to the root
(:func:`unit_parameters`). ``units=`` (``memsave.wrap``, ``memsave.estimate``, ``memsave.recompute.apply``)
overrides the choice. :func:`default_units` logs what it chose once per process (``MEMSAVE_LOG_LEVEL=INFO``).
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from memsave._logging import get_logger, warn_once

__all__ = ["REDUCES_IN_FLIGHT", "UnitChoice", "UnitPolicy", "attributes", "choose_units", "default_units", "output_tensors",
           "unit_parameters"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnitPolicy:
    """How :func:`choose_units` sizes units when the model has no ``nn.ModuleList`` or splitting
    ``nn.Sequential`` ([Note: the default units]).

    target_units: about how many units the size-based split aims at (it gives between about half and twice as
        many on typical models); sets ``unit_num_params`` to the model's parameters divided by it.
    unit_num_params: the most parameters a unit holds before it is split into its children (FSDP's
        ``min_num_params``, seen from above); None: from ``target_units``.
    """

    target_units: int = 16
    unit_num_params: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.target_units, bool) or not isinstance(self.target_units, int) or self.target_units < 1:
            raise ValueError(f"target_units = {self.target_units!r} is not allowed; expected a positive integer")
        n = self.unit_num_params
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"unit_num_params = {n!r} is not allowed; expected a positive integer or None")


@dataclasses.dataclass(frozen=True)
class UnitChoice:
    """What :func:`choose_units` chose.

    modules: the units, in forward (registration) order.
    names: their qualified names in the model.
    rule: "nn.ModuleList", "nn.Sequential", "size" or "none" (no submodule with parameters).
    owner: the qualified name of the ``nn.ModuleList`` / ``nn.Sequential`` whose children they are ("" for the
        root; the names joined by ", " where several lists give blocks); for "size", the threshold as text.
    """

    modules: tuple[nn.Module, ...]
    names: tuple[str, ...]
    rule: str
    owner: str = ""

    def describe(self) -> str:
        """One line: how many units, by which rule, and their names."""
        lists = ", ".join(f"'{n}'" for n in self.owner.split(", "))
        how = {"nn.ModuleList": (f"blocks of the nn.ModuleLists {lists}" if ", " in self.owner
                                 else f"blocks of the largest nn.ModuleList, {lists}"),
               "nn.Sequential": (f"children of the nn.Sequential '{self.owner}'" if self.owner
                                 else "children of the model, an nn.Sequential"),
               "size": f"size-based, {self.owner}",
               "none": "no submodule holds parameters; everything is in the root unit"}[self.rule]
        return f"{len(self.modules)} units ({how})" + (f": {_short_names(self.names)}" if self.names else "")


def _short_names(names: Sequence[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]} .. {names[-1]}"


def choose_units(model: nn.Module, *, policy: UnitPolicy | None = None) -> UnitChoice:
    """The default units of ``model`` ([Note: the default units]); the one policy behind ZeRO, recompute, the
    memory tracker and ``memsave.estimate``."""
    policy = policy if policy is not None else UnitPolicy()
    sizes: dict[int, int] = {}

    def size(m: nn.Module) -> int:
        if id(m) not in sizes:
            sizes[id(m)] = sum(p.numel() for p in m.parameters())
        return sizes[id(m)]

    names = {id(m): n for n, m in model.named_modules()}
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if lists:
        biggest = max(lists, key=size)
        blocks = _called_blocks(biggest)
        owners = [biggest]
        inside = {id(d) for d in biggest.modules()}
        # [Note: every tower's blocks] the other layer lists (an encoder's beside its decoder's, a vision tower's
        # beside the language model's) worth at least half a block of the largest: their blocks are units too
        half_block = size(biggest) / max(1, len(blocks)) / 2
        for other in lists:  # (pre-order: an outer list before the lists inside it)
            if id(other) in inside or any(names[id(o)].startswith(names[id(other)] + ".") for o in owners):
                continue  # inside a chosen list, or holding one
            if size(other) >= half_block > 0:
                owners.append(other)
                inside.update(id(d) for d in other.modules())
                blocks += _called_blocks(other)
        order = {id(m): i for i, m in enumerate(model.modules())}
        blocks.sort(key=lambda m: order[id(m)])
        owner = ", ".join(names[id(o)] for o in sorted(owners, key=lambda m: order[id(m)]))
        return _choice(blocks, names, "nn.ModuleList", owner)
    total = size(model)
    limit = policy.unit_num_params or max(1, math.ceil(total / policy.target_units))

    def coarse(m: nn.Module) -> bool:  # too big for one unit, and divisible
        return size(m) > 2 * limit and any(size(c) > 0 for c in m.children())

    seqs = []
    for s in model.modules():
        if isinstance(s, nn.Sequential) and 2 * size(s) > total:
            kids = [c for c in s.children() if size(c) > 0]
            if len(kids) >= 2 and not any(map(coarse, kids)):
                seqs.append((max(map(size, kids)), -size(s), s, kids))
    if seqs:
        _, _, s, kids = min(seqs, key=lambda t: t[:2])
        return _choice(kids, names, "nn.Sequential", names[id(s)])
    units = _split_by_size(model, limit, size)
    rule = "size" if units else "none"
    return _choice(units, names, rule, f"at most {limit:,} parameters a unit where divisible")


def _called_blocks(container: nn.Module) -> list[nn.Module]:
    """The elements of an ``nn.ModuleList``, with each element that is itself an ``nn.ModuleList`` or
    ``nn.ModuleDict`` replaced by its own elements (recursively): a container's forward is never called, so hooks on
    it never run (Funnel's ``encoder.blocks`` is a list of lists of layers). A unit is a module whose forward runs."""
    found: list[nn.Module] = []
    for child in container.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            found.extend(_called_blocks(child))
        else:
            found.append(child)
    return found


def _choice(modules: list[nn.Module], names: dict[int, str], rule: str, owner: str) -> UnitChoice:
    return UnitChoice(tuple(modules), tuple(names[id(m)] for m in modules), rule, owner)


def _split_by_size(model: nn.Module, limit: int, size: Callable[[nn.Module], int]) -> list[nn.Module]:
    """Step 3 of [Note: the default units]."""
    found: list[nn.Module] = []
    covered: set[int] = {id(model)}  # a module registered twice is taken once, and never inside another unit

    def split(m: nn.Module) -> None:
        for c in m.children():
            if id(c) in covered or size(c) == 0:
                continue
            taken = any(id(d) in covered for d in c.modules())  # holds a unit found under another name
            if (size(c) > limit or taken) and any(size(g) > 0 for g in c.children()):
                split(c)
            elif not taken:
                found.append(c)
                covered.update(id(d) for d in c.modules())

    split(model)
    root_extra, stragglers = 0, set()
    for m in sorted(found, key=size):
        if 8 * size(m) >= limit or root_extra + size(m) > limit:
            break
        root_extra += size(m)
        stragglers.add(id(m))
    return [m for m in found if id(m) not in stragglers]


_said: set[str] = set()


def default_units(model: nn.Module, *, policy: UnitPolicy | None = None) -> list[nn.Module]:
    """The units of :func:`choose_units`, saying once which were chosen and why: printed (rank 0) when they are
    not the blocks of an ``nn.ModuleList`` (the usual case, logged at info level), since the user did not write
    them down anywhere."""
    choice = choose_units(model, policy=policy)
    message = f"memsave: {choice.describe()}; pass units= to choose others"
    if message not in _said:
        _said.add(message)
        if choice.rule == "nn.ModuleList":
            get_logger().info(message)
        else:
            warn_once(message)
    return list(choice.modules)


# What ZeRO keeps in flight, read by the engine and the estimator alike: at most this many reduce-scatters
# (stages 1-3) and post-step parameter gathers (stages 1-2) are issued and not yet waited on. The gathers ahead
# of a stage-3 unit are ``[zero] prefetch``.
REDUCES_IN_FLIGHT = 2


def unit_parameters(model: nn.Module, units: Sequence[nn.Module]) -> list[list[tuple[str, nn.Parameter]]]:
    """Each unit's parameters as ``(qualified name, parameter)``, the root's first: a parameter shared between
    units, or in none, belongs to the root. In ``model.named_parameters()`` order (each shared parameter once,
    under its first name); a unit may come out empty-handed."""
    owners: dict[nn.Parameter, set[int]] = {}
    for k, m in enumerate(units):
        for p in m.parameters():
            owners.setdefault(p, set()).add(k)
    groups: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(len(units) + 1)]
    for name, p in model.named_parameters():
        ks = owners.get(p, set())
        groups[next(iter(ks)) + 1 if len(ks) == 1 else 0].append((name, p))
    return groups


# never looked inside for tensors: no output is made of these
_OPAQUE = (nn.Module, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
           str, bytes, int, float, complex, torch.dtype, torch.device)


def output_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors inside a forward output (what the engines hook for backward, and what the memory tracker watches):
    tensors, tuples/lists/dicts (mappings), dataclasses and ModelOutput-like objects, and plain objects (a small
    class instance, a ``types.SimpleNamespace``) through their ``__dict__`` and ``__slots__``. Modules, classes
    and functions are not looked into, and an object reached twice (a cycle) is visited once."""
    seen: set[int] = set()
    stack: list[Any] = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            yield x
            continue
        if x is None or isinstance(x, _OPAQUE) or id(x) in seen:
            continue
        seen.add(id(x))
        children = list(_members(x))
        stack.extend(reversed(children))  # depth first, in order


def _members(x: Any) -> Iterator[Any]:
    """What an output object holds, for :func:`output_tensors`."""
    if isinstance(x, list | tuple):
        yield from x
    elif isinstance(x, Mapping):
        yield from x.values()
    else:  # a dataclass's fields are in its __dict__ (or its __slots__) too
        yield from attributes(x).values()


def attributes(obj: Any) -> dict[str, Any]:
    """A plain object's attributes: its ``__dict__`` and those of its ``__slots__`` that are set."""
    found = dict(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                found[name] = getattr(obj, name)
    return found
