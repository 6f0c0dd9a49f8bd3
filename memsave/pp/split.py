"""Splitting an unchanged model into pipeline stages, by module names.

[Note: atoms] The model is cut at *atoms*: the blocks of its layer list (the largest ``nn.ModuleList``, the
children of an ``nn.Sequential`` root, or the list Hugging Face's ``base_model_pp_plan`` names), plus every
module with parameters beside the path from the root to that list (a decoder's embeddings before it, its final
norm and head after it). Each atom belongs to one stage, in registration order: the blocks are divided into
``n_stages`` contiguous runs (or cut where ``split`` says), the atoms registered before the first block go to the
first stage, those after the last block to the last. Where the forward calls an atom on the other side of the
blocks than it is registered (OPT's decoder registers ``final_layer_norm`` before ``layers``), the call order wins:
a Hugging Face model is run once on a meta copy with its ``dummy_inputs`` to learn it (:func:`_call_order`); any
other model keeps the registration order, and the stage runner's probe refuses a forward that then runs out of
stage order. Modules without parameters (rotary embeddings, dropout,
activation functions) are no atom: they run on every stage, as does the user's own ``forward`` code between the
atoms (the stage runner in memsave/pp/runtime.py runs the whole forward on every rank).

On a rank, the atoms of the stages it does not hold are *stripped*: their parameters and buffers leave the module
tree (``model.parameters()``, ``state_dict``, ZeRO, the optimizer and clipping no longer see them) and stay as
plain meta-device attributes, so the module keeps its class and attributes and can still run on the meta device
to tell the shapes of its outputs. A parameter shared by atoms of different stages (an input embedding tied to
the LM head) stays real on each stage that uses it: a *tie*, whose gradients are summed over its holders.

What cannot be split, with the reason: a model with fewer blocks than stages; parameters held directly by the
root or by a module on the path to the layer list (no stage owns them: move them into a submodule); split points
that are not atoms or not in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["StageSplit", "load_takes_whole_model", "plan_split", "strip_atoms"]


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """Which stage owns each atom ([Note: atoms]).

    atoms: qualified module names of the atoms, in registration order (call order beside the blocks).
    stage_of: atom name -> its (virtual) stage.
    n_stages: number of stages (``pp * virtual``).
    blocks: the atoms that are blocks of the layer list (the rest are before or after it).
    rule: how the blocks were found ("nn.ModuleList", "nn.Sequential", "base_model_pp_plan", "split").
    ties: (the parameter's qualified names, the stages holding it) for each parameter shared across stages.
    """

    atoms: tuple[str, ...]
    stage_of: dict[str, int]
    n_stages: int
    blocks: tuple[str, ...]
    rule: str
    ties: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...] = ()

    def atoms_of(self, stage: int) -> list[str]:
        return [a for a in self.atoms if self.stage_of[a] == stage]

    def to_text(self) -> str:
        rows = []
        for s in range(self.n_stages):
            names = self.atoms_of(s)
            rows.append(f"stage {s}: {names[0]} .. {names[-1]} ({len(names)} modules)" if len(names) > 2
                        else f"stage {s}: {', '.join(names)}")
        ties = "".join(f"\ntied: {' = '.join(n)} on stages {list(st)}" for n, st in self.ties)
        return "\n".join(rows) + ties


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def _layer_list(model: nn.Module) -> tuple[str, str]:
    """(qualified name of the module whose children are the blocks, the rule that chose it)."""
    plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None)
    base = getattr(model, "base_model_prefix", "")
    if plan:
        for key in plan:
            for name in (f"{base}.{key}" if base else key, key):
                try:
                    m = model.get_submodule(name)
                except AttributeError:
                    continue
                if isinstance(m, nn.ModuleList):
                    return name, "base_model_pp_plan"
    best, size = None, 0
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList):
            n = sum(p.numel() for p in m.parameters())
            if n > size:
                best, size = name, n
    if best is not None:
        return best, "nn.ModuleList"
    if isinstance(model, nn.Sequential):
        return "", "nn.Sequential"
    raise NotImplementedError(
        f"cannot split a {type(model).__name__} into pipeline stages: it has no nn.ModuleList of blocks and is not "
        "an nn.Sequential, so there is no sequence of modules to cut; build its layers as an nn.ModuleList (or the "
        "model as an nn.Sequential), or give [parallel] split = [module names where stages begin] over such a list")


def _atoms(model: nn.Module, owner: str) -> tuple[list[str], list[str]]:
    """(atoms in registration order, the blocks among them): see [Note: atoms]."""
    path = [""] + ([owner[: i] for i in range(len(owner)) if owner[i] == "."] + [owner] if owner else [])
    atoms: list[str] = []
    blocks: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        direct = [n for n, _ in module.named_parameters(recurse=False)]
        if direct:
            where = f"{prefix!r}" if prefix else "the model's root"
            raise NotImplementedError(
                f"cannot split into pipeline stages: {where} ({type(module).__name__}) holds parameters itself "
                f"({', '.join(direct)}) and contains the blocks being split, so no single stage owns them; move them "
                "into a submodule (an nn.Module of their own)")
        for name, child in module.named_children():
            q = f"{prefix}.{name}" if prefix else name
            if prefix == owner:
                if _has_params(child):
                    atoms.append(q)
                    blocks.append(q)
            elif q in path:
                visit(q, child)
            elif _has_params(child):
                atoms.append(q)

    visit("", model)
    return atoms, blocks


def _call_order(model: nn.Module, atoms: Sequence[str]) -> list[str] | None:
    """The atoms in the order a forward first calls them (:func:`memsave.deferred.meta.meta_call_order`: a meta copy
    of a Hugging Face model run on its own ``dummy_inputs``); None for any other model, or where that run fails:
    then the registration order stands ([Note: atoms])."""
    from memsave.deferred.meta import meta_call_order  # layer 1

    return meta_call_order(model, list(atoms))


def _by_call_order(atoms: list[str], blocks: list[str], order: Sequence[str] | None) -> list[str]:
    """``atoms`` with those beside the blocks that the forward calls on the other side of the blocks than they are
    registered moved there (to the front or the end, in call order)."""
    if not order or not blocks or blocks[0] not in order or blocks[-1] not in order:
        return atoms
    at = {name: i for i, name in enumerate(order)}
    first, last = at[blocks[0]], at[blocks[-1]]
    lo, hi = atoms.index(blocks[0]), atoms.index(blocks[-1])
    to_front = [a for a in atoms[hi + 1:] if a in at and at[a] < first]
    to_end = [a for a in atoms[:lo] if a in at and at[a] > last]
    if not to_front and not to_end:
        return atoms
    head = [a for a in atoms[:lo] if a not in to_end] + to_front
    tail = [a for a in atoms[hi + 1:] if a not in to_front] + to_end
    never = len(order)  # (an atom the run did not call keeps its place after those it did)
    return (sorted(head, key=lambda a: at.get(a, never)) + atoms[lo:hi + 1]
            + sorted(tail, key=lambda a: at.get(a, never)))


def plan_split(model: nn.Module, n_stages: int, split: Sequence[str] = ()) -> StageSplit:
    """Assign every atom of ``model`` to one of ``n_stages`` stages ([Note: atoms]); ``split``: the names of the
    atoms where stages 1, 2, ... begin (``n_stages - 1`` of them), else the blocks are divided evenly by count."""
    owner, rule = _layer_list(model)
    atoms, blocks = _atoms(model, owner)
    atoms = _by_call_order(atoms, blocks, _call_order(model, atoms))
    if split:
        rule = "split"
        if len(split) != n_stages - 1:
            raise ValueError(f"[parallel] split = {list(split)!r} gives {len(split) + 1} stages, but pp x virtual = "
                             f"{n_stages}; give {n_stages - 1} module names, each where a stage begins")
        where = []
        for name in split:
            if name not in atoms:
                raise ValueError(f"[parallel] split: {name!r} is not a module a stage can begin at; allowed: the "
                                 f"blocks and the modules beside them: {', '.join(atoms)}")
            where.append(atoms.index(name))
        if where != sorted(set(where)) or where[0] == 0:
            raise ValueError(f"[parallel] split = {list(split)!r}: the names must be distinct, in the model's order "
                             f"({', '.join(atoms)}), and not the first one")
        stage_of, s = {}, 0
        for i, a in enumerate(atoms):
            if s < len(where) and i == where[s]:
                s += 1
            stage_of[a] = s
    else:
        if len(blocks) < n_stages:
            raise ValueError(
                f"cannot split {type(model).__name__} into {n_stages} pipeline stages: its layer list "
                f"{owner or '<root>'!r} has {len(blocks)} blocks with parameters; use pp x virtual <= {len(blocks)}")
        base, extra = divmod(len(blocks), n_stages)
        stage_of = {}
        i = 0
        for s in range(n_stages):
            for _ in range(base + (1 if s < extra else 0)):
                stage_of[blocks[i]] = s
                i += 1
        first = atoms.index(blocks[0])
        last = atoms.index(blocks[-1])
        for i, a in enumerate(atoms):
            if a not in stage_of:
                stage_of[a] = 0 if i < first else n_stages - 1 if i > last else stage_of[atoms[i - 1]]
    holders: dict[nn.Parameter, set[int]] = {}
    names_of: dict[nn.Parameter, list[str]] = {}
    for a in atoms:
        for n, p in model.get_submodule(a).named_parameters(remove_duplicate=False):
            holders.setdefault(p, set()).add(stage_of[a])
            names_of.setdefault(p, []).append(f"{a}.{n}")
    ties = tuple((tuple(names_of[p]), tuple(sorted(st))) for p, st in holders.items() if len(st) > 1)
    return StageSplit(tuple(atoms), stage_of, n_stages, tuple(blocks), rule, ties)


def strip_atoms(model: nn.Module, split: StageSplit, local_stages: Sequence[int], *,
                dtype: torch.dtype | None = None) -> list[nn.Parameter]:
    """Strip the atoms of the stages not in ``local_stages`` ([Note: atoms]); return the parameters that left
    the model (to be dropped from the optimizer). A parameter tied to a local atom stays. ``dtype``: the compute
    dtype the local floating-point parameters are cast to (mixed precision), which the meta stand-ins take too."""
    local = set(local_stages)
    kept = {id(p) for a in split.atoms if split.stage_of[a] in local for p in model.get_submodule(a).parameters()}
    gone: dict[int, nn.Parameter] = {}
    for a in split.atoms:
        if split.stage_of[a] in local:
            continue
        for m in model.get_submodule(a).modules():
            for key, p in list(m._parameters.items()):
                if p is None:
                    continue
                if id(p) not in kept:
                    gone[id(p)] = p
                del m._parameters[key]
                cast = dtype if dtype is not None and p.is_floating_point() else p.dtype
                object.__setattr__(m, key, torch.empty_like(p, device="meta", dtype=cast))
            for key, b in list(m._buffers.items()):
                if b is None:
                    continue
                del m._buffers[key]
                object.__setattr__(m, key, torch.empty_like(b, device="meta"))
    return list(gone.values())


def load_takes_whole_model(model: nn.Module, split: StageSplit, local_stages: Sequence[int]) -> None:
    """Before :func:`strip_atoms`: make ``model.load_state_dict`` take the whole model's state dict on every rank
    (strict, as a user loads one file everywhere) by dropping the keys of the stages this rank does not hold,
    which their own ranks load; a key of no stage, or one of this rank's stages that is missing, is still
    refused. This rank's keys alone load as before."""
    local = set(local_stages)
    keys = {f"{a}.{k}" for a in split.atoms if split.stage_of[a] not in local
            for k in model.get_submodule(a).state_dict(keep_vars=True)}

    def drop_other_stages(module: nn.Module, state_dict: dict[str, object], prefix: str, *args: object) -> None:
        for key in keys:
            state_dict.pop(prefix + key, None)

    model.register_load_state_dict_pre_hook(drop_other_stages)
