"""Ranks whose control flow diverged are named within one step instead of hanging for the collective timeout
(issue 24, item 4; [Note: control-flow agreement] in memsave/dist/agreement.py). Before, these loops hung for
600 s and ended in gloo's generic timeout, and under ddp the off-by-one all-reduces first averaged the wrong
gradients."""

from __future__ import annotations

import contextlib
import re
import time

import pytest
import torch

import memsave
from tests.harness import run_ranks
from tests.toy import ToyLM, toy_batch


def _loop(profile: str, mesh: memsave.Mesh, *, skip_step_on: int = -1, extra_forward_on: int = -1) -> None:
    model = ToyLM(n_blocks=2)
    model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), profile, mesh=mesh)
    for step in range(4):
        opt.backward(model(**toy_batch(step, 2, seed=mesh.dp_rank)).loss)
        if not (step == 1 and mesh.dp_rank == skip_step_on):
            opt.step()
        opt.zero_grad()
        if step == 1 and mesh.dp_rank == extra_forward_on:  # an evaluation pass on one rank only
            with torch.no_grad():
                model(**toy_batch(step, 2))


class _FailOnce(torch.optim.AdamW):
    def __init__(self, params: object, fail: bool) -> None:
        super().__init__(params, lr=1e-2)  # type: ignore[arg-type]
        self.fail = fail

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        if self.fail:
            self.fail = False
            raise MemoryError("out of memory (simulated)")
        super().step()


def _cases(world: int) -> dict[str, float]:
    mesh = memsave.init()
    took = {}
    for profile in ("ddp", "zero1", "zero2", "zero3"):
        t0 = time.monotonic()
        ahead = "forward" if profile == "zero3" else "backward"  # stage 3's forward communicates already
        other = "rank 0 at step 1 (optimizer)" if mesh.dp_rank == 1 else f"rank 1 at step 1 ({ahead})"
        with pytest.raises(RuntimeError, match=rf"control flow diverged .* {re.escape(other)}"):
            _loop(profile, mesh, skip_step_on=1)
        took[profile] = time.monotonic() - t0
    # the inner optimizer's step raising on one rank (an out-of-memory error as Adam makes its state), caught and
    # the loop continued: the replicas diverged silently (ddp, zero3); now named at the next phase
    for profile in ("ddp", "zero3"):
        model = ToyLM(n_blocks=2)
        model, opt = memsave.wrap(model, _FailOnce(model.parameters(), fail=mesh.dp_rank == 1), profile, mesh=mesh)
        with pytest.raises(RuntimeError, match=r"control flow diverged .* at step [01] \((forward|backward)\)"):
            for step in range(3):
                opt.backward(model(**toy_batch(step, 2, seed=mesh.dp_rank)).loss)
                with contextlib.suppress(MemoryError):
                    opt.step()
                opt.zero_grad()
    # a forward on one rank only: legal where forward does not communicate, named at stage 3 where it does
    _loop("zero2", mesh, extra_forward_on=0)
    with pytest.raises(RuntimeError, match=r"control flow diverged .* at step 2 \((forward|backward)\)"):
        _loop("zero3", mesh, extra_forward_on=0)
    return took


def test_a_rank_that_skips_a_step_is_named_within_the_step() -> None:
    for took in run_ranks(_cases, 2, 2, timeout=120):
        assert max(took.values()) < 30, took  # not a collective timeout


def _slow_rank(world: int) -> str:
    mesh = memsave.init()
    model = ToyLM(n_blocks=2)
    model, _opt = memsave.wrap(model, torch.optim.AdamW(model.parameters()), "zero3", mesh=mesh)
    if mesh.dp_rank == 0:
        with pytest.raises(memsave.dist.CollectiveError,
                           match=r"all_gather over 2 ranks during step 0, forward .* failed: .*a peer rank never "
                                 r"joined .*ran out of batches"):
            model(**toy_batch(0, 2))
    else:  # a rank stuck elsewhere, long past the collective timeout
        time.sleep(8)
        with contextlib.suppress(RuntimeError):  # its peer gave up: whatever the transport says
            model(**toy_batch(0, 2))
    return "ok"


def test_a_collective_timeout_names_the_collective_the_phase_and_the_unit() -> None:
    assert run_ranks(_slow_rank, 2, 2, timeout=90, env={"MEMSAVE_TIMEOUT_S": "3"}) == ["ok"] * 2


