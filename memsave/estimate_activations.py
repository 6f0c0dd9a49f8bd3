"""The activation half of ``memsave.estimate``: one forward of a *meta-device* copy of the model under the
profile's recompute policy, with the saved-tensor counting of ``memsave.recompute.measure`` (shapes and dtypes
only, so a model far bigger than this machine is measured in seconds)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from memsave.config import Profile
from memsave.models.units import output_tensors

if TYPE_CHECKING:
    from memsave.recompute.measure import SavedBytes

__all__ = ["activations", "activations_cached", "measure_activations", "reuse"]

_T = TypeVar("_T")

# [Note: activations measured once per plan] A plan estimates many candidates exactly, and those that differ only
# in what the activations do not depend on (the ZeRO stage, offload, the schedule, the optimizer) ran the same
# meta forward again: 306 estimates of 0.16 s in the test that plans against the models. Inside
# activations_cached() a measurement is kept under everything it depends on: the meta model's parameters and
# buffers (names, shapes, dtypes: the tp cut and the compute dtype show there), the modules it is attributed to,
# the recompute and precision sections, the tp, sequence and pipeline split of [parallel], the offload of
# activations, the batch's shapes and dtypes, the device type, and the caller's own arguments.
_CACHE: contextvars.ContextVar[dict[Hashable, Any] | None] = contextvars.ContextVar("memsave_acts", default=None)


@contextlib.contextmanager
def activations_cached(store: dict[Hashable, Any] | None = None) -> Iterator[None]:
    """Activation measurements made inside with the same inputs are made once ([Note: activations measured once
    per plan]); ``store``: the measurements kept, to share them across several such blocks."""
    token = _CACHE.set({} if store is None else store)
    try:
        yield
    finally:
        _CACHE.reset(token)


def _signature(obj: Any) -> Hashable:
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), obj.dtype)
    if isinstance(obj, Mapping):
        return tuple((k, _signature(v)) for k, v in obj.items())
    if isinstance(obj, tuple | list):
        return tuple(_signature(v) for v in obj)
    return repr(obj) if not callable(obj) else ("callable", id(obj))


def reuse(kind: str, meta: nn.Module, modules: list[nn.Module], prof: Profile, batch: Any, device_type: str,
          extra: Hashable, compute: Callable[[], _T]) -> _T:
    """``compute()``, or what it returned for the same inputs inside :func:`activations_cached`."""
    cache = _CACHE.get()
    if cache is None:
        return compute()
    names = {id(m): n for n, m in meta.named_modules()}
    par = prof.parallel
    key = (kind, type(meta).__qualname__,
           tuple((n, tuple(t.shape), t.dtype) for n, t in (*meta.named_parameters(), *meta.named_buffers())),
           tuple(names.get(id(m), "?") for m in modules), repr(prof.recompute), repr(prof.precision),
           (par.tp, par.sequence, par.pp, par.virtual, par.split, par.balance), prof.offload.activations,
           _signature(batch), device_type, extra)
    if key not in cache:
        cache[key] = compute()
    return cache[key]  # type: ignore[no-any-return]


class MetaValueError(ValueError):
    """The model's forward read a tensor's value, which a meta tensor has none of: the estimate cannot run it (the
    configuration may still be fine; the planner then uses its closed forms)."""


def _run_forward(model: nn.Module, batch: Any) -> Callable[[], Any]:
    def call() -> Any:
        if callable(batch):
            return batch(model)
        if isinstance(batch, Mapping):
            return model(**batch)
        if isinstance(batch, tuple | list):
            return model(*batch)
        return model(batch)

    def run() -> Any:
        try:
            return call()
        except RuntimeError as exc:  # a forward that branches on a tensor's value cannot run on the meta device
            if "meta tensors" not in str(exc):
                raise
            raise MetaValueError(
                f"the estimate runs {type(model).__name__}'s forward on the meta device, where a tensor has no values, "
                f"and the forward read one ({exc}). Hugging Face models read a padded \"attention_mask\" under sdpa "
                "(an all-ones one is left out here, as they leave it out at run time): estimate with a batch of the "
                "same shape without it; some versions read the position ids without a mask and a cache: then put "
                "\"use_cache\": True in the example batch (the estimate only)") from exc
    return run


def _without_ones_mask(model: nn.Module, batch: Any) -> Any:
    """``batch`` without an all-ones ``attention_mask`` (a tokenizer's output for unpadded rows) where the model is a
    Hugging Face one under sdpa: it reads the mask's values to leave it out (a meta copy has none), and without it
    runs the same causal kernel; so its memory is the same."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if (attn != "sdpa" or not isinstance(mask, torch.Tensor) or mask.is_meta
            or not bool((mask == 1).all())):
        return batch
    return {k: v for k, v in batch.items() if k != "attention_mask"}


