"""Tensor-parallel plans: module-name patterns mapped to styles, in the spirit of torch's ``parallelize_module``.

A plan is a ``dict`` from a pattern to a style. A pattern is a module name whose components may be ``*`` (any one
component): ``"blocks.*.mlp_fc"``, ``"model.layers.*.self_attn.q_proj"``. Every pattern must match at least one
module, and no module may be matched twice. The styles:

| style | module | weight on each ``tp`` rank | communication |
|---|---|---|---|
| ``colwise`` | ``nn.Linear`` | rows (output features) | input: all-reduce of its gradient (SP: all-gather) |
| ``packed_colwise[:N]`` | ``nn.Linear`` | rows of each of N packed blocks (``qkv``: 3; default 2) | as ``colwise`` |
| ``colwise_gather_output`` | ``nn.Linear`` | rows | as ``colwise``, output all-gathered |
| ``loss_parallel`` | ``nn.Linear`` LM head | rows of the padded vocabulary | as ``colwise``; output :class:`ShardedLogits` |
| ``rowwise`` | ``nn.Linear`` | columns (input features); the bias whole | output all-reduce (SP: reduce-scatter) |
| ``rowwise_split_input`` | ``nn.Linear`` | as ``rowwise``; takes a whole input and cuts its columns | as ``rowwise`` |
| ``vocab_embedding`` | ``nn.Embedding`` | rows of the padded vocabulary | output all-reduce |
| ``sequence_parallel`` | norms, dropout | whole; under SP the gradient is summed over ``tp`` | none |
| ``sequence_input`` | the first block | none | under SP: its input cut to this rank's slice of the sequence |
| ``sequence_gather`` | attention, MLP | none | under SP: its input all-gathered whole (its linears regather it) |
| ``replicated_with_grad_allreduce`` | any | whole; the gradient summed over ``tp`` | none |
| ``replicated`` | any | whole; the gradient as each rank computed it (the same whole input on every rank) | none |
| ``moe_tp_experts`` | experts | its fused tensors, named ``colwise`` / ``packed_colwise`` (dim -2) or ``rowwise`` / ``packed_rowwise`` (dim -1) | output all-reduce |

A parameter the plan does not name stays whole on every rank, its gradient as computed: right where its module
reads the same whole input on every ``tp`` rank. Under sequence parallelism a module between the blocks reads
this rank's slice of the sequence, and its gradient must be summed over ``tp`` (``sequence_parallel``): there every
trainable parameter must be named (a router or experts left out summed nothing: wrong gradients, no error), and
one the plan leaves out is refused, naming it.

The attention heads split with their projections: a module that owns column-parallel children (``colwise``,
``packed_colwise``: their outputs stay cut; Phi-3's plan gathers its fused ``qkv_proj`` whole, and its attention
then runs every head on every rank, its ``o_proj`` cutting its input again: ``rowwise_split_input``) and counts heads
(``num_heads``, ``n_head``, ``num_attention_heads``, ``num_key_value_heads``; ``hidden_size`` on it) gets per-rank
counts. Key/value projections of grouped-query attention split when the KV heads divide by ``tp``; otherwise each
rank keeps them whole and uses the one KV head its query heads read (``num_key_value_groups`` updated), its
gradient summed over ``tp``.

:func:`default_plan` gives memsave's plans: its reference GPT, and any Hugging Face model whose config carries
``base_model_tp_plan`` (Llama, Mistral, Qwen2, ...), completed with the vocab-parallel embedding, the parallel
loss on the LM head, sequence-parallel norms and the sequence input of the first block.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import nn

__all__ = ["STYLES", "default_plan", "gathers_whole", "gpt_plan", "match_plan"]

STYLES = ("colwise", "packed_colwise", "colwise_gather_output", "loss_parallel", "rowwise", "rowwise_split_input",
          "vocab_embedding", "sequence_parallel", "sequence_input", "sequence_gather", "replicated_with_grad_allreduce",
          "replicated", "moe_tp_experts", "packed_rowwise")
_EXPERT_STYLES = ("ep_router", "grouped_gemm", "local_colwise", "local_rowwise", "local_packed_rowwise")  # (expert
# parallelism: each rank whole experts of its own)
_ALIASES = {"embedding": "vocab_embedding", "embedding_rowwise": "vocab_embedding", "colwise_rep": "colwise_gather_output"}


def gpt_plan() -> dict[str, str]:
    """The plan of memsave's reference GPT (memsave/models/gpt.py)."""
    return {
        "wte": "vocab_embedding",
        "wpe": "replicated",  # (before the blocks: the whole sequence on every rank)
        "blocks.0": "sequence_input",
        "blocks.*.ln_1": "sequence_parallel",
        "blocks.*.qkv": "packed_colwise:3",
        "blocks.*.attn_proj": "rowwise",
        "blocks.*.ln_2": "sequence_parallel",
        "blocks.*.mlp_fc": "colwise",
        "blocks.*.mlp_proj": "rowwise",
        "ln_f": "sequence_parallel",
        "lm_head": "loss_parallel",
    }


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith(("Norm", "LayerNorm", "RMSNorm")) or isinstance(
        module, nn.LayerNorm | nn.RMSNorm | nn.GroupNorm)


