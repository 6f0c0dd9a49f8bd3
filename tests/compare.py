"""Comparisons against a reference run, with the tolerance each world size allows."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def assert_same(a: torch.Tensor | None, b: torch.Tensor | None, what: str, world: int, rtol: float = 1e-6) -> None:
    """Bitwise equal up to 2 ranks (a sum of two is commutative). With 4, gloo's ring reduces each chunk of the
    flat buffer starting at a different rank, so an element's summation order depends on the buffer layout,
    which differs between engines: ulp-level differences, which AdamW's g / sqrt(v) then magnifies for the
    tiniest gradients. So with 4 ranks each tensor must agree in norm: ||a - b|| <= rtol * ||b|| (1e-6 for
    first-step gradients and losses, 1e-5 for anything after an optimizer step)."""
    if a is None or b is None:
        assert a is None and b is None, f"{what}: one is None ({a is None}, {b is None})"
        return
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    if world <= 2:
        assert torch.equal(a, b), f"{what}: not bitwise equal, max diff {(a - b).abs().max().item():.3g}"
    else:
        assert_close_norm(a, b, what, rtol)


def assert_close_norm(a: torch.Tensor, b: torch.Tensor, what: str, rtol: float) -> None:
    """``||a - b|| <= rtol * ||b||``: agreement of a whole tensor, robust to single near-zero elements."""
    err, scale = (a.double() - b.double()).norm().item(), b.double().norm().item()
    assert err <= rtol * scale + 1e-12, f"{what}: relative error {err / max(scale, 1e-30):.3g} > {rtol}"


def rel(a: Any, b: Any) -> float:
    """max |a - b| / max |b| (0 when both are 0)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, f"shape {a.shape} != {b.shape}"
    scale = np.abs(b).max() if b.size else 0.0
    err = np.abs(a - b).max() if b.size else 0.0
    return float(err / scale) if scale else float(err)
