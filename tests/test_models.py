"""The reference GPT and the embedded corpus: shapes, init, tying, meta construction, batches, training."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from memsave.models import GPT, Block, TokenBatches, corpus_text, corpus_tokens, gpt_config
from memsave.models.gpt import GPTConfig


def tiny(**overrides: object) -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", **overrides))


def test_forward_shapes_and_finite_loss() -> None:
    model = tiny()
    batch = TokenBatches(seq_len=16, batch_size=3).batch(0)
    out = model(**batch)
    assert out.logits.shape == (3, 16, 256)
    assert out.loss is not None and out.loss.ndim == 0 and torch.isfinite(out.loss)
    assert model(batch["input_ids"]).loss is None


def test_loss_at_init_is_about_ln_vocab() -> None:
    # Tied weights lean a little towards repeating the current byte (runs of spaces are common), hence 0.15.
    batch = TokenBatches(seq_len=64, batch_size=16).batch(0)
    for tie_weights in (True, False):
        loss = tiny(tie_weights=tie_weights)(**batch).loss
        assert loss is not None and abs(loss.item() - math.log(256)) < 0.15


def test_ignore_index_and_too_long_sequence() -> None:
    model = tiny()
    ids = torch.randint(0, 256, (2, 8))
    assert torch.isnan(model(ids, labels=torch.full((2, 8), -100)).loss)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size=64"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_tied_weights_share_storage_and_count_once() -> None:
    tied, untied = tiny(), tiny(tie_weights=False)
    assert tied.lm_head.weight.data_ptr() == tied.wte.weight.data_ptr()
    assert untied.lm_head.weight.data_ptr() != untied.wte.weight.data_ptr()
    assert untied.num_parameters() - tied.num_parameters() == 256 * 64
    assert tied.num_parameters() == sum(p.numel() for p in set(tied.parameters()))


def test_pos_buffer_not_in_state_dict() -> None:
    model = tiny()
    assert "pos" in dict(model.named_buffers())
    assert "pos" not in model.state_dict()
    tiny().load_state_dict(model.state_dict())  # strict load works without it


def test_meta_construction_then_materialize() -> None:
    with torch.device("meta"):
        model = GPT(gpt_config("tiny"))
    assert all(p.is_meta for p in model.parameters()) and model.pos.is_meta
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    reference = tiny()
    assert torch.equal(model.pos, torch.arange(64))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    assert model.lm_head.weight is model.wte.weight


def test_init_is_deterministic_and_scales_residual_projections() -> None:
    a, b = tiny(), tiny()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    block = a.blocks[0]
    assert isinstance(block, Block)
    assert block.qkv.bias is not None and not block.qkv.bias.any()
    assert block.mlp_proj.weight.std().item() < 0.02 / math.sqrt(2 * 2) * 1.2


def test_bench_parameter_count() -> None:
    with torch.device("meta"):
        tied = GPT(gpt_config("bench"))
        untied = GPT(gpt_config("bench", tie_weights=False))
    assert tied.num_parameters() == 23_240_704
    assert untied.num_parameters() == 27_435_008


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"d_model": 65, "n_head": 2}, "divisible"),
        ({"n_layer": 0}, "n_layer"),
        ({"vocab_size": 2.5}, "vocab_size"),
        ({"dropout": 1.0}, "dropout"),
    ],
)
def test_config_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)  # type: ignore[arg-type]


def test_unknown_size_lists_allowed() -> None:
    with pytest.raises(ValueError, match="tiny"):
        gpt_config("huge")


def test_corpus_is_cached_bytes() -> None:
    tokens = corpus_tokens()
    assert corpus_tokens() is tokens and tokens.dtype == torch.int64
    assert len(tokens) > 100_000 and int(tokens.min()) >= 0 and int(tokens.max()) <= 255
    assert bytes(tokens[:1000].tolist()) == corpus_text().encode()[:1000]


def test_rank_slices_concatenate_to_global_batch() -> None:
    dp_size = 4
    ranks = [
        TokenBatches(seq_len=8, batch_size=2, dp_rank=r, dp_size=dp_size, seed=3) for r in range(dp_size)
    ]
    single = TokenBatches(seq_len=8, batch_size=2 * dp_size, seed=3)
    for step in (0, 5):
        for key in ("input_ids", "labels"):
            joined = torch.cat([r.batch(step)[key] for r in ranks])
            assert torch.equal(joined, single.batch(step)[key])
            assert torch.equal(joined, ranks[1].global_batch(step)[key])


def test_batches_are_deterministic_and_shifted() -> None:
    a, b = TokenBatches(seq_len=16, batch_size=4), TokenBatches(seq_len=16, batch_size=4)
    it = iter(a)
    for step in range(3):
        batch = next(it)
        assert torch.equal(batch["input_ids"], b.batch(step)["input_ids"])
        assert batch["input_ids"].shape == (4, 16) and batch["labels"].dtype == torch.int64
        assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    assert not torch.equal(a.batch(0)["input_ids"], a.batch(1)["input_ids"])
    for seed in (1, 2**32):
        other = TokenBatches(seq_len=16, batch_size=4, seed=seed)
        assert not torch.equal(a.batch(0)["input_ids"], other.batch(0)["input_ids"])


def test_train_and_val_are_disjoint() -> None:
    train = TokenBatches(seq_len=8, batch_size=2, val_fraction=0.1)
    val = TokenBatches(seq_len=8, batch_size=2, split="val", val_fraction=0.1)
    assert len(train.tokens) + len(val.tokens) == len(corpus_tokens())
    assert train.tokens.data_ptr() + len(train.tokens) * 8 == val.tokens.data_ptr()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seq_len": 0}, "seq_len"),
        ({"batch_size": -1}, "batch_size"),
        ({"dp_rank": 2, "dp_size": 2}, "dp_rank"),
        ({"dp_size": 0}, "dp_size"),
        ({"split": "test"}, "split"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"seq_len": 10**7}, "seq_len"),
    ],
)
def test_token_batches_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"seq_len": 8, "batch_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        TokenBatches(**args)  # type: ignore[arg-type]


@pytest.fixture
def one_thread() -> Iterator[None]:
    # Tiny ops gain nothing from threads, and spinning intra-op threads crawl on a busy machine.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.mark.usefixtures("one_thread")
def test_short_training_lowers_loss() -> None:
    model = tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = iter(TokenBatches(seq_len=32, batch_size=8))
    losses = []
    for _ in range(30):
        loss = model(**next(data)).loss
        assert loss is not None
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