def _names_any(pattern: str, names: list[str]) -> bool:
    regex = _compile(pattern)
    return any(regex.fullmatch(n) for n in names)


def _plan_prefix(model: nn.Module, names: Mapping[nn.Module, str], base_plan: Mapping[str, str],
                 present: list[str]) -> str:
    """Where the base model's plan applies: under ``model.base_model``, or (a model whose ``base_model`` is itself:
    Llama 4's text model, ``base_model_prefix`` "language_model" with its layers under ``model``) under the first
    module whose names the plan's patterns match. ``ValueError`` where none does: with the entries that name nothing
    dropped (below), such a plan cut nothing but the embedding and the head, with no error."""
    base = names.get(getattr(model, "base_model", model), "")
    candidates = [base] + [n for n in names.values() if n != base]
    for cand in candidates:
        prefix = cand + "." if cand else ""
        if any(_names_any(prefix + k, present) for k in base_plan):
            return prefix
    raise ValueError(f"tensor parallelism: {type(model).__name__}'s base_model_tp_plan ({', '.join(list(base_plan)[:3])}"
                     ", ...) names no module of the model under any prefix; pass tp_plan= with its module names")


def _hf_plan(model: nn.Module, base_plan: Mapping[str, str]) -> dict[str, str]:
    """A Hugging Face model's ``base_model_tp_plan`` (relative to its base model), completed ([module docstring])."""
    names = {m: n for n, m in model.named_modules()}
    present = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    prefix = _plan_prefix(model, names, base_plan, present)
    owners = [k for k, v in base_plan.items() if str(v).partition(":")[0] in _EXPERT_STYLES]
    experts = [k for k in base_plan if any(k == o or k.startswith(o + ".") for o in owners)]
    if experts:
        raise NotImplementedError(
            f"tensor parallelism: {type(model).__name__}'s base_model_tp_plan places its mixture-of-experts experts "
            f"by expert parallelism ({', '.join(repr(prefix + k) for k in experts)}: each rank whole experts of its "
            "own), which memsave does not do; it cuts every expert over tp ('moe_tp_experts' on the experts "
            "module, their fused tensors 'packed_colwise' / 'rowwise'). Pass tp_plan= with those styles")
    # HF's plan covers its config's variants (Qwen2-MoE's dense-MLP entries, for layers a config may make dense):
    # an entry that names nothing in this model cuts nothing here (a user's plan that does is refused, a typo)
    plan = {prefix + k: v for k, v in base_plan.items() if _names_any(prefix + k, present)}
    _packed_halves(model, plan)
    get_in = getattr(model, "get_input_embeddings", None)
    embed = get_in() if callable(get_in) else None
    if isinstance(embed, nn.Embedding) and embed in names:
        plan[names[embed]] = "vocab_embedding"
    get_out = getattr(model, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    if isinstance(head, nn.Linear) and head in names:
        plan[names[head]] = "loss_parallel"
    # under SP an attention / MLP module reads the whole sequence from its input (its own forward takes the
    # sequence length from it): gathered at its entry, as torch's PrepareModuleInput does
    modules = dict(model.named_modules())
    for key, style in list(plan.items()):
        parent = key.rpartition(".")[0]
        if style in ("colwise", "packed_colwise", "colwise_gather_output") and parent:
            plan.setdefault(parent, "sequence_gather")
    layers = [(n, m) for n, m in modules.items() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if layers:
        name = max(layers, key=lambda nm: len(nm[1]))[0]
        plan[f"{name}.0"] = "sequence_input"
    named = [_compile(k) for k in plan]  # (Gemma 3 names its q_norm / k_norm: replicated_with_grad_allreduce)
    gathered = {k: _compile(k) for k, v in plan.items() if v == "sequence_gather"}
    inner_styles: dict[str, tuple[str, str]] = {}  # module -> (style, the attention / MLP it is in)
    for n, m in model.named_modules():
        if any(r.fullmatch(n) for r in named) or not any(True for _ in m.parameters(recurse=False)):
            continue
        inner = _inner_style(n, plan, gathered)
        if inner is not None:  # a norm, an activation with parameters (Apertus's xIELU) inside an attention / MLP
            inner_styles[n] = inner
        elif _is_norm(m):
            plan[n] = "sequence_parallel"
    plan.update(_by_call_order(model, plan, inner_styles))
    return plan


_OPENS = ("colwise", "packed_colwise", "colwise_gather_output")  # this rank's features or heads from here on
_CLOSES = ("rowwise", "packed_rowwise", "rowwise_split_input")  # whole again after


def _by_call_order(model: nn.Module, plan: Mapping[str, str], inner: Mapping[str, tuple[str, str]]) -> dict[str, str]:
    """[Note: modules beside the projections] The styles of :func:`_inner_style`, checked against this attention /
    MLP and the order the forward calls its modules. A module the forward calls between a column-parallel
    projection and the row-parallel one after it reads this rank's heads or features
    (``replicated_with_grad_allreduce``). One in an attention / MLP that has no column-parallel projection of its
    own (MiniMax's linear-attention layers beside its cut softmax-attention ones; EXAONE-MoE's shared expert in a
    sparse layer, where the plan's entries cut the dense layers' MLPs), or one called before any (on the module's
    own input, whole: DeepSeek-V3's router) or after the row-parallel one, reads whole features: ``replicated``.
    Taken for this rank's features, their gradients, whole already, were summed over tp again: doubled, with the
    loss equal and no error. The order comes from a meta run of a Hugging Face model on its dummy inputs (in bf16
    where the model's own dtype fails there: a mixture of experts' grouped matmul takes bf16 only on the meta
    device), up to where that run fails; a module it did not reach, or any module of another model, keeps its
    structural style."""
    styles = {n: style for n, (style, _) in inner.items()}
    todo = {n: owner for n, (style, owner) in inner.items() if style == "replicated_with_grad_allreduce"}
    if not todo:
        return styles
    owners = set(todo.values())
    inside = [n for n, _ in model.named_modules() if any(n.startswith(o + ".") for o in owners)]
    compiled = [(_compile(k), parse_style(k, v)[0]) for k, v in plan.items()]
    kind = {n: s for n in inside for r, s in compiled if r.fullmatch(n) and s in _OPENS + _CLOSES}
    opening = {o for o in owners if any(n.startswith(o + ".") and kind[n] in _OPENS for n in kind)}
    for n, owner in todo.items():
        if owner not in opening:  # nothing in it is cut by columns: its features are whole
            styles[n] = "replicated"
    if not opening:
        return styles
    from memsave.deferred.meta import meta_call_order  # layer 1

    order = meta_call_order(model, [n for n in inside if any(n.startswith(o + ".") for o in opening)], partial=True)
    for owner in opening:
        local = False
        for n in (n for n in order or () if n.startswith(owner + ".")):
            if kind.get(n) in _OPENS:
                local = True
            elif kind.get(n) in _CLOSES:
                local = False
            elif todo.get(n) == owner and not local:
                styles[n] = "replicated"
    return styles


def _packed_halves(model: nn.Module, plan: dict[str, str]) -> None:
    """An HF plan's plain ``colwise`` on a fused expert ``gate_up_proj`` that the experts' forward splits in two
    contiguous halves (``chunk(2``, read from its class's source) becomes ``packed_colwise``, said once. Inkling's
    plans name it ``colwise``: one rank then held every gate row and the other every up row, and trained on the
    wrong product with no error (loss 4e-5 off at the first step, gradients twice as far). Interleaved rows
    (GPT-OSS's ``[..., ::2]``) survive a contiguous cut and are left alone; so is a plan the user passes."""
    import inspect

    from memsave._logging import warn_once  # layer 0

    for key, style in list(plan.items()):
        owner, _, param = key.rpartition(".")
        if style != "colwise" or "gate_up" not in param:
            continue
        compiled = _compile(owner)
        module = next((m for n, m in model.named_modules() if compiled.fullmatch(n)), None)
        if module is None or not isinstance(getattr(module, param, None), nn.Parameter):
            continue
        try:
            source = inspect.getsource(type(module)).replace(" ", "")
        except (OSError, TypeError):
            continue
        if ".chunk(2" in source:
            plan[key] = "packed_colwise"
            warn_once(f"tensor parallelism: the Hugging Face plan names {key!r} 'colwise', but "
                      f"{type(module).__name__} splits it in two halves (gate, up): cut as 'packed_colwise' (a slice of "
                      "each half per rank); pass tp_plan= to choose otherwise")


def _inner_style(name: str, plan: Mapping[str, str],
                 gathered: Mapping[str, re.Pattern[str]]) -> tuple[str, str] | None:
    """A module with parameters the HF plan does not name, inside an attention or MLP whose projections it cuts:
    the whole features when the projections gather their outputs (OLMoE's ``q_norm`` / ``k_norm``: ``replicated``),
    else this rank's heads or features (Qwen 3's ``q_norm``, Apertus's trainable activation between ``up_proj``
    and ``down_proj``: ``replicated_with_grad_allreduce``). None outside those. Left whole with their gradients
    as computed, Apertus's activation trained on this rank's share of its gradient (2e-4 off after 3 steps, no
    error); marked ``sequence_parallel`` (as every norm was), OLMoE's norms had theirs doubled under SP. Returns the
    style and the attention / MLP module it is in; :func:`_by_call_order` checks it against the forward."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        owner = ".".join(parts[:i])
        hit = next((k for k, r in gathered.items() if r.fullmatch(owner)), None)
        if hit is not None:
            inner = [v for k, v in plan.items() if k.startswith(hit + ".") and parse_style(k, v)[0] in _OPENS]
            return ("replicated" if inner and all(v == "colwise_gather_output" for v in inner) else (
                "replicated_with_grad_allreduce"), owner)
    return None


def default_plan(model: nn.Module) -> dict[str, str]:
    """memsave's plan for ``model``: its reference GPT's, or one read from a Hugging Face config's
    ``base_model_tp_plan``. Raises ``ValueError`` for any other model: pass ``tp_plan=`` then."""
    from memsave.models.gpt import GPT  # layer 0

    if isinstance(model, GPT):
        return gpt_plan()
    config = getattr(model, "config", None)
    base_plan = getattr(config, "base_model_tp_plan", None)
    if base_plan:
        return _hf_plan(model, base_plan)
    raise ValueError(
        f"tensor parallelism: memsave has no plan for a {type(model).__name__} (its own GPT and Hugging Face models "
        "whose config has base_model_tp_plan have one); pass tp_plan={module-name pattern: style} to "
        f"memsave.wrap / memsave.parallelize, with styles from {', '.join(STYLES)}")


def gathers_whole(model: nn.Module, plan: Mapping[str, str] | None = None) -> bool:
    """Whether ``plan`` (default: :func:`default_plan`) gathers a column-parallel output whole (Phi-3's, OLMoE's):
    under sequence parallelism a unit then keeps its attention's or MLP's activations whole on every rank, not 1/tp
    of them (the estimators' 1/tp rule was 13% under the tracker on Phi-3)."""
    plan = plan if plan is not None else default_plan(model)
    return any(parse_style(k, v)[0] == "colwise_gather_output" for k, v in plan.items())


def parse_style(pattern: str, style: str) -> tuple[str, int]:
    """``(style, packed blocks)`` of a plan entry; ``ValueError`` naming the entry if the style is unknown."""
    if not isinstance(style, str):
        raise ValueError(f"tp plan entry {pattern!r}: style {style!r} is not a string; allowed are {', '.join(STYLES)}")
    name, _, blocks = style.partition(":")
    name = _ALIASES.get(name, name)
    if name in ("packed_colwise", "packed_rowwise"):  # (packed_rowwise: a fused expert tensor stored (in, out))
        if blocks and not (blocks.isdigit() and int(blocks) >= 1):
            raise ValueError(f"tp plan entry {pattern!r}: style {style!r}; the packed block count after ':' must be "
                             "a positive integer (packed_colwise:3 for a fused qkv)")
        return name, int(blocks) if blocks else 2
    if name not in STYLES or blocks:
        raise NotImplementedError(
            f"tp plan entry {pattern!r}: style {style!r} is not supported by memsave's tensor parallelism; "
            f"supported are {', '.join(STYLES)} (packed_colwise:N for N packed blocks)")
    return name, 1


def _compile(pattern: str) -> re.Pattern[str]:
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"tp plan pattern {pattern!r}: expected a module name, components may be '*'")
    parts = [r"[^.]+" if p == "*" else re.escape(p) for p in pattern.split(".")]
    return re.compile(r"\.".join(parts))


def match_plan(model: nn.Module, plan: Mapping[str, str]) -> dict[str, tuple[str, int]]:
    """Module name -> ``(style, packed blocks)`` for every module the plan names. ``ValueError`` for a pattern
    that matches nothing or a module matched by two patterns."""
    if not isinstance(plan, Mapping) or not plan:
        raise ValueError(f"tp_plan={plan!r}: expected a non-empty dict of module-name pattern -> style")
    names = [n for n, _ in model.named_modules() if n]
    params = [n for n, _ in model.named_parameters()]  # a fused expert tensor ([Note: expert tensor parallelism])
    out: dict[str, tuple[str, int]] = {}
    by: dict[str, str] = {}
    for pattern, style in plan.items():
        parsed = parse_style(pattern, style)
        regex = _compile(pattern)
        hits = [n for n in names if regex.fullmatch(n)]
        if hits and parsed[0] == "packed_rowwise":
            raise ValueError(f"tp plan entry {pattern!r}: style 'packed_rowwise' is for a fused expert tensor (a "
                             f"parameter), not a module ({hits[0]!r})")
        if not hits:
            hits = [n for n in params if regex.fullmatch(n)]
            if hits and parsed[0] not in ("colwise", "packed_colwise", "rowwise", "packed_rowwise"):
                raise ValueError(f"tp plan entry {pattern!r} names parameters ({hits[0]!r}, ...) with style "
                                 f"{style!r}; a parameter takes 'colwise', 'packed_colwise', 'rowwise' or "
                                 "'packed_rowwise' (a fused expert tensor, inside a module whose style is "
                                 "'moe_tp_experts')")
        if not hits:
            sample = ", ".join(names[:8])
            raise ValueError(f"tp plan pattern {pattern!r} matches no module of the {type(model).__name__}; its "
                             f"module names look like {sample}, ...")
        for n in hits:
            if n in out:
                raise ValueError(f"tp plan: module {n!r} is matched by both {by[n]!r} and {pattern!r}; give each "
                                 "module one style")
            out[n], by[n] = parsed, pattern
    return out