def _to_meta(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return torch.empty_like(batch, device="meta")
    if isinstance(batch, Mapping):
        return {k: _to_meta(v) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(_to_meta(v) for v in batch)
    return batch


def _cpu_flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any, dropout_p: float,
               gqa: bool) -> bool:
    """Whether a CPU runs the call's flash kernel: sdp_utils_cpp.cpp's ``use_flash_attention_cpp`` (no dropout;
    4-d inputs of one batch size, grouped KV heads with ``enable_gqa``; a mask of no gradient, 2-d or 4-d
    broadcasting over batch and heads; one head dimension; floating dtypes), else its math path."""
    if dropout_p > 0 or not torch.backends.cuda.flash_sdp_enabled() or any(t.dim() != 4 for t in (query, key, value)):
        return False
    (b, heads, s, d), (kb, kh, ks, kd), (vb, vh, _, vd) = query.shape, key.shape, value.shape
    if not b == kb == vb or kh != vh or not d == kd == vd or 0 in (s, ks) or heads % max(kh, 1) != 0 \
            or (kh != heads and not gqa) or query.dtype not in (torch.float32, torch.float64, torch.bfloat16,
                                                                torch.float16):
        return False
    if attn_mask is None:
        return True
    m = attn_mask.shape
    return (not attn_mask.requires_grad and m[-2] in (s, 1) and m[-1] in (ks, 1)
            and (len(m) == 2 or (len(m) == 4 and m[0] in (b, 1) and m[1] in (heads, 1))))


@contextlib.contextmanager
def _fused_attention_on_meta(device_type: str) -> Iterator[None]:
    """Make ``F.scaled_dot_product_attention`` on meta tensors run the fused (flash) kernel the target device
    would pick, instead of the math fallback the meta device decomposes into, which saves the whole attention
    matrix for backward: an estimate several times too big at long sequences. On CUDA without a mask, grouped
    KV heads (``enable_gqa``: Hugging Face's Llama, Mistral, Qwen) too, but not in fp32 (sdp_utils.cpp's
    ``check_grouped_query_attention``); with a mask the original function runs. On a CPU as
    :func:`_cpu_flash` decides: grouped heads and masks fused (the mask kept, a boolean one as a copy in the
    query's dtype), dropout on the math path, which keeps the attention matrix and its dropout mask."""
    original = F.scaled_dot_product_attention

    def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
             dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, **kwargs: Any) -> Any:
        gqa = kwargs.pop("enable_gqa", False)
        if query.device.type != "meta" or kwargs:
            fused = False
        elif device_type == "cuda":  # grouped-query: flash takes it, but not in fp32 (nor the memory-efficient one)
            fused = attn_mask is None and not (gqa and query.dtype == torch.float32)
        else:
            fused = _cpu_flash(query, key, value, attn_mask, dropout_p, gqa)
        if not fused:
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=gqa, **kwargs)
        if device_type == "cuda":
            return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                                      scale=scale)[0]
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # as attention.cpp converts it, per call
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                attn_mask.logical_not(), float("-inf"))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal,
                                                                          attn_mask=attn_mask, scale=scale)[0]

    F.scaled_dot_product_attention = sdpa  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original  # type: ignore[assignment]


