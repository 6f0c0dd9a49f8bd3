"""The default units of models without an ``nn.ModuleList`` ([Note: the default units] in memsave/models/units.py),
and units whose forward returns a custom object: the policy, what ``memsave.estimate`` gathers, and training under
ZeRO-3 and ZeRO-3 + recompute on 2 gloo ranks against plain single-process training on the same global batch.

Stage 3 on 2 ranks matches plain training within reduction-order rounding (each rank averages its half of the
batch, then the two halves are averaged): SGD with momentum keeps that at the rounding level, checked as
``||a - b|| <= 1e-5 ||b||`` per tensor after every step.
"""

from __future__ import annotations

import copy
import logging
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import memsave
from memsave import recompute
from memsave.estimator import format_estimates
from memsave.models.units import UnitPolicy, choose_units, default_units, output_tensors
from tests.compare import assert_close_norm
from tests.harness import run_ranks
from tests.toy import ToyLM

RTOL = 1e-5
D = 16


# -- models --------------------------------------------------------------------------------------------------------
def sequential(width: int = D, depth: int = 6) -> nn.Sequential:
    """No ModuleList: an nn.Sequential of linears and activations (the parameterless children are no units)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, width)]
    for _ in range(depth - 2):
        layers += [nn.Tanh(), nn.Linear(width, width)]
    return nn.Sequential(*layers, nn.Tanh(), nn.Linear(width, 1))


class Flat(nn.Module):
    """Neither a ModuleList nor a Sequential: linears as attributes, two groups of them in plain submodules, and a
    tiny norm that is a straggler of the size-based split."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.n = n
        self.inp = nn.Linear(8, D)
        self.a, self.b = nn.Module(), nn.Module()
        for i in range(n):
            setattr(self.a, f"fc{i}", nn.Linear(D, D))
            setattr(self.b, f"fc{i}", nn.Linear(D, D))
        self.norm = nn.LayerNorm(D, elementwise_affine=False, bias=False)
        self.scale = nn.Parameter(torch.ones(D))  # the root's own
        self.out = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for part in (self.a, self.b):
            for i in range(self.n):
                h = torch.tanh(getattr(part, f"fc{i}")(h))
        return self.out(self.norm(h) * self.scale)


class Out:
    """A block's output as a small class instance: the hidden state and a per-row (B, 1) term the loss uses too."""

    def __init__(self, h: torch.Tensor, aux: torch.Tensor) -> None:
        self.h, self.aux = h, aux
        self.me = self  # a cycle, which output_tensors must survive


