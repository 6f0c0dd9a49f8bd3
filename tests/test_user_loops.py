"""The training loops users really write, on 2 gloo ranks, each against plain single-process training of the same
model on the same global batch: partial freezing and LoRA under ZeRO-3, ``model.zero_grad()`` and the inner
optimizer's ``zero_grad()``, ``model.load_state_dict`` after wrap under bf16, HF's ``inputs_embeds`` idiom, a
``no_grad`` pass mid-step, a gradient penalty; and the misuses that must raise instead of returning a wrong number.

Every case below failed on the main branch before these fixes (the closing note of issue 17 has the table).
"""

from __future__ import annotations

import copy
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import memsave
from tests.compare import assert_close_norm
from tests.harness import run_ranks
from tests.toy import ToyLM, add_lora, hf_llama, hf_whisper, toy_batch

STEPS = 3
ROWS = 2  # per rank


def _global_batch(step: int, vocab: int = 32) -> dict[str, torch.Tensor]:
    b = toy_batch(step, 2 * ROWS, vocab=vocab)
    return {"input_ids": b["input_ids"], "labels": b["labels"]}


def _local(batch: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    return {k: v[rank * ROWS : (rank + 1) * ROWS] for k, v in batch.items()}


def _toy_loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(b["input_ids"], labels=b["labels"]).loss


def _hf_loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=b["input_ids"], labels=b["input_ids"]).loss


def _hf_masked_loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    """HF's defaults left as they are (use_cache=True) with an attention mask: under recompute the replay would
    append to the key/value cache a second time."""
    mask = torch.ones_like(b["input_ids"])
    mask[:, :2] = 0  # left padding
    return model(input_ids=b["input_ids"], attention_mask=mask, labels=b["input_ids"]).loss


def _hf_embeds_loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    """Prompt tuning / NEFTune / multimodal: the embeddings come from the model's own table, outside its forward."""
    embeds = model.get_input_embeddings()(b["input_ids"])
    return model(inputs_embeds=embeds * 1.5, labels=b["input_ids"]).loss


class _RewardModel(nn.Module):
    """The user's module around an unchanged HF model (a reward / classifier head): memsave's recompute passes
    use_cache=False to the HF model inside too (only the root's was: the replay appended to the key/value cache a
    second time and eager attention with a mask raised a shape error)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = hf_llama(tied=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)


def _reward_loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    mask = torch.ones_like(b["input_ids"])
    mask[:, :2] = 0
    return model(b["input_ids"], mask).loss


def _token_mean_loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    """The README's global token mean: ignored labels (-100) differ per rank, so each rank's summed loss is scaled
    by dp / the global count, and the average over dp is the single-process mean over the global batch."""
    from memsave import dist as mdist

    labels = b["labels"].masked_fill(b["input_ids"] % 3 == 0, -100)
    logits = model(b["input_ids"], labels=b["labels"]).logits
    loss_sum = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    n, dp = (labels != -100).sum().float(), 1
    if len(labels) == ROWS:  # this rank's half
        dp = mdist.group_size(None)
        mdist.all_reduce(n, None)
    return loss_sum * dp / n


class _RaiseInBackward(torch.autograd.Function):
    """Identity whose backward raises: an out-of-memory error in the middle of a backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("out of memory (simulated)")


def _train(model: nn.Module, opt: Any, loss_fn: Callable, rank: int | None, *, zero: str = "optimizer",
           eval_mid_step: bool = False, penalty: bool = False, sgd: bool = False,
           freeze_after: int | None = None, clip: str = "", raise_at: int = -1, drop: str = "") -> list[float]:
    """The loop under test. ``rank=None``: the plain reference on the global batch; else rank's half under memsave."""
    losses = []
    boom = {"step": False}  # the first block's output raises in backward: the later blocks' gradients exist (and
    if raise_at >= 0:  # are being reduced) by then
        model.blocks[0].register_forward_hook(lambda m, a, out: _RaiseInBackward.apply(out) if boom["step"] else None)
    for step in range(STEPS):
        boom["step"] = step == raise_at
        batch = _global_batch(step, vocab=32 if loss_fn in (_toy_loss, _token_mean_loss) else 64)
        b = batch if rank is None else _local(batch, rank)
        loss = loss_fn(model, b)
        if eval_mid_step:  # a metric / teacher pass between the training forward and its backward
            with torch.no_grad():
                loss_fn(model, b)
        if penalty:  # a gradient penalty (WGAN-GP / R1 style): a gradient, differentiated again; linear in the
            x = model.embed.weight  # gradient so that the average over ranks is the global batch's penalty
            (g,) = torch.autograd.grad(loss, x, create_graph=True)
            loss = loss + (g * torch.linspace(-1, 1, g.numel()).view_as(g)).sum()
        try:
            if rank is None:
                loss.backward()
            else:
                opt.backward(loss)
        except RuntimeError as exc:  # the OOM-skip idiom: clear and go on with the next batch
            assert "simulated" in str(exc), exc
            opt.zero_grad()
            losses.append(float("nan"))
            continue
        if drop == "none":  # one gradient cleared between backward and step: torch skips the parameter
            model.blocks[0].fc1.weight.grad = None
        elif drop == "zero_":  # zeroed: torch steps it with a zero gradient (momentum goes on)
            model.blocks[1].fc2.weight.grad.zero_()
        elif drop == "module":  # a submodule's zero_grad
            model.blocks[0].zero_grad()
        opt.step()
        if clip:  # WGAN-style clipping through p.data, gathered by hand at ZeRO-3 (freed by reshard, or not)
            if rank is not None:
                model.unshard()
            for p in model.parameters():
                if clip == "assign":  # as often written: a new tensor assigned ([Note: replaced data])
                    p.data = p.data.clamp(-0.05, 0.05)
                else:
                    p.data.clamp_(-0.05, 0.05)
            if rank is not None and clip in ("reshard", "assign"):
                model.reshard()
        if zero == "every_other":  # gradients accumulated over two steps on purpose, as plain torch allows
            if step % 2:
                opt.zero_grad()
        elif zero == "model_in_place":  # the reference too: a frozen parameter's zeroed gradient is still stepped
            model.zero_grad(set_to_none=False)
        elif rank is None or zero == "optimizer":
            opt.zero_grad()
        elif zero == "model":
            model.zero_grad()
        elif zero == "inner":
            opt.optimizer.zero_grad()
        elif zero == "manual":
            for p in model.parameters():
                p.grad = None
        elif zero == "manual_optimizer":  # what the optimizer holds (FSDP2 users' loop; a custom zero_grad)
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = None
        if step == freeze_after:  # a block frozen after wrap (its cleared gradients stay as they are)
            model.blocks[1].requires_grad_(False)
        losses.append(loss.item())
    return losses


