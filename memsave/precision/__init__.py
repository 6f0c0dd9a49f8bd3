"""Layer 2: mixed precision (Micikevicius et al., 2018): the dynamic loss scaler, agreed across ranks, and the
loss-scaled optimizer with fp32 master weights for models memsave does not wrap."""

from memsave.precision.nonfinite import NonfiniteGuard
from memsave.precision.optimizer import MixedPrecisionOptimizer
from memsave.precision.policy import (
    DTYPES,
    cast_forward_inputs,
    cast_parameters,
    compute_dtype,
    reduce_dtype_for,
    scaler_for,
)
from memsave.precision.scaler import LossScaler

__all__ = ["DTYPES", "LossScaler", "MixedPrecisionOptimizer", "NonfiniteGuard", "cast_forward_inputs", "cast_parameters", "compute_dtype", "reduce_dtype_for",
           "scaler_for"]
