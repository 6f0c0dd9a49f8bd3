"""Layer 3: activation recomputation (Chen et al., 2016). ``memsave.recompute.apply`` is the hand-composed entry."""

from memsave.recompute.checkpoint import RecomputedForward, is_recomputed
from memsave.recompute.compress import (
    COMPRESS_DTYPES,
    CompressionStats,
    SavedTensorCompressor,
    check_compress,
    compress_saved,
)
from memsave.recompute.measure import SavedBytes, measure_saved_bytes
from memsave.recompute.plan import RecomputePlan, apply, format_bytes, remove
from memsave.recompute.policy import (
    DEFAULT_SAVE_OPS,
    RecomputePolicy,
    SelectivePolicy,
    parse_policy,
    parse_size,
)

__all__ = [
    "COMPRESS_DTYPES",
    "DEFAULT_SAVE_OPS",
    "CompressionStats",
    "RecomputePlan",
    "RecomputePolicy",
    "RecomputedForward",
    "SavedBytes",
    "SavedTensorCompressor",
    "SelectivePolicy",
    "apply",
    "check_compress",
    "compress_saved",
    "format_bytes",
    "is_recomputed",
    "measure_saved_bytes",
    "parse_policy",
    "parse_size",
    "remove",
]