def _compare(build: Callable[[], nn.Module], profile: str, loss_fn: Callable, mesh: Any, what: str,
             rtol: float = 2e-5, **loop: Any) -> None:
    ref = build()
    model = copy.deepcopy(ref)
    make_opt = (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)) if loop.get("sgd") else (
        lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    ref_opt = make_opt([p for p in ref.parameters() if p.requires_grad])
    model, opt = memsave.wrap(model, make_opt([p for p in model.parameters() if p.requires_grad]), profile,
                              mesh=mesh)
    _train(ref, ref_opt, loss_fn, None, **loop)
    _train(model, opt, loss_fn, mesh.dp_rank, **loop)
    got = model.state_dict()  # collective at stage 3
    for k, v in ref.state_dict().items():
        assert_close_norm(got[k].float(), v.float(), f"{what} [{profile}] {k}", rtol)


def _cleared_by_hand_with_masters(mesh: Any) -> None:
    """[Note: gradients cleared through the optimizer] Under bf16 the optimizer holds fp32 masters, and with
    ``reduce = "fp32"`` the averaged gradient lives in an fp32 bucket, not in ``.grad``: clearing either by hand
    changed nothing, and from the third step on each step stepped the sum of two steps' gradients. Each loop must
    equal the one clearing with ``optimizer.zero_grad()`` bit for bit; gradients kept over a step on purpose
    (``every_other``) must still add up: at the second step, the first step's gradient plus the second's."""
    def run(profile: memsave.Profile, zero: str) -> tuple[list[float], dict[str, torch.Tensor], list[Any]]:
        model = ToyLM(n_blocks=2)
        model, opt = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), profile,
                                  mesh=mesh)
        grads = []
        opt.step = (lambda step: lambda: (grads.append(opt.full_grads()), step())[1])(opt.step)
        losses = _train(model, opt, _toy_loss, mesh.dp_rank, zero=zero)
        return losses, {k: v.float() for k, v in model.state_dict().items()}, grads

    for name, reduce in (("ddp", "fp32"), ("ddp", "compute"), ("zero2", "fp32"), ("zero3", "compute")):
        profile = memsave.load_profile(name, ["precision.compute=bf16", f"precision.reduce={reduce}"])
        losses, params, grads = run(profile, "optimizer")
        for zero in ("manual", "manual_optimizer"):
            got = run(profile, zero)
            assert got[0] == losses, (name, reduce, zero, got[0], losses)
            assert all(torch.equal(got[1][k], v) for k, v in params.items()), (name, reduce, zero)
        # [Note: a gradient cleared before the step] (the fp32 bucket's average, the shard's rows were stepped)
        # (through the model's parameter; through the optimizer's tensor, the fp32 master, which was stepped too)
        for through in ("model", "optimizer"):
            model = ToyLM(n_blocks=2)
            index = [n for n, _ in model.named_parameters()].index("blocks.0.fc1.weight")
            model, opt = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), profile, mesh=mesh)
            before = {k: v.clone() for k, v in model.state_dict().items()}
            opt.backward(_toy_loss(model, _local(_global_batch(0), mesh.dp_rank)))
            if through == "model":
                model.blocks[0].fc1.weight.grad = None
            else:
                opt.param_groups[0]["params"][index].grad = None
            opt.step()
            after = model.state_dict()
            assert torch.equal(after["blocks.0.fc1.weight"], before["blocks.0.fc1.weight"]), (name, reduce, through)
            assert not torch.equal(after["blocks.1.fc1.weight"], before["blocks.1.fc1.weight"]), (name, through)
        kept = run(profile, "every_other")[2]
        for n, g in kept[1].items():
            want = grads[0][n].float() + grads[1][n].float()
            assert_close_norm(g.float(), want, f"kept over a step [{name} bf16, reduce {reduce}] {n}", 1e-2)
            assert not torch.allclose(g.float(), grads[1][n].float(), rtol=1e-2), (name, reduce, n)


