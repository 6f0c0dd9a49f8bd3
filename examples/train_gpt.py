"""Train the reference GPT on the embedded corpus with your own loop and a memsave profile.

The same script runs as one process or under a launcher:

    python examples/train_gpt.py --profile zero2
    torchrun --nproc-per-node 2 examples/train_gpt.py --profile zero3
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no examples/train_gpt.py --profile zero3

(``accelerate launch`` takes ``--multi_gpu`` even on a CPU-only machine: it then starts the processes the way
torchrun does and memsave picks gloo. accelerate 1.x refuses ``--cpu`` together with ``--multi_gpu``, and
``--cpu --num_processes 2`` without mpirun starts one process with only MASTER_ADDR / MASTER_PORT set, which
``memsave.init()`` refuses as an incomplete launcher environment.)

The loop is the usual one, with memsave's optimizer doing backward (gradient sync / reduce-scatter), clipping by
the global norm and the step. At the end every rank takes part in the memory report; rank 0 prints it.
With no launcher, ``memsave.init()`` makes a world of one, so the script needs no ``if distributed`` branches.
"""

import argparse
import time

import torch

import memsave
from memsave.models import GPT, GPT_SIZES, TokenBatches, gpt_config

# -----------------------------------------------------------------------------------------------------------
# command line
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--profile", default="ddp",
                    help=f"a preset ({', '.join(memsave.list_presets())}) or a path to a TOML profile")
parser.add_argument("--steps", type=int, default=50, help="optimizer steps")
parser.add_argument("--size", default="tiny", choices=list(GPT_SIZES), help="reference GPT size")
parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
parser.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (default: the model's block size)")
parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
parser.add_argument("--log-every", type=int, default=10, help="print the loss every this many steps")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

# -----------------------------------------------------------------------------------------------------------
# processes: torchrun / accelerate set the environment; with neither this is a world of one
mesh = memsave.init()
master = mesh.is_main
if master:
    print(f"{mesh!r}, profile {args.profile!r}")

# -----------------------------------------------------------------------------------------------------------
# model, optimizer, data: plain PyTorch, built the same on every rank (wrap broadcasts rank 0's weights)
torch.manual_seed(args.seed)
config = gpt_config(args.size)
model = GPT(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
if master:
    print(f"GPT-{args.size}: {model.num_parameters():,} parameters")

model, optimizer = memsave.wrap(model, optimizer, profile=args.profile, mesh=mesh)

seq_len = args.seq_len or config.block_size
data = TokenBatches(seq_len=seq_len, batch_size=args.batch_size, dp_rank=mesh.dp_rank, dp_size=mesh.dp_size,
                    split="train", seed=args.seed)

# -----------------------------------------------------------------------------------------------------------
# training loop
t0 = time.perf_counter()
for step in range(args.steps):
    batch = {k: v.to(mesh.device) for k, v in data.batch(step).items()}
    loss = model(**batch).loss
    optimizer.backward(loss)
    grad_norm = optimizer.clip_grad_norm(1.0)
    optimizer.step()
    optimizer.zero_grad()

    if master and (step % args.log_every == 0 or step == args.steps - 1):
        dt = time.perf_counter() - t0
        print(f"step {step:4d} | loss {loss.item():.4f} | grad norm {grad_norm.item():.3f} | {dt:.2f}s")

# -----------------------------------------------------------------------------------------------------------
# where the memory went: collective (every rank reports), printed once
memory_report = memsave.report(model, optimizer, profile=str(args.profile))
if master:
    print(memory_report.to_text())

# Leave the process group before exiting: the ranks meet first, so no gloo worker thread is still releasing a
# collective's tensors while the interpreter shuts down ([Note: gloo at exit] in memsave/dist/collectives.py).
memsave.dist.shutdown()
