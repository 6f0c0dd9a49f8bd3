"""The zero-bubble I/W split of a stage's backward (memsave/pp/split_backward.py), in one process: I's input
gradients and W's weight gradients equal one full backward's (autograd on the same graph, FP32_TOL), W reaches the
weights' gradient hooks and computes no input gradient again, on stages with a weight used twice (two
intermediates), a weight no input reaches, a frozen weight, and no input at all."""

from __future__ import annotations

import torch
from torch import nn

from memsave.pp.split_backward import backward_input
from tests.compare import rel
from tests.pp_cases import FP32_TOL


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.shared = nn.Parameter(torch.randn(6, 6) / 3)  # used twice: two intermediates
        self.offset = nn.Parameter(torch.randn(6))  # added to a branch no input reaches
        self.frozen = nn.Linear(6, 6).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) @ self.shared
        h = self.frozen(torch.nn.functional.gelu(self.b(h) @ self.shared))
        return h * 2 + self.offset.exp()


def _grads(model: nn.Module, x: torch.Tensor, split: bool) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    leaf = x.detach().requires_grad_(x.requires_grad)
    out = model(leaf)
    g = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    if split:
        got, weight_pass = backward_input([out], [g], [leaf] if leaf.requires_grad else [])
        before = {n: p.grad for n, p in model.named_parameters()}
        assert all(v is None for v in before.values()), "I accumulated into a weight"
        weight_pass.run()
        dx = got[0] if got else None
    else:
        out.backward(g)
        dx = leaf.grad
    return dx, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_split_equals_full_backward() -> None:
    torch.manual_seed(0)
    model = Stage()
    for needs_input in (True, False):  # False: the first stage (nothing to send back; W does it all)
        x = torch.randn(5, 6, requires_grad=needs_input)
        dx_full, full = _grads(model, x, split=False)
        dx_split, split = _grads(model, x, split=True)
        assert sorted(full) == sorted(split) == ["a.bias", "a.weight", "b.bias", "b.weight", "offset", "shared"]
        for name in full:
            assert rel(split[name], full[name]) < FP32_TOL, name
        if needs_input:
            assert dx_full is not None and dx_split is not None and rel(dx_split, dx_full) < FP32_TOL


def test_weight_pass_runs_accumulate_hooks_and_not_the_input_path() -> None:
    torch.manual_seed(0)
    model = Stage()
    seen: list[str] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda _, name=name: seen.append(name))
    x = torch.randn(5, 6, requires_grad=True)
    out = model(x)
    calls: list[str] = []
    x_hook = x.register_hook(lambda g: calls.append("input"))
    got, weight_pass = backward_input([out], [torch.ones_like(out)], [x])
    assert calls == ["input"] and got[0] is not None and not seen
    weight_pass.run()
    x_hook.remove()
    assert calls == ["input"], "W computed the input gradient again"
    assert sorted(set(seen)) == ["a.bias", "a.weight", "b.bias", "b.weight", "offset", "shared"]
    assert seen.count("shared") == 1  # one accumulation per weight, not one per intermediate


def test_weight_no_input_reaches() -> None:
    """A stage output made of a weight alone (a learned token sent on beside the hidden state): that weight has no
    intermediate, so W takes its gradient from the roots."""
    torch.manual_seed(0)
    lin, token = nn.Linear(4, 4), nn.Parameter(torch.randn(4))
    x = torch.randn(3, 4, requires_grad=True)
    g1, g2 = torch.randn(3, 4), torch.randn(4)
    outs = [lin(x), token * 3]
    torch.autograd.backward(outs, [g1, g2])
    full = [t.grad.clone() for t in (lin.weight, lin.bias, token)]
    dx_full = x.grad.clone()
    for t in (lin.weight, lin.bias, token):
        t.grad = None
    leaf = x.detach().requires_grad_()
    got, weight_pass = backward_input([lin(leaf), token * 3], [g1, g2], [leaf])
    assert weight_pass.orphans == [token]
    weight_pass.run()
    assert rel(got[0], dx_full) < FP32_TOL
    for a, b in zip([lin.weight.grad, lin.bias.grad, token.grad], full):
        assert rel(a, b) < FP32_TOL


def test_weight_pass_rebuilds_each_recomputed_unit_once_and_releases_it() -> None:
    """Under full recomputation W rebuilds each unit once for all its autograd calls (one per group of weights:
    before, 7 per GPT block), and drops each rebuild's unread tensors (what only I needed) once the unit's calls
    are done: at most one unit's rebuild is held at a time (before, 0.64x the stage's activations at the pass's
    end). Gradients equal a full backward's with recomputation."""
    from memsave.models import GPT, gpt_config
    from memsave.recompute.checkpoint import recompute_unit, restore_unit, split_backward

    torch.manual_seed(0)
    model = GPT(gpt_config("small", dropout=0.0))
    blocks = list(model.blocks)
    x = torch.randn(2, 16, model.wte.embedding_dim)
    rebuilds = [0]
    for b in blocks:
        b.mlp_fc.register_forward_hook(lambda *_: rebuilds.__setitem__(0, rebuilds[0] + 1))
        recompute_unit(b)

    def stage(leaf: torch.Tensor) -> torch.Tensor:
        for b in blocks:
            leaf = b(leaf)
        return leaf

    full_x = x.clone().requires_grad_()
    out = stage(full_x)
    g = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    out.backward(g)
    full = {n: p.grad.clone() for n, p in model.blocks.named_parameters()}
    model.zero_grad(set_to_none=True)

    leaf = x.clone().requires_grad_()
    regions: list = []
    with split_backward(regions):
        out = stage(leaf)
    assert len(regions) == len(blocks)
    got, weight_pass = backward_input([out], [g], [leaf], regions)
    assert rel(got[0], full_x.grad) < FP32_TOL

    def held() -> int:  # the rebuilt tensors not yet read, over every unit
        return sum(t.untyped_storage().nbytes() for r in regions for d in r.frame.recomputed.values()
                   for t in d.values())

    most = [0]
    real = torch.autograd.backward

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        real(*args, **kwargs)
        most[0] = max(most[0], held())

    rebuilds[0] = 0
    torch.autograd.backward = counting
    try:
        weight_pass.run()
    finally:
        torch.autograd.backward = real
    assert rebuilds[0] == len(blocks)  # once per unit for the whole pass
    assert held() == 0
    for b in blocks:  # one unit's rebuilt activations: what a plain backward holds while it rebuilds a unit
        restore_unit(b)
    sizes: dict[int, int] = {}
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: sizes.__setitem__(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) or t,
            lambda t: t):
        blocks[0](x.clone().requires_grad_())
    one_unit = sum(sizes.values())
    assert 0 < most[0] <= one_unit, (most[0], one_unit)
    for n, p in model.blocks.named_parameters():
        assert rel(p.grad, full[n]) < FP32_TOL, n