def _frozen_norms(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        model = build()
        for name, p in model.named_parameters():
            if "norm" in name:
                p.requires_grad_(False)
        return model
    return make


def _equivalence_cases(world: int) -> str:
    mesh = memsave.init()
    toy = lambda: ToyLM(n_blocks=3)  # noqa: E731
    llama = lambda: hf_llama(tied=False)  # noqa: E731
    llama_tied = lambda: hf_llama(tied=True)  # noqa: E731
    # 1. frozen and trainable parameters in one ZeRO-3 unit: frozen norms, and LoRA (frozen base linears)
    for profile in ("zero3", "zero2"):
        _compare(_frozen_norms(toy), profile, _toy_loss, mesh, "frozen norms, toy")
    _compare(_frozen_norms(llama), "zero3", _hf_loss, mesh, "frozen RMSNorm, HF Llama")
    _compare(lambda: add_lora(ToyLM(n_blocks=3), ("fc1", "fc2")), "zero3", _toy_loss, mesh, "LoRA, toy")
    _compare(lambda: add_lora(llama_tied(), ("q_proj", "v_proj")), "zero3", _hf_loss, mesh, "LoRA, HF Llama tied")
    # 2. clearing gradients some other way than the wrapper's zero_grad: fresh gradients at every stage
    for profile in ("ddp", "zero1", "zero2", "zero3"):
        for zero in ("model", "inner", "manual", "manual_optimizer", "model_in_place", "every_other"):
            _compare(toy, profile, _toy_loss, mesh, f"zero_grad via {zero}", zero=zero)
        # [Note: a gradient cleared before the step]: the shard's reduced rows were stepped all the same
        drop = {"zero1": "none", "zero2": "zero_", "zero3": "module"}.get(profile)  # (each form failed at 1-3)
        if drop is not None:
            _compare(toy, profile, _toy_loss, mesh, f"a gradient cleared before the step ({drop})", drop=drop,
                     sgd=True)
        # stage 1 read a frozen parameter's cleared gradient (a guard) and raised its own "was reduced" error
        _compare(toy, profile, _toy_loss, mesh, "frozen after wrap", zero="model_in_place", freeze_after=0)
    _compare(toy, "zero2", _toy_loss, mesh, "model.zero_grad, SGD", zero="model", sgd=True)
    _cleared_by_hand_with_masters(mesh)
    _compare(llama, "zero3", _hf_loss, mesh, "model.zero_grad, HF Llama", zero="model")
    _compare(toy, "zero2", _token_mean_loss, mesh, "labels of -100, the global token mean")
    # 4. HF inputs_embeds: the embedding table is read outside the model's forward
    for model_fn in (llama, llama_tied):
        _compare(model_fn, "zero3", _hf_embeds_loss, mesh, "get_input_embeddings()(ids)")
    # crashes: a no_grad forward between the training forward and its backward; a gradient penalty
    for profile in ("zero3", "zero3-recompute", "zero2"):
        _compare(toy, profile, _toy_loss, mesh, "no_grad pass mid-step", eval_mid_step=True)
    _compare(llama, "zero3", _hf_loss, mesh, "no_grad pass mid-step, HF Llama", eval_mid_step=True)
    for profile in ("zero3", "zero1", "ddp"):
        _compare(toy, profile, _toy_loss, mesh, "gradient penalty", penalty=True)
    # recompute on an unchanged HF model with use_cache at its default and an attention mask
    for profile in ("zero3-recompute", memsave.load_profile("ddp", ["recompute.policy=full"])):
        _compare(llama, profile, _hf_masked_loss, mesh, "recompute, HF use_cache default")
    _compare(_RewardModel, "zero3-recompute", _reward_loss, mesh, "recompute, an HF model inside the user's module")
    # weights edited between model.unshard() and model.reshard() (or the next backward, which frees them) reach
    # the shards ([Note: edits of gathered parameters]); they were dropped at the free
    for clip in ("reshard", "next_backward"):
        _compare(toy, "zero3", _toy_loss, mesh, f"clipping p.data, freed by {clip}", clip=clip)
    _compare(llama_tied, "zero3", _hf_loss, mesh, "clipping p.data, HF Llama tied", clip="reshard")
    # [Note: replaced data] p.data = p.data.clamp(...): the step went on from the old rows (stages 1-2), the edit
    # was dropped at reshard (stage 3), silently
    with tempfile.TemporaryDirectory() as folder:  # (each rank its own)
        disk = memsave.load_profile("zero2", ['offload.optimizer="disk"', f"offload.path={folder!r}"])
        for profile in ("zero1", "zero2", "zero3", disk):
            _compare(toy, profile, _toy_loss, mesh, "clipping by assigning p.data", clip="assign")
    # a backward that raised (out of memory), caught, the next batches trained: the engines' half-done state of
    # it is dropped ([Note: a backward that raised]); before, every later backward raised a false error
    for profile in ("ddp", "zero2", "zero3", "zero3-recompute"):
        _compare(toy, profile, _toy_loss, mesh, "a backward that raised, skipped", raise_at=0)
    _accelerate_recipe(mesh)  # last: accelerate's state is the process's for good
    return "ok"


def _accelerate_recipe(mesh: Any, accumulate: int = 2) -> None:
    """README's accelerate loop (the optimizer, loader and scheduler prepared, not the model; accumulate(),
    memsave's clip) under zero3 against plain training on the global batch; prepare(model) is refused."""
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    rows = [{k: v[i] for k, v in _global_batch(s).items()} for s in range(2) for i in range(2 * ROWS)]
    collate = lambda batch: {k: torch.stack([r[k] for r in batch]) for k in batch[0]}  # noqa: E731
    ref = ToyLM(n_blocks=3)
    sgd = lambda ps: torch.optim.SGD([p for p in ps if p.requires_grad], lr=0.1)  # noqa: E731  (not scale-free)
    model, memsave_opt = memsave.wrap(m := copy.deepcopy(ref), sgd(m.parameters()), "zero3", mesh=mesh)
    ref_opt = sgd(ref.parameters())
    for step in range(len(rows) // (2 * ROWS * accumulate)):
        for mb in range(accumulate):
            i = (step * accumulate + mb) * 2 * ROWS
            (_toy_loss(ref, collate(rows[i: i + 2 * ROWS])) / accumulate).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 50.0)
        ref_opt.step()
        ref_opt.zero_grad()
    loader = torch.utils.data.DataLoader(rows, batch_size=ROWS, collate_fn=collate)
    optimizer, loader = accelerator.prepare(memsave_opt, loader)
    with pytest.raises(RuntimeError, match="DistributedDataParallel around a memsave-wrapped model"):
        accelerator.prepare(model)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(_toy_loss(model, batch))
            if accelerator.sync_gradients:
                memsave_opt.clip_grad_norm(50.0)  # the call path (clipping would hide a wrong scale)
            optimizer.step()
            optimizer.zero_grad()
    got = model.state_dict()
    for k, v in ref.state_dict().items():
        assert_close_norm(got[k], v, f"accelerate recipe [zero3] {k}", 2e-5)


def test_user_loops_match_plain_training() -> None:
    assert run_ranks(_equivalence_cases, 2, 2, timeout=600) == ["ok"] * 2


def _profile(name: str) -> memsave.Profile:
    """``"zero1-fp16"`` -> the zero1 preset with ``[precision] compute = "fp16"`` (its dynamic loss scale)."""
    base, _, dtype = name.partition("-")
    scale = ["precision.loss_scale=dynamic"] if dtype == "fp16" else []
    return memsave.load_profile(base, [f"precision.compute={dtype}", *scale] if dtype else [])


def _load_after_wrap(mesh: Any, profile: str) -> None:
    """bf16: model.load_state_dict after wrap must move the fp32 masters too. Reference: the same profile wrapped
    around a model that had those weights from the start (bit for bit)."""
    new = ToyLM(n_blocks=2, seed=7).state_dict()
    fresh = ToyLM(n_blocks=2, seed=0)
    fresh.load_state_dict(new)
    ref, ref_opt = memsave.wrap(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2), _profile(profile), mesh=mesh)
    model = ToyLM(n_blocks=2, seed=0)
    model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _profile(profile), mesh=mesh)
    model.load_state_dict(new)
    for m, o in ((ref, ref_opt), (model, opt)):
        _train(m, o, _toy_loss, mesh.dp_rank)
    got, want = model.state_dict(), ref.state_dict()
    for k, v in want.items():
        assert torch.equal(got[k], v), f"load after wrap [{profile}] {k}: max diff {(got[k] - v).abs().max()}"


