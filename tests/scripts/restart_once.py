"""Trains a tiny model under zero2 on 2 ranks; on the first attempt rank 1 is SIGKILLed at step 2, so torchrun
(``--max-restarts 1``) restarts both ranks, which must then rendezvous and finish. Prints one ``done`` line
per rank and attempt that finished."""

import os
import signal

import torch

import memsave
from tests.toy import ToyLM, toy_batch

mesh = memsave.init()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
model = ToyLM(n_blocks=2)
model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "zero2", mesh=mesh)
for step in range(4):
    if attempt == 0 and step == 2 and mesh.dp_rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    opt.backward(model(**toy_batch(step, 2, seed=mesh.dp_rank)).loss)
    opt.step()
    opt.zero_grad()
print(f"done rank {mesh.dp_rank} attempt {attempt}", flush=True)
memsave.dist.shutdown()
