"""Activation recomputation: bit-exact losses and gradients against no recomputation (dropout on), the bytes
each policy keeps for backward, and the same under memsave.wrap with DDP and ZeRO-1/2/3 on 2 ranks.

Saved bytes are counted with ``memsave.recompute.measure_saved_bytes`` (saved-tensor hooks, distinct
storages, parameters excluded). On the tiny GPT (B=2, T=64, d=64) one block's input is 2*64*64*4 = 32 KiB.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import memsave
from memsave import recompute
from memsave.models import GPT, gpt_config
from memsave.recompute.plan import PLAN_ATTR
from tests.harness import run_ranks
from tests.toy import hf_gpt2

B, T = 2, 64
POLICIES = ("full", "every:2", "selective")


def _gpt(dropout: float = 0.1, n_layer: int = 2) -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", dropout=dropout, n_layer=n_layer))


def _batch(step: int, rows: int = B, vocab: int = 256, seq: int = T) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, vocab, (rows, seq + 1), generator=g)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def _train(model: nn.Module, steps: int = 2, batch=_batch) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Losses and the gradients of the last step; the same RNG stream for every run (dropout masks)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    losses: list[torch.Tensor] = []
    for step in range(steps):
        opt.zero_grad()
        loss = model(**batch(step)).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        losses.append(loss.detach())
    return losses, grads


def _assert_bitwise(run: tuple, ref: tuple, what: str) -> None:
    (losses, grads), (ref_losses, ref_grads) = run, ref
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert torch.equal(a, b), f"{what}: loss of step {i} differs: {a.item()!r} != {b.item()!r}"
    assert grads.keys() == ref_grads.keys(), what
    for n, g in grads.items():
        assert torch.equal(g, ref_grads[n]), f"{what}: gradient of {n} differs by {(g - ref_grads[n]).abs().max()}"


# -- single process: exactness ---------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", [*POLICIES, "budget:300KiB"])
def test_recompute_is_bitwise_exact_with_dropout(policy: str) -> None:
    base = _gpt(dropout=0.1)
    ref = _train(copy.deepcopy(base))
    model = copy.deepcopy(base)
    keys, cls = list(model.state_dict()), type(model.blocks[0])
    plan = recompute.apply(None, policy, model=model, example_inputs=_batch(0) if "budget" in policy else None)
    expected = {"full": 2, "every:2": 1, "selective": 2, "budget:300KiB": 2}[policy]
    assert len(plan.units) == expected and plan.names[0] == "blocks.0", plan
    assert all(recompute.is_recomputed(u) for u in plan.units)
    assert type(model.blocks[0]) is cls and list(model.state_dict()) == keys  # same object, class and keys
    _assert_bitwise(_train(model), ref, policy)
    assert recompute.remove(model.blocks) == expected
    assert not any("forward" in b.__dict__ for b in model.blocks)


class _BufferBlock(nn.Module):
    """A unit whose forward updates buffers in place: BatchNorm's statistics, spectral_norm's power iteration, and
    an EMA of its activations that the forward then reads."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8))
        self.bn = nn.BatchNorm1d(8)
        self.register_buffer("ema", torch.zeros(8))
        self.register_buffer("ema_data", torch.zeros(8))  # written through .data: its version does not move

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.fc(x))
        with torch.no_grad():
            self.ema.lerp_(h.mean(0), 0.5)
        self.ema_data.data.mul_(0.5).add_(h.detach().mean(0), alpha=0.5)
        return x + torch.tanh(h) * self.ema + h * self.ema_data


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_a_replay_updates_no_buffer_twice(policy: str) -> None:
    """[Note: buffers a forward changes]: buffers, parameters and losses equal training without recomputation
    (before the fix: num_batches_tracked 6 after 3 steps, running statistics moved twice, spectral_norm's weight
    6.5e-2 off, the EMA-reading unit's gradients off)."""
    torch.manual_seed(0)
    base = nn.Sequential(_BufferBlock(), _BufferBlock(), nn.Linear(8, 3))
    runs = []
    for recomputed in (False, True):
        model = copy.deepcopy(base)
        if recomputed:
            recompute.apply(list(model[:2]), policy, model=model)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        g = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(3):
            loss = nn.functional.cross_entropy(model(torch.randn(8, 8, generator=g)), torch.randint(0, 3, (8,), generator=g))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        runs.append((losses, model.state_dict()))
    (ref_losses, ref), (losses, got) = runs
    assert got["0.bn.num_batches_tracked"].item() == 3
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    for k, v in ref.items():
        assert torch.equal(got[k], v), f"{policy}: {k} differs by {(got[k].float() - v.float()).abs().max()}"


