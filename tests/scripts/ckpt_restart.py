"""A Trainer run with checkpoints (zero3, tiny GPT with dropout, fp32 CPU) under ``torchrun --max-restarts 1``,
resuming from the latest committed checkpoint in CKPT_DIR. Rank 1 of the first attempt SIGKILLs itself while
reading the batch of step 6 (after the step-4 checkpoint); torchrun restarts both ranks, which resume from step 4
and finish. Then the same processes train a fresh model the same way without checkpoints: the uninterrupted
reference. Rank 0 prints ``loss <step> <repr>`` for each step logged, ``ref <step> <repr>`` for the reference.

usage: torchrun ... tests/scripts/ckpt_restart.py CKPT_DIR
"""

import os
import signal
import sys

import torch

import memsave
from memsave.models import TokenBatches
from memsave.models.gpt import GPT, gpt_config

ckpt_dir = sys.argv[1]
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
mesh = memsave.init()


class Data(TokenBatches):
    kill = True

    def batch(self, step: int):  # type: ignore[no-untyped-def]
        if self.kill and attempt == 0 and step == 5 and mesh.dp_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().batch(step)


def run(tag: str, **ckpt: object) -> None:
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", dropout=0.1))
    model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), "zero3", mesh=mesh)
    cfg = memsave.TrainConfig(steps=8, batch_size=2, seq_len=32, log_every=1, seed=0, **ckpt)  # type: ignore[arg-type]
    data = Data(seq_len=32, batch_size=2, dp_rank=mesh.dp_rank, dp_size=mesh.dp_size)
    data.kill = bool(ckpt)
    trainer = memsave.Trainer(model, opt, mesh=mesh, config=cfg, train_data=data,
                              on_log=lambda r: print(f"{tag} {r.step} {r.loss!r}", flush=True))
    trainer.fit()


run("loss", ckpt_dir=ckpt_dir, save_every=2, keep_last=2, resume="latest")
run("ref")
print(f"done rank {mesh.dp_rank} attempt {attempt}", flush=True)
memsave.dist.shutdown()
