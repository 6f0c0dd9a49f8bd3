"""memsave's Adafactor under tensor parallelism (and tp with ZeRO over dp): the same training as one process.

The reference GPT is cut over ``tp=2`` (colwise, rowwise and vocab-parallel weights, tp-sharded and replicated
biases, norms); Adafactor sums its row statistics over the axes cutting the columns and its column statistics,
mean(R) and RMS sums over the axes cutting the rows ([Note: Adafactor under row sharding]). A vocabulary of 251
pads the tied embedding to 252 rows: the padding rows have zero values and gradients, so they add only eps1-sized
terms to sum(R) (below float32 resolution here). Tolerance: the sums are taken in another order than in one
process, so parameters and losses agree to rounding: relative 1e-5 (what is measured is ~1e-7).
"""

from __future__ import annotations

from typing import Any

import torch

import memsave
from memsave.models.gpt import GPT, gpt_config
from memsave.optim import Adafactor
from tests.harness import run_ranks

STEPS = 3
# (foreach, Adafactor kwargs): an explicit lr on the foreach path; relative steps, momentum and weight decay on
# the per-tensor path
SETTINGS = [
    (True, dict(lr=1e-2, relative_step=False)),
    (False, dict(beta1=0.9, weight_decay=0.1)),
]


def _batches(vocab: int, n: int = STEPS, b: int = 4, t: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, vocab, (b, t), generator=g), torch.randint(0, vocab, (b, t), generator=g))
            for _ in range(n)]


def _zero_key_bias(model: torch.nn.Module) -> None:
    """The key third of each qkv bias has an exactly zero gradient (softmax is shift-invariant), computed as
    rounding noise that Adafactor scales to O(1) updates: set it to the exact zero in the reference and tp runs
    alike (each tp rank's packed slice holds its q, k, v thirds in order, as the whole tensor does)."""

    def exact(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        third = grad.numel() // 3
        grad[third:2 * third] = 0
        return grad

    for name, p in model.named_parameters():
        if name.endswith("qkv.bias"):
            p.register_hook(exact)


def _reference(vocab: int, foreach: bool, kwargs: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", vocab_size=vocab))
    _zero_key_bias(model)
    opt = Adafactor(model.parameters(), foreach=foreach, **kwargs)
    losses = []
    for x, y in _batches(vocab):
        loss = model(x, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _train(profile_name: str, vocab: int, foreach: bool, kwargs: dict) -> tuple[list[float], dict[str, Any]]:
    from memsave import dist as mdist

    profile = memsave.load_profile(profile_name, ["parallel.tp=2"])
    mesh = memsave.init(profile=profile)
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", vocab_size=vocab))
    _zero_key_bias(model)
    model, opt = memsave.wrap(model, Adafactor(model.parameters(), foreach=foreach, **kwargs), profile, mesh=mesh)
    dp, r = mesh.dp_size, mesh.dp_rank
    losses = []
    for x, y in _batches(vocab):
        b = x.shape[0] // dp
        loss = model(x[r * b:(r + 1) * b], labels=y[r * b:(r + 1) * b]).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        mdist.all_reduce(total, mesh.dp_group)
        losses.append(total.item() / dp)
    _rank0_state_loads_everywhere(model, opt)
    return losses, {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}  # (tensors would share
    # memory with the exiting child)


def _rank0_state_loads_everywhere(model: torch.nn.Module, opt: Any) -> None:
    """optimizer.state_dict() holds whole tensors over tp, the factored statistics too (row_var (..., rows, 1),
    col_var (..., 1, cols) of the whole parameter), so rank 0's file (README's torch.save recipe) loads on every
    rank, each cutting its own slices back (before, every tp rank took rank 0's row_var / col_var slices: 7.8e-3
    off after two more steps, no error)."""
    from memsave import dist as mdist

    whole = {n: tuple(v.shape) for n, v in model.state_dict().items()}
    osd = opt.state_dict()
    for i, name in enumerate(n for n, _ in model.named_parameters()):
        shape = whole[name]
        for key, v in osd["state"][i].items():
            want = {"row_var": (*shape[:-1], 1), "col_var": (*shape[:-2], 1, shape[-1]), "step": ()}.get(key, shape)
            assert tuple(v.shape) == want, (name, key, tuple(v.shape), want)
    opt.load_state_dict(mdist.all_gather_object(osd)[0])
    again = opt.state_dict()
    for i, st in osd["state"].items():
        assert all(torch.equal(v, again["state"][i][k]) for k, v in st.items()), i


def _cases(profile_name: str) -> list:
    return [_train(profile_name, vocab, foreach, kwargs) for vocab in (250, 251) for foreach, kwargs in SETTINGS]


def _check(world: int, profile_name: str) -> None:
    results = run_ranks(_cases, world, profile_name, timeout=300)
    expected = [_reference(vocab, foreach, kwargs) for vocab in (250, 251) for foreach, kwargs in SETTINGS]
    for rank_results in results:
        for (losses, params), (ref_losses, ref_params) in zip(rank_results, expected):
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
            assert params.keys() == ref_params.keys()
            for name, ref in ref_params.items():
                torch.testing.assert_close(torch.from_numpy(params[name]), ref, rtol=1e-5, atol=1e-7,
                                           msg=lambda m, n=name: f"{n}: {m}")


def test_adafactor_tp2_equals_one_process() -> None:
    _check(2, "ddp")


def test_adafactor_zero2_dp2_tp2_equals_one_process() -> None:
    _check(4, "zero2")
