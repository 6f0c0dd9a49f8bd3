"""A planned configuration as a memsave profile (and its TOML), and the exact check of its memory.

:func:`to_profile` gives the :class:`memsave.Profile` of a :class:`Candidate`; :func:`to_toml` its text for
``memsave plan --write``, with the batch split the profile cannot hold (rows per micro-batch, micro-batches per
step) as comments. :func:`exact_peak` runs :func:`memsave.estimate` on the model itself (built on the meta
device) for a candidate: the estimator validated against the tracker per category, where the planner's own
figures are closed forms.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from memsave.config import Profile
from memsave.models import GPT_SIZES
from memsave.plan.cost import Candidate

__all__ = ["exact_peak", "to_profile", "to_toml"]


def _sections(c: Candidate, offload_path: str | Path | None = None) -> dict[str, Any]:
    tier = "disk" if c.offload.endswith(":disk") else "cpu"
    offload: dict[str, Any] = {}
    if c.offload.startswith("optimizer"):
        offload["optimizer"] = tier
    if c.offload.startswith("optimizer+params"):
        offload["params"] = tier
    if tier == "disk" and offload:
        offload["path"] = str(offload_path or "memsave-offload")  # a folder under the working directory
    precision: dict[str, Any] = {"compute": c.precision}
    if c.precision == "fp16":
        precision["loss_scale"] = "dynamic"
    parallel: dict[str, Any] = {"tp": c.tp, "pp": c.pp}
    if c.pp > 1:
        parallel.update(schedule=c.schedule, virtual=c.virtual)
    if c.tp > 1:
        parallel["sequence"] = c.sequence
    return {"parallel": parallel, "zero": {"stage": c.stage}, "precision": precision, "offload": offload,
            "recompute": {"policy": c.recompute}, "optimizer": {"name": c.optimizer}}


def to_profile(c: Candidate, *, name: str = "planned", offload_path: str | Path | None = None) -> Profile:
    data = _sections(c, offload_path)
    data["description"] = f"memsave plan: {c.label()}"
    return Profile.from_dict(data, name=name)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)


def to_toml(c: Candidate, *, why: str = "", offload_path: str | Path | None = None, seq: int | None = None,
            model: str | None = None, path: str | Path | None = None) -> str:
    """The profile's TOML. ``seq``, ``model`` (``memsave plan --model``) and ``path`` (where it is written) complete
    the comment's ``memsave demo`` command (the reference GPT only: its size, sequence length and processes,
    which the plan assumed)."""
    lines = [f"# written by memsave plan: {c.label()}"]
    lines += [f"# {line}" for line in why.splitlines() if line]
    size = model.split(":", 1)[1] if model and model.startswith("gpt:") else None
    demo = (f"memsave demo --profile {path or 'PROFILE.toml'} --size {size} --nproc {c.dp * c.tp * c.pp} "
            + (f"--seq-len {seq} " if seq else "") + f"--batch-size {c.micro_batch} --micro-batches {c.micro_batches}")
    lines += [f"# batch: {c.micro_batch} rows per micro-batch on each of {c.dp} data-parallel ranks, "
              f"{c.micro_batches} micro-batches per step" + (f", {seq} tokens per row" if seq else "")
              + (f" ({demo})" if size in GPT_SIZES else ""),
              f'description = {_value("memsave plan: " + c.label())}']
    for section, keys in _sections(c, offload_path).items():
        if keys:
            lines.append(f"\n[{section}]")
            lines += [f"{k} = {_value(v)}" for k, v in keys.items()]
    return "\n".join(lines) + "\n"


def exact_peak(model: torch.nn.Module, c: Candidate, batch: Any, *, device: str) -> dict[str, int]:
    """Bytes per category on the busiest rank from :func:`memsave.estimate` (under pp: the busiest stage's rank
    under the candidate's schedule)."""
    from memsave.estimator import estimate  # layer 5

    est = estimate(model, to_profile(c), world_size=c.dp * c.tp * c.pp, batch=batch, device=device,
                   micro_batches=c.micro_batches)
    # on CUDA: what the allocator holds beyond the tensors counted, as a term of its own ([Note: the allocator's
    # peak] in memsave/estimate_cuda.py)
    return dict(est.bytes, transient=est.transient) if est.transient else dict(est.bytes)
