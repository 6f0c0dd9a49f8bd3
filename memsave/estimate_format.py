"""The table ``memsave estimate`` prints: one line per estimate (under pp: per pipeline rank)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from memsave.memory.schema import CATEGORIES, format_bytes

if TYPE_CHECKING:
    from memsave.estimator import Estimate

__all__ = ["format_estimates"]


def format_estimates(estimates: Sequence[Estimate]) -> str:
    """One line per estimate (under pp: per pipeline rank): bytes per category at the estimated peak, the model
    state and the peak."""
    rows_of = [(e, s) for e in estimates for s in (e.stages or (e,))]
    cats = [c for c in CATEGORIES if any(s.bytes.get(c) for _, s in rows_of)]
    cuda = any(s.transient for _, s in rows_of)  # the CUDA allocator's peak beside the tensors'
    head = ["profile", "ranks", *cats, "model state", "peak", *(["device peak"] if cuda else [])]
    rows = [[e.profile, f"{s.world_size}" + (f" pp {s.pp_rank}" if s.pp > 1 else ""),
             *(format_bytes(s.bytes.get(c, 0)) for c in cats), format_bytes(s.model_state),
             format_bytes(s.peak_total), *([format_bytes(s.device_peak)] if cuda else [])] for e, s in rows_of]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    if estimates:
        e = estimates[0]
        lines.append(f"{e.model}: {e.num_params:,} parameters; per rank (rank 0: the most rows), at the estimated "
                     "peak; model state as the ZeRO formula counts it (full gradients at stages 0-1)"
                     + ("; device peak: with what the CUDA allocator holds beside the tensors (cuBLAS workspace, "
                        "the loss's logit gradients, the step's temporaries)" if cuda else ""))
        lines += [u for u in dict.fromkeys(e.units for e in estimates if not e.stages) if u]
        lines += list(dict.fromkeys(s.notes[0] for _, s in rows_of if s.pp > 1))  # which stages, what in flight
    return "\n".join(lines)