def _convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


def _float_inputs(mesh: Any, profile: str) -> None:
    """bf16 with an fp32 image batch: the inputs are cast as FSDP2 casts them (it crashed: "Input type (float)
    and bias type (BFloat16) should be the same"); the same numbers as casting them by hand."""
    runs = []
    for by_hand in (False, True):
        model = _convnet()
        model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _profile(profile), mesh=mesh)
        losses = []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(10 * step + mesh.dp_rank)
            x, y = torch.randn(2, 3, 8, 8, generator=g), torch.randint(0, 5, (2,), generator=g)
            loss = nn.functional.cross_entropy(model(x.bfloat16() if by_hand else x).float(), y)
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append((losses, model.state_dict()))
    assert runs[0][0] == runs[1][0], f"{profile}: losses {runs[0][0]} != {runs[1][0]}"
    for k, v in runs[1][1].items():
        assert torch.equal(runs[0][1][k], v), f"float inputs [{profile}] {k}"


def _channels_last(mesh: Any, profile: str) -> None:
    """A channels_last convolution weight (not contiguous) under ZeRO-1/2: the all-gather after the step wrote it
    through ``view`` and crashed ("view size is not compatible"); now its rows land in logical order, and the
    parameters equal plain training on the global batch."""
    def build() -> nn.Module:
        return _convnet().to(memory_format=torch.channels_last)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return torch.randn(4, 3, 8, 8, generator=g).contiguous(memory_format=torch.channels_last), torch.randint(
            0, 5, (4,), generator=g)

    ref = build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model = build()
    model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _profile(profile), mesh=mesh)
    lo, hi = 2 * mesh.dp_rank // mesh.dp_size, 2 * (mesh.dp_rank + 1) // mesh.dp_size
    for step in range(STEPS):
        x, y = batch(step)
        nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(model(x[2 * lo : 2 * hi]), y[2 * lo : 2 * hi]))
        opt.step()
        opt.zero_grad()
    got = model.state_dict()
    for k, v in ref.state_dict().items():
        assert_close_norm(got[k], v, f"channels_last [{profile}] {k}", 1e-5)