def _tp_forward_on_one_rank(world: int) -> str:
    from memsave.models import GPT, TokenBatches, gpt_config

    mesh = memsave.init(tp=2)
    model = GPT(gpt_config("tiny", dropout=0.0))
    model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters()), "ddp", mesh=mesh)
    batch = TokenBatches(seq_len=16, batch_size=2).batch(0)
    opt.backward(model(**batch).loss)
    opt.step()
    opt.zero_grad()
    if mesh.rank == 0:  # an eval forward on one rank only: the forward's check times out, named as the forward
        with pytest.raises(memsave.dist.CollectiveError, match=r"all_gather over 2 ranks during step 1, forward "):
            with torch.no_grad():
                model(**batch)
    else:
        time.sleep(8)
    return "ok"


def test_a_tp_collective_timeout_in_a_forward_after_a_step_names_the_forward() -> None:
    """Under ddp the engine names the forward as its phase (it said "optimizer.step()", the last phase named)."""
    assert run_ranks(_tp_forward_on_one_rank, 2, 2, timeout=90, env={"MEMSAVE_TIMEOUT_S": "3"}) == ["ok"] * 2


def _tp_eval_on_one_rank(world: int) -> list[str]:
    """A rank-0-only evaluation under tp = 2 (a sample printed by the main process): named on both ranks at once.
    Before, its all-reduces paired with rank 1's next training forward (computing with rank 1's activations), and
    rank 0's own training forward then with rank 1's backward, until two sizes differed (here gloo aborted rank 1
    on a size mismatch in the second step)."""
    from memsave.models import GPT, TokenBatches, gpt_config

    mesh = memsave.init(tp=2)
    batch = TokenBatches(seq_len=16, batch_size=2).batch(0)
    seen = []
    for profile in ("ddp", "zero2", "zero3"):
        torch.manual_seed(0)
        model = GPT(gpt_config("tiny", dropout=0.0))
        model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters()), profile, mesh=mesh)
        with torch.no_grad():  # on every rank: legal
            model.eval()
            model(**batch)
            model.train()
        opt.backward(model(**batch).loss)
        opt.step()
        opt.zero_grad()
        other = "rank 1 at step 1 (forward)" if mesh.rank == 0 else "rank 0 at step 1 (forward without autograd)"
        with pytest.raises(RuntimeError, match=rf"control flow diverged .* {re.escape(other)} .*synced_gpus=True"):
            if mesh.rank == 0:
                with torch.no_grad():
                    model(**batch)
            else:
                model(**batch)
        seen.append(profile)
        # [Note: one input per tp group] rows sharded by the global rank (DistributedSampler's defaults): the tp
        # ranks would compute one model on two batches, their all-reduces mixing them, with no error
        other = TokenBatches(seq_len=16, batch_size=2, dp_rank=mesh.rank, dp_size=2).batch(1)
        with pytest.raises(RuntimeError, match=r"ranks \[0, 1\] run one model replica together .*different inputs .*"
                                               r"num_replicas=mesh\.dp_size, rank=mesh\.dp_rank"):
            model(**other)
        model(**TokenBatches(seq_len=16, batch_size=2).batch(1))  # the same rows on both: trains on
        seen.append(f"{profile} inputs")
    return seen


def test_an_evaluation_on_one_tp_rank_is_named_before_it_computes() -> None:
    """Also: tp ranks fed different rows are named at the forward."""
    want = ["ddp", "ddp inputs", "zero2", "zero2 inputs", "zero3", "zero3 inputs"]
    assert run_ranks(_tp_eval_on_one_rank, 2, 2, timeout=120) == [want] * 2


def test_the_input_fingerprint_tells_batches_apart() -> None:
    """[Note: one input per tp group]: equal inputs agree; other rows, the same rows in another order, another
    shape differ; empty, 0-d, bool and bf16 tensors, a dataclass's and a dict's, take part without an error."""
    import dataclasses

    from memsave.dist.agreement import _fingerprint

    @dataclasses.dataclass
    class Batch:
        ids: torch.Tensor

    def fp(*inputs: object) -> list[float]:
        return _fingerprint(3, 0, (inputs, {}), torch.device("cpu")).tolist()

    ids = torch.arange(12).view(3, 4)
    assert fp(ids) == fp(ids.clone()) and fp(Batch(ids)) == fp({"ids": ids})
    assert fp(ids) != fp(ids + 1) and fp(ids) != fp(ids.flip(0)) and fp(ids) != fp(ids.view(4, 3))
    fp(torch.ones(0, 5), torch.tensor(2.0), torch.ones(2, 2, dtype=torch.bool), torch.randn(2, 3, dtype=torch.bfloat16))
