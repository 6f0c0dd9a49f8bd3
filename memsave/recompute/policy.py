"""Recompute policies: the ``[recompute] policy`` string parsed into a small frozen dataclass, and the op-level
policy that selective recomputation hands to ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.

[Note: random ops are recomputed] Selective recomputation replays a unit's forward in backward, but returns the
*cached* output of every op it saved instead of running it again. A random op (dropout, attention with
``dropout_p > 0``) that were saved would therefore draw no random numbers during the replay, and every random
op after it in the unit would draw different numbers than in the forward: other dropout masks, wrong
gradients. So an op tagged ``nondeterministic_seeded`` is saved only when it draws nothing (attention with
``dropout_p == 0``); otherwise it is recomputed, from the RNG state that ``preserve_rng_state=True`` restores,
and draws exactly the numbers it drew in forward. On CPU, attention with dropout decomposes (math path) into
``bmm``s, which are saved, and a ``bernoulli_``, which is recomputed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.utils.checkpoint import CheckpointPolicy

from memsave.config import RecomputeConfig
from memsave.recompute.measure import note_saved

__all__ = ["DEFAULT_SAVE_OPS", "RecomputePolicy", "SelectivePolicy", "parse_policy", "parse_size"]


def _ops(*names: str) -> frozenset[torch._ops.OpOverload]:
    """The ``default`` overloads of the named aten ops that exist in this torch build."""
    found = []
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None and "default" in packet.overloads():
            found.append(packet.default)
    return frozenset(found)


# What selective recomputation saves inside a unit: the ops whose outputs are expensive to recompute (their
# FLOPs grow with a hidden size or the sequence length) and cheap to keep relative to that cost. Everything
# else (norms, activations, residual adds, dropout, views) is recomputed. Composite ops decompose before they
# reach the dispatcher: ``linear`` and ``matmul`` arrive as ``addmm`` / ``mm`` / ``bmm``, and
# ``_scaled_dot_product_attention_math`` (listed for completeness) as ``bmm`` + softmax. After torchtitan's
# ``_op_sac_save_list`` (torchtitan/models/llama3/parallelize.py). Override with ``apply(..., save_ops=...)``.
DEFAULT_SAVE_OPS: frozenset[torch._ops.OpOverload] = _ops(
    # matrix multiplies (every nn.Linear / Conv1D of a transformer lands on one of these)
    "mm", "addmm", "_addmm_activation", "bmm", "baddbmm",
    # fused attention kernels, per backend, as present in torch 2.11-2.13
    "_scaled_dot_product_flash_attention",  # CUDA flash
    "_scaled_dot_product_efficient_attention",  # CUDA memory-efficient
    "_scaled_dot_product_cudnn_attention",  # CUDA cuDNN
    "_scaled_dot_product_flash_attention_for_cpu",  # CPU flash (no dropout)
    "_scaled_dot_product_fused_attention_overrideable",  # out-of-tree backends
    "_scaled_dot_product_attention_math",  # composite: reaches dispatch as bmm/softmax (see above)
    "_scaled_dot_product_attention_math_for_mps",
)

_SIZE = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(B|KiB|MiB|GiB|TiB)$")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_size(text: str) -> int:
    """``"1.5GiB"`` -> bytes (``B``, ``KiB``, ``MiB``, ``GiB``, ``TiB``; binary units)."""
    m = _SIZE.match(text.strip())
    if not m:
        raise ValueError(f"size {text!r} is not a number followed by B, KiB, MiB, GiB or TiB (e.g. \"2GiB\")")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


@dataclass(frozen=True, kw_only=True)
class RecomputePolicy:
    """A parsed ``[recompute] policy`` (Chen et al., 2016, "Training Deep Nets with Sublinear Memory Cost").

    kind: "none" (keep every activation), "full" (recompute every unit), "every" (recompute units 0, K, 2K, ...
        of the given order), "selective" (inside every unit, keep the outputs of ``save_ops`` and recompute the
        rest) or "budget" (recompute whole units, largest first, until the saved activations fit).
    every: K for "every".
    budget_bytes: the activation budget for "budget", in bytes.
    text: the policy as the user wrote it (for messages).
    """

    kind: Literal["none", "full", "every", "selective", "budget"]
    every: int = 0
    budget_bytes: int = 0
    text: str = field(default="", compare=False)

    def __str__(self) -> str:
        if self.text:
            return self.text
        if self.kind == "every":
            return f"every:{self.every}"
        if self.kind == "budget":
            return f"budget:{self.budget_bytes}B"
        return self.kind


def parse_policy(policy: str | RecomputeConfig | RecomputePolicy) -> RecomputePolicy:
    """A policy string (``"none"``, ``"full"``, ``"every:K"``, ``"selective"``, ``"budget:<size>"``), a
    :class:`~memsave.config.RecomputeConfig` or an already parsed :class:`RecomputePolicy`."""
    if isinstance(policy, RecomputePolicy):
        return policy
    text = policy.policy if isinstance(policy, RecomputeConfig) else RecomputeConfig(policy=policy).policy
    kind, _, arg = text.partition(":")
    if kind == "every":
        return RecomputePolicy(kind="every", every=int(arg), text=text)
    if kind == "budget":
        return RecomputePolicy(kind="budget", budget_bytes=parse_size(arg), text=text)
    assert kind in ("none", "full", "selective"), text  # RecomputeConfig validated the string
    return RecomputePolicy(kind=kind, text=text)  # type: ignore[arg-type]


def _draws_random_numbers(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this call of a ``nondeterministic_seeded`` op consumes RNG ([Note: random ops are recomputed])."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    names = [a.name for a in func._schema.arguments]
    if "dropout_p" not in names:
        return True  # bernoulli_, rand, native_dropout, ...: random by nature
    i = names.index("dropout_p")
    p = kwargs.get("dropout_p", args[i] if i < len(args) else 0.0)
    return bool(p)


class SelectivePolicy:
    """The per-op policy of selective recomputation: ``MUST_SAVE`` for ``save_ops`` (unless the call draws
    random numbers, see [Note: random ops are recomputed]), ``PREFER_RECOMPUTE`` for everything else.

    A plain class (not a closure) so that a model holding it can be deep-copied and pickled.
    """

    def __init__(self, save_ops: Iterable[Any] = DEFAULT_SAVE_OPS) -> None:
        ops = frozenset(save_ops)
        for op in ops:
            if not isinstance(op, torch._ops.OpOverload):
                hint = " (pick an overload, e.g. torch.ops.aten.mm.default)" if isinstance(
                    op, torch._ops.OpOverloadPacket) else ""
                raise ValueError(f"save_ops holds {op!r} of type {type(op).__name__}, not a torch OpOverload{hint}")
        self.save_ops = ops

    def saves(self, func: Any, args: tuple, kwargs: dict) -> bool:
        return func in self.save_ops and not _draws_random_numbers(func, args, kwargs)

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if self.saves(func, args, kwargs):
            if not ctx.is_recompute:  # kept in the checkpoint's cache: tell a measurement in progress
                note_saved(getattr(ctx, "op_output", None))
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
