"""Layer 1: deferred (meta-device) initialization. Build a model under :func:`deferred_init` (or plain
``torch.device("meta")``) and ``memsave.wrap`` materializes it unit by unit ([Note: deferred-init recording] in
record.py, [Note: materialization] in materialize.py)."""

from __future__ import annotations

from memsave.deferred.materialize import Materializer, has_meta, meta_tensors
from memsave.deferred.record import Program, deferred_init

__all__ = ["Materializer", "Program", "deferred_init", "has_meta", "meta_tensors"]
