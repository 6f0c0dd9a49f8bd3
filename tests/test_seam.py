"""The composition seam of issue 18: placements, the Engine protocol, the unit lifecycle, ``memsave.parallelize``
and the one ``MemsaveOptimizer``; a mesh axis that cannot be trained yet is refused, never ignored."""

from __future__ import annotations

import copy

import pytest
import torch

import memsave
from memsave import dist as mdist
from memsave.dist import Partial, Placement, Replicate, Shard
from memsave.engines import DataParallelEngine, Engine, MemsaveOptimizer
from memsave.phases import TrainingState, UnitState
from tests.harness import run_ranks
from tests.toy import ToyLM, toy_batch


def test_placement_is_plain_data() -> None:
    rows = Placement(dp=Shard(0))
    assert rows.sharded_axes() == ("dp",) and rows.differs_along() == ("dp",)
    assert Placement().differs_along() == () and Placement().grad_sync_axes() == ("dp",)
    assert Placement(dp=Partial()).differs_along() == ("dp",) and Placement(dp=Partial()).grad_sync_axes() == ()
    # a padded dim-0 shard: ceil(5 / 2) rows of 3; a TP column shard of it as well: ceil(3 / 2) columns
    assert rows.local_numel((5, 3), degrees={"dp": 2}) == 9
    assert Placement(dp=Shard(0), tp=Shard(1)).local_numel((5, 3), degrees={"dp": 2, "tp": 2}) == 6
    assert Placement(dp=Shard(0)).local_numel((), degrees={"dp": 4}) == 1  # a scalar: one padded row per rank
    assert rows.with_axis("tp", Replicate()) == rows
    with pytest.raises(ValueError, match="placement for axis 'dp' is 'rows'"):
        Placement(dp="rows")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mesh axis 'ep' is not allowed"):
        rows.along("ep")


def _norm_counts_each_parameter_once() -> list[float]:
    mesh = memsave.init()
    torch.manual_seed(0)
    replicated = torch.randn(7)  # the same on both ranks: counted once, not twice
    full = torch.randn(6, 3)  # rows 0-2 on rank 0, 3-5 on rank 1
    mine = full[3 * mesh.dp_rank : 3 * mesh.dp_rank + 3]
    parts = {(): replicated.pow(2).sum(), ("dp",): mine.pow(2).sum()}
    total = mdist.sum_over_shards(parts, {"dp": mesh.dp_group})
    maxed = mdist.sum_over_shards({(): replicated.abs().max(), ("dp",): mine.abs().max()}, {"dp": mesh.dp_group},
                                  op=mdist.ReduceOp.MAX)
    expect = replicated.pow(2).sum() + full.pow(2).sum()
    return [float(total - expect), float(maxed - torch.cat([replicated, full.flatten()]).abs().max())]


def test_a_sum_over_parameters_counts_each_once() -> None:
    for errors in run_ranks(_norm_counts_each_parameter_once, 2, timeout=120):
        assert errors == pytest.approx([0.0, 0.0], abs=1e-5)


@pytest.mark.parametrize("profile", ["ddp", "zero1", "zero3"])
def test_engines_follow_the_protocol(profile: str) -> None:
    model = ToyLM(n_blocks=2)
    model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), profile)
    engine = model.memsave_engine
    assert isinstance(engine, Engine) and isinstance(opt, MemsaveOptimizer)
    assert isinstance(engine, DataParallelEngine) == (profile == "ddp")
    expect = Placement() if profile == "ddp" else Placement(dp=Shard(0))
    assert {engine.placement_of(s) for _, s in engine.stepped()} == {expect}
    assert isinstance(opt, torch.optim.Optimizer) and opt.param_groups is opt.optimizer.param_groups


