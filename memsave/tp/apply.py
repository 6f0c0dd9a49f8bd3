"""Apply a tensor-parallel plan to an unchanged model, in place (the first transform of ``memsave.parallelize``).

Validation first, mutation after: every style is checked against its module (type, sizes divisible by ``tp``,
heads) before any weight is cut, so a refused plan changes nothing. Then, per matched module:
- its weight (and bias) are cut to this rank's slice *in place* (``p.data``): the ``nn.Parameter`` objects stay,
  so the user's optimizer, tied weights and ``state_dict`` keys keep working;
- its class is swapped for the TP layer (memsave/tp/layers.py), so the model's own forward runs as it is;
- each parameter gets its :class:`~memsave.dist.Placement` (``tp=Shard(dim)``, or replicated with a gradient summed
  over ``tp`` for sequence-parallel norms), which the engines, the optimizer, clipping and the report read.

[Note: replicated over tp means identical] Parameters replicated over ``tp`` must hold the same values on every
``tp`` rank, and the slices must be cut from one tensor: every parameter and buffer is broadcast from ``tp`` rank 0
before it is cut (as DDP broadcasts over ``dp``), and the default random generator is made equal over ``tp``
([Note: TP random streams] in memsave/tp/random.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from memsave import dist as mdist
from memsave.dist import Mesh, Placement, Shard
from memsave.tp.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPContext,
    VocabParallelEmbedding,
    gather_tp,
)
from memsave.tp.loss import ShardedLogits, VocabShard
from memsave.tp.mappings import CopyToTP, ReduceFromTP, ScatterSeq
from memsave.tp.plan import default_plan, match_plan
from memsave.tp.random import RegionRandom, sync_default_rng

__all__ = ["TPParam", "apply_tp", "cut_shapes", "cut_tp", "expert_dim", "full_state_dicts", "tp_param"]

_HEAD_ATTRS = ("num_heads", "n_head", "n_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads")
_WIDTH_ATTRS = ("hidden_size", "embed_dim", "all_head_size")
_COLUMN = ("colwise", "packed_colwise", "colwise_gather_output", "loss_parallel")
_ROW = ("rowwise", "rowwise_split_input")


@dataclasses.dataclass(frozen=True)
class TPParam:
    """How a parameter is laid out over ``tp``: ``dim`` split (None: whole), of ``blocks`` packed blocks, from a
    tensor of ``full_shape`` (a padded vocabulary's rows past the real ones are zeros)."""

    placement: Placement
    dim: int | None
    blocks: int
    full_shape: tuple[int, ...]


def tp_param(p: torch.Tensor) -> TPParam | None:
    """The tensor-parallel layout of a parameter (None: not touched by TP)."""
    return getattr(p, "_memsave_tp", None)


@dataclasses.dataclass
class _Cut:
    module: nn.Module
    name: str
    style: str
    blocks: int
    select: tuple[int, int] | None = None  # GQA: replicated K/V, the output columns this rank reads
    param: str | None = None  # a fused expert tensor of ``module`` ([Note: expert tensor parallelism])


def _cuts(model: nn.Module, matched: Mapping[str, tuple[str, int]]) -> list[_Cut]:
    modules = dict(model.named_modules())
    out = []
    for n, (style, blocks) in matched.items():
        if n in modules:
            out.append(_Cut(modules[n], n, style, blocks))
        else:  # a parameter's name
            owner, _, attr = n.rpartition(".")
            out.append(_Cut(modules[owner], n, style, blocks, param=attr))
    return out


def expert_dim(p: torch.Tensor, style: str) -> int:
    """The dim a fused expert tensor is cut along, as HF's plans name it: the second to last for ``colwise`` /
    ``packed_colwise``, the last for ``rowwise`` / ``packed_rowwise``. Mixtral stores each expert ``(out, in)`` as
    ``nn.Linear`` does (gate_up ``packed_colwise``, down ``rowwise``), Llama 4 ``(in, out)`` (gate_up
    ``packed_rowwise``, down ``colwise``): both cut the intermediate features."""
    return p.dim() - 1 if style in ("rowwise", "packed_rowwise") else p.dim() - 2


def apply_tp(model: nn.Module, mesh: Mesh, plan: Mapping[str, str] | None = None, *, sequence: bool = False,
             units: Sequence[nn.Module] | None = None, seq_dim: int = 1) -> TPContext:
    """Cut ``model`` over the mesh's ``tp`` axis by ``plan`` (default: :func:`~memsave.tp.plan.default_plan`)."""
    group, t, r = mesh.group("tp"), mesh.degree("tp"), mesh.axis_rank("tp")
    matched = match_plan(model, plan if plan is not None else default_plan(model))
    cuts = _cuts(model, matched)
    heads = _check(model, cuts, t, r, sequence)  # raises before anything changes
    _broadcast_whole(model, group)
    ctx = TPContext(group=group, rank=r, size=t, sequence=sequence, seq_dim=seq_dim,
                    random=RegionRandom(r, mesh.device))
    done: dict[int, TPParam] = {}
    for cut in cuts:
        _cut(cut, ctx, done)
    for module, updates in heads:
        for attr, value in updates.items():
            setattr(module, attr, value)
    _install_hooks(model, ctx, cuts, units)
    sync_default_rng(group, mesh.device)
    model.memsave_tp = ctx  # type: ignore[assignment]
    return ctx


def _check(model: nn.Module, cuts: list[_Cut], t: int, r: int, sequence: bool) -> list[tuple[nn.Module, dict[str, Any]]]:
    """Every refusal, before any change: module types, sizes divisible by tp, heads. Returns the head-count
    attributes to update."""
    experts = {c.module for c in cuts if c.style == "moe_tp_experts" and c.param is None}
    if experts and sequence:
        raise NotImplementedError("tensor parallelism: experts cut over tp ('moe_tp_experts') under sequence "
                                  "parallelism are not supported; set [parallel] sequence = false")
    for cut in cuts:
        m, style = cut.module, cut.style
        if cut.param is not None:  # [Note: expert tensor parallelism]
            p = getattr(m, cut.param)
            if m not in experts:
                raise ValueError(f"tp plan: parameter {cut.name!r} has style {style!r}, but its module is not "
                                 "'moe_tp_experts' (which sums the experts' partial outputs over tp): name it so")
            if not isinstance(p, nn.Parameter) or p.dim() < 2:
                raise ValueError(f"tp plan: parameter {cut.name!r} is not a matrix of each expert (shape "
                                 f"{tuple(getattr(p, 'shape', ()))}); a fused expert tensor is (experts, out, in)")
            dim = expert_dim(p, style)
            if p.shape[dim] % (cut.blocks * t):
                raise ValueError(f"tensor parallelism: parameter {cut.name!r} has size {p.shape[dim]} along dim {dim}, "
                                 f"not divisible by {cut.blocks} x tp={t}")
            continue
        if style in (*_COLUMN, *_ROW) and not isinstance(m, nn.Linear):
            inner = [f"{cut.name}.{n}" for n, c in m.named_children() if isinstance(c, nn.Linear)]
            hint = (f"; it holds the nn.Linear {', '.join(map(repr, inner))}: name those. An adapter (LoRA) around "
                    "a base layer: cut the base layer, and with a colwise one the adapter's up-projection colwise "
                    "too, with a rowwise one its down-projection rowwise too; the other factor stays whole"
                    ) if inner else ""
            raise ValueError(f"tp plan: module {cut.name!r} ({type(m).__name__}) has style {style!r}, which needs an "
                             f"nn.Linear{hint}")
        if style == "vocab_embedding" and not isinstance(m, nn.Embedding):
            raise ValueError(f"tp plan: module {cut.name!r} ({type(m).__name__}) has style 'vocab_embedding', which "
                             "needs an nn.Embedding")
        if style in (*_COLUMN, *_ROW) and _own_forward(m, nn.Linear):
            raise NotImplementedError(
                f"tensor parallelism: module {cut.name!r} is a {type(m).__name__}, a subclass of nn.Linear with a "
                f"forward of its own; style {style!r} cuts the nn.Linear's weight, and what that forward does with "
                "the slice (before or after the matmul, across the features now cut) cannot be known: leave it out "
                "of the tp plan (tp_plan=...), or give it a subclass whose forward is nn.Linear's")
        if style in ("colwise", "packed_colwise", "colwise_gather_output"):
            assert isinstance(m, nn.Linear)
            if m.out_features % (cut.blocks * t):
                what = f"{cut.blocks} packed blocks of " if cut.blocks > 1 else ""
                raise ValueError(f"tensor parallelism: module {cut.name!r} has {what}out_features={m.out_features}, "
                                 f"not divisible by {cut.blocks} x tp={t}")
        if style in _ROW:
            assert isinstance(m, nn.Linear)
            if m.in_features % t:
                raise ValueError(f"tensor parallelism: module {cut.name!r} has in_features={m.in_features}, not "
                                 f"divisible by tp={t}")
    if sequence:
        _check_named(model, cuts)
    column = {c.module for c in cuts if c.style in ("colwise", "packed_colwise") and c.param is None}  # (cut outputs)
    updates = []
    for name, parent in model.named_modules():
        children = {n: c for n, c in parent.named_children() if c in column}
        if not children:
            continue
        counts = {a: getattr(parent, a) for a in _HEAD_ATTRS if isinstance(getattr(parent, a, None), int)}
        head_dim = getattr(parent, "head_dim", None)
        if not counts and not isinstance(head_dim, int):
            continue  # an MLP: nothing counts heads
        new: dict[str, Any] = {}
        for attr, n in counts.items():
            if n % t:
                raise ValueError(f"tensor parallelism: module {name!r} has {attr}={n}, not divisible by tp={t}; "
                                 f"choose tp dividing {n}")
            new[attr] = n // t
        for attr in _WIDTH_ATTRS:
            width = getattr(parent, attr, None)
            if isinstance(width, int) and (counts or head_dim):
                new[attr] = width // t
        if isinstance(head_dim, int):
            new.update(_gqa(name, parent, children, cuts, head_dim, t, r))
        updates.append((parent, new))
    return updates


def _check_named(model: nn.Module, cuts: list[_Cut]) -> None:
    """Under sequence parallelism every trainable parameter is named by the plan ([module docstring] of plan.py)."""
    named: set[int] = set()
    for cut in cuts:
        if cut.style in (*_COLUMN, *_ROW, "vocab_embedding"):
            named.update(id(p) for p in (getattr(cut.module, "weight", None), getattr(cut.module, "bias", None))
                         if p is not None)
        elif cut.style in ("sequence_parallel", "replicated_with_grad_allreduce", "replicated"):
            named.update(id(p) for p in cut.module.parameters(recurse=False))
    left: dict[str, list[str]] = {}
    for pn, p in model.named_parameters():
        if p.requires_grad and id(p) not in named:
            left.setdefault(pn.rpartition(".")[0] or "<root>", []).append(pn)
    if left:
        mods = list(left)
        raise ValueError(
            f"tensor parallelism with sequence parallelism: the tp plan names no style for module(s) "
            f"{', '.join(map(repr, mods[:4]))}{f' and {len(mods) - 4} more' if len(mods) > 4 else ''} (trainable "
            f"parameters {', '.join(map(repr, left[mods[0]][:2]))}, ...). Between the blocks a module reads this rank's "
            "slice of the sequence, and its gradient must be summed over tp: name it 'sequence_parallel'; one that "
            "reads this rank's features or heads (after a colwise projection): 'replicated_with_grad_allreduce'; one "
            "that reads the same whole input on every rank (before the first block, or after a projection that "
            "gathers its output): 'replicated'")


def _gqa(name: str, parent: nn.Module, children: dict[str, nn.Module], cuts: list[_Cut], head_dim: int, t: int,
         r: int) -> dict[str, Any]:
    """Query heads split; K/V heads split when they divide by tp, else kept whole with each rank reading one."""
    by_module = {c.module: c for c in cuts}
    q = children.get("q_proj") or children.get("query")
    k, v = children.get("k_proj") or children.get("key"), children.get("v_proj") or children.get("value")
    if not isinstance(q, nn.Linear) or not isinstance(k, nn.Linear):
        return {}
    nh, nkv = q.out_features // head_dim, k.out_features // head_dim
    if nh % t:
        raise ValueError(f"tensor parallelism: module {name!r} has {nh} attention heads, not divisible by tp={t}")
    if nkv % t == 0:
        return {}
    per_rank, group_size = nh // t, nh // nkv
    if group_size % per_rank:
        raise ValueError(f"tensor parallelism: module {name!r} has {nkv} key/value heads for {nh} query heads: with "
                         f"tp={t} the {per_rank} query heads of a rank span several KV heads unevenly; choose tp "
                         f"dividing {nkv}, or a multiple of {nkv} dividing {nh}")
    kv = r * per_rank // group_size
    for proj in (k, v):
        if proj is not None:
            by_module[proj].select = (kv * head_dim, (kv + 1) * head_dim)
    return {"num_key_value_groups": per_rank} if hasattr(parent, "num_key_value_groups") else {}


@torch.no_grad()
def cut_shapes(model: nn.Module, tp: int, plan: Mapping[str, str] | None = None) -> set[int]:
    """Give a *meta-device* ``model`` the parameter shapes and head counts ``tp`` rank 0 holds under ``plan``, with
    no process group and no class swapped (the estimator's model: its forward on the meta device then saves what a
    tensor-parallel rank saves without sequence parallelism). A vocab-parallel head returns :class:`ShardedLogits`
    (with no group), so the model's own loss runs on the shard as in training. Returns the ids of the parameters
    cut."""
    matched = match_plan(model, plan if plan is not None else default_plan(model))
    cuts = _cuts(model, matched)
    for module, updates in _check(model, cuts, tp, 0, False):
        for attr, value in updates.items():
            setattr(module, attr, value)
    seen: set[int] = set()
    for cut in cuts:
        m = cut.module
        if cut.style == "loss_parallel":  # its logits are the vocabulary's shard the model's own loss runs on
            assert isinstance(m, nn.Linear)
            shard = VocabShard(None, 0, -(-m.out_features // tp), m.out_features)
            m.register_forward_hook(lambda _m, _args, out, shard=shard: ShardedLogits.wrap(out, shard))
        elif cut.style == "colwise_gather_output":  # the whole output, as the gather makes it
            m.register_forward_hook(lambda _m, _args, out: torch.cat([out] * tp, -1))
        elif cut.style == "rowwise_split_input":  # this rank's columns of the whole input (a copy, as the split's)
            m.register_forward_pre_hook(lambda _m, args: (args[0][..., :_m.weight.shape[1]].contiguous(), *args[1:]))
        dims = {"rowwise": {"weight": 1}, "rowwise_split_input": {"weight": 1},
                "vocab_embedding": {"weight": 0}}.get(cut.style, {})
        if cut.style in _COLUMN and cut.select is None:
            dims = {"weight": 0, "bias": 0}
        if cut.param is not None:
            dims = {cut.param: expert_dim(getattr(m, cut.param), cut.style)}
        elif cut.style == "moe_tp_experts":
            dims = {}
        for pn, dim in dims.items():
            p = getattr(m, pn, None)
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            shape = list(p.shape)
            shape[dim] = -(-shape[dim] // tp)
            p.data = torch.empty(shape, dtype=p.dtype, device="meta")
    return seen


@torch.no_grad()
def _broadcast_whole(model: nn.Module, group: mdist.ProcessGroup) -> None:
    seen: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen and t.device.type != "meta":
            seen.add(id(t))
            mdist.broadcast(t.data, 0, group)


def _slice(full: torch.Tensor, dim: int, t: int, r: int, blocks: int, pad_to: int | None = None) -> torch.Tensor:
    if pad_to is not None and pad_to != full.shape[dim]:
        pad = list(full.shape)
        pad[dim] = pad_to - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad)], dim)
    parts = [b.chunk(t, dim)[r] for b in full.chunk(blocks, dim)]
    return torch.cat(parts, dim).clone() if blocks > 1 else parts[0].clone()


def cut_tp(whole: torch.Tensor, lay: TPParam, t: int, r: int) -> torch.Tensor:
    """Rank ``r``'s slice (of ``t``) of a whole tensor laid out as ``lay`` says (padded as the parameter is)."""
    assert lay.dim is not None
    pad_to = -(-lay.full_shape[lay.dim] // t) * t
    return _slice(whole, lay.dim, t, r, lay.blocks, pad_to)


def _set(p: torch.Tensor, local: torch.Tensor, layout: TPParam, done: dict[int, TPParam], name: str) -> None:
    if id(p) in done:  # a tied parameter, cut already: the same layout or a refusal
        if done[id(p)] != layout:
            raise ValueError(f"tensor parallelism: {name} is tied to a parameter cut another way ({done[id(p)]} vs "
                             f"{layout}); give tied modules styles that split it alike")
        return
    full_shape = tuple(p.shape)
    p.data = local
    p._memsave_tp = dataclasses.replace(layout, full_shape=full_shape)  # type: ignore[attr-defined]
    p._memsave_placement = layout.placement  # type: ignore[attr-defined]
    done[id(p)] = dataclasses.replace(layout, full_shape=())


def _cut(cut: _Cut, ctx: TPContext, done: dict[int, TPParam]) -> None:
    m, style, t, r = cut.module, cut.style, ctx.size, ctx.rank
    partial = Placement(partial_grad=("tp",))
    if cut.param is not None:  # [Note: expert tensor parallelism]
        p = getattr(m, cut.param)
        dim = expert_dim(p, style)
        _set(p, _slice(p.data, dim, t, r, cut.blocks), TPParam(Placement(tp=Shard(dim)), dim, cut.blocks, ()), done,
             cut.name)
    elif style == "moe_tp_experts":
        m.register_forward_pre_hook(_experts_input(ctx), with_kwargs=True)
        m.register_forward_hook(lambda _m, _args, out: tree_map(
            lambda x: ReduceFromTP.apply(x, ctx.group) if isinstance(x, torch.Tensor) and x.is_floating_point()
            else x, out))
    elif style in _COLUMN:
        assert isinstance(m, nn.Linear)
        vocab = None
        if cut.select is not None:  # GQA: whole, the gradient summed over tp
            layout = TPParam(partial, None, 1, ())
            for p in (m.weight, m.bias):
                if p is not None:
                    _set(p, p.data, layout, done, f"{cut.name} parameter")
        else:
            pad_to = -(-m.out_features // t) * t if style == "loss_parallel" else None
            layout = TPParam(Placement(tp=Shard(0)), 0, cut.blocks, ())
            if pad_to is not None:
                vocab = VocabShard(ctx.group, r * (pad_to // t), pad_to // t, m.out_features)
            _set(m.weight, _slice(m.weight.data, 0, t, r, cut.blocks, pad_to), layout, done, f"{cut.name}.weight")
            if m.bias is not None:
                _set(m.bias, _slice(m.bias.data, 0, t, r, cut.blocks, pad_to), layout, done, f"{cut.name}.bias")
            m.out_features = m.weight.shape[0]
        _become(m, ColumnParallelLinear, cut.name)
        vars(m).update(tp=ctx, gather_output=style == "colwise_gather_output", vocab=vocab, select=cut.select)
    elif style in _ROW:
        assert isinstance(m, nn.Linear)
        _set(m.weight, _slice(m.weight.data, 1, t, r, 1), TPParam(Placement(tp=Shard(1)), 1, 1, ()), done,
             f"{cut.name}.weight")
        if m.bias is not None:  # added once, after the reduction; under SP on sequence shards: partial gradient
            _set(m.bias, m.bias.data, TPParam(partial if ctx.sequence else Placement(), None, 1, ()), done,
                 f"{cut.name}.bias")
        m.in_features = m.weight.shape[1]
        _become(m, RowParallelLinear, cut.name)
        vars(m).update(tp=ctx, split_input=style == "rowwise_split_input")
    elif style == "vocab_embedding":
        assert isinstance(m, nn.Embedding)
        pad_to = -(-m.num_embeddings // t) * t
        vars(m)["vocab"] = VocabShard(ctx.group, r * (pad_to // t), pad_to // t, m.num_embeddings)
        _set(m.weight, _slice(m.weight.data, 0, t, r, 1, pad_to), TPParam(Placement(tp=Shard(0)), 0, 1, ()), done,
             f"{cut.name}.weight")
        _become(m, VocabParallelEmbedding, cut.name)
        vars(m)["tp"] = ctx
    elif style == "replicated_with_grad_allreduce" or (style == "sequence_parallel" and ctx.sequence):
        for pn, p in m.named_parameters(recurse=False):
            _set(p, p.data, TPParam(partial, None, 1, ()), done, f"{cut.name}.{pn}")


def _own_forward(m: nn.Module, base: type[nn.Module]) -> bool:
    return type(m).forward is not base.forward


class _Reached(nn.Module):
    """Between a subclass's own forward and the parallel one: records that ``super().forward`` got there."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.__dict__["_memsave_tp_reached"] = True
        return super().forward(*args, **kwargs)


def _checked_forward(own: type[nn.Module]) -> Callable[..., Any]:
    """The subclass's forward, refused where it does not reach the parallel forward (it read the weight itself)."""

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        self.__dict__["_memsave_tp_reached"] = False
        try:
            out = own.forward(self, *args, **kwargs)
        except Exception as exc:
            if self.__dict__["_memsave_tp_reached"]:
                raise
            raise NotImplementedError(_not_reached(self, own)) from exc
        if not self.__dict__["_memsave_tp_reached"]:
            raise NotImplementedError(_not_reached(self, own))
        return out

    return forward


def _not_reached(m: nn.Module, own: type[nn.Module]) -> str:
    return (f"tensor parallelism: module {m.__dict__.get('_memsave_tp_name')!r} is a {own.__name__}, whose forward "
            "does not call nn.Embedding.forward (super().forward); memsave cut its weight to this rank's rows of "
            "the vocabulary, which only the parallel forward reads right: leave it out of the tp plan")


_COMBINED: dict[tuple[type, type], type] = {}


def _become(m: nn.Module, parallel: type, name: str) -> None:
    """[Note: subclasses of the cut layers] The cut module takes the parallel class. A subclass of nn.Linear or
    nn.Embedding keeps its own methods above it: the class becomes ``(its class, parallel)``, so its forward runs
    and its ``super().forward`` is the parallel one. Gemma's ``GemmaTextScaledWordEmbedding`` multiplies the
    lookup by sqrt(hidden): replaced by the parallel class alone, its embeddings were unscaled (step 0's loss off
    by 0.15%, its norms' weights 5x off after 3 steps, no error). That is exact for a vocab-parallel embedding,
    whose input (the ids) and output (all-reduced over tp) are whole; a Linear subclass with a forward of its own
    is refused before the cut (:func:`_check`). A forward that does not reach ``super().forward`` (it reads the
    weight itself: this rank's rows, with the global ids) is refused at its first call."""
    own = type(m)
    base: type[nn.Module] = nn.Embedding if issubclass(parallel, nn.Embedding) else nn.Linear
    if own is base:
        m.__class__ = parallel
        return
    combined = _COMBINED.get((own, parallel))
    if combined is None:
        if _own_forward(m, base):
            combined = type(f"{parallel.__name__}[{own.__name__}]", (own, _Reached, parallel),
                            {"forward": _checked_forward(own)})
        else:
            combined = type(f"{parallel.__name__}[{own.__name__}]", (own, parallel), {})
        _COMBINED[(own, parallel)] = combined
    m.__class__ = combined
    vars(m)["_memsave_tp_name"] = name


def _experts_input(ctx: TPContext) -> Callable[..., Any]:
    """[Note: expert tensor parallelism] A mixture-of-experts layer's experts module (HF's ``MixtralExperts``,
    ``OlmoeExperts``, ...: fused tensors ``gate_up_proj`` (experts, 2 x intermediate, hidden) and ``down_proj``
    (experts, hidden, intermediate)) is cut as an MLP is, every expert at once: each rank holds its share of every
    expert's intermediate features (the gate and up halves each cut), so its output is a partial sum, all-reduced
    over tp. Its floating-point inputs (the tokens and the router's weights, whole on every rank) enter the region
    as a column-parallel layer's input does: their gradients, partial on each rank, are all-reduced in backward."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        return tree_map(lambda x: CopyToTP.apply(x, ctx.group) if isinstance(x, torch.Tensor)
                        and x.is_floating_point() else x, (args, kwargs))

    return hook


def _install_hooks(model: nn.Module, ctx: TPContext, cuts: list[_Cut], units: Sequence[nn.Module] | None) -> None:
    def reset(*_: Any) -> None:
        ctx.clear()
        ctx.random.leave()

    model.register_forward_pre_hook(reset)
    model.register_forward_hook(reset)
    if ctx.sequence:
        for cut in cuts:
            if cut.style in ("sequence_input", "sequence_gather"):
                cut.module.register_forward_pre_hook(_map_input(ctx, cut.style), with_kwargs=True)
    from memsave.models.units import default_units  # layer 0

    for unit in units if units is not None else default_units(model):
        if unit is not model:  # [Note: TP random streams]: each unit starts and ends in the replicated stream
            unit.forward = ctx.random.scoped(unit.forward)  # type: ignore[method-assign]


def _map_input(ctx: TPContext, style: str) -> Any:
    """The sequence input of a module: cut to this rank's slice (``sequence_input``, the first block) or gathered
    whole (``sequence_gather``, a module whose column-parallel children read it)."""

    def mapped(x: torch.Tensor) -> torch.Tensor:
        return ScatterSeq.apply(x, ctx.seq_dim, ctx.group) if style == "sequence_input" else ctx.gather_input(x)

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        if args and isinstance(args[0], torch.Tensor):
            args = (mapped(args[0]), *args[1:])
        elif isinstance(kwargs.get("hidden_states"), torch.Tensor):
            kwargs = {**kwargs, "hidden_states": mapped(kwargs["hidden_states"])}
        else:
            raise ValueError(f"sequence parallelism: the sequence input of {type(module).__name__} is neither its "
                             "first positional tensor nor a hidden_states= keyword")
        return args, kwargs

    return hook


def full_state_dicts(model: nn.Module, ctx: TPContext) -> None:
    """``model.state_dict()`` holds the whole tensors (gathered over ``tp``, padding dropped: a collective over
    ``tp``), and ``model.load_state_dict`` takes whole tensors (each rank cuts its slice) or this rank's slices, so
    a state dict moves between a tensor-parallel run, a plain model and ``save_pretrained`` as it is. Installed
    after the other transforms, so their own state-dict hooks (ZeRO-3's gather over ``dp``) run first."""
    def cut_params() -> dict[str, tuple[Any, nn.Parameter]]:
        """The cut parameters by their names now (a block replaced after wrap, by ``torch.compile(block)``, puts
        ``_orig_mod.`` in its keys: names taken at wrap missed them, and its shards were saved as they are)."""
        return {k: (lay, p) for k, p in model.named_parameters(remove_duplicate=False)
                if (lay := tp_param(p)) is not None and lay.dim is not None}

    def gather(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        layouts = cut_params()
        if layouts:  # rank 0 alone (`if rank == 0: model.state_dict()`): its error, not a 600 s hang in the gather
            mdist.expect_every_rank("model.state_dict() under tensor parallelism", ctx.group)
        whole: dict[nn.Parameter, torch.Tensor] = {}  # a tied parameter's names share one tensor, as in plain torch
        for key, (lay, p) in layouts.items():  # (an edit through one key then reaches the load of both)
            value = state_dict.get(prefix + key)
            if isinstance(value, torch.Tensor) and lay.dim is not None:
                if p not in whole:
                    whole[p] = gather_tp(value, lay.dim, ctx.group, blocks=lay.blocks, full=lay.full_shape[lay.dim])
                state_dict[prefix + key] = whole[p]

    def cut(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for name, p in module._parameters.items():
            lay = tp_param(p) if p is not None else None
            value = state_dict.get(prefix + name)
            if (lay is not None and lay.dim is not None and isinstance(value, torch.Tensor)
                    and tuple(value.shape) == lay.full_shape):
                state_dict[prefix + name] = cut_tp(value, lay, ctx.size, ctx.rank)

    model.register_state_dict_post_hook(gather)
    # on each module holding a cut parameter, not the root alone: a load through a submodule
    # (model.model.load_state_dict(backbone) after wrap) took whole tensors as slices, torch's size mismatch
    for m in model.modules():
        if any(p is not None and (lay := tp_param(p)) is not None and lay.dim is not None
               for p in m._parameters.values()):
            m.register_load_state_dict_pre_hook(cut)
