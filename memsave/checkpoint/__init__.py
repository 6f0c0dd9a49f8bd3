"""Layer 5: sharded, reshardable, crash-safe checkpoints on ``torch.distributed.checkpoint``.

``memsave.save(path, model, optimizer)`` writes every rank's own rectangles of the parameters, the optimizer
state and the fp32 masters (nothing gathered); ``memsave.load`` reads them back under any world size, ZeRO stage
or tp degree. See memsave/checkpoint/api.py, [Note: two-phase commit] in commit.py and [Note: no pickle on load]
in memsave/dist/dcp.py.
"""

from memsave.checkpoint.api import Loaded, load, save
from memsave.checkpoint.background import AsyncSave, wait
from memsave.checkpoint.commit import checkpoints_in, latest
from memsave.checkpoint.export import export, load_weights

__all__ = ["AsyncSave", "Loaded", "checkpoints_in", "export", "latest", "load", "load_weights", "save", "wait"]
