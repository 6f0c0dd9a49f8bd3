"""Layer 3: tensor parallelism (Megatron-style column/row/vocab-parallel layers, sequence parallelism, the
vocab-parallel loss) applied to an unchanged model by a plan. ``memsave.wrap`` / ``memsave.parallelize`` apply it
when the mesh has a ``tp`` axis; the pieces are public for users who compose by hand."""

from memsave.tp.apply import TPParam, apply_tp, cut_shapes, cut_tp, full_state_dicts, tp_param
from memsave.tp.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPContext,
    VocabParallelEmbedding,
    gather_tp,
)
from memsave.tp.loss import ShardedLogits, VocabShard, vocab_parallel_cross_entropy
from memsave.tp.mappings import CopyToTP, GatherLast, GatherSeq, ReduceFromTP, ReduceScatterSeq, ScatterSeq
from memsave.tp.plan import STYLES, default_plan, gathers_whole, gpt_plan, match_plan

__all__ = [
    "STYLES",
    "ColumnParallelLinear",
    "CopyToTP",
    "GatherLast",
    "GatherSeq",
    "ReduceFromTP",
    "ReduceScatterSeq",
    "RowParallelLinear",
    "ScatterSeq",
    "ShardedLogits",
    "TPContext",
    "TPParam",
    "VocabParallelEmbedding",
    "VocabShard",
    "apply_tp",
    "cut_shapes",
    "cut_tp",
    "default_plan",
    "full_state_dicts",
    "gather_tp",
    "gathers_whole",
    "gpt_plan",
    "match_plan",
    "tp_param",
    "vocab_parallel_cross_entropy",
]
