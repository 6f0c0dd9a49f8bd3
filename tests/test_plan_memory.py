"""The planner's closed-form memory model against memsave.estimate on the model itself, candidate by candidate.

The closed forms price every candidate of a model given as a ``config.json`` (a 70B plan prices 1,600 of them);
the estimator is validated against the tracker (tests/test_memory_tracker.py, tests/test_estimate_pp.py). Here
the two agree on a grid of the planner's own candidates: ZeRO-0..3 with gradient accumulation, every
recomputation, tensor and sequence parallelism, every pipeline schedule with ZeRO, offload to disk.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch

from memsave.memory.schema import OFF_DEVICE
from memsave.models import GPT, gpt_config
from memsave.plan import Candidate, exact_peak, from_gpt, from_hf_config, from_module, price
from memsave.plan.memory import flights
from tests.test_plan import CPU

GPU = dataclasses.replace(CPU, name="test gpu", device="cuda", flops={"bf16": 1e12, "fp32": 1e12})

# Under full recomputation the closed forms hold a unit's rebuilt activations during its backward: a real peak
# on a device, which memsave.estimate (sampled at unit boundaries, as the tracker is) does not see.
# Offloaded to disk, the closed forms take the chunk window at its 1 MiB cap (4 on the device with the prefetch);
# this tiny model's chunks are smaller.
UNDER, OVER, OVER_FULL, OVER_DISK = 0.02, 0.02, 0.12, 0.15


def _grid() -> list[dict[str, Any]]:
    grid = [dict(dp=2, stage=s, recompute=r, micro_batches=m) for s in (0, 1, 2, 3)
            for r in ("none", "selective", "full") for m in (1, 4)]
    grid += [dict(dp=2, stage=s, recompute="none", micro_batches=2, offload=o)
             for s, o in ((2, "optimizer:disk"), (3, "optimizer+params:disk"))]
    grid += [dict(tp=2, stage=0, recompute=r, micro_batches=1) for r in ("none", "selective", "full")]
    grid += [dict(dp=2, pp=2, stage=s, recompute=r, micro_batches=4, schedule=sched, virtual=v)
             for sched, v in (("1f1b", 1), ("gpipe", 1), ("zero-bubble", 1), ("interleaved", 2))
             for s in (0, 1, 3) for r in ("none", "full")]
    return grid


@functools.cache
def _gpt() -> tuple[torch.nn.Module, Any]:
    cfg = gpt_config("small", dropout=0.0)
    with torch.device("meta"):
        meta = GPT(cfg)
    return meta, from_gpt(cfg)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_closed_forms_equal_the_estimator(precision: str) -> None:
    meta, spec = _gpt()
    seq, rows = 64, 2
    ids = torch.zeros(rows, seq, dtype=torch.long, device="meta")
    errors: list[str] = []
    # bf16 adds the step's fp32 copies and the masters: every stage with accumulation, and the schedules
    grid = _grid() if precision == "fp32" else [g for g in _grid() if g.get("recompute") == "none"]
    for g in grid:
        c = Candidate(**{"dp": 1, "tp": 1, "pp": 1, "offload": "none", **g}, precision=precision,
                      micro_batch=rows)
        exact = exact_peak(meta, c, {"input_ids": ids, "labels": ids}, device="cpu")
        want = sum(v for k, v in exact.items() if k not in OFF_DEVICE)
        p = price(spec, c, CPU, seq)
        err = p.peak / want - 1
        errors.append(f"{c.label()}: {err:+.1%}")
        over = OVER_FULL if c.recompute == "full" else OVER_DISK if c.offload != "none" else OVER
        assert -UNDER <= err <= over, errors[-1]
        assert p.disk == pytest.approx(exact.get("offload_disk", 0), rel=0.02), c.label()


def test_activations_measured_once_per_plan() -> None:
    """Inside activations_cached (as the planner's exact estimates run), a candidate that differs from an earlier
    one in any field the activations depend on is measured anew, and one that differs only in the ZeRO stage, the
    offload, the schedule or the micro-batch count reuses the measurement: every figure equals an estimate made
    without the cache."""
    from memsave.estimate_activations import activations_cached

    meta, _ = _gpt()
    batches = {rows: {"input_ids": torch.zeros(rows, 64, dtype=torch.long, device="meta"),
                      "labels": torch.zeros(rows, 64, dtype=torch.long, device="meta")} for rows in (1, 2)}
    grid = [dict(dp=2, stage=0, recompute="none"), dict(dp=2, stage=3, recompute="none", micro_batches=4),
            dict(dp=2, stage=2, recompute="full"), dict(dp=2, stage=2, recompute="selective"),
            dict(dp=2, stage=1, recompute="full", micro_batch=1), dict(dp=2, stage=1, recompute="full",
                                                                      precision="bf16"),
            dict(tp=2, sequence=True, recompute="none"), dict(tp=2, sequence=True, recompute="full"),
            dict(pp=2, schedule="1f1b", recompute="none", micro_batches=4),
            dict(pp=2, schedule="zero-bubble", recompute="none", micro_batches=4, stage=1, dp=2),
            dict(pp=2, schedule="interleaved", virtual=2, recompute="none", micro_batches=4),
            dict(pp=2, schedule="1f1b", recompute="full", micro_batches=4)]
    store: dict[Any, Any] = {}
    for g in grid:
        c = Candidate(**{"dp": 1, "tp": 1, "pp": 1, "stage": 0, "offload": "none", "precision": "fp32",
                         "micro_batch": 2, "micro_batches": 1, **g})
        batch = batches[c.micro_batch]
        with activations_cached(store):
            cached = exact_peak(meta, c, batch, device="cpu")
        assert cached == exact_peak(meta, c, batch, device="cpu"), c.label()
    # measured anew: all but the ZeRO-3 micro-batch variant and the zero-bubble one (1F1B's split); tp measures
    # the cut model and, for sequence parallelism, the uncut one
    assert len(store) == len(grid) - 2 + 1, [(k[0], k[4], k[6]) for k in store]


def test_flights_before_and_after_the_first_backward() -> None:
    """The micro-batches a pipeline rank holds at once: 1F1B's p - rank, again after the first backward when
    m > p; GPipe's m, all before it; gradient accumulation without a pipeline: one, with the gradients after."""
    assert flights("1f1b", 4, 8) == ((4.0, 4.0), (3.0, 3.0), (2.0, 2.0), (1.0, 1.0))
    assert flights("gpipe", 2, 4) == ((4.0, 0.0), (4.0, 0.0))
    assert flights("1f1b", 2, 2) == ((2.0, 0.0), (1.0, 1.0))  # rank 0's forwards all come before its backwards
    assert flights("interleaved", 2, 4, 2)[0] == (2.5, 2.5)  # Megatron's p (1 + (p - 1) / (p v))
    assert flights("1f1b", 1, 4) == ((1.0, 1.0),) and flights("1f1b", 1, 1) == ((1.0, 0.0),)


def _llama(tied: bool) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A Llama-family layer as Hugging Face writes it (RMSNorm in fp32, rotary, 4 query heads over 2 KV heads,
    SwiGLU at 2.75 h) with its default attention (sdpa), on the meta device. The batch asks for a cache: without
    one the forward reads the positions' values (a packed-sequence check), which meta tensors do not have."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, tie_word_embeddings=tied)
    with torch.device("meta"):
        meta = LlamaForCausalLM(config)
    ids = torch.zeros(2, 128, dtype=torch.long, device="meta")
    return meta, {"input_ids": ids, "labels": ids, "use_cache": True}


@pytest.mark.parametrize("tied", [False, True])
def test_closed_forms_equal_the_estimator_on_hf_llama(tied: bool) -> None:
    """The Llama family's own layer constants (LayerActivations.for_llama) on a CUDA device's flash kernel: every
    ZeRO stage with and without accumulation, selective recomputation, host offload, tensor parallelism, and
    each schedule."""
    meta, batch = _llama(tied)
    spec = from_module(meta)
    assert spec.family == "llama" and spec.intermediate == 352 and spec.kv_heads == 2
    # the same spec from the config alone (memsave plan --model config.json)
    same = from_hf_config(meta.config.to_dict())
    assert (same.layer_params, same.embed_params + same.head_params + same.final_params, same.intermediate) == (
        spec.layer_params, spec.embed_params + spec.head_params, spec.intermediate)
    grid = [dict(dp=2, stage=s, recompute=r, micro_batches=m) for s in (0, 1, 2, 3) for r in ("none", "selective")
            for m in (1, 4) if not tied or (r, m) == ("none", 4)]  # tied: the head's copy on the last stage
    grid += [dict(dp=2, stage=3, recompute="none", micro_batches=1, offload=o)
             for o in ("optimizer", "optimizer+params")]
    # the vocab-parallel head's logits reach the model's own loss as in training (it failed on the cut shapes)
    grid += [dict(tp=2, stage=s, recompute=r, micro_batches=1) for s in (0, 1) for r in ("none", "selective")]
    grid += [dict(dp=2, pp=2, stage=s, recompute="none", micro_batches=4, schedule=sched, virtual=v)
             for sched, v in (("1f1b", 1), ("gpipe", 1), ("zero-bubble", 1), ("interleaved", 2)) for s in (0, 3)]
    # fp32: grouped queries run the math kernel on CUDA, which keeps its scores
    grid += [dict(dp=2, stage=s, recompute=r, micro_batches=1, precision="fp32") for s in (0, 3)
             for r in ("none", "selective")]
    for g in grid:
        c = Candidate(**{"dp": 1, "tp": 1, "pp": 1, "offload": "none", "precision": "bf16", **g}, micro_batch=2)
        exact = exact_peak(meta, c, batch, device="cuda")
        # the tensors, then what the CUDA allocator holds beside them ([Note: the allocator's peak])
        want = sum(v for k, v in exact.items() if k not in (*OFF_DEVICE, "transient"))
        p = price(spec, c, GPU, 128)
        transient = p.device.get("transient", 0)
        err = (p.peak - transient) / want - 1
        assert -UNDER <= err <= OVER, f"{c.label()}: {err:+.1%}"
        assert abs(transient - exact["transient"]) <= 0.02 * want, (c.label(), transient, exact["transient"], want)
        assert p.host == pytest.approx(exact.get("offload_host", 0), rel=0.02), c.label()


def _sdpa_saved(device: str, wrap: bool, heads_kv: int, dtype: torch.dtype, **kw: Any) -> int:
    """Bytes one ``F.scaled_dot_product_attention`` call keeps for backward beyond its q, k and v, on ``device``
    (``wrap``: under memsave.estimate's kernel choice for a CPU target)."""
    from memsave.estimate_activations import _fused_attention_on_meta

    q, k, v = (torch.zeros(2, h, 64, 16, dtype=dtype, device=device, requires_grad=True) for h in (4, heads_kv,
                                                                                                    heads_kv))
    inputs = {t.untyped_storage()._cdata for t in (q, k, v)}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage()._cdata not in inputs:
            kept[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    if isinstance(kw.get("attn_mask"), torch.Tensor):
        kw["attn_mask"] = kw["attn_mask"].to(device)
    with (_fused_attention_on_meta("cpu") if wrap else torch.enable_grad()), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=heads_kv < 4, **kw)
    return sum(kept.values())


def test_grouped_query_flash_attention_keeps_no_scores() -> None:
    """On a CUDA device memsave.estimate runs grouped-query sdpa calls in bf16 as the flash kernel does (no
    attention matrix kept): a Llama layer's saved bytes grow with the sequence, not with its square. In fp32 no
    fused kernel takes grouped queries (flash needs 16-bit inputs, the memory-efficient kernel no GQA; measured on
    an H100: the estimate was 17% under the tracker), so the math kernel's scores are kept. On a CPU (torch's
    use_flash_attention_cpp) flash takes grouped queries in any dtype and masks (keeping the mask, a boolean one
    converted to the query's dtype), and dropout runs the math path: each call's kept bytes equal a real CPU
    call's (the estimate of a Hugging Face Llama with grouped KV heads was 2.3x the tracker at 1,024 tokens, and
    GPT-2's with dropout 0.1 half of it)."""
    import memsave

    meta, _ = _llama(False)
    per_token: dict[tuple[str, str], list[float]] = {(d, c): [] for d in ("cuda", "cpu") for c in ("bf16", "fp32")}
    for device, compute in per_token:
        prof = memsave.load_profile("ddp", (f'precision.compute="{compute}"',))
        for seq in (64, 256):
            ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
            est = memsave.estimate(meta, prof, batch={"input_ids": ids, "use_cache": True}, device=device)
            per_token[device, compute].append(est.activations / seq)
    for key in (("cuda", "bf16"), ("cpu", "bf16"), ("cpu", "fp32")):
        assert per_token[key][1] == pytest.approx(per_token[key][0], rel=1e-3), key
    assert per_token["cuda", "fp32"][1] > 1.1 * per_token["cuda", "fp32"][0]
    mask = torch.ones(64, 64, dtype=torch.bool).tril()
    for kv, kw in ((2, dict(is_causal=True)), (2, dict(attn_mask=mask[None, None])), (4, dict(attn_mask=mask)),
                   (4, dict(dropout_p=0.1, is_causal=True)), (2, dict(dropout_p=0.1))):
        for dtype in (torch.float32, torch.bfloat16):
            real = _sdpa_saved("cpu", False, kv, dtype, **kw)
            assert _sdpa_saved("meta", True, kv, dtype, **kw) == real, (kv, kw, dtype)
            assert (real > 3 * 2 * 4 * 64 * 64) == ("dropout_p" in kw), (kv, kw, dtype)  # the scores, or none


def test_closed_forms_equal_the_estimator_on_hf_gpt2() -> None:
    """Hugging Face GPT-2 from its config.json gets its own layer constants (LayerActivations.for_gpt2: gelu_new's
    intermediates, the key/value cache's copies): with dropout on a CPU the math kernel's three fp32 attention
    matrices (sdpa's flash kernel takes no dropout there; the plan chose a candidate at 17.3 MiB whose run peaked
    at 49.3), on CUDA the flash kernel's. Memory's own reference GPT keeps its constants (the tests above)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    seq, rows = 64, 2
    ids = torch.zeros(rows, seq, dtype=torch.long, device="meta")
    for pdrop, cases in ((0.1, (("cpu", "fp32", "none"), ("cpu", "bf16", "selective"), ("cuda", "bf16", "none"))),
                         (0.0, (("cpu", "fp32", "none"), ("cuda", "fp32", "selective")))):
        config = GPT2Config(n_embd=96, n_layer=2, n_head=6, vocab_size=128, n_positions=seq, bos_token_id=0,
                            eos_token_id=0, resid_pdrop=pdrop, embd_pdrop=pdrop, attn_pdrop=pdrop)
        spec = from_hf_config(config.to_dict())
        assert (spec.family, spec.intermediate, spec.dropout) == ("gpt2", 384, pdrop > 0)
        with torch.device("meta"):
            meta = GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
        for device, precision, recompute in cases:
            c = Candidate(dp=1, tp=1, pp=1, stage=0, precision=precision, recompute=recompute, offload="none",
                          micro_batch=rows, micro_batches=1)
            exact = exact_peak(meta, c, {"input_ids": ids, "labels": ids, "use_cache": True}, device=device)
            want = sum(v for k, v in exact.items() if k not in (*OFF_DEVICE, "transient"))
            p = price(spec, c, GPU if device == "cuda" else dataclasses.replace(CPU, flops=GPU.flops), seq)
            err = (p.peak - p.device.get("transient", 0)) / want - 1
            assert -UNDER <= err <= OVER, f"{pdrop} {device} {c.label()}: {err:+.1%}"
    # the model itself (memsave plan --model MODULE:FUNCTION): its Conv1D layers read as the config says (it was
    # refused, "no nn.Linear"), the parameters counted as the config counts them
    module = from_module(meta)
    assert (module.hidden, module.layers, module.layer_params, module.layer_split) == (
        spec.hidden, spec.layers, spec.layer_params, 12 * 96 * 96)


def test_the_cuda_allocators_transients_are_added_where_they_happen(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: the allocator's peak] (memsave/estimate_cuda.py): on a CUDA target the estimate adds the cuBLAS
    workspace throughout and the loss's logit gradients after forward (4 bytes per logit, 2 more under bf16);
    on a CPU target nothing. The workspace follows CUBLAS_WORKSPACE_CONFIG when it is set."""
    import memsave
    from memsave.models import GPT, gpt_config

    with torch.device("meta"):
        meta = GPT(gpt_config("small", vocab_size=8192, block_size=256, dropout=0.0))
    rows, seq = 4, 256
    ids = torch.zeros(rows, seq, dtype=torch.long, device="meta")
    batch = {"input_ids": ids, "labels": ids}
    logits = rows * seq * 8192  # the head's gradients dwarf the step's temporary on this model
    assert memsave.estimate(meta, "ddp", batch=batch, device="cpu").transient == 0
    for compute, per_logit in (("fp32", 4), ("bf16", 6)):
        prof = memsave.load_profile("ddp", (f'precision.compute="{compute}"',))
        est = memsave.estimate(meta, prof, batch=batch, device="cuda")
        # at stage 0 the estimate's own peak is the end of forward: the head's transient comes on top of it
        assert est.transient == 32 * 2**20 + per_logit * logits, compute
        assert est.device_peak == est.peak_total + est.transient
        assert "CUDA allocator" in est.notes[-1]
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2")
    assert memsave.estimate(meta, "ddp", batch=batch, device="cuda").transient == 8 * 2**20 + 4 * logits


def test_closed_forms_hold_the_logits_in_the_compute_dtype() -> None:
    """Our GPT returns its logits in the compute dtype (the loss casts its own fp32 copy): a large vocabulary,
    where the logits are most of the activations, on both devices. (The closed forms took them as fp32: +6.5%
    under bf16 at a vocabulary of 8,192, measured against the allocator on an H100.)"""
    cfg = gpt_config("small", vocab_size=8192, n_layer=2, dropout=0.0)
    with torch.device("meta"):
        meta = GPT(cfg)
    ids = torch.zeros(4, 128, dtype=torch.long, device="meta")
    for device, hw in (("cpu", CPU), ("cuda", GPU)):
        for precision in ("fp32", "bf16"):
            c = Candidate(dp=1, tp=1, pp=1, stage=0, precision=precision, recompute="none", offload="none",
                          micro_batch=4, micro_batches=1)
            exact = exact_peak(meta, c, {"input_ids": ids, "labels": ids}, device=device)
            want = sum(v for k, v in exact.items() if k not in (*OFF_DEVICE, "transient"))
            p = price(from_gpt(cfg), c, hw, 128)
            err = (p.peak - p.device.get("transient", 0)) / want - 1
            assert -UNDER <= err <= OVER, f"{device} {precision}: {err:+.1%}"