def _skipped_by_user(mesh: Any, profile: str, clear: str) -> tuple[list[float], dict[str, torch.Tensor], int]:
    """A loss-spike guard (``norm = clip(); if spike: zero_grad(); continue``) at step 1, then a NaN loss at step 2,
    then a clean step. ``loss.backward()`` (allowed without a loss scale), cleared by ``clear`` ("optimizer" or
    "model"). Returns the norms, the parameters and the steps skipped."""
    model = ToyLM(n_blocks=2)
    model, opt = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), _profile(profile), mesh=mesh)
    norms = []
    for step in range(4):
        loss = _toy_loss(model, _local(_global_batch(step), mesh.dp_rank))
        (loss * float("nan") if step == 2 else loss).backward()
        norms.append(float(opt.clip_grad_norm(1.0)))
        if step != 1:
            opt.step()
        opt.zero_grad() if clear == "optimizer" else model.zero_grad()
    return norms, model.state_dict(), opt.nonfinite.num_skipped


def _generate_stops_apart(mesh: Any) -> None:
    """HF generate under zero3, each rank its prompts, rank 0's reaching eos after one token: the ranks keep
    stepping together (synced_gpus, as HF does for FSDP and DeepSpeed ZeRO-3) and each gets the tokens one
    process generates; rank 1 hung alone in its next forward's gather until the collective timeout."""
    ref = hf_llama().eval()
    prompts = torch.randint(3, 64, (4, 6), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        whole = ref.generate(input_ids=prompts, max_new_tokens=5, do_sample=False, pad_token_id=0)[:, 6:]
    eos = sorted({int(whole[0, 0]), int(whole[1, 0])})
    assert not set(whole[2:, :-1].flatten().tolist()) & set(eos), "the prompts must let rank 1 go on"
    model = hf_llama()
    model, _ = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), "zero3", mesh=mesh)
    model.eval()
    mine = slice(2 * mesh.dp_rank, 2 * mesh.dp_rank + 2)
    with torch.no_grad():
        out = model.generate(input_ids=prompts[mine], max_new_tokens=5, do_sample=False, pad_token_id=0,
                             eos_token_id=eos)[:, 6:]
    want = whole[mine, :1] if mesh.dp_rank == 0 else whole[mine]
    assert torch.equal(out, want), (mesh.dp_rank, out.tolist(), want.tolist())


def _whisper_generates_apart(mesh: Any) -> None:
    """Whisper's own generate defaults synced_gpus to False (SeamlessM4T's, CSM's too), so transformers does not
    turn it on under ZeRO-3 as for other models: rank 0, done after one token, left the loop while rank 1 gathered
    for its next; both waited out the 600 s collective timeout (gloo: "Timed out waiting 600000ms"). The wrapped
    class's generate passes synced_gpus=True there, unless the call says otherwise."""
    features = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(3))
    mine = slice(2 * mesh.dp_rank, 2 * mesh.dp_rank + 2)
    new = 1 if mesh.dp_rank == 0 else 4
    with torch.no_grad():
        want = hf_whisper().eval().generate(input_features=features[mine], max_new_tokens=new, do_sample=False)
    model = hf_whisper()
    model, _ = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), "zero3", mesh=mesh)
    model.eval()
    with torch.no_grad():
        out = model.generate(input_features=features[mine], max_new_tokens=new, do_sample=False)
    assert torch.equal(out, want), (mesh.dp_rank, out.tolist(), want.tolist())


