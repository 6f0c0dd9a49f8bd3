"""``memsave export CKPT OUT.safetensors``: a checkpoint's model as one safetensors file (streamed tensor by
tensor: memsave/checkpoint/export.py)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memsave.checkpoint import export

__all__ = ["add_parser", "run_command"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("export", help="write a checkpoint's model weights to a safetensors file",
                       description="Write the model of a memsave.save checkpoint to a safetensors file with the "
                       "model's own state_dict keys (a tied parameter once), one tensor at a time.")
    p.add_argument("checkpoint", type=Path, help="a committed checkpoint directory (memsave.save)")
    p.add_argument("out", help="the .safetensors file to write (an existing folder: FOLDER/model.safetensors)")


def run_command(args: argparse.Namespace, extra: Sequence[str]) -> int:
    written = export(args.checkpoint, args.out)
    numel = sum(math.prod(s) for s in written.values())
    out = Path(args.out)
    out = out / "model.safetensors" if out.is_dir() else out
    print(f"wrote {len(written)} tensors ({numel:,} elements) to {out}")
    return 0
