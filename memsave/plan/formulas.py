"""The closed forms the planner is built from, each as its paper states it.

- Model states per device under ZeRO (Rajbhandari et al., 2020, section 5 and Figure 1): with ``Psi``
  parameters, ``K`` bytes of optimizer state per parameter (12 for mixed-precision Adam: fp32 master, momentum
  and variance), 2-byte parameters and gradients, over ``N`` data-parallel devices:
  baseline ``(2 + 2 + K) Psi``; P_os ``2 Psi + 2 Psi + K Psi / N``; P_os+g ``2 Psi + (2 + K) Psi / N``;
  P_os+g+p ``(2 + 2 + K) Psi / N``.
- Activation memory per transformer layer (Korthikanti et al., 2022, section 4 and Table 2), in bytes, with
  ``s`` the sequence length, ``b`` the micro-batch, ``h`` the hidden size, ``a`` the heads, ``t`` the
  tensor-parallel degree, 2-byte activations and 1-byte dropout masks:
  attention ``11 s b h + 5 a s^2 b``, MLP ``19 s b h``, the two layer norms ``4 s b h``; in all
  ``s b h (34 + 5 a s / h)``. Tensor parallelism splits ``24 s b h`` of it and the ``5 a s^2 b`` of the attention
  core; sequence parallelism splits the remaining ``10 s b h`` too; selective recomputation drops the attention
  core's ``5 a s^2 b``; full recomputation keeps only the layer's input, ``2 s b h``.
- FLOPs of a GPT step (Narayanan et al., 2021, equation 3): ``72 B s l h^2 (1 + s / (6 h) + V / (12 h l))``
  without recomputation, a forward more (96 for 72 in the layers) with full recomputation.

The per-layer terms are kept apart (:class:`LayerActivations`) so that the planner can swap the paper's
constants for those of the model at hand (no dropout: no masks; 4-byte activations in fp32; a fused attention
kernel: no ``s^2`` term).
"""

from __future__ import annotations

import dataclasses

__all__ = ["LayerActivations", "gpt_step_flops", "layer_activation_bytes", "zero_model_states"]