def _error_cases(world: int) -> str:
    mesh = memsave.init()
    rank = mesh.dp_rank
    _generate_stops_apart(mesh)
    _whisper_generates_apart(mesh)
    # [Note: what a step derives from its gradients]: a step the user skipped leaves no clip norm, unscaled master
    # gradients or overflow check behind (the NaN step was applied; model.zero_grad() replayed the old gradients)
    for profile in ("ddp-bf16", "zero2-bf16"):
        norms, params, skipped = _skipped_by_user(mesh, profile, "optimizer")
        assert skipped == 1 and all(v.isfinite().all() for v in params.values()), (profile, norms, skipped)
        by_model = _skipped_by_user(mesh, profile, "model")
        assert by_model[0] == norms and by_model[2] == 1, (profile, by_model[0], norms)
        assert all(torch.equal(by_model[1][k], v) for k, v in params.items()), profile
    for profile in ("ddp-bf16", "zero1-bf16", "zero2-bf16", "zero3-bf16"):
        _load_after_wrap(mesh, profile)
    for profile in ("ddp-bf16", "zero3-bf16"):
        _float_inputs(mesh, profile)
    for profile in ("zero1", "zero2"):
        _channels_last(mesh, profile)
    b = _local(_global_batch(0), rank)
    # 6. torch's clip_grad_norm_ over the model's parameters reads gradients that live in the shards: refused,
    # with foreach too (its lists of tensors went past the guard: zero1 returned a different norm on each rank
    # and clipped with it, silently; zero2-3 raised torch's "single memory location" error)
    for profile in ("zero1", "zero2", "zero3"):
        model = ToyLM(n_blocks=2)
        model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), profile, mesh=mesh)
        opt.backward(_toy_loss(model, b))
        for clip in (lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0),
                     lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=True),
                     lambda ps: torch.nn.utils.clip_grad_value_(ps, 1.0, foreach=True),
                     lambda ps: torch.nn.utils.get_total_norm([p.grad for p in ps if p.grad is not None], foreach=True)):
            with pytest.raises(RuntimeError, match=r"optimizer\.clip_grad_norm"):
                clip(list(model.parameters()))
        assert opt.clip_grad_norm(1.0).isfinite()  # the right way still works
        model.zero_grad(set_to_none=False)  # torch's _foreach_zero_ over the guards: cleared, not refused
        torch._foreach_zero_([p.grad for p in model.parameters() if p.grad is not None])
    # [Note: guarded param_groups] torch's clip over the optimizer's own param_groups (PyTorch Lightning's): under
    # ZeRO each rank clipped its rows by their own norm, under bf16 it found no gradient (a norm of 0); refused,
    # and the optimizer's clip and step then give what they give without the attempt. Under ddp (fp32) the
    # param_groups are the parameters: torch's clip works there, bit for bit the optimizer's.
    for profile in ("zero1", "zero2", "zero3", "ddp-bf16", "zero2-bf16", "ddp"):
        got = []
        for attempt in (True, False):
            model = ToyLM(n_blocks=2)
            model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), profile, mesh=mesh)
            for step in range(2):
                opt.backward(_toy_loss(model, _local(_global_batch(step), rank)))
                held = [p for g in opt.param_groups for p in g["params"]]
                if attempt and profile == "ddp":
                    norm = torch.nn.utils.clip_grad_norm_(held, 0.1)
                elif attempt:
                    for foreach in (False, True):
                        with pytest.raises(RuntimeError, match=r"param_groups hold .*optimizer\.clip_grad_norm"):
                            torch.nn.utils.clip_grad_norm_(held, 0.1, foreach=foreach)
                if not (attempt and profile == "ddp"):
                    norm = opt.clip_grad_norm(0.1)
                opt.step()
                opt.zero_grad()
            got.append((float(norm), {k: v.clone() for k, v in model.state_dict().items()}))
        assert got[0][0] == got[1][0], (profile, got[0][0], got[1][0])
        assert all(torch.equal(v, got[1][1][k]) for k, v in got[0][1].items()), profile
    # [Note: gradients a step would ignore] a step whose gradients never reached the shards changed nothing,
    # silently: the last backward inside no_sync(), or torch.autograd.grad with .grad assigned by hand
    for profile in ("zero1", "zero2", "zero3"):
        model = ToyLM(n_blocks=2)
        model, opt = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), profile, mesh=mesh)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with model.no_sync():
            _toy_loss(model, b).backward()
        with pytest.raises(RuntimeError, match=r"backward inside model\.no_sync\(\).*outside no_sync"):
            opt.step()
        opt.zero_grad()
        params = [p for p in model.parameters() if p.requires_grad]
        with pytest.raises(RuntimeError, match=r"set by hand|was read \(grad\)"):  # zero3: in autograd.grad
            for p, g in zip(params, torch.autograd.grad(_toy_loss(model, b), params)):
                p.grad = g
            opt.step()
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), profile  # nothing lost
        opt.zero_grad()
        _toy_loss(model, b).backward()
        opt.step()  # trains on
        assert not all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), profile
    # the optimizer object built before wrap, stepped instead of the returned one (scaler.step(optimizer) or
    # accelerator.prepare with the old name): the same training, bit for bit, and an LR scheduler built on it
    # after wrap counts its steps (it moved nothing under bf16 and left zero1/2 0.24 off at 2 ranks, no error)
    for profile in ("zero2", "zero2-bf16", "ddp-bf16"):
        states = []
        for which in ("returned", "kept"):
            model = ToyLM(n_blocks=2)
            kept = torch.optim.AdamW(model.parameters(), lr=1e-2)
            model, opt = memsave.wrap(model, kept, profile, mesh=mesh)
            sched = torch.optim.lr_scheduler.LambdaLR(kept, lambda s: 1.0 / (1 + s))
            for step in range(2):
                opt.backward(_toy_loss(model, _local(_global_batch(step), rank)))
                (kept if which == "kept" else opt).step()
                sched.step()
                opt.zero_grad()
            assert sched.get_last_lr() == pytest.approx([1e-2 / 3]) and getattr(kept, "_opt_called", False), profile
            states.append(model.state_dict())
        assert all(torch.equal(v, states[0][k]) for k, v in states[1].items()), profile
    # [Note: the user's gradient hooks first] a post-accumulate-grad hook registered after wrap sees this rank's
    # own gradient, as under torch's DDP: it saw the bucket already divided by the world size (ddp, the last
    # parameter of a bucket) or p.grad None (ZeRO-2/3)
    plain = ToyLM(n_blocks=2)
    _toy_loss(plain, b).backward()
    local = {n: p.grad.norm().item() for n, p in plain.named_parameters() if p.grad is not None}
    for profile in ("ddp", "zero1", "zero2", "zero3"):
        model = ToyLM(n_blocks=2)
        model, opt = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), profile, mesh=mesh)
        seen: dict[str, float] = {}
        for n, p in ((n, p) for n, p in model.named_parameters() if p.requires_grad):
            p.register_post_accumulate_grad_hook(lambda q, n=n, seen=seen: seen.__setitem__(n, q.grad.norm().item()))
        opt.backward(_toy_loss(model, b))
        assert seen.keys() == local.keys(), profile
        assert all(abs(v / local[n] - 1) < 1e-5 for n, v in seen.items()), (profile, seen, local)
        opt.step()
    # zero3: a second backward after the first one ended (retain_graph, or two losses of two forwards backwarded
    # one by one) found the root freed: torch's "setStorage ... out of bounds". Now equal to ddp (plain torch's)
    for case in ("retain_graph", "two_losses"):
        states = []
        for profile in ("ddp", "zero3"):
            model = ToyLM(n_blocks=2)
            model, opt = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), profile, mesh=mesh)
            if case == "retain_graph":
                loss = _toy_loss(model, b)
                loss.backward(retain_graph=True)
                (0.5 * loss).backward()
            else:
                first, second = _toy_loss(model, b), _toy_loss(model, _local(_global_batch(1), rank))
                first.backward()
                second.backward()
            opt.step()
            states.append(model.state_dict())
        for k, v in states[0].items():
            torch.testing.assert_close(states[1][k], v, rtol=1e-5, atol=1e-7, msg=f"{case} {k}")
    # fp16: loss.backward() skips the loss scale that step() divides by
    for profile in ("ddp-fp16", "zero2-fp16", "zero3-fp16"):
        model = ToyLM(n_blocks=2)
        model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _profile(profile), mesh=mesh)
        with pytest.raises(RuntimeError, match=r"optimizer\.backward\(loss\)"):
            _toy_loss(model, b).backward()
    # fp16 under ddp: .grad holds the scaled gradient; torch's clip would clip the scaled values (its norm came out
    # 0.00085 where 1.0 is asked), so it is refused; one gradient stays readable, and the optimizer's clip works
    model = ToyLM(n_blocks=2)
    fixed = memsave.load_profile("ddp", ["precision.compute=fp16", "precision.loss_scale=1024"])
    model, opt = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), fixed, mesh=mesh)
    opt.backward(_toy_loss(model, b))
    for foreach in (False, True):
        with pytest.raises(RuntimeError, match=r"times the fp16 loss scale.*optimizer\.clip_grad_norm"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=foreach)
    assert model.embed.weight.grad.float().norm().isfinite()
    ref = ToyLM(n_blocks=2)
    ref, ref_opt = memsave.wrap(ref, torch.optim.SGD(ref.parameters(), lr=0.1), "ddp", mesh=mesh)
    ref_opt.backward(_toy_loss(ref, b))  # the same model in fp32: the norm of the unscaled gradient
    assert abs(float(opt.clip_grad_norm(1.0)) / float(ref_opt.clip_grad_norm(1.0)) - 1) < 1e-2
    # 5. unfreezing after wrap: refused at the next forward, on every engine
    for profile in ("ddp", "zero1", "zero3"):
        model = ToyLM(n_blocks=2)
        model.blocks[0].requires_grad_(False)
        model, opt = memsave.wrap(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]),
                                  profile, mesh=mesh)
        model.blocks[0].requires_grad_(True)
        with pytest.raises(NotImplementedError, match=r"blocks\.0\..*frozen .* at memsave\.wrap"):
            _toy_loss(model, b)
    # 4. a sharded parameter read outside its unit's forward raises (never computes with zeros); gathered, it reads
    model = ToyLM(n_blocks=2)
    ref_weight = model.blocks[1].fc1.weight.detach().clone()
    model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters()), "zero3", mesh=mesh)
    with pytest.raises(RuntimeError, match=r"'blocks\.1\.fc1\.weight' was read .* sharded"):
        model.blocks[1].fc1.weight.sum()
    with pytest.raises(RuntimeError, match=r"sharded"):
        model.blocks[1].fc1(torch.ones(2, 16))  # a submodule of a block, called on its own
    model.unshard()
    assert torch.equal(model.blocks[1].fc1.weight.detach(), ref_weight)
    model.reshard()
    assert model.blocks[1].fc1.weight.shape == ref_weight.shape  # metadata stays readable while sharded
    # [Note: replaced data] p.data assigned while the unit is sharded: the next gather would overwrite it
    with pytest.raises(RuntimeError, match=r"p\.data = \.\.\. on a ZeRO-3 parameter while its unit is sharded"):
        model.blocks[1].fc1.weight.data = torch.zeros_like(ref_weight)
    model.unshard()
    assert torch.equal(model.blocks[1].fc1.weight.detach(), ref_weight)
    model.reshard()
    # ...and a new tensor of another shape is refused at the step, naming the parameter, before anything moved
    model = ToyLM(n_blocks=2)
    model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters()), "zero2", mesh=mesh)
    opt.backward(_toy_loss(model, b))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.blocks[0].fc1.weight.data = model.blocks[0].fc1.weight.data[:1].clone()
    with pytest.raises(RuntimeError, match=r"'blocks\.0\.fc1\.weight': its \.data was replaced by a tensor of shape"):
        opt.step()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items() if k != "blocks.0.fc1.weight")
    return "ok"