class ObjBlock(nn.Module):
    """``kind``: "object" returns an :class:`Out` (the next block takes it as it is), "namespace" a
    ``types.SimpleNamespace``, "state" writes into the state object it was given and returns that."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: object) -> object:
        h = x.h if isinstance(x, Out | types.SimpleNamespace) else x
        assert isinstance(h, torch.Tensor)
        h = h + self.fc2(F.gelu(self.fc1(h)))  # (B, D)
        if self.kind == "object":
            return Out(h, h.square().mean(-1, keepdim=True))
        if self.kind == "namespace":
            return types.SimpleNamespace(h=h, aux=h.square().mean(-1, keepdim=True))
        assert isinstance(x, types.SimpleNamespace)
        x.h, x.aux = h, x.aux + h.square().mean(-1, keepdim=True)
        return x


class ObjNet(nn.Module):
    def __init__(self, kind: str, n: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.inp = nn.Linear(8, D)
        self.blocks = nn.ModuleList(ObjBlock(kind) for _ in range(n))
        self.out = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        state: object = types.SimpleNamespace(h=h, aux=h.new_zeros(h.shape[0], 1)) if self.kind == "state" else h
        aux = h.new_zeros(h.shape[0], 1)  # (B, 1)
        for block in self.blocks:
            state = block(state)
            if self.kind == "namespace":
                aux = aux + state.aux  # type: ignore[attr-defined]
                state = state.h  # type: ignore[attr-defined]
            elif self.kind == "object":
                aux = aux + state.aux  # type: ignore[attr-defined]
        if self.kind == "state":
            aux = state.aux  # type: ignore[attr-defined]
        h = state if isinstance(state, torch.Tensor) else state.h  # type: ignore[attr-defined]
        return self.out(h) + 1e-2 * aux


# -- the policy ----------------------------------------------------------------------------------------------------
def _check_disjoint(model: nn.Module, units: list[nn.Module]) -> None:
    for u in units:
        assert u is not model
        for v in units:
            assert u is v or not any(v is m for m in u.modules()), "units must not nest"


def test_policy_module_list_then_sequential_children() -> None:
    toy = ToyLM()
    assert default_units(toy) == list(toy.blocks)  # unchanged where there is a ModuleList
    seq = sequential()
    choice = choose_units(seq)
    assert choice.rule == "nn.Sequential"
    assert list(choice.modules) == [m for m in seq if isinstance(m, nn.Linear)]
    assert choice.names == ("0", "2", "4", "6", "8", "10")
    # the Sequential that holds most of the parameters and splits them finest: the inner one
    inner = nn.Sequential(*[nn.Linear(D, D) for _ in range(8)])
    model = nn.Sequential(nn.Embedding(10, D), inner, nn.Linear(D, 3))
    assert default_units(model) == list(inner)
    # a Sequential whose children are too coarse (two halves) is split by size instead
    coarse = nn.Sequential(Flat(), Flat())
    units = default_units(coarse)
    assert choose_units(coarse).rule == "size" and len(units) == 18  # 2 x (inp, 8 linears); the outs to the root
    _check_disjoint(coarse, units)


def test_policy_takes_every_tower_and_the_layers_inside_nested_lists() -> None:
    """[Note: every tower's blocks] An encoder's layers beside a decoder's (BART), a text tower beside a vision
    tower (CLIP): the blocks of both lists are units. Before, only the largest list's were, so ZeRO-3 kept the
    other tower whole on every rank in the root unit (45% of this BART's parameters). A list of lists
    (Funnel's encoder) gives its layers: a ModuleList's forward never runs, so as a unit its hooks never did and
    ZeRO-3 refused the model. A small list beside the layers (two norms) stays in the root."""
    from memsave.models.units import unit_parameters
    from tests.toy import hf_bart, hf_clip, hf_funnel

    def root_share(model: nn.Module, units: list[nn.Module]) -> float:
        groups = unit_parameters(model, units)
        return sum(p.numel() for _, p in groups[0]) / sum(p.numel() for p in model.parameters())

    bart = hf_bart()
    choice = choose_units(bart)
    assert choice.names == ("model.encoder.layers.0", "model.encoder.layers.1", "model.decoder.layers.0",
                            "model.decoder.layers.1")
    assert "blocks of the nn.ModuleLists 'model.encoder.layers', 'model.decoder.layers'" in choice.describe()
    assert root_share(bart, list(choice.modules)) < 0.15 < 0.4 < root_share(bart, list(bart.model.decoder.layers))
    clip = hf_clip()
    names = choose_units(clip).names
    assert names == tuple(f"{t}_model.encoder.layers.{i}" for t in ("text", "vision") for i in (0, 1))
    assert root_share(clip, list(choose_units(clip).modules)) < 0.2
    funnel = hf_funnel()
    assert choose_units(funnel).names == ("funnel.encoder.blocks.0.0", "funnel.encoder.blocks.1.0",
                                          "funnel.decoder.layers.0", "funnel.decoder.layers.1")
    toy = ToyLM()
    toy.norms = nn.ModuleList([nn.LayerNorm(16) for _ in range(2)])  # (d = 16)
    assert default_units(toy) == list(toy.blocks)
    _check_disjoint(bart, list(choice.modules))


def test_policy_size_based_without_sequential_or_module_list() -> None:
    model = Flat()
    choice = choose_units(model)
    assert choice.rule == "size"
    # 4 * 2 linears of 272 parameters, inp (144), out (17), scale (16): 2,353 in all, 148 a unit (16 units).
    # a and b (1,088 each) are split into their linears; inp stays whole (indivisible); out (17 < 148 / 8) is a
    # straggler left to the root; the root's own scale is the root's anyway
    assert choice.names == ("inp", *(f"a.fc{i}" for i in range(4)), *(f"b.fc{i}" for i in range(4)))
    _check_disjoint(model, list(choice.modules))
    assert "9 units (size-based" in choice.describe()
    # a larger unit size: a and b are units of their own
    names = choose_units(model, policy=UnitPolicy(unit_num_params=1100)).names
    assert names == ("inp", "a", "b")
    # 1,177 a unit: inp (144) joins out as a straggler too (161 in the root)
    assert choose_units(model, policy=UnitPolicy(target_units=2)).names == ("a", "b")
    assert choose_units(nn.Linear(3, 3)).modules == ()  # only the root holds parameters
    with pytest.raises(ValueError, match="target_units = 0 is not allowed"):
        UnitPolicy(target_units=0)
    with pytest.raises(ValueError, match="unit_num_params = -1 is not allowed"):
        UnitPolicy(unit_num_params=-1)


def test_default_units_say_once_what_they_chose() -> None:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("memsave")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        for _ in range(3):
            default_units(sequential(depth=5))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    said = [r for r in records if "children of the model, an nn.Sequential" in r]
    assert said == ["memsave: 5 units (children of the model, an nn.Sequential): 0, 2 .. 8; pass units= to choose "
                    "others"], records


def test_recompute_default_units_of_a_sequential() -> None:
    seq = sequential()
    plan = recompute.apply(None, "full", model=seq)
    assert plan.names == ("0", "2", "4", "6", "8", "10")
    recompute.remove(plan, model=seq)


def test_estimate_gathers_one_unit_of_a_sequential() -> None:
    """ZeRO-3 keeps the root and the unit in use gathered: for 6 linears in an nn.Sequential (no ModuleList) that
    is one linear, not the whole model as when the root was the only unit."""
    width = 1024
    with torch.device("meta"):
        model = sequential(width=width, depth=6)
    one = (width * width + width) * 4  # the biggest linear, fp32
    whole = sum(p.numel() for p in model.parameters()) * 4
    est = memsave.estimate(model, "zero3", world_size=4, device="cpu")
    assert est.bytes["params_gathered"] == one, (est.bytes["params_gathered"], one, whole)
    assert est.units.startswith("units: 6 units (children of the model, an nn.Sequential)")
    assert est.units in est.notes and est.units in format_estimates([est])
    # the size-based split too, and units= still overrides
    with torch.device("meta"):
        flat = Flat()
    est = memsave.estimate(flat, "zero3", world_size=2, device="cpu")
    root = (17 + 16) * 4  # out (a straggler) and scale
    assert est.bytes["params_gathered"] == root + (D * D + D) * 4
    est = memsave.estimate(flat, "zero3", world_size=2, device="cpu", units=[flat.a, flat.b])
    # at most the root (inp, out, scale) and a: at the peak, a may already be freed with its reduce in flight
    assert (144 + 17 + 16) * 4 <= est.bytes["params_gathered"] <= (144 + 17 + 16 + 4 * (D * D + D)) * 4
    assert est.units == "units: 2 given (units=)"


# -- outputs that are objects --------------------------------------------------------------------------------------
@dataclass
class _Pair:
    a: torch.Tensor
    b: object


class _Slots:
    __slots__ = ("t", "unset")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def test_output_tensors_look_into_plain_objects() -> None:
    x, y, z, w = (torch.full((1,), float(i)) for i in range(4))
    out = Out(x, y)
    ns = types.SimpleNamespace(first=out, pair=_Pair(z, _Slots(w)), module=nn.Linear(2, 2), fn=len)
    ns.again = ns
    found = list(output_tensors([ns, {"k": (x,)}]))
    assert [t.item() for t in found] == [0.0, 1.0, 2.0, 3.0, 0.0]  # modules not entered, cycles once
    assert list(output_tensors(ToyLM)) == [] and list(output_tensors("text")) == []


def test_recompute_replays_the_inputs_of_the_first_call() -> None:
    """Blocks that write into the state object they were given: without a snapshot of it the replay in backward
    would read the final state (wrong numbers, or torch's CheckpointError on a shape change)."""
    x = torch.randn(4, 8)
    for kind in ("state", "object", "namespace"):
        ref = ObjNet(kind)
        for block in ref.blocks:
            block.fc1 = nn.Sequential(block.fc1, nn.Dropout(0.2))  # the replay must draw the same masks
        for policy in ("full", "selective"):
            runs = []
            for on in (False, True):
                model = copy.deepcopy(ref)
                if on:
                    recompute.apply(None, policy, model=model)
                torch.manual_seed(3)
                model(x).square().mean().backward()
                runs.append([p.grad for p in model.parameters()])
            for i, (a, b) in enumerate(zip(*runs, strict=True)):
                assert torch.equal(a, b), f"{kind}, {policy}: gradient {i} differs"


def test_recompute_shape_changing_state_object() -> None:
    class Grow(nn.Module):
        def __init__(self, i: int, o: int) -> None:
            super().__init__()
            self.fc = nn.Linear(i, o)

        def forward(self, s: types.SimpleNamespace) -> types.SimpleNamespace:
            s.h = torch.tanh(self.fc(s.h))
            return s

    torch.manual_seed(0)
    ref = nn.ModuleList([Grow(8, 16), Grow(16, 32), Grow(32, 4)])
    x = torch.randn(4, 8)
    grads = []
    for on in (False, True):
        blocks = copy.deepcopy(ref)
        if on:
            recompute.apply(list(blocks), "full")
        s = types.SimpleNamespace(h=x)
        for b in blocks:
            s = b(s)
        s.h.square().mean().backward()
        grads.append([p.grad for p in blocks.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_recompute_holds_positional_tensors_only_through_the_hooks() -> None:
    """The snapshot of the inputs leaves the positional tensors to the checkpoint, which keeps them through the
    saved-tensor hooks (what activation offload and compression rely on): nothing else holds them by reference."""
    unit = nn.Linear(4, 4)
    recompute.apply([unit], "full")
    x = torch.randn(2, 4, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        h = x * 2  # (B, 4)
        alive = weakref.ref(h)
        out = unit(h)
        del h
    assert alive() is None, "a recomputed unit holds its positional input by reference"
    out.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, 2 * unit.weight.sum(0).expand(2, 4))


class _KeywordUnit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(D, D), nn.Dropout(0.5)

    def forward(self, *, h: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc(h))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_recompute_replays_gpu_dropout_of_tensors_inside_objects_and_keywords() -> None:
    """torch's checkpoint stashes the random state of the devices of the positional tensors it sees; tensors that
    come inside an object or as keywords get an anchor so the replay draws the same GPU dropout masks."""
    x = torch.randn(4, 8, device="cuda")
    for kind in ("object", "state"):
        ref = ObjNet(kind).cuda()
        for block in ref.blocks:
            block.fc1 = nn.Sequential(block.fc1, nn.Dropout(0.5))
        grads = []
        for on in (False, True):
            model = copy.deepcopy(ref)
            if on:
                recompute.apply(None, "full", model=model)
            torch.cuda.manual_seed(5)
            model(x).square().mean().backward()
            grads.append([p.grad for p in model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True)), kind
    torch.manual_seed(0)
    ref_unit = _KeywordUnit().cuda()
    grads = []
    for on in (False, True):
        unit = copy.deepcopy(ref_unit)
        if on:
            recompute.apply([unit], "full")
        torch.cuda.manual_seed(6)
        unit(h=x.new_ones(4, D)).square().sum().backward()
        grads.append([p.grad for p in unit.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True)), "keyword input"


# -- training on 2 ranks against plain single-process training ----------------------------------------------------
def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)  # the global batch: (B, in), (B, out)


def _train_against_plain(build: Callable[[], nn.Module], profile: str, mesh: memsave.Mesh,
                         units_of: Callable[[nn.Module], list[nn.Module]] | None = None) -> list[str]:
    """Train under ``profile`` (each rank on its half of the global batch) and plainly on the whole batch; compare
    losses and parameters after every step. Returns the names of the ZeRO units."""
    ref = build()
    plain_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    model = copy.deepcopy(ref)
    model, opt = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), profile, mesh=mesh,
                              units=units_of(model) if units_of else None)
    rows = slice(4 * mesh.dp_rank, 4 * mesh.dp_rank + 4)
    what = f"{type(ref).__name__} {getattr(ref, 'kind', '')} {profile}"
    for step in range(3):
        x, y = _batch(step)
        loss = F.mse_loss(model(x[rows]), y[rows])
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        ref_loss = F.mse_loss(ref(x), y)
        ref_loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()
        state = model.state_dict()
        for name, p in ref.state_dict().items():
            assert_close_norm(state[name], p, f"{what}: {name} after step {step}", RTOL)
    return [u.name for u in model.memsave_engine.units if not u.is_root]


def _cases() -> dict[str, list[str] | str]:
    """Every case in one spawn; a failing case is reported by its own test, not by all of them."""
    mesh = memsave.init()
    assert mesh.dp_size == 2
    builds: dict[str, Callable[[], nn.Module]] = {"sequential": sequential, "flat": Flat}
    for kind in ("object", "namespace", "state"):
        builds[kind] = lambda kind=kind: ObjNet(kind)
    units: dict[str, list[str] | str] = {}
    for profile in ("zero3", "zero3-recompute"):
        for name, build in builds.items():
            try:
                units[f"{name} {profile}"] = _train_against_plain(build, profile, mesh)
            except Exception as exc:
                units[f"{name} {profile}"] = f"{type(exc).__name__}: {exc}"
    return units


@pytest.fixture(scope="module")
def trained() -> list[dict[str, list[str] | str]]:
    return run_ranks(_cases, 2, timeout=300)


@pytest.mark.parametrize("profile", ["zero3", "zero3-recompute"])
def test_sequential_trains_like_plain_with_its_children_as_units(trained: list[dict], profile: str) -> None:
    for rank in trained:
        assert rank[f"sequential {profile}"] == ["0", "2", "4", "6", "8", "10"]
        assert rank[f"flat {profile}"] == ["inp", *(f"a.fc{i}" for i in range(4)), *(f"b.fc{i}" for i in range(4))]


@pytest.mark.parametrize("kind", ["object", "namespace", "state"])
@pytest.mark.parametrize("profile", ["zero3", "zero3-recompute"])
def test_blocks_returning_objects_train_like_plain(trained: list[dict], kind: str, profile: str) -> None:
    for rank in trained:
        assert rank[f"{kind} {profile}"] == ["blocks.0", "blocks.1", "blocks.2"]