def test_a_large_buffer_a_recomputed_forward_changes_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: buffers a forward changes]: buffers over 1 MiB are not copied for the replay; one the forward changes
    is said, naming it, and one it leaves alone is not."""
    from memsave import _logging

    class Big(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("table", torch.zeros(2**19))  # 2 MiB of fp32
            self.register_buffer("mask", torch.ones(2**19))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.table[:4].add_(1.0)
            return self.fc(x) * self.mask[:4]

    said: list[str] = []
    monkeypatch.setattr(_logging, "_warned", set())
    monkeypatch.setattr(_logging.get_logger(), "warning", lambda msg, *a, **k: said.append(msg))
    model = nn.Sequential(Big())
    recompute.apply([model[0]], "full", model=model)
    model(torch.randn(2, 4)).sum().backward()
    assert len(said) == 1 and "buffer 'table' of Big (over 1 MiB) changed" in said[0], said


def test_selective_is_refused_around_a_gru_and_budget_recomputes_it_fully() -> None:
    """[Note: no selective recomputation around a GRU]: torch's selective checkpoint trains an nn.GRU with wrong
    gradients (17% off, no error); memsave refuses "selective" on such a unit, naming it and "full", and the
    budget policy recomputes it fully, exactly."""
    class Rec(nn.Module):
        def __init__(self, cls: type[nn.Module]) -> None:
            super().__init__()
            self.rnn = cls(8, 8, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.rnn(x)[0]

    torch.manual_seed(0)
    base = nn.Sequential(Rec(nn.GRU), Rec(nn.LSTM), nn.Linear(8, 3))
    other = copy.deepcopy(base)
    with pytest.raises(NotImplementedError, match=r"unit '0', which holds an nn.GRU.*policy = \"full\""):
        recompute.apply(list(other[:2]), "selective", model=other)
    cell = nn.Sequential(nn.GRUCell(8, 8))
    with pytest.raises(NotImplementedError, match=r"which holds an nn.GRUCell"):
        recompute.apply([cell[0]], "selective", model=cell)
    x = torch.randn(4, 5, 8)
    runs = []
    for policy in (None, "budget:1920B"):  # the least it can keep: every unit full
        model = copy.deepcopy(base)
        plan = recompute.apply(list(model[:2]), policy, model=model, example_inputs=(x,)) if policy else None
        model(x).square().sum().backward()
        runs.append([p.grad.clone() for p in model.parameters()])
    assert plan is not None and plan.kinds[0] == "full", plan.kinds  # the GRU unit; the LSTM may be selective
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_every_k_recomputes_units_0_k_2k() -> None:
    model = _gpt(n_layer=5)
    plan = recompute.apply(list(model.blocks), "every:2", model=model)
    assert plan.names == ("blocks.0", "blocks.2", "blocks.4")
    recompute.remove(plan)
    assert recompute.apply(list(model.blocks), memsave.config.RecomputeConfig(policy="every:3")).names == (
        "units[0]", "units[3]")


def test_hooks_on_a_unit_run_once_and_no_grad_skips_the_checkpoint() -> None:
    model = _gpt()
    calls = {"pre": 0, "post": 0}
    block = model.blocks[1]
    block.register_forward_pre_hook(lambda *_: calls.__setitem__("pre", calls["pre"] + 1))
    block.register_forward_hook(lambda *_: calls.__setitem__("post", calls["post"] + 1))
    recompute.apply(None, "full", model=model)
    model(**_batch(0)).loss.backward()
    assert calls == {"pre": 1, "post": 1}, "recomputation must not re-run the unit's own hooks"
    with torch.no_grad():
        out = model(**_batch(0))
    assert out.loss.grad_fn is None and calls["pre"] == 2


def test_save_ops_override_and_bad_arguments() -> None:
    base = _gpt(dropout=0.0)
    ref = _train(copy.deepcopy(base), steps=1)
    model = copy.deepcopy(base)
    recompute.apply(None, "selective", model=model, save_ops=[torch.ops.aten.mm.default])
    _assert_bitwise(_train(model, steps=1), ref, "selective, save_ops=[mm]")
    with pytest.raises(ValueError, match="already recomputed"):
        recompute.apply(None, "full", model=model)
    with pytest.raises(ValueError, match=r"OpOverload.*aten\.mm\.default"):
        recompute.apply(None, "selective", model=_gpt(), save_ops=[torch.ops.aten.mm])
    with pytest.raises(ValueError, match='save_ops= applies to the "selective"'):
        recompute.apply(None, "full", model=_gpt(), save_ops=[torch.ops.aten.mm.default])
    with pytest.raises(ValueError, match=r"recompute\.policy.*'sometimes'"):
        recompute.apply(None, "sometimes", model=_gpt())
    with pytest.raises(ValueError, match="not a submodule"):
        recompute.apply([nn.Linear(2, 2)], "full", model=_gpt())


def test_selective_policy_never_saves_random_ops() -> None:
    """[Note: random ops are recomputed] in memsave/recompute/policy.py."""
    aten = torch.ops.aten
    q = torch.zeros(1, 1, 4, 2)
    pol = recompute.SelectivePolicy([*recompute.DEFAULT_SAVE_OPS, aten.bernoulli_.float])
    assert pol.saves(aten.mm.default, (q, q), {}) and pol.saves(aten.addmm.default, (q, q, q), {})
    flash = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert flash in recompute.DEFAULT_SAVE_OPS
    assert pol.saves(flash, (q, q, q), {}) and pol.saves(flash, (q, q, q, 0.0), {})
    assert not pol.saves(flash, (q, q, q, 0.1), {}) and not pol.saves(flash, (q, q, q), {"dropout_p": 0.1})
    assert not pol.saves(aten.bernoulli_.float, (q, 0.5), {}), "a random op is recomputed even when listed"
    assert not pol.saves(aten.gelu.default, (q,), {})
    # ... and listing the dropout op keeps the recomputation exact
    base = _gpt(dropout=0.1)
    ref = _train(copy.deepcopy(base), steps=1)
    model = copy.deepcopy(base)
    recompute.apply(None, "selective", model=model, save_ops=pol.save_ops)
    _assert_bitwise(_train(model, steps=1), ref, "selective, bernoulli_ listed")


# -- models without a ModuleList, keyword arguments, dataclass and ModelOutput outputs -------------------------
@dataclasses.dataclass
class _Pair:
    y: torch.Tensor
    aux: tuple[torch.Tensor, int]


class _KwBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor, debug: bool = False) -> _Pair:
        h = self.drop(torch.tanh(self.fc(x))) * scale  # `debug` collides with checkpoint's own keyword
        return _Pair(y=x + h, aux=(h.sum(), 3))


class _KwNet(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = _KwBlock(d), _KwBlock(d)
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.a(x, scale=self.scale, debug=True)
        q = self.b(p.y, scale=self.scale * 2)
        return (q.y.square().mean() + p.aux[0] * 1e-3) * p.aux[1]


def test_sequential_with_explicit_units_and_keyword_dataclass_units() -> None:
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(4, 8)

    def run(m: nn.Module) -> tuple:
        torch.manual_seed(2)
        loss = m(x).square().mean()
        loss.backward()
        return [loss.detach()], {n: p.grad for n, p in m.named_parameters()}

    ref = run(copy.deepcopy(seq))
    assert recompute.apply(None, "full", model=copy.deepcopy(seq)).names == ("0", "3", "5")  # its children
    m = copy.deepcopy(seq)
    plan = recompute.apply([m[0], m[3]], "full", model=m)
    assert plan.names == ("0", "3")
    _assert_bitwise(run(m), ref, "nn.Sequential, units=[0, 3]")

    net = _KwNet()
    x = torch.randn(3, 16)
    ref = run(copy.deepcopy(net))
    for policy in POLICIES:
        m = copy.deepcopy(net)
        recompute.apply([m.a, m.b], policy, model=m)
        _assert_bitwise(run(m), ref, f"keyword arguments, dataclass outputs, {policy}")


def test_hf_gpt2_keyword_forward_and_model_output() -> None:
    pytest.importorskip("transformers")
    base = hf_gpt2()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def batch(step: int) -> dict[str, torch.Tensor]:  # no KV cache: a replayed forward must not see its own keys
        return {"input_ids": ids, "labels": ids, "use_cache": False}

    ref = _train(copy.deepcopy(base), batch=batch)
    for policy in POLICIES:
        model = copy.deepcopy(base)
        plan = recompute.apply(None, policy, model=model)
        assert plan.names[0] == "transformer.h.0"
        _assert_bitwise(_train(model, batch=batch), ref, f"HF GPT-2, {policy}")


# -- saved bytes per policy ------------------------------------------------------------------------------------
def _saved(policy: str, budget_batch: dict | None = None) -> recompute.SavedBytes:
    model = _gpt(dropout=0.1)
    recompute.apply(None, policy, model=model, example_inputs=budget_batch)
    batch = _batch(0)
    return recompute.measure_saved_bytes(lambda: model(**batch), list(model.blocks), model=model)


def test_saved_activation_bytes_per_policy() -> None:
    x_bytes = B * T * 64 * 4  # one block's input: (B, T, d) fp32
    s = {p: _saved(p) for p in ("none", *POLICIES)}
    for p, r in s.items():
        print(f"{p:>10}: per unit {r.units}, outside {r.outside}, total {r.total} B")
    none, full, every2, sel = s["none"], s["full"], s["every:2"], s["selective"]
    assert none.inputs == full.inputs == (x_bytes, x_bytes)
    assert full.units == full.inputs, "a fully recomputed unit keeps only its input"
    assert full.outside == none.outside  # what lies outside the units is untouched
    assert full.total == none.total - sum(none.units) + sum(full.units)  # no unit saves another's storage here
    assert every2.units == (full.units[0], none.units[1])
    assert all(f < s_ < n for f, s_, n in zip(full.units, sel.units, none.units)), (full.units, sel.units, none.units)
    assert full.total < sel.total < none.total and full.total < every2.total < none.total
    # the estimate used by budget: from the none measurement, recomputing both blocks, is what full measures
    assert none.estimate({0, 1}) == full.total and none.estimate({0}) == every2.total
    # budget: recompute whole units, largest first, until it fits; the measurement then honours the budget
    one_block = none.estimate({0})  # fits with one block recomputed, not with none
    b = _saved(f"budget:{one_block}B", _batch(0))
    assert b.total <= one_block and b.units == every2.units
    tight = _saved(f"budget:{full.total}B", _batch(0))
    assert tight.total <= full.total and tight.units == full.units


def test_measurement_frees_what_it_counted() -> None:
    """A saved op output (tanh saves its own result) must not outlive the measurement: the pack hook once
    returned the tensor itself, which made an autograd cycle and leaked a whole forward per measurement."""
    import gc
    import weakref

    torch.manual_seed(0)
    unit = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    refs: list[weakref.ref] = []
    unit[1].register_forward_hook(lambda m, a, out: refs.append(weakref.ref(out)))
    x = torch.randn(4, 8)
    saved = recompute.measure_saved_bytes(lambda: unit(x).sum(), [unit], model=unit)
    assert saved.units == (2 * 4 * 8 * 4,)  # the input x (for the weight gradient) and tanh's output
    gc.collect()
    assert refs and refs[0]() is None


def test_budget_refuses_what_cannot_fit_and_needs_inputs() -> None:
    model = _gpt()
    minimum = _saved("full").total
    with pytest.raises(ValueError, match=rf"budget of 1.00 KiB \(1024 B\) cannot be met.*keeps .*\({minimum} B\)"):
        recompute.apply(None, "budget:1KiB", model=model, example_inputs=_batch(0))
    with pytest.raises(ValueError, match="example_inputs="):
        recompute.apply(None, "budget:1GiB", model=model)
    assert not any(recompute.is_recomputed(b) for b in model.blocks)
    plan = recompute.apply(None, "budget:1GiB", model=model, example_inputs=lambda: model(**_batch(0)))
    assert plan.units == () and plan.measured is not None and plan.estimated_bytes == plan.measured.total


def _plan_and_measure(budget: int, **gpt: object) -> tuple[recompute.RecomputePlan, recompute.SavedBytes]:
    model = _gpt(**gpt)  # type: ignore[arg-type]
    plan = recompute.apply(None, f"budget:{budget}B", model=model, example_inputs=_batch(0))
    assert getattr(model, PLAN_ATTR) is plan and plan.summary.startswith("recompute policy budget:")
    batch = _batch(0)
    return plan, recompute.measure_saved_bytes(lambda: model(**batch), list(model.blocks), model=model)


def _options(n_layer: int = 4) -> recompute.SavedBytes:
    """The budget planner's measurement of the 4-block tiny GPT without dropout (CPU flash attention): there a
    block costs ~19 MFLOP-equivalents forward and ~4 of them are what selective recomputation re-runs."""
    model = _gpt(dropout=0.0, n_layer=n_layer)
    measured = recompute.apply(None, "budget:1GiB", model=model, example_inputs=_batch(0)).measured
    assert measured is not None and len(measured.costs) == n_layer
    assert all(0 < c.selective < c.forward / 2 for c in measured.costs), measured.costs
    return measured


def test_budget_prefers_selective_when_it_fits() -> None:
    m = _options()
    every = set(range(4))
    all_selective = m.estimate(set(), every)
    assert m.estimate(every) < all_selective < m.estimate({0}) < m.total  # one full block does not fit
    plan, after = _plan_and_measure(all_selective, dropout=0.0, n_layer=4)
    assert plan.kinds == ("selective",) * 4 and plan.estimated_bytes == all_selective
    assert after.total == plan.estimated_bytes <= all_selective
    assert "selective for blocks.0-3" in plan.summary
    # a looser budget needs fewer units: the planner does not recompute more than the fit needs
    plan, after = _plan_and_measure((all_selective + m.total) // 2, dropout=0.0, n_layer=4)
    assert set(plan.kinds) == {"selective"} and 0 < len(plan.units) < 4 and after.total <= (all_selective + m.total) // 2


def test_budget_recomputes_fully_where_needed_and_the_measurement_fits() -> None:
    m = _options()
    every = set(range(4))
    full, all_selective = m.estimate(every), m.estimate(set(), every)
    for budget in (full, (full + all_selective) // 2, all_selective - 1):
        plan, after = _plan_and_measure(budget, dropout=0.0, n_layer=4)
        assert "full" in plan.kinds, (budget, plan.kinds)
        assert after.total == plan.estimated_bytes <= budget, (budget, plan.kinds, after.total)
    plan, _ = _plan_and_measure(full, dropout=0.0, n_layer=4)
    assert plan.kinds == ("full",) * 4
    # with dropout the tiny GPT's attention runs the math path, whose softmax and masks make selective
    # recomputation cost ~60% of a block's forward: one full block is cheaper than two selective ones
    plan, after = _plan_and_measure(_saved("every:2").total, dropout=0.1)
    assert plan.kinds == ("full",) and after.total <= _saved("every:2").total


def test_plan_summary_and_attribute_for_every_policy() -> None:
    model = _gpt()
    plan = recompute.apply(None, "every:2", model=model)
    assert plan.kinds == ("full",) and plan.summary == "recompute policy every:2: full for blocks.0"
    assert model.memsave_recompute_plan is plan
    recompute.remove(plan, model=model)
    assert not hasattr(model, PLAN_ATTR)
    plan = recompute.apply(None, "selective", model=model)
    assert plan.summary == "recompute policy selective: selective for blocks.0-1"


# -- under memsave.wrap: DDP and ZeRO-1/2/3 on 2 ranks ---------------------------------------------------------
def _wrapped_run(profile: str, policy: str, rank: int, world: int, model: nn.Module, batch,
                 overrides: tuple[str, ...] = ()) -> dict:
    from memsave.dist import COMM_STATS
    from memsave.phases import ShardedState

    def local(step: int) -> dict:
        return {k: v.chunk(world)[rank] if isinstance(v, torch.Tensor) else v for k, v in batch(step).items()}

    mesh = memsave.init()
    overrides = (*overrides, f'recompute.policy="{policy}"') if policy != "none" else overrides
    model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                              memsave.load_profile(profile, overrides), mesh=mesh,
                              example_inputs=local(0) if policy.startswith("budget") else None)
    torch.manual_seed(10 + rank)  # each rank its own dropout masks, the same with and without recompute
    losses, gathers, resharded = [], [], True
    for step in range(2):
        local_batch = local(step)
        with COMM_STATS.measure() as comm:
            loss = model(**local_batch).loss
            opt.backward(loss)
        gathers.append((comm.calls["all_gather"], comm.bytes["all_gather"]))
        if profile.startswith("zero3"):
            resharded &= all(u.state is ShardedState.SHARDED for u in model.memsave_engine.units)
        grads = (opt.full_grads() if profile != "ddp" else
                 {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    params = {k: v.clone() for k, v in model.state_dict().items()}
    # numpy, not tensors: tensors cross the process boundary as shared memory that dies with the child
    return {"losses": [t.numpy() for t in losses], "grads": {k: v.numpy() for k, v in grads.items() if v is not None},
            "params": {k: v.numpy() for k, v in params.items()}, "gathers": gathers, "resharded": resharded,
            "recomputed": [recompute.is_recomputed(b) for b in model.modules() if b is not model]}


def _wrap_cases(world: int) -> dict:
    rank = memsave.init().dp_rank
    out: dict = {}
    gpt = _gpt(dropout=0.1)
    for profile in ("ddp", "zero1", "zero2", "zero3"):
        for policy in ("none", *POLICIES):
            out[profile, policy] = _wrapped_run(profile, policy, rank, world, copy.deepcopy(gpt),
                                                lambda step: _batch(step, rows=2 * world))
    # budget through wrap: 1.2 MiB fits with one of the two blocks recomputed (see the saved-bytes test)
    out["zero3", "budget:1.2MiB"] = _wrapped_run("zero3", "budget:1.2MiB", rank, world, copy.deepcopy(gpt),
                                                  lambda step: _batch(step, rows=2 * world))
    # stage 3's schedule knobs: no prefetch, parameters kept from forward to backward
    for knob in ("zero.prefetch=0", "zero.reshard_after_forward=false"):
        for policy in ("none", "full"):
            out["zero3", knob, policy] = _wrapped_run("zero3", policy, rank, world, copy.deepcopy(gpt),
                                                      lambda step: _batch(step, rows=2 * world), (knob,))
    out["zero3-recompute"] = _wrapped_run("zero3-recompute", "none", rank, world, copy.deepcopy(gpt),
                                          lambda step: _batch(step, rows=2 * world))
    hf = hf_gpt2()
    ids = torch.randint(0, 64, (2 * world, 16), generator=torch.Generator().manual_seed(0))
    for policy in ("none", "full", "selective"):
        out["hf zero3", policy] = _wrapped_run("zero3", policy, rank, world, copy.deepcopy(hf),
                                               lambda step: {"input_ids": ids, "labels": ids, "use_cache": False})
    return out


@pytest.fixture(scope="module")
def wrapped() -> list[dict]:
    return run_ranks(_wrap_cases, 2, 2, timeout=150)


def _flatten(run: dict) -> tuple:
    return [torch.from_numpy(a) for a in run["losses"]], {
        **{f"grad {k}": torch.from_numpy(v) for k, v in run["grads"].items()},
        **{f"param {k}": torch.from_numpy(v) for k, v in run["params"].items()}}


@pytest.mark.parametrize("profile", ["ddp", "zero1", "zero2", "zero3"])
@pytest.mark.parametrize("policy", POLICIES)
def test_wrap_recompute_is_bitwise_exact(wrapped: list[dict], profile: str, policy: str) -> None:
    for rank, out in enumerate(wrapped):
        run, ref = out[profile, policy], out[profile, "none"]
        _assert_bitwise(_flatten(run), _flatten(ref), f"{profile} {policy} rank {rank}")
        assert sum(run["recomputed"]) == (1 if policy == "every:2" else 2)
        assert not any(ref["recomputed"])


@pytest.mark.parametrize("policy", POLICIES)
def test_zero3_recompute_adds_no_gather_and_reshards(wrapped: list[dict], policy: str) -> None:
    for out in wrapped:
        run, ref = out["zero3", policy], out["zero3", "none"]
        assert run["gathers"] == ref["gathers"], "recomputation must reuse the gather of the unit's backward"
        assert run["resharded"] and ref["resharded"], "every unit SHARDED after backward"


def test_zero3_recompute_budget_and_schedule_knobs(wrapped: list[dict]) -> None:
    for out in wrapped:
        run, ref = out["zero3", "budget:1.2MiB"], out["zero3", "none"]
        _assert_bitwise(_flatten(run), _flatten(ref), "zero3 budget:1.2MiB")
        assert sum(run["recomputed"]) == 1 and run["gathers"] == ref["gathers"] and run["resharded"]
        for knob in ("zero.prefetch=0", "zero.reshard_after_forward=false"):
            run, ref = out["zero3", knob, "full"], out["zero3", knob, "none"]
            _assert_bitwise(_flatten(run), _flatten(ref), f"zero3 {knob} full")
            assert run["gathers"] == ref["gathers"] and run["resharded"], knob


def test_zero3_recompute_preset_and_hf_gpt2_under_zero3(wrapped: list[dict]) -> None:
    assert memsave.load_profile("zero3-recompute").recompute.policy == "full"
    for out in wrapped:
        _assert_bitwise(_flatten(out["zero3-recompute"]), _flatten(out["zero3", "full"]), "zero3-recompute preset")
        for policy in ("full", "selective"):
            run, ref = out["hf zero3", policy], out["hf zero3", "none"]
            _assert_bitwise(_flatten(run), _flatten(ref), f"HF GPT-2 zero3 {policy}")
            assert run["gathers"] == ref["gathers"] and run["resharded"]


class _ChangesAMatmulOutput(nn.Module):
    """Funnel Transformer's ``positional_attn *= cls_mask``: an op that selective recomputation saves (a matmul,
    here through einsum's view of it) changed in place afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.einsum("bi,ij->bj", x, self.w)
        scores *= (torch.arange(8) % 2).float()  # in place on the cached output
        return torch.tanh(scores) @ self.w


