"""memsave's Adafactor with its state offloaded ([Note: whole-shard offload] in memsave/offload/whole.py): whole
shards in chunks on disk, one step over all of them, at ZeRO-1 and -3 on 2 ranks (uneven rows, its statistics
summed over the ranks), fp32 and bf16 (the fp32 masters on disk too): losses, parameters and the consolidated state
bit for bit those of the same run without offload; its first moment and the masters leave memory."""

from __future__ import annotations

import itertools
from pathlib import Path

import memsave
from memsave.optim import Adafactor
from memsave.phases import MemoryCategory
from tests.harness import run_ranks
from tests.test_offload import BF16, DISK, _same, _train

KW = dict(lr=1e-2, relative_step=False, beta1=0.9, weight_decay=0.1, clip_threshold=0.5)
NO_MOMENTUM = dict(lr=1e-2, relative_step=False)  # the factored statistics only (an LR schedule: lr is set)


def _cases(path: str) -> list[str]:
    mesh = memsave.init()
    done = []
    for stage, prec, kw in itertools.product((1, 3), ((), BF16), (KW, NO_MOMENTUM)):
        def make(groups: list, kw: dict = kw) -> Adafactor:
            return Adafactor(groups, **kw)

        what = f"zero{stage} {prec} {kw}"
        ref = _train(stage, prec, mesh, path, make_opt=make)
        run = _train(stage, (*prec, *DISK, "offload.chunk_mb=0.001"), mesh, path, make_opt=make)
        _same(run, ref, what)
        opt = run["opt"]
        own = sum(s.numel() for s in opt._full_of if s.requires_grad)
        moved = (4 if "beta1" in kw else 0) + (4 if prec else 0)  # the first moment (beta1), the fp32 masters
        # at least the moved bytes (vectors' second moments go too); on rank 1 the rows are fewer
        assert opt.offloaded_bytes()["disk"] >= moved * own * 0.9, (what, opt.offloaded_bytes(), own)
        held = memsave.memory.account([opt]).bytes
        assert held.get(MemoryCategory.MASTER.value, 0) == 0, (what, held)
        opt.close()
        ref["opt"].close() if hasattr(ref["opt"], "close") else None
        done.append(what)
    return done


def test_adafactor_offload_to_disk_is_exact(tmp_path: Path) -> None:
    out = run_ranks(_cases, 2, str(tmp_path), timeout=300)
    assert len(out[0]) == 8
