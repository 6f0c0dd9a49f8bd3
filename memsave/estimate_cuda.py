"""What the CUDA caching allocator holds beyond the tensors :func:`memsave.estimate` counts.

[Note: the allocator's peak] The estimate (like the memory tracker) counts the tensors held at the boundaries of
forward, backward and the step. On a CUDA device the allocator also holds, measured on an H100 (torch 2.11;
tests/test_estimate_gpu.py, ``memsave bench --plan``), things that live inside one op or one phase:

- the cuBLAS workspace, allocated by the first matmul and kept (32 MiB on sm90: torch's default
  ``CUBLAS_WORKSPACE_CONFIG=:4096:8``; 8 MiB + 128 KiB before Hopper; the variable, when set, says);
- the loss's backward, the largest transient of a step in every case measured: the gradient of the fp32
  logits the loss computes on (4 bytes per logit) and, under bf16/fp16, of the compute-dtype logits too;
- the optimizer step: torch's foreach AdamW (the default on CUDA) makes an fp32 temporary of every stepped
  element (``_foreach_sqrt`` of the second moment), 4 bytes per element of the shard stepped on the device.

Without them the estimate was 6-43% under ``max_memory_allocated`` there, and a plan within its 5% headroom
would not fit. Each is added where it happens: the head's backward to the end of forward, the foreach temporary
to the step, the workspace throughout. Not modelled: a unit's backward transients (its recomputed activations
under recomputation, the gradients of its largest intermediates): measured below the head's in every case.
"""

from __future__ import annotations

import os

import torch

__all__ = ["FOREACH_OPTIMIZERS", "allocator_extra", "measured_workspace", "workspace_bytes"]

FOREACH_OPTIMIZERS = ("adamw", "adam")  # the step's fp32 temporary is measured for these


def workspace_bytes() -> int:
    """The cuBLAS workspace torch keeps on each device: ``CUBLAS_WORKSPACE_CONFIG`` when set (``:KiB:count``
    pairs), else torch's default for the visible GPU, else (estimating from a machine without one) Hopper's."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    sizes = [int(v) for v in config.split(":")[1:] if v.isdigit()]
    if sizes and len(sizes) % 2 == 0:
        return sum(sizes[i] * sizes[i + 1] for i in range(0, len(sizes), 2)) * 1024
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9:
        return (4096 * 2 + 16 * 8) * 1024
    return 4096 * 8 * 1024


def measured_workspace() -> int:
    """What a matmul leaves allocated on this process's CUDA device besides its output: the cuBLAS workspace the
    first one allocates (0 once it is there). Measurements that start above an allocation baseline taken after
    it (one per configuration in a process) add it back."""
    x = torch.ones(64, 64, device="cuda")
    before = torch.cuda.memory_allocated()
    y = x @ x
    return torch.cuda.memory_allocated() - before - y.nbytes


def allocator_extra(*, forward_end: int, step: int, peak: int, logits: int, compute: str, optimizer_state: float,
                    optimizer: str) -> tuple[int, str]:
    """Bytes the allocator holds at its peak beyond ``peak`` (the estimate's), and a note. ``forward_end`` and
    ``step``: the estimate's totals at the end of forward and in the step; ``logits``: elements of the largest
    floating output (the logits); ``optimizer_state``: its bytes on the device (Adam's 8 per stepped element)."""
    head = logits * (4 + (0 if compute == "fp32" else 2))  # fp32 logits' gradient, and bf16/fp16 ones'
    temporary = 4 * (int(optimizer_state) // 8) if optimizer in FOREACH_OPTIMIZERS else 0
    workspace = workspace_bytes()
    top = max(peak, forward_end + head, step + temporary)
    mib = 2**20
    return top - peak + workspace, (
        f"CUDA allocator: + {(top - peak + workspace) / mib:.1f} MiB at its peak beyond the tensors counted "
        f"(cuBLAS workspace {workspace / mib:.0f} MiB, the loss's logit gradients {head / mib:.1f} MiB after "
        f"forward, the step's foreach temporary {temporary / mib:.1f} MiB)")