def test_misuse_raises_and_loads_follow() -> None:
    assert run_ranks(_error_cases, 2, 2, timeout=300) == ["ok"] * 2


def _state_dict_on_rank0_only(world: int) -> str:
    mesh = memsave.init()
    for profile in ("zero3", "zero1"):
        model = ToyLM(n_blocks=2)
        model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters()), profile, mesh=mesh)
        if mesh.dp_rank == 0:  # a torch-DDP habit: save on rank 0 only
            target = model if profile == "zero3" else opt
            with pytest.raises(RuntimeError, match=r"state_dict\(\) .*collective.*rank\(s\) \[1\] did not"):
                target.state_dict()
        memsave.dist.barrier(mesh.dp_group)
    # torch.save's habit with memsave.save / load and a report printed on rank 0: each waited 600 s in its first
    # collective and ended in gloo's "Timed out waiting 600000ms for send operation"
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/ckpt-{mesh.rank}"  # (each rank its own folder: the calls never meet)
        for what, call in (("memsave.save()", lambda: memsave.save(path, model, opt)),
                           ("memsave.save()", lambda: memsave.save(path, model, opt, async_=True)),
                           ("memsave.load()", lambda: memsave.load(path, model, opt)),
                           ("memsave.load_weights() into a wrapped model", lambda: memsave.load_weights(model, path)),
                           ("memsave.report()", lambda: memsave.report(model, opt))):
            if mesh.dp_rank == 0:
                with pytest.raises(RuntimeError, match=rf"{re.escape(what)} is collective.*rank\(s\) \[1\] did not"):
                    call()
            memsave.dist.barrier(mesh.dp_group)
        assert not os.path.exists(path)
    # a weights file loaded on rank 0 alone (as into a torch DDP model, then a forgotten broadcast): the replicas
    # diverged under ddp, and zero1/2 stepped rank 0's loaded rows beside rank 1's old ones, silently
    for profile in ("ddp", "zero2"):
        model = ToyLM(n_blocks=2)
        loaded = {k: v + 1 for k, v in model.state_dict().items()}
        model, opt = memsave.wrap(model, torch.optim.AdamW(model.parameters()), profile, mesh=mesh)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        if mesh.dp_rank == 0:
            with pytest.raises(RuntimeError, match=r"load_state_dict\(\).* is collective.*rank\(s\) \[1\] did not"):
                model.load_state_dict(loaded)
            child = next(m for m in model.children() if any(True for _ in m.parameters()))  # (a backbone's load)
            with pytest.raises(RuntimeError, match=r"load_state_dict\(\).* is collective.*rank\(s\) \[1\] did not"):
                child.load_state_dict({k: v + 1 for k, v in child.state_dict().items()})
            assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # nothing changed
        memsave.dist.barrier(mesh.dp_group)
    # tensor parallelism gathers each cut tensor over tp, whatever the profile: the same error, not a 600 s hang
    from memsave.models import GPT, gpt_config

    tp = memsave.Mesh.build(device=mesh.device, tp=2)
    model = GPT(gpt_config("tiny", vocab_size=64, d_model=32, n_layer=1, block_size=8))
    model, tp_opt = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), "ddp", mesh=tp)
    if tp.axis_rank("tp") == 0:
        with pytest.raises(RuntimeError, match=r"under tensor parallelism is collective.*rank\(s\) \[1\] did not"):
            model.state_dict()
    memsave.dist.barrier(None)
    whole = model.state_dict()  # every rank: the failed call on rank 0 alone is not counted (it raised here)
    # ...and loaded on tp rank 0 alone: rank 1 kept its old slices
    if tp.axis_rank("tp") == 0:
        with pytest.raises(RuntimeError, match=r"load_state_dict\(\) is collective.*rank\(s\) \[1\] did not"):
            model.load_state_dict(whole)
    memsave.dist.barrier(None)
    # ...and torch's clip over this rank's slices would clip by their norm, each tp rank by another factor
    ids = torch.arange(16).reshape(2, 8) % 64
    model(ids, labels=ids).loss.backward()
    with pytest.raises(RuntimeError, match=r"optimizer\.clip_grad_norm"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    assert float(tp_opt.clip_grad_norm(0.1)) > 0  # the norm over both slices; then the step reads plain gradients
    tp_opt.step()
    return "ok"


def test_state_dict_on_one_rank_says_it_is_collective() -> None:
    """Without the arrival check rank 0 hangs for the 600 s collective timeout, then shows a raw gloo error (under
    ZeRO-3's state dict, ZeRO's optimizer state dict, and tensor parallelism's, even under ddp)."""
    assert run_ranks(_state_dict_on_rank0_only, 2, 2, timeout=120, env={"MEMSAVE_ARRIVAL_S": "1"}) == ["ok"] * 2


class _Opaque:
    """An output memsave cannot look into: its tensor hides behind a closure."""

    def __init__(self, t: torch.Tensor) -> None:
        self.get = lambda: t


class _OpaqueBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Any:
        box = _Opaque(self.fc(x))
        return box


class _OpaqueModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_OpaqueBlock(), _OpaqueBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x).get()
        return x.sum()


def test_a_unit_output_memsave_cannot_look_into_is_refused_at_the_first_forward() -> None:
    model = _OpaqueModel()
    model, _opt = memsave.wrap(model, torch.optim.SGD(model.parameters()), "zero3")
    with pytest.raises(NotImplementedError, match=r"unit 'blocks\.0' \(_OpaqueBlock\) returned a _Opaque"):
        model(torch.ones(2, 4))