def activations(meta: nn.Module, modules: list[nn.Module], prof: Profile, batch: Any, device_type: str,
                sequence_tp: int = 1) -> tuple[int, list[int], int, str, int, int, int, tuple[int, ...]]:
    """Saved bytes of one forward of the meta model under the recompute policy: total, per unit, the bytes of the
    forward's outputs that backward does not keep (the logits beside the log-softmax cross-entropy saves), a
    note, the elements of the largest floating output (the logits), and the bytes saved outside every unit before
    the first one ran (an embedding's input, a vision model's patch convolution's: kept until the end of backward,
    [Note: the estimated peak] in memsave/estimator.py), and the elements of the trainable parameters outside
    every unit used only after the last one (:func:`_late_params`). ``sequence_tp``: under full
    recomputation with sequence parallelism over that many ranks, a unit keeps 1/tp of the hidden states it is
    called with (its positional inputs: sequence-sharded), the rest of what it keeps as is (a Llama layer's
    rotary tables and mask, which no rank shards). Last, the indices of ``modules`` in the order the forward first
    called them ([Note: the units' call order] in memsave/zero/engine.py)."""
    total, per_unit, output_bytes, note, logits, first, late, order = reuse(
        "activations", meta, modules, prof, batch, device_type, sequence_tp,
        lambda: _activations(meta, modules, prof, batch, device_type, sequence_tp))
    return total, list(per_unit), output_bytes, note, logits, first, late, order


