"""In-place edits of the model's weights between steps reach the fp32 masters ([Note: edits between steps] in
memsave/precision/edits.py): WGAN's clipping through ``p.data`` and a padding row zeroed under ``no_grad``, under
ddp, ZeRO-1 and ZeRO-2 with bf16 (and ddp with fp16, ZeRO-2 with offloaded masters), at 1 and 2 ranks.

The reference is plain torch built by hand: a bf16 copy of the model and fp32 masters stepped by the same
optimizer, the gradient of each rank's half batch pre-divided and summed in bf16 (what the engines' all-reduce and
reduce-scatter compute), and after the user's edit each master taking the edited low-precision value where the
user changed it. Every case is compared bit for bit (model and masters), and a run without edits refreshes no
master (the same numbers as before masters followed edits).
"""

from __future__ import annotations

import copy

import pytest
import torch

import memsave
from tests.harness import run_ranks
from tests.toy import ToyLM, toy_batch

STEPS, ROWS, CLIP = 3, 4, 0.05


def _clamp(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.data.clamp_(-CLIP, CLIP)  # WGAN: p.data, which does not move p._version


def _pad_row(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model.embed.weight[0].zero_()  # type: ignore[index]


EDITS = {"none": None, "clamp": _clamp, "pad_row": _pad_row}

# (name, profile, overrides, dtype, loss scale, edit, optimizer)
CASES = [
    ("ddp-bf16", "ddp-bf16", (), torch.bfloat16, 1.0),
    ("zero1-bf16", "zero1", ('precision.compute="bf16"',), torch.bfloat16, 1.0),
    ("zero2-bf16", "zero2-bf16", (), torch.bfloat16, 1.0),
    ("ddp-fp16", "ddp", ('precision.compute="fp16"', "precision.loss_scale=1024.0"), torch.float16, 1024.0),
    ("zero2-bf16-offload", "zero2-bf16", ('offload.optimizer="cpu"',), torch.bfloat16, 1.0),
    # ZeRO-3: edited between model.unshard() and model.reshard() ([Note: edits of gathered parameters])
    ("zero3-bf16", "zero3-bf16", (), torch.bfloat16, 1.0),
    ("zero3-bf16-disk", "zero3-bf16", ('offload.params="disk"', 'offload.optimizer="disk"'), torch.bfloat16, 1.0),
]


def _make_opt(params: list, name: str) -> torch.optim.Optimizer:
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=5e-3)
    return torch.optim.AdamW(params, lr=5e-3, weight_decay=0.1)


def _base(dtype: torch.dtype) -> ToyLM:
    model = ToyLM(seed=0)
    with torch.no_grad():  # masters are made from the cast weights: start from values the cast keeps
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    return model


def _local(b: dict, rank: int, world: int) -> dict:
    r = ROWS // world
    return {k: v[rank * r : (rank + 1) * r] for k, v in b.items()}


def _reference(dtype: torch.dtype, scale: float, edit: str, opt_name: str, world: int) -> tuple[dict, list]:
    low = copy.deepcopy(_base(dtype)).to(dtype)
    params = [p for p in low.parameters() if p.requires_grad]
    masters = [p.detach().float().requires_grad_() for p in params]
    opt = _make_opt(masters, opt_name)
    for step in range(STEPS):
        b = toy_batch(step, ROWS)
        summed: list[torch.Tensor] = []
        for r in range(world):
            low.zero_grad(set_to_none=True)
            (low(**_local(b, r, world)).loss * scale).backward()
            part = [p.grad.div(world) for p in params]  # pre-divided in the compute dtype, as the engines do
            summed = part if not summed else [a + c for a, c in zip(summed, part)]
        for m, g in zip(masters, summed):
            m.grad = g.float() * torch.full((), 1.0 / scale)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        if EDITS[edit] is not None:
            EDITS[edit](low)
            with torch.no_grad():  # the user's edit reaches the master where it changed the low-precision value
                for p, m in zip(params, masters):
                    m.copy_(torch.where(p != m.to(dtype), p.float(), m))
    return low.state_dict(), [m.detach() for m in masters]


def _memsave(profile: str, overrides: tuple, dtype: torch.dtype, edit: str, opt_name: str,
             mesh: memsave.Mesh, tmp: str) -> tuple[dict, list, int, int]:
    model = _base(dtype)
    opt_in = _make_opt([p for p in model.parameters() if p.requires_grad], opt_name)
    extra = (f'offload.path="{tmp}"',) if any("offload" in o for o in overrides) else ()
    model, opt = memsave.wrap(model, opt_in, memsave.load_profile(profile, [*overrides, *extra]), mesh=mesh)
    for step in range(STEPS):
        b = _local(toy_batch(step, ROWS), mesh.dp_rank, mesh.dp_size)
        opt.backward(model(**b).loss)
        opt.step()
        opt.zero_grad()
        if EDITS[edit] is not None:
            model.unshard()  # (a no-op but at ZeRO-3)
            EDITS[edit](model)
            model.reshard()
    edits = getattr(opt.mp, "edits", None)
    refreshed, watched = (edits.num_refreshed, len(edits.entries)) if edits is not None else (0, 0)
    if profile.startswith("zero3"):  # the shards written back, where no parameter is watched
        refreshed, watched = model.memsave_engine.edit_windows.num_written_back, 0
    sd = opt.state_dict()  # its masters hold the edit after the last step too
    return ({k: v.clone() for k, v in model.state_dict().items()}, sd["master_params"], refreshed, watched)


def _cases(tmp: str) -> list[tuple[str, str, str, bool, int, int]]:
    mesh = memsave.init()
    out = []
    for name, profile, overrides, dtype, scale in CASES:
        for edit, opt_name in (("none", "adamw"), ("clamp", "rmsprop"), ("pad_row", "adamw")):
            want_sd, want_masters = _reference(dtype, scale, edit, opt_name, mesh.dp_size)
            got_sd, got_masters, refreshed, watched = _memsave(profile, overrides, dtype, edit, opt_name, mesh, tmp)
            same = (all(torch.equal(got_sd[k], v) for k, v in want_sd.items())
                    and len(got_masters) == len(want_masters)
                    and all(torch.equal(a, b) for a, b in zip(got_masters, want_masters)))
            biggest = max(float(m.abs().max()) for m in got_masters)
            out.append((name, edit, f"max |master| {biggest:.4g}", same, refreshed, watched))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_edits_reach_masters(world: int, tmp_path: object) -> None:
    results = run_ranks(_cases, world, str(tmp_path), timeout=120)
    for rank, cases in enumerate(results):
        for name, edit, info, same, refreshed, watched in cases:
            where = f"{name} world {world} rank {rank} edit {edit} ({info})"
            assert same, f"{where}: memsave's weights or masters differ from the hand-built reference"
            if edit == "none":  # nothing edited: no master is refreshed (no pass over the weights)
                assert refreshed == 0, f"{where}: {refreshed} masters refreshed without an edit"
            elif name.startswith("zero3"):  # written back at every reshard: the clamped rows, the padding row (rank 0's)
                assert refreshed >= STEPS or (edit == "pad_row" and rank > 0), f"{where}: {refreshed} written back"
            elif edit == "clamp":  # every watched parameter, after every step but the last (read by state_dict)
                assert refreshed == watched * (STEPS - 1), f"{where}: {refreshed} refreshes, {watched} watched"


def test_reads_between_steps_keep_only_what_the_user_holds() -> None:
    """``p.data`` read every forward (or in a loop that never steps) keeps no tensor per read, and an edit
    through a temporary or a kept ``.data`` is still seen after many later reads."""
    from memsave.precision.edits import _HANDED, EditWatch

    p = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16))
    watch = EditWatch([(p.detach().float(), p, p)])
    for _ in range(1000):
        p.data.sum()
    assert len(p.__dict__[_HANDED]) <= 1 and watch.edited() == []
    p.data.clamp_(-0.1, 0.1)  # through a temporary, then many reads
    for _ in range(100):
        p.data.sum()
    assert watch.edited() == [0]
    watch.mark()
    kept = p.data
    for _ in range(100):
        p.data.sum()
    assert len(p.__dict__[_HANDED]) <= 2 and watch.edited() == []
    kept.mul_(0.5)  # a tensor taken before the reads, written after them
    assert watch.edited() == [0]