def test_selective_recomputes_a_saved_output_the_forward_changed() -> None:
    """[Note: cached outputs the forward changed] torch raised in backward ("Tensor cached during selective
    activation checkpoint has been mutated"); the op is recomputed from its replayed inputs instead: gradients
    bitwise equal to no recomputation."""
    torch.manual_seed(0)
    net = nn.Sequential(_ChangesAMatmulOutput(), _ChangesAMatmulOutput())
    x = torch.randn(4, 8)

    def run(m: nn.Module) -> tuple:
        loss = m(x).square().mean()
        loss.backward()
        return [loss.detach()], {n: p.grad for n, p in m.named_parameters()}

    ref = run(copy.deepcopy(net))
    m = copy.deepcopy(net)
    recompute.apply(list(m), "selective", model=m)
    _assert_bitwise(run(m), ref, "an in-place change of a saved matmul output")


def test_torch_2_11_selective_cache_lists_are_counted_and_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11 keeps selective recomputation's cache as one list per op and hands the policy no output
    (memsave/recompute/checkpoint.py, [Note: selective cache seen on every torch]): each entry is reported to a
    measurement as it is stored; under a split backward the entries are read in order from the first at every
    recompute, not popped (a recompute may stop early), and without one popped as torch does."""
    from memsave.recompute import checkpoint as ckpt
    from memsave.recompute.measure import measure_saved_bytes

    monkeypatch.setattr(ckpt, "_POLICY_SEES_OUTPUT", False)
    kept = torch.zeros(1000)

    class Wrapper:  # torch's _VersionWrapper: the value in .val
        def __init__(self, val: torch.Tensor) -> None:
            self.val = val

    entries = ckpt._ListEntries()

    class Caching(torch.nn.Module):  # a unit whose forward stores an op's output in the cache, as torch's mode does
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            entries.append(Wrapper(kept))
            return x * 2

    unit = Caching()
    saved = measure_saved_bytes(lambda: unit(torch.ones(1, 2, requires_grad=True)), [unit])
    assert saved.units[0] == kept.numel() * 4  # counted as the unit's
    first, second = Wrapper(torch.ones(1)), Wrapper(torch.ones(2))
    split = ckpt._KeptListEntries()
    split.extend([first, second])
    for _ in range(2):  # two recomputes, the second after the first stopped after one read
        split._read = 0  # what _RewindingCachedMode does as each recompute enters
        assert split.pop(0) is first
    assert split.pop(0) is second and len(split) == 2
    plain = ckpt._ListEntries()
    plain.extend([first, second])
    assert plain.pop(0) is first and len(plain) == 1


def test_packed_rows_under_recompute_say_the_mask_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed rows (position_ids restarting inside a row, no attention mask): the use_cache=False that recompute
    passes makes transformers mask each document apart, so the loss differs from the model at its defaults (as
    under HF's gradient checkpointing); said once, and equal with use_cache=False in the user's call."""
    from memsave import _logging
    from tests.harness import LogRecords
    from tests.toy import hf_llama

    monkeypatch.setattr(_logging, "_warned", set())
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(5), torch.arange(7)]).expand(2, 12)  # two documents per row
    ref = hf_llama()
    model = copy.deepcopy(ref)
    model, _ = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0),
                            memsave.load_profile("ddp", ["recompute.policy=full"]))
    records = LogRecords()
    _logging.get_logger().addHandler(records)
    try:
        packed = model(input_ids=ids, position_ids=pos, labels=ids).loss
    finally:
        _logging.get_logger().removeHandler(records)
    assert any("position_ids without an attention_mask (packed rows?)" in m for m in records.messages)
    with torch.no_grad():
        default = float(ref(input_ids=ids, position_ids=pos, labels=ids).loss)  # one causal mask over the row
        uncached = float(ref(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss)
    assert float(packed.detach()) != default and float(packed.detach()) == uncached