def _activations(meta: nn.Module, modules: list[nn.Module], prof: Profile, batch: Any, device_type: str,
                 sequence_tp: int) -> tuple[int, list[int], int, str, int, int, int, tuple[int, ...]]:
    order: list[int] = []
    index_of = {id(m): i for i, m in enumerate(modules)}

    def called(module: nn.Module, args: Any) -> None:
        if index_of[id(module)] not in order:
            order.append(index_of[id(module)])

    hooks = [m.register_forward_pre_hook(called) for m in modules]
    try:
        with _late_params(meta, modules) as late:
            saved, output_bytes, scale, note, logits = measure_activations(meta, modules, prof, batch, device_type)
    finally:
        for h in hooks:
            h.remove()
    per_unit, total = list(saved.units), saved.total
    in_units = {k for keys in saved._unit_keys for k in keys}
    at = saved._outside_at or {}
    first = sum(n for k, n in (saved._outside_keys or {}).items() if at.get(k) == 0 and k not in in_units)
    if sequence_tp > 1 and prof.recompute.policy == "full":
        for i, keys in enumerate(saved._unit_keys):
            sharded = sum(n for k, n in saved._positional_keys[i].items() if k in keys)
            others = sharded - -(-sharded // sequence_tp)  # the other ranks' share of the hidden states
            per_unit[i] -= others
            total -= others
    return int(total * scale), per_unit, output_bytes, note, logits, first, late[0], tuple(order)


@contextlib.contextmanager
def _late_params(meta: nn.Module, modules: list[nn.Module]) -> Iterator[list[int]]:
    """The elements of the trainable parameters outside every unit that the forward first uses once a unit ran
    (a final norm, an untied head; a second tower's embeddings, CLIP's text tower running after its vision
    tower): their gradients come in backward before the first unit's, and stay in ``.grad`` until the root's
    reduce at its end ([Note: the estimated peak] in memsave/estimator.py), counted from the start of backward
    (for a second tower's embeddings, from the middle: an upper bound). Read from the modules holding them, in the
    last forward run inside the block; a tied head's weight, used by the embedding before the units too, is not
    one (autograd sums both uses before its ``.grad`` exists)."""
    in_units = {id(p) for m in modules for p in m.parameters()}

    def outside(module: nn.Module) -> list[nn.Parameter]:
        return [p for p in module.parameters(recurse=False) if id(p) not in in_units and p.requires_grad]

    owners = [m for m in meta.modules() if outside(m)]
    before: set[int] = set()  # used before any unit finished
    after: dict[int, int] = {}  # first used once one had: id -> elements
    done = [0]

    def start(*_: Any) -> None:
        done[0] = 0
        before.clear()
        after.clear()

    def unit_done(*_: Any) -> None:
        done[0] += 1

    def used(module: nn.Module, *_: Any) -> None:
        for p in outside(module):
            if done[0]:
                after.setdefault(id(p), p.numel())
            else:
                before.add(id(p))

    hooks = [meta.register_forward_pre_hook(start), *(m.register_forward_hook(unit_done) for m in modules),
             *(m.register_forward_pre_hook(used) for m in owners)]
    late = [0]
    try:
        yield late
    finally:
        for h in hooks:
            h.remove()
        late[0] = sum(n for k, n in after.items() if k not in before) if modules else 0


def measure_activations(meta: nn.Module, modules: list[nn.Module], prof: Profile, batch: Any, device_type: str,
                        attribute: list[nn.Module] | None = None) -> tuple[SavedBytes, int, float, str, int]:
    """One forward of the meta model with the recompute policy applied to ``modules``, its saved bytes attributed
    to ``attribute`` (default: ``modules``; a pipeline's atoms for ``memsave.estimate`` under pp): the
    measurement, the bytes of the outputs backward does not keep, the factor compression applies to the saved
    bytes (1.0 without), a note, and the elements of the largest floating output."""
    from memsave import recompute
    from memsave.recompute.measure import measure_saved_bytes

    forward = _run_forward(meta, _to_meta(_without_ones_mask(meta, batch)))
    outputs: dict[int, int] = {}

    def run() -> Any:
        out = forward()
        outputs.clear()
        outputs.update((t.untyped_storage()._cdata, t.untyped_storage().nbytes()) for t in output_tensors(out))
        largest[:] = [max((t.numel() for t in output_tensors(out) if t.is_floating_point()), default=0)]
        return out

    largest = [0]

    plan = None
    if prof.recompute.policy != "none":
        with _fused_attention_on_meta(device_type):  # a budget measures a forward too
            plan = recompute.apply(modules, prof.recompute, model=meta,
                                   example_inputs=run if prof.recompute.policy.startswith("budget:") else None)
    try:
        with _fused_attention_on_meta(device_type):
            saved = measure_saved_bytes(run, modules if attribute is None else attribute, model=meta)
    finally:
        if plan is not None:
            recompute.remove(plan, model=meta)
    kept = {k for keys in (*saved._unit_keys, saved._outside_keys or {}) for k in keys}
    output_bytes = sum(n for k, n in outputs.items() if k not in kept)
    note = f"activations: one forward on the meta device, recompute policy {prof.recompute.policy}"
    scale = 1.0
    if prof.recompute.compress != "none":  # Gist-like compression stores fp32 activations at 2 (bf16) or 1 byte
        keep = 2 if prof.recompute.compress == "bf16" else 1
        scale = keep / 4 if prof.precision.compute == "fp32" else 1.0
        note += f", compressed to {prof.recompute.compress} (estimated as {keep}/4 of the fp32 bytes)"
    return saved, output_bytes, scale, note, largest[0]


def sequence_parallel(whole: nn.Module, unit_names: list[str], prof: Profile, batch: Any, device_type: str,
                      tp: int, acts: int, per_unit: list[int]) -> tuple[int, list[int]]:
    """The activations of a tp rank under sequence parallelism, from ``acts`` and ``per_unit`` measured on its
    cut copy without it: each unit keeps 1/tp of what it keeps in ``whole`` (the model uncut, one forward). Inside
    the parallel regions a rank keeps its heads' and columns' share, outside them (norms, residuals, the inputs
    the column-parallel layers gather again in backward) its share of the tokens (Korthikanti et al., 2022,
    eq. 4). What lies outside the units (the embedding, the head and its vocab-parallel loss) stays as cut.
    Measured against the tracker without recomputation: GPT +0.7%, HF Llama +1.3% (tests/test_estimate_tp.py).
    Under recomputation a unit also keeps inputs no rank shards (a Llama layer's rotary tables and mask: 1/tp of
    them was 11% under), so :func:`memsave.estimate` keeps the figure without sequence parallelism there."""
    by_name = dict(whole.named_modules())
    _, full, _, _, _, _, _, _ = activations(whole, [by_name[n] for n in unit_names], prof, batch, device_type)
    shares = [-(-f // tp) for f in full]
    return acts - sum(per_unit) + sum(shares), shares