def test_stage3_lifecycle_has_named_states() -> None:
    model = ToyLM(n_blocks=2)
    model, opt = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=1e-2), "zero3")
    schedule, units = model.memsave_engine.schedule, model.memsave_engine.units
    assert schedule.state is TrainingState.IDLE and all(u.state is UnitState.SHARDED for u in units)
    out = model(**toy_batch(0, 2))
    assert schedule.state is TrainingState.AWAIT_BACKWARD
    with torch.no_grad():  # a metric pass between forward and backward: nested, back to waiting
        model(**toy_batch(1, 2))
    assert schedule.state is TrainingState.AWAIT_BACKWARD
    opt.backward(out.loss)
    assert schedule.state is TrainingState.IDLE and all(u.state is UnitState.SHARDED for u in units)
    with pytest.raises(AssertionError, match="SHARDED -> UNSHARDED is not a transition"):
        units[1]._enter(UnitState.UNSHARDED)  # a unit is never unsharded without its gather
    model.unshard()
    assert all(u.state is UnitState.UNSHARDED for u in units)
    model.reshard()
    assert all(u.state is UnitState.SHARDED for u in units)


def test_parallelize_then_compose_by_hand_equals_wrap() -> None:
    torch.manual_seed(0)
    ref = ToyLM(n_blocks=2)
    a, b = copy.deepcopy(ref), copy.deepcopy(ref)
    a, opt_a = memsave.wrap(a, torch.optim.AdamW(a.parameters(), lr=1e-2), "zero2")
    engine = memsave.parallelize(b, profile="zero2")
    assert engine is b.memsave_engine
    opt_b = MemsaveOptimizer(torch.optim.AdamW(b.parameters(), lr=1e-2), engine)
    for step in range(3):
        for m, o in ((a, opt_a), (b, opt_b)):
            o.backward(m(**toy_batch(step, 2)).loss)
            o.clip_grad_norm(1.0)
            o.step()
            o.zero_grad()
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def _refuses_tp_and_pp(axis: str) -> list[str]:
    mesh = memsave.init(**{axis: 2})
    model = ToyLM(n_blocks=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    errors = []
    # tp: a model memsave has no plan for, and no tp_plan given (pp: tests/test_pp.py, which splits such models)
    kind = ValueError
    for call in (lambda: memsave.wrap(model, opt, "zero2", mesh=mesh),
                 lambda: memsave.parallelize(model, mesh, "ddp")):
        with pytest.raises(kind) as info:
            call()
        errors.append(str(info.value))
    assert type(model) is ToyLM and not model._forward_hooks  # a refused wrap loses nothing
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    return errors


@pytest.mark.parametrize("axis", ["tp"])
def test_a_tp_or_pp_axis_is_refused_not_ignored(axis: str) -> None:
    for errors in run_ranks(_refuses_tp_and_pp, 2, axis, timeout=120):
        for text in errors:
            assert "memsave has no plan for a ToyLM" in text and "tp_plan=" in text


def _refuses_a_cpu_tensor_over_nccl() -> str:
    from memsave.dist import collectives

    mesh = memsave.init()
    collectives._IS_NCCL[id(mesh.dp_group)] = True  # as an NCCL group reports itself (no GPU here)
    with pytest.raises(ValueError) as info:
        mdist.all_reduce(torch.ones(3), mesh.dp_group)
    del collectives._IS_NCCL[id(mesh.dp_group)]
    mdist.all_reduce(torch.ones(3), mesh.dp_group)  # gloo takes it
    return str(info.value)


def test_dist_refuses_a_tensor_off_the_groups_device() -> None:
    for text in run_ranks(_refuses_a_cpu_tensor_over_nccl, 2, timeout=120):
        assert "all_reduce: a (3,) torch.float32 tensor on cpu over an NCCL group" in text


def test_a_profile_asking_for_tp_or_pp_is_refused() -> None:
    model = ToyLM(n_blocks=2)
    profile = memsave.load_profile("zero3", ["parallel.pp=4"])  # the one-process mesh has no pp axis either
    with pytest.raises(ValueError, match=r"\[parallel\] pp = 4 but the mesh has pp = 1"):
        memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), profile)
    profile = memsave.load_profile("zero3", ["parallel.tp=2"])  # the one-process mesh has no tp axis
    with pytest.raises(ValueError, match=r"\[parallel\] tp = 2 but the mesh has tp = 1"):
        memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), profile)
    assert type(model) is ToyLM
