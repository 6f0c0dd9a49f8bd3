"""The tensor-parallel pieces that need no peers, in this process: the vocab-parallel cross-entropy's definition
(its tp group of one: padding columns, ignore_index, label smoothing, reductions), ShardedLogits through a model's
loss code, plans and their refusals, and the dropout streams. The same loss over 2 and 4 ranks is in
tests/test_tp.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memsave
from memsave.tp import ShardedLogits, VocabShard, cut_shapes, default_plan, gpt_plan, match_plan
from memsave.tp import vocab_parallel_cross_entropy as vp_ce
from memsave.tp.random import RegionRandom

TOL = 1e-12  # float64 logits: the two definitions agree to rounding


def _gpt(**overrides: object) -> nn.Module:
    from memsave.models.gpt import GPT, gpt_config

    torch.manual_seed(0)
    return GPT(gpt_config("tiny", **overrides))


def _padded(full: torch.Tensor, pad: int) -> torch.Tensor:
    """``full``'s columns and ``pad`` columns of garbage (the padding of a vocabulary cut over tp): the loss must
    mask them."""
    return torch.cat([full, torch.full((*full.shape[:-1], pad), 50.0, dtype=full.dtype)], -1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / scale if scale else (a - b).abs().max().item()


CASES = [(ignore, smoothing, reduction) for ignore, smoothing in ((-100, 0.0), (-100, 0.1), (3, 0.25), (-100, 1.0))
         for reduction in ("mean", "sum", "none")]


@pytest.mark.parametrize("vocab,pad", [(250, 0), (251, 1), (7, 3)])
def test_vocab_parallel_cross_entropy_equals_torch(vocab: int, pad: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    full = torch.randn(20, vocab, generator=g, dtype=torch.float64) * 4
    targets = torch.randint(0, vocab, (20,), generator=g)
    targets[::3] = -100
    shard = VocabShard(None, 0, vocab + pad, vocab)  # one rank holds the whole (padded) vocabulary
    assert shard.padded == pad
    for ignore, smoothing, reduction in CASES:
        target = targets.masked_fill(targets == -100, ignore)
        want_in = full.clone().requires_grad_()
        want = F.cross_entropy(want_in, target, ignore_index=ignore, label_smoothing=smoothing, reduction=reduction)
        seed = torch.rand(want.shape, generator=g, dtype=torch.float64)
        (want * seed).sum().backward()
        mine = _padded(full, pad).requires_grad_()
        got = vp_ce(mine, target, shard, ignore_index=ignore, label_smoothing=smoothing, reduction=reduction)
        (got * seed).sum().backward()
        what = f"V={vocab}+{pad} ignore={ignore} smoothing={smoothing} {reduction}"
        assert got.shape == want.shape, what
        assert _rel(got.detach(), want.detach()) <= TOL, what
        assert mine.grad is not None and want_in.grad is not None
        assert _rel(mine.grad[:, :vocab], want_in.grad) <= TOL, what
        assert torch.equal(mine.grad[:, vocab:], torch.zeros(20, pad, dtype=torch.float64)), what + ": padding"


def test_a_batch_with_every_label_ignored_is_torch_s_nan_loss_with_zero_gradient() -> None:
    logits = torch.randn(4, 5, dtype=torch.float64)
    target = torch.full((4,), -100)
    for reduction in ("mean", "sum", "none"):
        want_in, mine = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        want = F.cross_entropy(want_in, target, reduction=reduction)
        got = vp_ce(mine, target, VocabShard(None, 0, 5, 5), reduction=reduction)
        torch.testing.assert_close(got, want, equal_nan=True)  # mean: 0 / 0
        want.sum().backward()
        got.sum().backward()
        assert want_in.grad is not None and mine.grad is not None
        assert torch.equal(mine.grad, want_in.grad), f"{reduction}: {mine.grad}"  # zeros, not nan


def test_float32_logits_and_extreme_values() -> None:
    """No overflow: the row maximum is subtracted first (logits of +-1e4 in fp32)."""
    g = torch.Generator().manual_seed(0)
    full = torch.randn(8, 11, generator=g) * 1e4
    target = torch.randint(0, 11, (8,), generator=g)
    want_in, mine = full.clone().requires_grad_(), _padded(full, 1).requires_grad_()
    want = F.cross_entropy(want_in, target, label_smoothing=0.2)
    got = vp_ce(mine, target, VocabShard(None, 0, 12, 11), label_smoothing=0.2)
    want.backward()
    got.backward()
    assert torch.isfinite(got) and _rel(got.detach(), want.detach()) <= 1e-6
    assert mine.grad is not None and want_in.grad is not None
    assert torch.allclose(mine.grad[:, :11], want_in.grad, rtol=0, atol=1e-6)


def test_bad_arguments_are_refused() -> None:
    shard = VocabShard(None, 0, 5, 5)
    x, t = torch.randn(4, 5), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"logits \(2, 2, 5\) and target \(4,\); expected \[tokens, local vocab\]"):
        vp_ce(x.view(2, 2, 5), t, shard)
    with pytest.raises(ValueError, match="expected"):
        vp_ce(x, t[:3], shard)
    with pytest.raises(ValueError, match=r"reduction='avg'; allowed are 'mean', 'sum', 'none'"):
        vp_ce(x, t, shard, reduction="avg")
    with pytest.raises(ValueError, match=r"label_smoothing=1.5; allowed is \[0, 1\]"):
        vp_ce(x, t, shard, label_smoothing=1.5)


# -- ShardedLogits ----------------------------------------------------------------------------------------------------
def _sharded(vocab: int = 9, pad: int = 1) -> tuple[torch.Tensor, torch.Tensor, ShardedLogits]:
    """The whole logits, this rank's padded columns (a leaf), and those as the LM head returns them."""
    full = torch.randn(2, 3, vocab, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    local = _padded(full, pad).requires_grad_()
    return full, local, ShardedLogits.wrap(local * 1.0, VocabShard(None, 0, vocab + pad, vocab))


def test_sharded_logits_stay_sharded_through_a_model_s_loss_code() -> None:
    """float(), view(-1, vocab) (or the width the logits report), flatten(0, 1), slicing that keeps the vocabulary and
    F.cross_entropy work on this rank's columns (the [tokens, vocab] logits are never built)."""
    full, _, logits = _sharded()
    target = torch.tensor([0, 8, -100, 4, 4, 1])
    for shaped in (logits.double().view(-1, 9), logits.flatten(0, 1), logits.contiguous().reshape(-1, 9),
                   logits[:, :, :].flatten(0, 1), logits.detach().flatten(0, 1),
                   # the classic HF idiom: the width the logits report is this rank's (before, the whole logits were
                   # gathered and viewed with it: a "batch_size (120) to match target (60)" error at tp = 2)
                   logits.view(-1, logits.size(-1)), logits.reshape(-1, logits.shape[-1])):
        assert isinstance(shaped, ShardedLogits) and shaped.shape == (6, 10), type(shaped)
        loss = F.cross_entropy(shaped, target, label_smoothing=0.1)
        assert type(loss) is torch.Tensor
        assert _rel(loss.detach(), F.cross_entropy(full.view(-1, 9), target, label_smoothing=0.1)) <= TOL
    assert isinstance(logits.float(), ShardedLogits) and logits.float().dtype == torch.float32
    shifted = logits[..., :-1, :]  # HF's shift: drops a position, keeps the vocabulary
    assert isinstance(shifted, ShardedLogits) and shifted.shape == (2, 2, 10)
    scaled = logits * 0.5
    assert isinstance(scaled, ShardedLogits) and scaled.shape[-1] == 10
    assert logits.size(-1) == 10 and logits.dim() == 3 and "ShardedLogits(columns 0..10 of 9" in repr(logits)


def test_other_operations_see_the_whole_logits() -> None:
    """Anything else gathers them whole over tp first (here a tp of one: the padding is dropped) and the gradient
    goes back to this rank's columns."""
    full, local, logits = _sharded()
    probs = logits.softmax(-1)
    assert type(probs) is torch.Tensor and probs.shape == (2, 3, 9)
    assert torch.allclose(probs, full.softmax(-1), rtol=0, atol=1e-15)
    assert torch.equal(logits.argmax(-1), full.argmax(-1))
    probs[..., 0].sum().backward()
    want = full.clone().requires_grad_()
    want.softmax(-1)[..., 0].sum().backward()
    assert want.grad is not None and local.grad is not None
    assert torch.allclose(local.grad[..., :9], want.grad, rtol=0, atol=1e-15)
    assert torch.equal(local.grad[..., 9:], torch.zeros(2, 3, 1, dtype=torch.float64))
    # weighted cross-entropy gathers too, and equals torch's
    weight = torch.rand(9, dtype=torch.float64)
    target = torch.tensor([0, 8, 2, 4, 4, 1])
    got = F.cross_entropy(logits.view(-1, 9), target, weight=weight)
    assert _rel(got.detach(), F.cross_entropy(full.view(-1, 9), target, weight=weight)) <= TOL


# -- plans ------------------------------------------------------------------------------------------------------------
def test_plans_match_module_names_and_refuse_what_they_cannot_apply() -> None:
    gpt = _gpt()
    assert default_plan(gpt) == gpt_plan()
    matched = match_plan(gpt, gpt_plan())
    assert matched["blocks.1.qkv"] == ("packed_colwise", 3) and matched["lm_head"] == ("loss_parallel", 1)
    assert matched["blocks.0"] == ("sequence_input", 1) and "blocks.1" not in matched
    assert set(match_plan(gpt, {"blocks.*": "sequence_gather"})) == {"blocks.0", "blocks.1"}  # '*': one component
    assert match_plan(gpt, {"wte": "embedding", "blocks.0.qkv": "colwise_rep", "blocks.1.qkv": "packed_colwise"}) == {
        "wte": ("vocab_embedding", 1), "blocks.0.qkv": ("colwise_gather_output", 1),
        "blocks.1.qkv": ("packed_colwise", 2)}  # aliases of torch's / HF's style names; 2 packed blocks by default
    with pytest.raises(ValueError, match=r"tp plan pattern 'blocks\.\*\.mlp' matches no module of the GPT; its "
                                         r"module names look like wte, wpe"):
        match_plan(gpt, {"blocks.*.mlp": "colwise"})
    with pytest.raises(ValueError, match=r"module 'blocks\.1\.qkv' is matched by both 'blocks\.\*\.qkv' and "
                                         r"'blocks\.1\.qkv'"):
        match_plan(gpt, {"blocks.*.qkv": "colwise", "blocks.1.qkv": "rowwise"})
    with pytest.raises(NotImplementedError, match=r"tp plan entry 'lm_head': style 'diagonal' is not supported by "
                                                  r"memsave's tensor parallelism; supported are colwise"):
        match_plan(gpt, {"lm_head": "diagonal"})
    with pytest.raises(NotImplementedError, match="style 'rowwise:2' is not supported"):
        match_plan(gpt, {"lm_head": "rowwise:2"})
    with pytest.raises(ValueError, match=r"style 'packed_colwise:x'; the packed block count after ':' must be a "
                                         "positive integer"):
        match_plan(gpt, {"blocks.0.qkv": "packed_colwise:x"})
    with pytest.raises(ValueError, match=r"tp_plan=\{\}: expected a non-empty dict"):
        match_plan(gpt, {})
    with pytest.raises(ValueError, match=r"memsave has no plan for a Sequential \(its own GPT and Hugging Face "
                                         r"models whose config has base_model_tp_plan have one\); pass tp_plan="):
        default_plan(nn.Sequential(nn.Linear(4, 4)))


def _meta_gpt(**overrides: object) -> nn.Module:
    from memsave.models.gpt import GPT, gpt_config

    with torch.device("meta"):
        return GPT(gpt_config("tiny", **overrides))


def test_cut_shapes_gives_tp_rank_0_s_shapes_and_refuses_before_changing_anything() -> None:
    model = _meta_gpt(vocab_size=251)
    cut_shapes(model, 2)
    block = model.blocks[0]
    assert block.n_head == 1  # heads split with their projections
    assert block.qkv.weight.shape == (96, 64) and block.attn_proj.weight.shape == (64, 32)
    assert block.mlp_fc.weight.shape == (128, 64) and block.mlp_proj.weight.shape == (64, 128)
    assert model.wte.weight.shape == (126, 64)  # ceil(251 / 2) rows of the padded vocabulary (tied: the head too)
    assert block.ln_1.weight.shape == (64,) and model.wpe.weight.shape == (64, 64)  # replicated
    for overrides, tp, match in (({"d_model": 48, "n_head": 3}, 2, r"module 'blocks\.0' has n_head=3, not divisible "
                                                                   r"by tp=2; choose tp dividing 3"),
                                 ({}, 3, r"module 'blocks\.0\.qkv' has 3 packed blocks of out_features=192, not "
                                         r"divisible by 3 x tp=3")):
        model = _meta_gpt(**overrides)
        before = {n: tuple(p.shape) for n, p in model.named_parameters()}
        heads = model.blocks[0].n_head
        with pytest.raises(ValueError, match=match):
            cut_shapes(model, tp)
        assert {n: tuple(p.shape) for n, p in model.named_parameters()} == before
        assert model.blocks[0].n_head == heads


def test_a_plan_on_a_mesh_without_tp_is_refused() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"tp_plan= was given but the mesh has tp = 1; build the mesh with tp > 1"):
        memsave.wrap(model, opt, "ddp", mesh=memsave.init(), tp_plan={"0": "colwise", "2": "rowwise"})
    assert type(model) is nn.Sequential and not opt.state
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# -- dropout streams --------------------------------------------------------------------------------------------------
def test_region_streams_differ_per_rank_and_leave_the_replicated_stream_as_every_rank_has_it() -> None:
    """[Note: TP random streams], for two would-be tp ranks in one process: from the same generator state, each
    rank's stream inside a TP region differs; after leaving, the replicated stream continues identically on both;
    and from the same state the same rank replays the same masks (what recompute relies on)."""
    cpu = torch.device("cpu")
    torch.manual_seed(1234)
    start = torch.get_rng_state()

    def region(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        torch.set_rng_state(start)
        rr = RegionRandom(rank, cpu)
        rr.enter()
        rr.enter()  # (idempotent)
        inside = torch.rand(64)
        rr.leave()
        rr.leave()
        return inside, torch.rand(64)

    (in0, out0), (in1, out1), (again0, after0) = region(0), region(1), region(0)
    assert not torch.equal(in0, in1)
    assert torch.equal(out0, out1) and torch.equal(out0, after0)
    assert torch.equal(in0, again0)
    torch.set_rng_state(start)
    rr = RegionRandom(1, cpu)
    body = rr.scoped(lambda: (rr.enter(), torch.rand(3))[1])  # a unit that enters a region and returns in it
    body()
    assert not rr.varying  # the unit's forward ends in the replicated stream
    assert torch.equal(torch.rand(64), out0)  # where the one seed draw left the replicated stream
