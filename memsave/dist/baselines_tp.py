"""torch's own tensor parallelism (DTensor: ``parallelize_module`` and ``loss_parallel``) on memsave's reference
GPT, set up as ``memsave bench --tp`` measures it against memsave's TP engine (memsave/tp/).

It lives in ``dist/`` because this is the only layer that touches ``torch.distributed`` (as
memsave/dist/baselines.py; the same [Note: baselines import cost]: import it inside the worker that runs it).

The plan is torchtitan's for a Llama block (``models/llama3/infra/parallelize.py``), written for the GPT's
modules: ``ColwiseParallel`` on ``qkv`` and ``mlp_fc``, ``RowwiseParallel`` on ``attn_proj`` and ``mlp_proj``,
the token embedding ``RowwiseParallel`` (vocabulary rows, all-reduced output), the LM head ``ColwiseParallel``
with ``Shard(-1)`` logits for ``loss_parallel``. With sequence parallelism the norms are ``SequenceParallel``,
the first block's input is cut along the sequence (``PrepareModuleInput``: Replicate -> Shard(1), as memsave's
``sequence_input``; the position embedding is added whole before it, as in memsave), the column linears
all-gather their ``Shard(1)`` input and the row linears reduce-scatter their output.

[Note: torch TP on a packed qkv] ``ColwiseParallel`` cuts a weight's rows in ``tp`` contiguous blocks, but the
GPT's ``qkv`` packs q, k and v: a contiguous cut gives rank 0 all of q and half of k. The rows of ``qkv`` are
therefore reordered before the cut (rank r's q heads, then its k, then its v, rank after rank), so each rank's
contiguous block is the ``[q_r; k_r; v_r]`` that memsave's ``packed_colwise:3`` gives it, and ``n_head`` is set
to the heads per rank, as memsave does. Both then compute the same numbers (same FLOPs, same communication).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

__all__ = ["loss_parallel", "torch_tp_gpt"]


@torch.no_grad()
def _regroup_qkv(block: Any, tp: int) -> None:
    """[Note: torch TP on a packed qkv]: rows [q; k; v] -> [q_0; k_0; v_0; q_1; k_1; v_1; ...]."""
    for p in (block.qkv.weight, block.qkv.bias):
        if p is not None:
            q, k, v = (t.chunk(tp, 0) for t in p.data.chunk(3, 0))
            p.data = torch.cat([part for r in range(tp) for part in (q[r], k[r], v[r])], 0).contiguous()
    block.n_head //= tp


def torch_tp_gpt(model: nn.Module, device: str, tp: int, *, sequence: bool) -> Any:
    """Apply torch's TP to a plain GPT (memsave/models/gpt.py) over a 1-D ``tp`` mesh of the whole default group;
    returns the mesh. Run forward *and* backward inside ``loss_parallel()``."""
    mesh = init_device_mesh(device, (tp,), mesh_dim_names=("tp",))
    for block in model.blocks:  # type: ignore[union-attr]
        _regroup_qkv(block, tp)
    seq = Shard(1)
    if sequence:
        block_plan: dict[str, Any] = {
            "ln_1": SequenceParallel(use_local_output=True),
            "qkv": ColwiseParallel(input_layouts=seq),
            "attn_proj": RowwiseParallel(output_layouts=seq),
            "ln_2": SequenceParallel(use_local_output=True),
            "mlp_fc": ColwiseParallel(input_layouts=seq),
            "mlp_proj": RowwiseParallel(output_layouts=seq),
        }
    else:
        block_plan = {"qkv": ColwiseParallel(), "attn_proj": RowwiseParallel(),
                      "mlp_fc": ColwiseParallel(), "mlp_proj": RowwiseParallel()}
    for block in model.blocks:  # type: ignore[union-attr]
        parallelize_module(block, mesh, block_plan)
    top: dict[str, Any] = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(input_layouts=seq if sequence else Replicate(), output_layouts=Shard(-1),
                                   use_local_output=False),
    }
    if sequence:
        top["blocks.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(seq,),
                                             use_local_output=True)
        top["ln_f"] = SequenceParallel(use_local_output=True)
    parallelize_module(model, mesh, top)
    return mesh


def local(t: torch.Tensor) -> torch.Tensor:
    """The local part of a DTensor (a plain tensor as it is)."""
    return t.to_local() if isinstance(t, DTensor) else t