def zero_model_states(psi: float, n: int, stage: int, k: float = 12, param_bytes: float = 2,
                      grad_bytes: float = 2) -> float:
    """Bytes of model states per device at ZeRO ``stage`` (0: plain data parallelism) over ``n`` devices."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage = {stage!r} is not allowed; expected 0, 1, 2 or 3")
    params = param_bytes * psi / (n if stage >= 3 else 1)
    grads = grad_bytes * psi / (n if stage >= 2 else 1)
    optim = k * psi / (n if stage >= 1 else 1)
    return params + grads + optim


@dataclasses.dataclass(frozen=True)
class LayerActivations:
    """The constants of a layer's saved activations, bytes per ``s b h`` element (``scores``: per ``a s^2 b``).

    The defaults are the paper's (2-byte activations, 1-byte dropout masks, unfused attention): ``split`` is
    what tensor parallelism divides by ``t`` (inside the parallel regions: Q, K and V, the projection's input,
    the MLP's two 4h activations), and ``replicated`` what it does not (the two layer norms' inputs and outputs,
    the two residual dropout masks), which sequence parallelism divides too."""

    split: float = 24.0
    replicated: float = 10.0
    scores: float = 5.0  # softmax output (2), its dropout mask (1) and output (2): per a s^2 b
    layer_input: float = 2.0  # what full recomputation keeps

    @classmethod
    def for_model(cls, elem: int, dropout: bool, fused_attention: bool) -> LayerActivations:
        """The constants for activations of ``elem`` bytes: without dropout its three 1-byte masks and the
        dropped-out scores are not kept; with a fused attention kernel the scores are never materialized."""
        unit = elem / 2  # the paper's constants are for 2-byte activations
        masks = 1.0 if dropout else 0.0
        scores = 0.0 if fused_attention else (4 * unit + masks if dropout else 2 * unit)
        return cls(split=24 * unit, replicated=8 * unit + 2 * masks, scores=scores, layer_input=2 * unit)

    @classmethod
    def for_llama(cls, elem: int, h: int, intermediate: int, kv_dim: int, heads: int, *,
                  selective: bool = False) -> LayerActivations:
        """A Hugging Face Llama-family layer (RMSNorm, rotary, grouped KV heads, SwiGLU) under a flash kernel,
        per token as memsave.estimate measures it (fitted over 9 shapes, 2 bytes at most per token off; checked
        in tests/test_plan_memory.py): split by tp, the Q projection and its rotary copies (``2e h``), the
        SwiGLU's four intermediates (``4e I``; memsave's selective recomputation keeps the two matmul outputs),
        K and V (``2e`` per KV width) and the kernel's fp32 log-sum-exp (4 per head); replicated, the two
        RMSNorms' fp32 copies (8) and the norm outputs and residual inputs (``4e h``; selective: ``3e h``) and the
        rotary cos and sin (``2e`` per head dimension)."""
        head_dim = h // max(heads, 1)
        split = (2 * elem * h + (2 if selective else 4) * elem * intermediate + 2 * elem * kv_dim + 4 * heads) / h
        replicated = (3 * elem if selective else 8 + 4 * elem) + 2 * elem * head_dim / h
        return cls(split=split, replicated=replicated, scores=0.0, layer_input=float(elem))

    @classmethod
    def for_gpt2(cls, elem: int, h: int, intermediate: int, heads: int, *, dropout: bool, math_attention: bool,
                 selective: bool = False) -> LayerActivations:
        """A Hugging Face GPT-2 layer (Conv1D projections, ``gelu_new``, its key/value cache on by default) per
        token as memsave.estimate measures it (fitted over 7 shapes, exact; checked in tests/test_plan_memory.py).
        Fused attention (flash: no dropout, or a CUDA device): split by tp, the qkv output, the cache's K and V
        copies and the attention output (``6e h``), the kernel's fp32 log-sum-exp (4 per head) and gelu_new's five
        ``I``-wide intermediates (``5e I``; selective: the matmul output ``e I``, and no log-sum-exp with dropout);
        replicated, the two residual inputs and the two norm outputs (``4e h``), each norm's fp32 mean and rstd
        (16), the two residual dropout masks in the compute dtype (``2e h``). ``math_attention`` (dropout on a
        CPU: sdpa's math path, in fp32 whatever the compute dtype): the scaled Q, K and V in fp32 and the cache's
        copies beside them (16 per ``h``) for the fused kernel's, and three fp32 ``a s^2`` matrices (softmax,
        dropout mask, dropped scores; selective keeps one). Full recomputation keeps the layer's input and the
        cache's K and V (``3e h``)."""
        e = float(elem)
        ffn = (1 if selective else 5) * e * intermediate / h
        lse = 4.0 * heads / h
        if math_attention:
            if selective:
                return cls(split=5 * e + 4 + ffn, replicated=3 * e, scores=4.0, layer_input=3 * e)
            return cls(split=e + 16 + ffn, replicated=6 * e + 16 / h, scores=12.0, layer_input=3 * e)
        if selective:
            return cls(split=5 * e + (0.0 if dropout else e + lse) + ffn, replicated=3 * e, scores=0.0,
                       layer_input=3 * e)
        return cls(split=6 * e + lse + ffn, replicated=(6 * e if dropout else 4 * e) + 16 / h, scores=0.0,
                   layer_input=3 * e)


def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, *, sequence: bool = False,
                           recompute: str = "none", consts: LayerActivations = LayerActivations()) -> float:
    """Activation bytes one transformer layer keeps for its backward on one tensor-parallel rank
    (Korthikanti et al., 2022, Table 2 with ``consts`` the paper's): ``recompute`` is ``"none"``,
    ``"selective"`` (the attention core recomputed) or ``"full"`` (only the layer's input kept; under
    sequence parallelism its 1/t slice)."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute = {recompute!r} is not allowed; expected none, selective or full")
    if recompute == "full":
        return consts.layer_input * s * b * h / (t if sequence else 1)
    sbh = s * b * h
    total = sbh * (consts.split / t + consts.replicated / (t if sequence else 1))
    if recompute == "none":
        total += consts.scores * a * s * s * b / t
    return total


def gpt_step_flops(batch: int, s: int, layers: int, h: int, vocab: int, *, recompute: str = "none",
                   rebuilds: int = 1) -> float:
    """Floating-point operations of one training step of a GPT over ``batch`` sequences of ``s`` tokens
    (Narayanan et al., 2021, equation 3): the layers' matrix multiplies and attention (forward 24 B s h^2 and
    4 B s^2 h per layer, backward twice that), the logit layer's 6 B s h V. Full recomputation runs the layers'
    forward again; selective recomputation only the attention core (4 B s^2 h per layer). ``rebuilds``: how many
    times the backward recomputes (2 under a zero-bubble schedule: its input- and its weight-gradient pass)."""
    layer_fwd = 24 * batch * s * h * h * (1 + s / (6 * h))
    factor = {"none": 3, "selective": 3, "full": 3 + rebuilds}[recompute]
    extra = rebuilds * 4 * batch * s * s * h if recompute == "selective" else 0
    return layers * (factor * layer_fwd + extra) + 6 * batch * s * h * vocab
