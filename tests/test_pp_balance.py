"""[parallel] balance: stages cut by parameters or by measured block time, on a model whose blocks differ in cost."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn

import memsave
from memsave.pp import by_count
from tests.harness import run_ranks

WIDTHS = (2048,) + (128,) * 16  # one wide block, then sixteen narrow ones: the same bytes on each side
# by time: the wide block is 24 of 56 narrow-block FLOPs, so a split can land within one narrow block (4%) of the ideal.
# With WIDTHS the only even split was the wide block against the sixteen narrow ones, and the slowest stage was
# the ratio of this CPU's speed on the two kinds of matmul (1.104x in a CI run, over the 1.10 bound with the
# balancer's choice optimal): a property of the machine, not of the balancer
TIME_WIDTHS = (3072,) + (128,) * 32
D, ROWS = 256, 256


def _model(widths: tuple[int, ...] = WIDTHS) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(D, w), nn.GELU(), nn.Linear(w, D)) for w in widths])


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"input": torch.randn(ROWS, D, generator=g)} for _ in range(n)]



def _balanced(how: str) -> dict[str, Any]:
    mesh = memsave.init(pp=2)
    model = _model(TIME_WIDTHS if how == "time" else WIDTHS)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = memsave.load_profile("ddp", ["parallel.pp=2", f"parallel.balance={how!r}"])
    batches = _batches(4)
    rng = torch.get_rng_state()
    model, opt = memsave.wrap(model, opt, prof, mesh=mesh, example_inputs=(batches[0]["input"],))
    assert torch.equal(torch.get_rng_state(), rng)  # measuring the blocks drew nothing from the user's stream
    bal = model.memsave_engine.balance
    losses = []
    for step in range(2):
        loss = model.pipeline_step([(b["input"],) for b in batches[2 * step: 2 * step + 2]],
                                   targets=[0, 0], loss_fn=lambda out, _t: out.pow(2).mean())
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else float(loss))
    rep = memsave.report(model, opt)  # the split and its measured costs are in the report (validated)
    memsave.memory.validate_report(rep.data)
    return {"bounds": bal.bounds, "times": bal.times, "names": bal.names, "losses": losses,
            "pipeline": rep.data["pipeline"], "text": rep.to_text()}


def test_balance_by_time_evens_the_stages() -> None:
    """balance = "time": the stages' measured costs are within 1.10x of the ideal (total / p), where the count
    split of the same blocks is >= 1.3x; both ranks cut alike; the pipeline trains equal to one process."""
    ranks = run_ranks(_balanced, 2, "time", timeout=180)
    assert ranks[0]["bounds"] == ranks[1]["bounds"] and ranks[0]["times"] == ranks[1]["times"]
    times = ranks[0]["times"]
    ideal = sum(times) / 2
    assert max(times) / ideal <= 1.10, times
    pipe = ranks[0]["pipeline"]  # the chosen balance in the memory report: stage, blocks, measured ms, bytes
    assert pipe["balance"] == "time" and [s["ms"] for s in pipe["stages"]] == pytest.approx([t * 1e3 for t in times])
    names, bounds = ranks[0]["names"], [*ranks[0]["bounds"], len(ranks[0]["names"])]
    assert [s["blocks"] for s in pipe["stages"]] == [list(names[a:b]) for a, b in itertools.pairwise(bounds)]
    assert all(s["bytes"] is not None and s["bytes"] >= 0 for s in pipe["stages"])
    assert "pipeline: pp = 2, schedule 1f1b, virtual 1, balance by time" in ranks[0]["text"]
    # the same blocks cut by count: >= 1.3x of the ideal in FLOPs (1.43x: the wide block and sixteen narrow ones
    # against sixteen; measured 1.37 on a quiet machine; the load of a CI run beside other jobs slows the many small
    # blocks more, so here only clearly worse than the balancer's). Per-block costs back from the chosen stages are not
    # kept, so measure the blocks here the way the split did
    from memsave.pp.auto_split import block_times

    model = _model(TIME_WIDTHS)
    names = [str(i) for i in range(len(TIME_WIDTHS))]
    assert by_count(names, [float(w) for w in TIME_WIDTHS], 2).slowest_vs_ideal >= 1.3
    per_block = block_times(model, names, (_batches(1)[0]["input"],))
    counted = by_count(names, per_block, 2)
    assert counted.slowest_vs_ideal >= 1.15, counted.times
    # one process on the same global batch
    model = _model(TIME_WIDTHS)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = _batches(4)
    ref = []
    for step in range(2):
        total = 0.0
        for b in batches[2 * step: 2 * step + 2]:
            loss = model(b["input"]).pow(2).mean() / 2
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        ref.append(total)
    assert ranks[1]["losses"] == pytest.approx(ref, rel=1e-6)


def test_balance_by_params_and_errors() -> None:
    ranks = run_ranks(_balanced, 2, "params", timeout=180)
    # bytes: the wide block (2 x 256 x 2048 weights, + biases) weighs as much as the sixteen narrow ones
    assert ranks[0]["bounds"] == (0, 1), ranks[0]
    with pytest.raises(ValueError, match=r"parallel\.balance"):
        memsave.load_profile("ddp", ["parallel.pp=2", "parallel.balance='time'", "parallel.split=['3']"])
    with pytest.raises(ValueError, match=r"parallel\.balance"):
        memsave.load_profile("ddp", ["parallel.balance='even'"])


def test_measuring_the_blocks_leaves_training_as_it_was() -> None:
    """balance = "time" runs forwards and backwards at wrap: the random stream (dropout) and the buffers (a norm's
    running statistics) are as before, and no gradient is left behind."""
    from memsave.pp.auto_split import block_times

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(D, 64), nn.BatchNorm1d(64), nn.Dropout(0.5), nn.Linear(64, D))
                            for _ in range(3)])
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    x = torch.randn(8, D)
    rng = torch.get_rng_state()
    times = block_times(model, ["0", "1", "2"], (x,))
    assert len(times) == 3 and all(t > 0 for t in times)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert all(p.grad is None for p in model.parameters())
