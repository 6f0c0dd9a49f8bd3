"""Tensor parallelism (memsave/tp) on gloo CPU ranks: training equals single-process training, the collective
counts and bytes follow the Megatron formulas, the vocab-parallel loss equals ``F.cross_entropy``, bad plans are
refused before anything changes, and dropout draws per-region random streams.

Spawning ranks is the slow part (each imports torch, memsave and transformers), so one 2-rank group (``tp=2``) and
one 4-rank group (``dp=2 x tp=2``, then a ``tp=4`` mesh) each run all their cases in a loop; every
case's outcome (its metrics, or its traceback) comes back to one pytest test per case. A case that raises on one
rank only can leave the others in a collective: the group then fails as a whole, by the harness's timeout.

Tolerances: FP32_TOL (tests/tp_cases.py, 1e-6 relative, max abs diff / max abs value) for fp32 runs against plain
single-process training; BF16_TOL for bf16 mixed precision against memsave's own bf16 training on a 1-process mesh.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memsave
from memsave import dist as mdist
from memsave.dist import COMM_STATS
from tests import tp_cases as tc
from tests.harness import run_ranks

# bf16 mixed precision against the same bf16 training (memsave.wrap, profile ddp-bf16) on a 1-process mesh. TP
# splits each bf16 matmul's reduction over tp and rounds the halves to bf16 before summing them, where one process
# rounds once: outputs move by an ulp (2^-8 relative) here and there. The parameters compared are the bf16 ones, so
# they differ by whole bf16 ulps of their own values: a few ulps of a tensor's largest value, most for the biases
# that start at zero (measured: up to 2.5e-2 relative for an LN bias of magnitude 2e-3, about the gap between
# the bf16 and the fp32 single-process runs themselves). A TP bug (a missing or doubled reduction) moves them by
# O(1). Losses and clip norms are fp32 reductions of bf16 values: measured 3e-5 and below.
BF16_TOL = {"loss": 2e-4, "eval": 2e-4, "norm": 2e-3, "param": 5e-2}

Case = Callable[[memsave.Mesh], Any]


# -- training cases -------------------------------------------------------------------------------------------------
# (model, profile, sequence parallel). tp=2: the reference GPT under every profile with SP off and on; the GPT with a
# vocabulary of 251 (padded to 252: a column of padding on rank 1), untied and tied; each Llama variant (tied/untied,
# KV heads split: nkv=2, or kept whole: nkv=1) under a few profiles. dp=2 x tp=2: a covering subset of the same.
TP2_TRAIN = {
    # every profile, sequence parallelism with half of them (the other halves in the Llama and dp2 x tp2 cases)
    **{f"gpt-{p}{'-sp' if sp else ''}": ("gpt", p, sp) for p, sp in (
        ("ddp", False), ("ddp", True), ("zero1", False), ("zero2", True), ("zero3", True), ("zero3", False),
        ("zero3-recompute", True), ("ddp-bf16", False))},
    "gpt251-untied-ddp": ("gpt251-untied", "ddp", False),
    "gpt251-untied-zero2-sp": ("gpt251-untied", "zero2", True),
    "gpt251-untied-zero3-sp": ("gpt251-untied", "zero3", True),
    "gpt251-zero3": ("gpt251", "zero3", False),
    "llama-tied-kv2-ddp": ("llama-tied-kv2", "ddp", False),
    "llama-tied-kv2-zero3-sp": ("llama-tied-kv2", "zero3", True),
    "llama-untied-kv2-zero1-sp": ("llama-untied-kv2", "zero1", True),
    "llama-untied-kv2-zero3-recompute": ("llama-untied-kv2", "zero3-recompute", False),
    "llama-tied-kv1-zero3": ("llama-tied-kv1", "zero3", False),
    "llama-tied-kv1-ddp-sp": ("llama-tied-kv1", "ddp", True),
    "llama-untied-kv1-zero1-sp": ("llama-untied-kv1", "zero1", True),
    "llama-untied-kv1-zero2": ("llama-untied-kv1", "zero2", False),
    "llama-untied-kv1-zero3-recompute-sp": ("llama-untied-kv1", "zero3-recompute", True),
    "gemma-scaled-embedding-zero3-sp": ("gemma", "zero3", True),
    "phi3-gathered-qkv-zero2-sp": ("phi3", "zero2", True),
    "olmoe-whole-experts-ddp-sp": ("olmoe", "ddp", True),
    "apertus-trainable-activation-zero1": ("apertus", "zero1", False),
    "mixtral-experts-cut-zero3": ("mixtral", "zero3", False),
    "llama4-experts-in-out-zero1": ("llama4", "zero1", False),
    "deepseek-v3-router-beside-a-cut-mlp-zero2": ("deepseek_v3", "zero2", False),
    "minimax-linear-attention-uncut-ddp": ("minimax", "ddp", False),
    "exaone-moe-shared-expert-uncut-zero1": ("exaone_moe", "zero1", False),
}
DP2TP2_TRAIN = {
    "gpt-ddp-sp": ("gpt", "ddp", True),
    "gpt-zero1": ("gpt", "zero1", False),
    "gpt-zero2-sp": ("gpt", "zero2", True),
    "gpt-zero3-sp": ("gpt", "zero3", True),
    "gpt-zero3-recompute": ("gpt", "zero3-recompute", False),
    "gpt-ddp-bf16": ("gpt", "ddp-bf16", False),
    "gpt-ddp-bf16-sp": ("gpt", "ddp-bf16", True),
    "gpt251-untied-ddp": ("gpt251-untied", "ddp", False),
    "gpt251-zero2-sp": ("gpt251", "zero2", True),
    "gpt251-untied-zero3-recompute-sp": ("gpt251-untied", "zero3-recompute", True),
    "llama-tied-kv2-zero3": ("llama-tied-kv2", "zero3", False),
    "llama-untied-kv2-zero2-sp": ("llama-untied-kv2", "zero2", True),
    "llama-tied-kv1-ddp-sp": ("llama-tied-kv1", "ddp", True),
    "llama-untied-kv1-zero3-recompute": ("llama-untied-kv1", "zero3-recompute", False),
    # host offload (on CPU the state stays in the offload store in host memory) and disk offload (the state in
    # files, streamed through the store): the tp slices' dp rows, stepped where they live
    "gpt-zero3-offload-sp": ("gpt", "zero3-offload", True),
    "llama-tied-kv2-zero3-infinity": ("llama-tied-kv2", "zero3-infinity", False),
    "mixtral-experts-cut-zero2": ("mixtral-noaux", "zero2", False),
}
# tp=4 (the 4-rank group): 4 query heads, one per rank; with nkv=2 the KV heads do not split over 4, so each rank keeps
# both and reads the one its query head uses (ranks 0, 1: head 0; ranks 2, 3: head 1); a vocabulary of 250 padded to 252
TP4_TRAIN = {
    "llama-untied-kv2-ddp-sp": ("llama-untied-kv2", "ddp", True),
    "llama-tied-kv2-zero1": ("llama-tied-kv2", "zero1", False),
    "llama-tied-kv1-zero3-sp": ("llama-tied-kv1", "zero3", True),
}
TP2_COMM = [("gpt", False), ("gpt", True), ("llama-untied-kv1", False), ("llama-tied-kv2", True)]
DP2TP2_COMM = [("gpt", True), ("llama-untied-kv2", False)]
BF16_REFS = sorted({m for m, p, _ in [*TP2_TRAIN.values(), *DP2TP2_TRAIN.values()] if p == "ddp-bf16"})


def _model(key: str) -> tuple[Callable[[], nn.Module], tc.LossFn, int]:
    """(builder, loss, vocabulary) of a model key."""
    if key.startswith("gpt"):
        vocab = 251 if key.startswith("gpt251") else 250
        tie = "untied" not in key
        return (lambda: tc.gpt(vocab, tie)), tc.gpt_loss, vocab
    if key in ("gemma", "phi3", "olmoe", "apertus", "mixtral", "llama4", "deepseek_v3", "minimax", "exaone_moe"):
        return getattr(tc, key), tc.llama_loss, 250
    if key == "mixtral-noaux":
        return (lambda: tc.mixtral(aux=False)), tc.llama_loss, 250
    tie, nkv = "untied" not in key, int(key[-1])
    return (lambda: tc.llama(tie, nkv)), tc.llama_loss, 250


_REFS: dict[str, tc.Run] = {}


def _fp32_reference(key: str) -> tc.Run:
    if key not in _REFS:
        build, loss_fn, vocab = _model(key)
        _REFS[key] = tc.reference(build, tc.batches(vocab), loss_fn)
    return _REFS[key]


def _train_case(mesh: memsave.Mesh, key: str, prof_name: str, sequence: bool,
                bf16_refs: dict[str, tc.Run]) -> dict[str, Any]:
    """Train ``key`` under the profile on the mesh and compare with its reference. Also checked along the way:
    the LM head's output is ShardedLogits of width ceil(V / tp) and never gathered; under SP the norm gradients
    are identical on every tp rank after clip_grad_norm; the state dict holds whole tensors."""
    from memsave.tp import ShardedLogits, tp_param

    build, loss_fn, vocab = _model(key)
    tp = mesh.degree("tp")
    prof = tc.profile(prof_name, tp, sequence)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=tc.LR, momentum=tc.MOMENTUM)
    plan = tc.olmoe_plan(model) if key == "olmoe" else None
    model, mopt = memsave.wrap(model, opt, prof, mesh=mesh, tp_plan=plan)
    widths: list[tuple[str, int]] = []

    def head_output(module: nn.Module, args: Any, out: Any) -> None:
        widths.append((type(out).__name__, out.shape[-1]))

    model.lm_head.register_forward_hook(head_output)
    names = {p: n for n, p in model.named_parameters()}
    partial = [names[p] for p in model.parameters()
               if (lay := tp_param(p)) is not None and lay.placement.partial_grad]
    checked = [0]

    def partial_grads_equal() -> None:
        """After clip_grad_norm (which completes them), a gradient summed over tp is the same on every tp rank:
        at stage 0 read from .grad as it is, else through full_grads (a partial gradient is whole over tp)."""
        params = dict(model.named_parameters())
        grads = ({n: params[n].grad for n in partial} if prof.zero.stage == 0 else mopt.full_grads())
        for n in partial:
            g = grads[n]
            assert g is not None, n
            both = _tp_all_gather(g.float(), mesh.group("tp"))
            assert all(torch.equal(both[0], o) for o in both[1:]), f"{n}: the gradient differs across tp ranks"
            checked[0] += 1

    # under SP cleared by model.zero_grad() or by hand (p.grad = None over model.parameters()): the summed norm
    # gradients are summed afresh after it (both raised "accumulated over an optimizer step" at the second step)
    clear = ("hand" if prof_name in ("ddp", "zero1", "zero2", "zero3-recompute") else "model") if sequence else "optimizer"
    with COMM_STATS.measure() as comm:
        run = tc.train(model, mopt, mesh, tc.batches(vocab), loss_fn, after_clip=partial_grads_equal if partial else None,
                       clear=clear)
    assert comm.calls["tp_logits_gather"] == 0, comm.snapshot()
    assert widths == [(ShardedLogits.__name__, -(-vocab // tp))] * (tc.STEPS + 1), widths  # (+ the eval forward)
    # under SP the norms' gradients are partial (each rank its tokens'); so are KV heads kept whole (nkv % tp != 0),
    # and norms on this rank's heads (Apertus's, EXAONE-MoE's q_norm / k_norm; its plan names them)
    assert bool(partial) == (sequence or key in ("apertus", "exaone_moe")
                             or (key.startswith("llama") and int(key[-1]) % tp != 0)), partial
    assert checked[0] == len(partial) * tc.STEPS
    if partial and prof_name in ("ddp", "zero2"):  # not cleared: the summed gradients would be summed again
        x, y = tc.batches(vocab)[0]
        mopt.backward(loss_fn(model, x, y))
        mopt.step()
        mopt.backward(loss_fn(model, x, y))
        with pytest.raises(NotImplementedError, match="the summed gradients would be summed again"):
            mopt.step()
        mopt.zero_grad()
    if prof_name == "ddp" and not sequence:  # the state dict: whole tensors, and whole tensors load back
        sd = model.state_dict()
        for n, v in run.params.items():
            assert np.array_equal(sd[n].float().numpy(), v), n
        model.load_state_dict(sd)
        assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())
        # an EMA copy: refused, saying what to do (it raised pickle's "cannot pickle 'ProcessGroup'")
        with pytest.raises(NotImplementedError, match=r"copy.deepcopy of a model under tensor parallelism"):
            copy.deepcopy(model)
        # a block replaced by torch.compile(block) after wrap (torchtitan's way): its keys gain "_orig_mod.", and
        # names taken at wrap missed them, so its tensors were saved as this rank's shards
        blocks = max((m for m in model.modules() if isinstance(m, nn.ModuleList)), key=len)
        blocks[0] = torch.compile(blocks[0], backend="eager")
        sd = {k.replace("_orig_mod.", ""): v for k, v in model.state_dict().items()}
        for n, v in run.params.items():
            assert np.array_equal(sd[n].float().numpy(), v), f"{n} after torch.compile(block)"
    if prof_name in ("ddp", "zero3") and not sequence:  # the optimizer's: whole over tp (save on rank 0, load on
        # every rank): each rank cuts its own slices back (before, rank 0's slices went to every tp rank)
        osd = mopt.state_dict()
        params = dict(model.named_parameters())
        whole = {n: tuple(lay.full_shape) for n, p in params.items() if (lay := tp_param(p)) is not None}
        index = {n: i for i, n in enumerate(params)}
        for n, shape in whole.items():
            assert tuple(osd["state"][index[n]]["exp_avg" if "exp_avg" in osd["state"][index[n]] else
                                           "momentum_buffer"].shape) == shape, n
        mopt.load_state_dict(mdist.all_gather_object(osd)[0])
        again = mopt.state_dict()
        for i, st in osd["state"].items():
            assert all(torch.equal(v, again["state"][i][k]) for k, v in st.items()), i
    ref = bf16_refs[key] if prof_name == "ddp-bf16" else _fp32_reference(key)
    return tc.compare(run, ref)


def _tp_all_gather(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's ``t``, in rank order."""
    from memsave.tp.mappings import all_gather_dim

    return list(all_gather_dim(t.unsqueeze(0), 0, group, count_as="test").unbind(0))


def bf16_reference(key: str) -> tc.Run:
    """memsave's own bf16 mixed-precision training (profile ddp-bf16) on a 1-process mesh: the parent process."""
    build, loss_fn, vocab = _model(key)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=tc.LR, momentum=tc.MOMENTUM)
    mesh = memsave.init()
    assert mesh.world_size == 1
    model, mopt = memsave.wrap(model, opt, "ddp-bf16", mesh=mesh)
    return tc.train(model, mopt, mesh, tc.batches(vocab), loss_fn)


# -- collective counts ----------------------------------------------------------------------------------------------
def _comm_case(mesh: memsave.Mesh, key: str, sequence: bool) -> dict[str, Any]:
    """Calls and logical bytes of each TP traffic kind in one forward and one backward ([Note: TP traffic kinds]).

    The model has L = 2 blocks; every activation is b·s·h fp32 elements, b = this rank's rows (4 / dp), s = 16,
    h = 64. Two accumulated micro-batches each count the same.

    Without SP (Megatron's f/g):
    - forward: 2 all-reduces per block (after the row-parallel attention output and MLP output), plus 1 after the
      vocab-parallel embedding (each rank looks up its rows of the vocabulary): 2L + 1;
    - backward: 2 per block (the input gradient of the column-parallel qkv / q,k,v and mlp_fc / gate,up, one per
      input whatever the number of linears reading it), plus 1 at the column-parallel LM head's input: 2L + 1;
    each of b·s·h elements, counted twice its size (an all-reduce is a reduce-scatter and an all-gather).

    With SP (Korthikanti et al.): per block 2 all-gathers (before the column-parallel regions) and 2 reduce-scatters
    (after the row-parallel ones) each way, no all-reduce in a block; the 2 column inputs are all-gathered again in
    backward (tp_regather). Outside the blocks: the embedding still all-reduces in forward (1 tp_all_reduce) and
    blocks.0 keeps its slice of it, whose backward all-gathers (1); the LM head's input is all-gathered in forward
    (1), reduce-scattered (1) and regathered (1) in backward. Each of those counts b·s·h elements (an all-gather
    its output, a reduce-scatter its input).

    The vocab-parallel loss is counted apart (tp_loss: a MAX and a SUM all-reduce of per-token values).
    """
    build, loss_fn, vocab = _model(key)
    model = build()
    dp, r = mesh.degree("dp"), mesh.axis_rank("dp")
    prof = tc.profile("ddp", mesh.degree("tp"), sequence)
    model, opt = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=tc.LR), prof, mesh=mesh)
    L, b = 2, tc.BATCH // dp  # blocks; this rank's rows of the micro-batch
    bsh = b * tc.SEQ * 64 * 4  # bytes of one activation (fp32, hidden 64)
    kinds = ("tp_all_reduce", "tp_all_gather", "tp_reduce_scatter", "tp_regather")
    if sequence:
        want_f = {"tp_all_reduce": (1, 2 * bsh), "tp_all_gather": (2 * L + 1, (2 * L + 1) * bsh),
                  "tp_reduce_scatter": (2 * L, 2 * L * bsh), "tp_regather": (0, 0)}
        want_b = {"tp_all_reduce": (0, 0), "tp_all_gather": (2 * L + 1, (2 * L + 1) * bsh),
                  "tp_reduce_scatter": (2 * L + 1, (2 * L + 1) * bsh), "tp_regather": (2 * L + 1, (2 * L + 1) * bsh)}
    else:
        want_f = {"tp_all_reduce": (2 * L + 1, (2 * L + 1) * 2 * bsh), "tp_all_gather": (0, 0),
                  "tp_reduce_scatter": (0, 0), "tp_regather": (0, 0)}
        want_b = dict(want_f)
    data = tc.batches(vocab, 2)
    for micro, (x, y) in enumerate(data):  # two micro-batches, accumulated: each counts the same
        x, y = x[r * b : (r + 1) * b], y[r * b : (r + 1) * b]
        with COMM_STATS.measure() as fwd:
            loss = loss_fn(model, x, y)
        with COMM_STATS.measure() as bwd:
            if micro == 0:
                with model.no_sync():
                    opt.backward(loss)
            else:
                opt.backward(loss)
        got_f = {k: (fwd.calls[k], fwd.bytes[k]) for k in kinds}
        got_b = {k: (bwd.calls[k], bwd.bytes[k]) for k in kinds}
        assert got_f == want_f, f"micro-batch {micro} forward {got_f} != {want_f}"
        assert got_b == want_b, f"micro-batch {micro} backward {got_b} != {want_b}"
        # the loss: a MAX and a SUM all-reduce of per-token values (SUM: sum-exp and the target logit), b·s tokens
        # (HF pads the shifted labels, so s per row there too)
        assert fwd.calls["tp_loss"] == 2 and fwd.bytes["tp_loss"] == 2 * 4 * b * tc.SEQ * (1 + 2), fwd.snapshot()
        assert bwd.calls["tp_loss"] == 0 and fwd.calls["tp_logits_gather"] == bwd.calls["tp_logits_gather"] == 0
        assert bwd.calls["tp_grad"] == 0  # partial gradients are completed once, when first read (below)
    with COMM_STATS.measure() as clip:
        opt.clip_grad_norm(tc.CLIP)
    partial = sequence or key.endswith("kv1")  # norms under SP, replicated KV heads
    assert clip.calls["tp_grad"] == (1 if partial else 0), clip.snapshot()
    opt.step()
    opt.zero_grad()
    return {"forward": got_f, "backward": got_b}


# -- the vocab-parallel loss ----------------------------------------------------------------------------------------
def _ce_case(mesh: memsave.Mesh) -> dict[str, Any]:
    """vocab_parallel_cross_entropy, and F.cross_entropy on ShardedLogits, equal F.cross_entropy on the whole logits:
    loss and logits gradient, reductions mean/sum/none, ignore_index, label smoothing over the global vocabulary,
    vocabularies that divide by tp and that do not (padding columns hold garbage: masked)."""
    from memsave.tp import ShardedLogits, VocabShard, vocab_parallel_cross_entropy

    t, r, group = mesh.degree("tp"), mesh.axis_rank("tp"), mesh.group("tp")
    worst = 0.0
    vocabs = (250, 251, 7) if t == 2 else (250, 5)  # tp=4, V=5: rank 3 holds only padding
    for vocab in vocabs:
        local = -(-vocab // t)
        start = r * local
        real = max(0, min(local, vocab - start))
        g = torch.Generator().manual_seed(vocab)
        full = torch.randn(24, vocab, generator=g, dtype=torch.float64) * 3
        targets = torch.randint(0, vocab, (24,), generator=g)
        targets[::5] = -100  # ignored rows (ignore_index=-100, or the other ignore_index below)
        shard = VocabShard(group, start, local, vocab)
        for ignore, smoothing, reduction in [(-100, 0.0, "mean"), (-100, 0.1, "mean"), (17 % vocab, 0.25, "sum"),
                                             (-100, 0.3, "none"), (-100, 1.0, "mean"), (-100, 0.0, "none")]:
            target = targets.masked_fill(targets == -100, ignore)
            want_in = full.clone().requires_grad_()
            want = F.cross_entropy(want_in, target, ignore_index=ignore, label_smoothing=smoothing,
                                   reduction=reduction)
            seed = torch.randn(want.shape, generator=g, dtype=torch.float64)
            (want * seed).sum().backward()
            assert want_in.grad is not None
            for through in ("function", "sharded"):
                mine = torch.full((24, local), 1e4, dtype=torch.float64)  # padding columns: garbage, masked
                mine[:, :real] = full[:, start : start + real]
                mine.requires_grad_()
                if through == "function":
                    got = vocab_parallel_cross_entropy(mine, target, shard, ignore_index=ignore,
                                                       label_smoothing=smoothing, reduction=reduction)
                else:
                    logits = ShardedLogits.wrap(mine.view(4, 6, local), shard)  # the model's [b, s, V] logits
                    got = F.cross_entropy(logits.view(-1, vocab), target, ignore_index=ignore,
                                          label_smoothing=smoothing, reduction=reduction)
                    assert type(got) is torch.Tensor
                (got * seed).sum().backward()
                what = f"V={vocab} rank {r} ignore={ignore} smoothing={smoothing} {reduction} via {through}"
                assert mine.grad is not None
                assert torch.isfinite(got).all() and torch.isfinite(mine.grad).all(), what
                assert torch.equal(mine.grad[:, real:], torch.zeros_like(mine.grad[:, real:])), what + ": padding"
                for a, b in ((got, want), (mine.grad[:, :real], want_in.grad[:, start : start + real])):
                    err = tc.rel(a.detach(), b.detach()) if b.numel() else 0.0
                    assert err <= 1e-12, f"{what}: relative error {err:.3g}"
                    worst = max(worst, err)
    # any other operation on the logits gathers them whole first (counted as tp_logits_gather), padding dropped
    vocab = 251 if t == 2 else 5
    local = -(-vocab // t)
    real = max(0, min(local, vocab - r * local))
    full = torch.randn(6, vocab, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mine = torch.zeros(6, local, dtype=torch.float64)
    mine[:, :real] = full[:, r * local : r * local + real]
    mine.requires_grad_()
    logits = ShardedLogits.wrap(mine, VocabShard(group, r * local, local, vocab))
    with COMM_STATS.measure() as comm:
        probs = logits.softmax(-1)
        flat = logits.float().view(-1, vocab)  # stays sharded: no traffic
    assert type(probs) is torch.Tensor and torch.allclose(probs, full.softmax(-1), rtol=0, atol=1e-15)
    assert isinstance(flat, ShardedLogits) and flat.shape == (6, local)
    assert comm.calls["tp_logits_gather"] == 1 and comm.bytes["tp_logits_gather"] == 6 * local * t * 8
    probs[:, 0].sum().backward()  # the gradient comes back to each rank's columns
    want = full.clone().requires_grad_()
    want.softmax(-1)[:, 0].sum().backward()
    assert want.grad is not None and mine.grad is not None
    assert torch.allclose(mine.grad[:, :real], want.grad[:, r * local : r * local + real], rtol=0, atol=1e-15)
    return {"worst": worst}


# -- plans ----------------------------------------------------------------------------------------------------------
def _snapshot(model: nn.Module) -> tuple[type, dict[str, tuple[int, torch.Tensor]]]:
    return type(model), {n: (id(p), p.detach().clone()) for n, p in model.named_parameters()}


def _assert_unchanged(model: nn.Module, snap: tuple[type, dict[str, tuple[int, torch.Tensor]]]) -> None:
    cls, params = snap
    assert type(model) is cls, f"class changed to {type(model).__name__}"
    now = {n: (id(p), p.detach()) for n, p in model.named_parameters()}
    assert now.keys() == params.keys()
    for n, (pid, v) in params.items():
        assert now[n][0] == pid and torch.equal(now[n][1], v), f"{n} changed"
        assert not hasattr(dict(model.named_parameters())[n], "_memsave_tp"), n
    assert not hasattr(model, "memsave_tp")


def _plans_case(mesh: memsave.Mesh) -> dict[str, Any]:
    """Bad plans and sizes raise clear errors before anything changes; a user plan for an nn.Sequential trains."""

    tp = mesh.degree("tp")
    prof = tc.profile("ddp", tp, False)
    refused = []

    def refuse(model: nn.Module, plan: dict[str, str] | None, exc: type[Exception], match: str) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        snap = _snapshot(model)
        with pytest.raises(exc, match=match):
            memsave.wrap(model, opt, prof, mesh=mesh, tp_plan=plan)
        _assert_unchanged(model, snap)
        assert not opt.state and "zero_grad" not in vars(opt)
        refused.append(match)

    # a pattern that matches nothing, named (its neighbours matched: nothing was cut before the refusal)
    refuse(tc.gpt(), {"wte": "vocab_embedding", "blocks.*.mlp": "colwise"}, ValueError,
           r"tp plan pattern 'blocks\.\*\.mlp' matches no module of the GPT")
    # heads not divisible by tp: GPT d_model=48 with 3 heads (qkv's 144 rows split evenly; the heads do not)
    refuse(_gpt_heads3(), None, ValueError,
           rf"module 'blocks\.0' has n_head=3, not divisible by tp={tp}")
    # the same for an HF Llama with 3 heads of 16 (its attention counts heads by head_dim)
    refuse(_llama_heads3(), None, ValueError,
           rf"module 'model\.layers\.0\.self_attn' has 3 attention heads, not divisible by tp={tp}")
    # an unknown style
    refuse(tc.gpt(), {**_gpt_plan(), "lm_head": "diagonal"}, NotImplementedError,
           r"tp plan entry 'lm_head': style 'diagonal' is not supported")
    # a model with no default plan
    seq = _sequential()
    refuse(seq, None, ValueError, r"memsave has no plan for a Sequential.*pass tp_plan=")
    # a module matched twice; a style on the wrong module type
    refuse(tc.gpt(), {"blocks.*.qkv": "colwise", "blocks.0.qkv": "colwise"}, ValueError,
           r"module 'blocks\.0\.qkv' is matched by both 'blocks\.\*\.qkv' and 'blocks\.0\.qkv'")
    refuse(tc.gpt(), {"blocks.*.ln_1": "colwise"}, ValueError, r"module 'blocks\.0\.ln_1' \(LayerNorm\) has style "
           r"'colwise', which needs an nn\.Linear")
    refuse(_lora_sequential(), {"0": "colwise", "2": "rowwise"}, ValueError,
           r"module '0' \(_LoRA\) has style 'colwise', which needs an nn\.Linear; it holds the nn\.Linear '0\.base', "
           r"'0\.A', '0\.B': name those\. An adapter \(LoRA\) .* colwise one the adapter's up-projection colwise")
    refuse(_sequential(width=33), {"0": "colwise", "2": "rowwise"}, ValueError,
           rf"module '0' has out_features=33, not divisible by .*tp={tp}")
    # under sequence parallelism a trainable parameter the plan does not name (OLMoE's router and experts, left
    # whole: their gradients were not summed over tp, 0.3% off after 3 steps, no error)
    model = tc.olmoe()
    plan = {k: v for k, v in tc.olmoe_plan(model).items() if not k.startswith("model.layers.*.mlp.")}
    with pytest.raises(ValueError, match=r"the tp plan names no style for module\(s\) 'model\.layers\.0\.mlp\.gate', "
                                         r"'model\.layers\.0\.mlp\.experts'.*name it 'sequence_parallel'"):
        memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), tc.profile("ddp", tp, True), mesh=mesh,
                     tp_plan=plan)
    refused.append("unnamed under sp")
    # experts cut over tp under sequence parallelism: not supported, said before anything changes
    model = tc.mixtral()
    snap = _snapshot(model)
    with pytest.raises(NotImplementedError, match=r"experts cut over tp \('moe_tp_experts'\) under sequence "
                                                  r"parallelism are not supported"):
        memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), tc.profile("ddp", tp, True), mesh=mesh)
    _assert_unchanged(model, snap)
    refused.append("experts under sp")
    # an nn.Linear subclass with a forward of its own: what it does with the cut features cannot be known (it was
    # replaced by the parallel class, its forward dropped, with no error)
    scaled = _sequential()
    scaled[0].__class__ = _ScaledLinear
    refuse(scaled, {"0": "colwise", "2": "rowwise"}, NotImplementedError,
           r"module '0' is a _ScaledLinear, a subclass of nn\.Linear with a forward of its own")

    # an nn.Linear subclass without one keeps its class (and its other methods) above the parallel one
    marked = _sequential()
    marked[0].__class__ = _MarkedLinear
    marked, _ = memsave.wrap(marked, torch.optim.SGD(marked.parameters(), lr=0.1), prof, mesh=mesh,
                             tp_plan={"0": "colwise", "2": "rowwise"})
    from memsave.tp import ColumnParallelLinear

    assert isinstance(marked[0], _MarkedLinear) and isinstance(marked[0], ColumnParallelLinear)
    assert marked[0].extra_repr() == "marked"
    # an nn.Embedding subclass whose forward reads the weight itself (with the global ids, on this rank's rows):
    # refused at its first call, whether the ids fall in this rank's rows or index past them
    raw = nn.Sequential(_RawEmbedding(250, 8), nn.Linear(8, 4))
    raw, _ = memsave.wrap(raw, torch.optim.SGD(raw.parameters(), lr=0.1), prof, mesh=mesh,
                          tp_plan={"0": "vocab_embedding"})
    for ids in (torch.tensor([[1, 2]]), torch.tensor([[1, 249]])):
        with pytest.raises(NotImplementedError, match=r"module '0' is a _RawEmbedding, whose forward does not call "
                                                      r"nn\.Embedding\.forward"):
            raw(ids)

    # under SP, a sequence that does not divide by tp: refused at the forward, on every rank alike
    model = tc.gpt()
    model, _ = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), tc.profile("ddp", tp, True), mesh=mesh)
    x = torch.randint(0, 250, (2, 15))
    with pytest.raises(ValueError, match=rf"sequence parallelism: dim 1 has size 15, which is not divisible by "
                                         rf"tp={tp}; use a sequence length that is a multiple of {tp}, or set "
                                         r"\[parallel\] sequence = false"):
        model(x, labels=x)
    model(x[:, :14], labels=x[:, :14])  # (and the next forward runs)

    # the user's plan for an nn.Sequential(Linear, GELU, Linear): trains as one process does
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(tc.STEPS)]

    def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    ref = tc.reference(_sequential, data, mse)
    model = _sequential()
    model, opt = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=tc.LR, momentum=tc.MOMENTUM), prof,
                              mesh=mesh, tp_plan={"0": "colwise", "2": "rowwise"})
    from memsave.tp import ColumnParallelLinear, RowParallelLinear

    assert isinstance(model[0], ColumnParallelLinear) and isinstance(model[2], RowParallelLinear)
    assert model[0].weight.shape == (32 // tp, 16) and model[2].weight.shape == (4, 32 // tp)
    run = tc.train(model, opt, mesh, data, mse)
    out = tc.compare(run, ref)
    assert all(err <= tc.FP32_TOL for err, _ in out.values()), out

    # LoRA adapters on frozen base layers, cut as the refusal above says: trains as one process does
    ref = tc.reference(_lora_sequential, data, mse)
    model = _lora_sequential()
    model, opt = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=tc.LR, momentum=tc.MOMENTUM), prof,
                              mesh=mesh, tp_plan={"0.base": "colwise", "0.B": "colwise", "2.base": "rowwise",
                                                  "2.A": "rowwise"})
    assert model[0].A.weight.shape == (2, 16) and model[0].B.weight.shape == (32 // tp, 2)
    lora = tc.compare(tc.train(model, opt, mesh, data, mse), ref)
    assert all(err <= tc.FP32_TOL for err, _ in lora.values()), lora
    return {"refused": len(refused), "sequential": out, "lora": lora}


def _gpt_plan() -> dict[str, str]:
    from memsave.tp import gpt_plan

    return gpt_plan()


def _gpt_heads3() -> nn.Module:
    from memsave.models.gpt import GPT, gpt_config

    torch.manual_seed(0)
    return GPT(gpt_config("tiny", d_model=48, n_head=3, vocab_size=250))


def _llama_heads3() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=250, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=3, num_key_value_heads=3, max_position_embeddings=64))


def _sequential(width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, 4))


class _ScaledLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2.0


class _MarkedLinear(nn.Linear):
    def extra_repr(self) -> str:
        return "marked"


class _RawEmbedding(nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class _LoRA(nn.Module):
    """A frozen base layer plus a trainable low-rank update B(A(x)), as LoRA adapters are written."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.A = nn.Linear(base.in_features, rank, bias=False)
        self.B = nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.B(self.A(x))


def _lora_sequential() -> nn.Module:
    model = _sequential()
    torch.manual_seed(1)
    return nn.Sequential(_LoRA(model[0]), model[1], _LoRA(model[2]))


def _embedding_case(mesh: memsave.Mesh) -> dict[str, Any]:
    """A user's nn.Embedding with every option (padding_idx, max_norm, scale_grad_by_freq; 11 rows: padded to 12),
    vocab-parallel, then a column-parallel linear gathering its output: trains as one process does. Each rank
    looks up only its own ids (a stand-in row for the others' ids must not be renormed nor counted)."""
    def build() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(11, 8, padding_idx=7, max_norm=1.5, scale_grad_by_freq=True),
                              nn.Linear(8, 4))
        with torch.no_grad():
            model[0].weight.mul_(3.0)  # most rows longer than max_norm: renormed when (and only when) looked up
        return model

    g = torch.Generator().manual_seed(4)
    ids = [torch.randint(0, 6, (4, 6), generator=g) for _ in range(tc.STEPS)]  # rank 0's rows 0-5 only ...
    ids[1][:, ::2] = torch.randint(6, 11, (4, 3), generator=g)  # ... then both ranks' (7: padding_idx)
    data = [(x, torch.randn(4, 6, 4, generator=g)) for x in ids]

    def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    ref = tc.reference(build, data, mse)
    model = build()
    model, opt = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=tc.LR, momentum=tc.MOMENTUM),
                              tc.profile("ddp", mesh.degree("tp"), False), mesh=mesh,
                              tp_plan={"0": "vocab_embedding", "1": "colwise_gather_output"})
    out = tc.compare(tc.train(model, opt, mesh, data, mse), ref)
    assert all(err <= tc.FP32_TOL for err, _ in out.values()), out
    return out


# -- dropout ----------------------------------------------------------------------------------------------------------
def _dropout_case(mesh: memsave.Mesh) -> dict[str, Any]:
    """[Note: TP random streams], observed through module outputs under tp without SP. The two ranks' heads are
    made identical (each q, k, v block's rows for head 1 copied from head 0), so without dropout the attention
    outputs the ranks hold would be equal: with dropout they differ (each rank its own mask inside the TP region),
    while the embedding dropout and the residual dropout after the row-parallel output (replicated regions) are the
    same on every rank even though the ranks' generators were seeded differently before wrap."""
    group = mesh.group("tp")
    model = tc.gpt(dropout=0.5)
    with torch.no_grad():
        for block in model.blocks:
            w = block.qkv.weight.view(3, 2, 32, 64)  # (q/k/v, head, head_dim, d)
            w[:, 1] = w[:, 0]
            block.qkv.bias.view(3, 2, 32)[:, 1] = block.qkv.bias.view(3, 2, 32)[:, 0]
    torch.manual_seed(100 + mesh.axis_rank("tp"))  # different generators on the ranks: wrap makes them equal
    model, opt = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), tc.profile("ddp", 2, False),
                              mesh=mesh)
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str, inputs: bool) -> Any:
        def hook(module: nn.Module, args: Any, out: Any = None) -> None:
            seen.setdefault(name, (args[0] if inputs else out).detach().clone())
        return hook

    model.drop.register_forward_hook(keep("embedding dropout", False))
    model.blocks[0].attn_proj.register_forward_pre_hook(keep("attention (TP region)", True))
    model.blocks[0].resid_drop.register_forward_hook(keep("residual dropout", False))
    x, y = tc.batches(250, 1)[0]
    loss = model(x, labels=y).loss
    opt.backward(loss)
    same = {k: all(torch.equal(v[0], o) for o in v[1:]) for k, v in
            ((k, _tp_all_gather(t, group)) for k, t in sorted(seen.items()))}
    assert same == {"embedding dropout": True, "attention (TP region)": False, "residual dropout": True}, same
    emb = seen["embedding dropout"]
    assert 0.3 < (emb == 0).float().mean().item() < 0.7  # the dropout ran (p = 0.5)
    # and without dropout (eval) the two ranks' attention outputs are equal: the masks made the difference
    model.eval()
    seen.clear()
    with torch.no_grad():
        model(x)
    both = _tp_all_gather(seen["attention (TP region)"], group)
    assert torch.equal(both[0], both[1])
    return {}


def _recompute_dropout_case(mesh: memsave.Mesh) -> dict[str, Any]:
    """zero3-recompute replays the dropout masks of the first forward (TP and replicated streams alike): losses and
    gradients equal zero3's bit for bit on the same seeds, SP off and on."""
    out = {}
    for sequence in (False, True):
        runs = []
        for name in ("zero3", "zero3-recompute"):
            model = tc.gpt(dropout=0.2)
            torch.manual_seed(5)
            model, opt = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=tc.LR, momentum=tc.MOMENTUM),
                                      tc.profile(name, 2, sequence), mesh=mesh)
            losses, grads = [], []
            for x, y in tc.batches(250, 2):
                loss = model(x, labels=y).loss
                opt.backward(loss)
                losses.append(loss.item())
                grads.append({k: v.clone() for k, v in opt.full_grads().items() if v is not None})
                opt.step()
                opt.zero_grad()
            runs.append((losses, grads))
        (l0, g0), (l1, g1) = runs
        assert l0 == l1, f"sequence={sequence}: losses {l0} != {l1}"
        for step, (a, b) in enumerate(zip(g0, g1)):
            assert a.keys() == b.keys() and len(a) > 0
            diff = [k for k in a if not torch.equal(a[k], b[k])]
            assert not diff, f"sequence={sequence} step {step}: gradients differ: {diff}"
        out[f"sequence={sequence}"] = l0
    return out


# -- the workers ----------------------------------------------------------------------------------------------------
def _run_cases(cases: dict[str, Case], mesh: memsave.Mesh) -> dict[str, tuple[bool, Any]]:
    results: dict[str, tuple[bool, Any]] = {}
    for name, case in cases.items():
        torch.manual_seed(0)
        try:
            results[name] = (True, case(mesh))
        except (Exception, pytest.fail.Exception):  # reported by the case's own test (pytest's Failed too)
            results[name] = (False, traceback.format_exc())
    return results


def _tp2_worker(bf16_refs: dict[str, tc.Run]) -> dict[str, tuple[bool, Any]]:
    mesh = memsave.init(tp=2)
    cases: dict[str, Case] = {}
    cases["tied-state-dict"] = _tied_state_dict_case
    cases["submodule-load"] = _submodule_load_case
    for name, (key, prof, seq) in TP2_TRAIN.items():
        cases[f"train:{name}"] = lambda m, k=key, p=prof, s=seq: _train_case(m, k, p, s, bf16_refs)
    for key, seq in TP2_COMM:
        cases[f"comm:{key}:sp={seq}"] = lambda m, k=key, s=seq: _comm_case(m, k, s)
    cases["ce:tp2"] = _ce_case
    cases["plans"] = _plans_case
    cases["embedding"] = _embedding_case
    cases["dropout"] = _dropout_case
    cases["recompute-dropout"] = _recompute_dropout_case
    return _run_cases(cases, mesh)


def _tied_state_dict_case(mesh: memsave.Mesh) -> str:
    """A tied weight's names share one gathered tensor in ``model.state_dict()``, as they alias in plain torch:
    a padding row zeroed through one name and loaded back is zero (the other name's copy overwrote it)."""
    for profile in ("ddp", "zero3"):
        torch.manual_seed(0)
        model = tc.gpt(tie=True)
        model, _ = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=tc.LR), profile, mesh=mesh)
        sd = model.state_dict()
        assert sd["wte.weight"] is sd["lm_head.weight"], profile
        sd["wte.weight"][0] = 0
        model.load_state_dict(sd)
        after = model.state_dict()
        assert not after["wte.weight"][0].any() and not after["lm_head.weight"][0].any(), profile
        assert after["wte.weight"][1].any(), profile
    return "ok"


def _submodule_load_case(mesh: memsave.Mesh) -> str:
    """A pretrained backbone loaded into a submodule after wrap (``model.model.load_state_dict(backbone)``, whole
    tensors): each rank cuts its slices, as a load through the root does (torch's size mismatch before)."""
    backbone = tc.llama(False, 2)
    with torch.no_grad():
        for p in backbone.parameters():
            p.add_(1.0)
    for profile in ("ddp", "zero2"):
        model = tc.llama(False, 2)
        model, _ = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=tc.LR), profile, mesh=mesh)
        model.model.load_state_dict(backbone.model.state_dict())
        got = model.state_dict()
        for k, v in backbone.state_dict().items():
            same = torch.equal(got[k], v)
            assert same if k.startswith("model.") else not same, (profile, k)
    return "ok"


def _replica_eval_case(mesh: memsave.Mesh) -> dict[str, list[float]]:
    """An evaluation on dp rank 0's replica only (its two tp ranks) between steps: legal, since a forward
    communicates over tp alone ([Note: control-flow agreement]); the losses equal those of the loop without it."""
    x, y = tc.batches(250, steps=1)[0]
    x, y = x[mesh.dp_rank::2], y[mesh.dp_rank::2]
    out = {}
    for profile in ("ddp", "zero2"):
        for evaluate in (False, True):
            torch.manual_seed(0)
            model = tc.gpt()
            model, opt = memsave.wrap(model, torch.optim.SGD(model.parameters(), lr=tc.LR), profile, mesh=mesh)
            losses = []
            for _ in range(2):
                loss = tc.gpt_loss(model, x, y)
                opt.backward(loss)
                opt.step()
                opt.zero_grad()
                losses.append(float(loss))
                if evaluate and mesh.dp_rank == 0:
                    with torch.no_grad():
                        tc.gpt_loss(model, x, y)
            out[f"{profile}:{evaluate}"] = losses
        assert out[f"{profile}:True"] == out[f"{profile}:False"], out
    return out


def _dp2tp2_worker(bf16_refs: dict[str, tc.Run]) -> dict[str, tuple[bool, Any]]:
    mesh = memsave.init(tp=2)
    assert mesh.degree("dp") == 2
    cases: dict[str, Case] = {}
    for name, (key, prof, seq) in DP2TP2_TRAIN.items():
        cases[f"train:{name}"] = lambda m, k=key, p=prof, s=seq: _train_case(m, k, p, s, bf16_refs)
    for key, seq in DP2TP2_COMM:
        cases[f"comm:{key}:sp={seq}"] = lambda m, k=key, s=seq: _comm_case(m, k, s)
    cases["replica-eval"] = _replica_eval_case
    results = _run_cases(cases, mesh)
    cases = {"ce:tp4": _ce_case}
    for name, (key, prof, seq) in TP4_TRAIN.items():
        cases[f"train-tp4:{name}"] = lambda m, k=key, p=prof, s=seq: _train_case(m, k, p, s, bf16_refs)
    results.update(_run_cases(cases, memsave.init(tp=4)))
    return results


@pytest.fixture(scope="module")
def bf16_refs() -> dict[str, tc.Run]:
    return {key: bf16_reference(key) for key in BF16_REFS}


def _merged(per_rank: list[dict[str, tuple[bool, Any]]]) -> dict[str, tuple[bool, Any]]:
    """A case passed if it passed on every rank; the first failing rank's traceback, or rank 0's result."""
    out = {}
    for name in per_rank[0]:
        bad = [(r, res[name][1]) for r, res in enumerate(per_rank) if not res[name][0]]
        out[name] = (False, f"rank {bad[0][0]}: {bad[0][1]}") if bad else per_rank[0][name]
    return out


@pytest.fixture(scope="module")
def tp2(bf16_refs: dict[str, tc.Run]) -> dict[str, tuple[bool, Any]]:
    return _merged(run_ranks(_tp2_worker, 2, bf16_refs, timeout=300))


@pytest.fixture(scope="module")
def dp2tp2(bf16_refs: dict[str, tc.Run]) -> dict[str, tuple[bool, Any]]:
    return _merged(run_ranks(_dp2tp2_worker, 4, bf16_refs, timeout=300))


def _outcome(results: dict[str, tuple[bool, Any]], name: str) -> Any:
    ok, value = results[name]
    if not ok:
        pytest.fail(f"case {name} failed:\n{value}", pytrace=False)
    return value


def _assert_matches(name: str, prof: str, out: dict[str, tuple[float, str]]) -> None:
    print(name, {k: f"{v[0]:.3g}" for k, v in out.items()})
    for what, (err, detail) in out.items():
        tol = BF16_TOL[what] if prof == "ddp-bf16" else tc.FP32_TOL
        assert err <= tol, f"{name}: {what} relative difference {err:.3g} > {tol} ({detail})"


# -- the tests --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(TP2_TRAIN))
def test_tp2_trains_as_one_process(tp2: dict, name: str) -> None:
    _assert_matches(name, TP2_TRAIN[name][1], _outcome(tp2, f"train:{name}"))


@pytest.mark.parametrize("name", list(DP2TP2_TRAIN))
def test_dp2_tp2_trains_as_one_process(dp2tp2: dict, name: str) -> None:
    _assert_matches(name, DP2TP2_TRAIN[name][1], _outcome(dp2tp2, f"train:{name}"))


@pytest.mark.parametrize("name", list(TP4_TRAIN))
def test_tp4_trains_as_one_process(dp2tp2: dict, name: str) -> None:
    _assert_matches(name, TP4_TRAIN[name][1], _outcome(dp2tp2, f"train-tp4:{name}"))


@pytest.mark.parametrize(("model", "sequence"), TP2_COMM)
def test_tp2_collective_counts_and_bytes_follow_the_formulas(tp2: dict, model: str, sequence: bool) -> None:
    _outcome(tp2, f"comm:{model}:sp={sequence}")


@pytest.mark.parametrize(("model", "sequence"), DP2TP2_COMM)
def test_dp2_tp2_collective_counts_and_bytes_follow_the_formulas(dp2tp2: dict, model: str, sequence: bool) -> None:
    _outcome(dp2tp2, f"comm:{model}:sp={sequence}")


@pytest.mark.parametrize("group", ["tp2", "tp4"])
def test_vocab_parallel_cross_entropy_equals_torch(tp2: dict, dp2tp2: dict, group: str) -> None:
    _outcome(tp2 if group == "tp2" else dp2tp2, f"ce:{group}")


def test_bad_plans_are_refused_before_anything_changes_and_a_user_plan_trains(tp2: dict) -> None:
    assert _outcome(tp2, "plans")["refused"] == 12


def test_a_vocab_parallel_embedding_with_every_option_trains_as_one_process(tp2: dict) -> None:
    _outcome(tp2, "embedding")


def test_dropout_masks_differ_in_tp_regions_and_agree_in_replicated_ones(tp2: dict) -> None:
    _outcome(tp2, "dropout")


def test_recompute_replays_the_dropout_masks(tp2: dict) -> None:
    _outcome(tp2, "recompute-dropout")


def test_a_tied_weight_edited_through_the_state_dict_loads_back(tp2: dict) -> None:
    _outcome(tp2, "tied-state-dict")


def test_a_backbone_loaded_into_a_submodule_after_wrap_is_cut(tp2: dict) -> None:
    _outcome(tp2, "submodule-load")


def test_an_evaluation_on_one_dp_replica_is_legal(dp2tp2: dict) -> None:
    print(_outcome(dp2tp2, "replica-eval"))


def test_every_case_ran(tp2: dict, dp2tp2: dict) -> None:
    assert {f"train:{n}" for n in TP2_TRAIN} | {f"comm:{m}:sp={q}" for m, q in TP2_COMM} | {
        "ce:tp2", "plans", "embedding", "dropout", "recompute-dropout", "tied-state-dict",
        "submodule-load"} == tp2.keys()
    assert {f"train:{n}" for n in DP2TP2_TRAIN} | {f"comm:{m}:sp={q}" for m, q in DP2TP2_COMM} | {
        "ce:tp4", "replica-eval"} | {f"train-tp4:{n}" for n in TP4_TRAIN} == dp2tp2.keys()


def test_a_hf_plan_that_names_norms_keeps_their_styles() -> None:
    """Gemma 3's base_model_tp_plan names its q_norm / k_norm (replicated_with_grad_allreduce); memsave's completion
    (sequence-parallel norms) added them again by their full names: every wrap under tp refused the model
    ("matched by both"). Now the plan's own entry stands, and every other norm is completed."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from memsave.tp.plan import default_plan, match_plan

    cfg = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32)
    matched = match_plan(model := Gemma3ForCausalLM(cfg), default_plan(model))
    assert matched["model.layers.1.self_attn.q_norm"][0] == "replicated_with_grad_allreduce"
    assert matched["model.layers.1.input_layernorm"][0] == "sequence_parallel"
    assert matched["model.norm"][0] == "sequence_parallel"


def test_hf_plans_with_experts_and_gathered_projections() -> None:
    """Mixtral's base_model_tp_plan cuts its fused expert tensors ('packed_colwise' / 'rowwise' on parameters of
    the experts module, 'moe_tp_experts'): before, "pattern ... matches no module"; now each rank holds its share
    of every expert ([Note: expert tensor parallelism] in memsave/tp/apply.py). An expert-parallel style, a
    parameter cut outside a 'moe_tp_experts' module and experts under sequence parallelism are refused, naming
    them. OLMoE's plan (Phi-3's too) gathers its projections' outputs whole ('colwise_gather_output') and cuts
    o_proj's input again ('rowwise_split_input'); its norms inside the attention read the whole features there, so
    they are completed 'replicated', not 'sequence_parallel' (summed over tp under sequence parallelism: their
    gradients were doubled at tp = 2). A module beside the projections takes its style from where the forward
    calls it ([Note: modules beside the projections])."""
    from transformers import MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM

    from memsave.tp import cut_shapes
    from memsave.tp.plan import default_plan, match_plan

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=32)
    cfg = MixtralConfig(**small, num_key_value_heads=2, num_local_experts=4)
    with torch.device("meta"):
        mixtral = MixtralForCausalLM(cfg)
    matched = match_plan(mixtral, default_plan(mixtral))
    assert matched["model.layers.1.mlp.experts"][0] == "moe_tp_experts"
    assert matched["model.layers.1.mlp.experts.gate_up_proj"] == ("packed_colwise", 2)
    cut_shapes(mixtral, 2)
    experts = mixtral.model.layers[1].mlp.experts
    assert experts.gate_up_proj.shape == (4, 48, 32) and experts.down_proj.shape == (4, 32, 24)
    ep = copy.deepcopy(cfg)
    ep.base_model_tp_plan = {**cfg.base_model_tp_plan, "layers.*.mlp.gate": "ep_router"}
    with pytest.raises(NotImplementedError, match=r"places its mixture-of-experts experts by expert parallelism "
                                                  r"\('model\.layers\.\*\.mlp\.gate': each rank whole experts"):
        default_plan(MixtralForCausalLM(ep))
    # Llama 4 stores each expert (in, out): 'packed_rowwise' / 'colwise' cut the same intermediate features; its
    # base_model is the model itself, and its plan applies under "model." (taken as no prefix, every entry named
    # nothing: the plan cut only the embedding and the head, with no error)
    from tests.tp_cases import llama4

    with torch.device("meta"):
        l4 = llama4()
    assert match_plan(l4, default_plan(l4))["model.layers.0.self_attn.q_proj"][0] == "colwise"
    cut_shapes(l4, 2)
    experts = l4.model.layers[0].feed_forward.experts
    assert experts.gate_up_proj.shape == (4, 64, 96) and experts.down_proj.shape == (4, 48, 64)
    # Qwen2-MoE's plan names dense-MLP modules for layers a config may make dense: with every layer sparse they
    # name nothing here and are dropped (a user's plan that names nothing is still refused: a typo)
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    with torch.device("meta"):
        qmoe = Qwen2MoeForCausalLM(Qwen2MoeConfig(**small, num_key_value_heads=2, num_experts=4,
                                                   moe_intermediate_size=24, shared_expert_intermediate_size=32))
    plan = default_plan(qmoe)
    assert "model.layers.*.mlp.gate_proj" not in plan and plan["model.layers.*.mlp.experts"] == "moe_tp_experts"
    with pytest.raises(ValueError, match=r"tp plan pattern 'model\.layers\.\*\.mlp\.gate_proj' matches no module"):
        match_plan(qmoe, {**plan, "model.layers.*.mlp.gate_proj": "colwise"})
    # a fused expert tensor takes the four cutting styles only, 'packed_rowwise' a parameter only, and its cut dim
    # divides by blocks x tp
    with torch.device("meta"):
        bad = MixtralForCausalLM(cfg)
    with pytest.raises(ValueError, match=r"names parameters \('model\.layers\.0\.mlp\.experts\.down_proj'.*"
                                         r"'vocab_embedding'; a parameter takes 'colwise'"):
        match_plan(bad, {"model.layers.*.mlp.experts.down_proj": "vocab_embedding"})
    with pytest.raises(ValueError, match=r"'packed_rowwise' is for a fused expert tensor \(a parameter\), not a "
                                         r"module \('model\.layers\.0\.mlp\.gate'\)"):
        match_plan(bad, {"model.layers.*.mlp.gate": "packed_rowwise"})
    with pytest.raises(ValueError, match=r"parameter 'model\.layers\.0\.mlp\.experts\.gate_up_proj' has size 96 "
                                         r"along dim 1, not divisible by 2 x tp=5"):
        cut_shapes(bad, 5, {"model.layers.*.mlp.experts": "moe_tp_experts",
                            "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise"})
    plan = {k: v for k, v in default_plan(MixtralForCausalLM(cfg)).items() if not k.endswith("mlp.experts")}
    with pytest.raises(ValueError, match=r"parameter 'model\.layers\.0\.mlp\.experts\.gate_up_proj' has style "
                                         r"'packed_colwise', but its module is not 'moe_tp_experts'"):
        cut_shapes(MixtralForCausalLM(cfg), 2, plan)
    olmoe = OlmoeForCausalLM(OlmoeConfig(**small, num_key_value_heads=4, num_experts=4, num_experts_per_tok=1))
    olmoe.config.base_model_tp_plan = {k: v for k, v in olmoe.config.base_model_tp_plan.items() if "experts" not in k}
    matched = match_plan(olmoe, default_plan(olmoe))
    assert matched["model.layers.1.self_attn.o_proj"][0] == "rowwise_split_input"
    assert matched["model.layers.1.self_attn.q_norm"][0] == "replicated"
    assert matched["model.layers.1.post_attention_layernorm"][0] == "sequence_parallel"
    # Apertus's trainable activation (xIELU) between up_proj (colwise) and down_proj reads this rank's features: its
    # gradient is summed over tp (left whole before: 2e-4 off after 3 steps without SP, no error)
    from transformers import ApertusConfig, ApertusForCausalLM

    apertus = ApertusForCausalLM(ApertusConfig(**small, num_key_value_heads=2))
    assert match_plan(apertus, default_plan(apertus))["model.layers.1.mlp.act_fn"][0] == (
        "replicated_with_grad_allreduce")
    # DeepSeek-V3's router runs on its MLP's input, before the shared expert's colwise projections: whole features,
    # its gradient whole already ('replicated'; as this rank's features it was summed again: doubled, no error).
    # Qwen 3's q_norm runs after q_proj: this rank's heads
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.tp_cases import deepseek_v3

    ds = deepseek_v3()
    assert match_plan(ds, default_plan(ds))["model.layers.1.mlp.gate"][0] == "replicated"
    # an attention / MLP with no column-parallel projection of its own: MiniMax's linear-attention layer, EXAONE-MoE's
    # sparse layer (the plan cuts the dense layers' MLPs; its shared expert stays whole): whole features (their
    # gradients were doubled)
    from tests.tp_cases import exaone_moe, minimax

    mm, ex = minimax(), exaone_moe()
    assert match_plan(mm, default_plan(mm))["model.layers.1.self_attn.qkv_proj"][0] == "replicated"
    assert match_plan(ex, default_plan(ex))["model.layers.1.mlp.shared_experts.up_proj"][0] == "replicated"
    # Inkling 2's plan cuts its fused gate_up_proj 'colwise', its experts split it with chunk(2): packed (a rank held
    # every gate row, the other every up row); GPT-OSS's interleaved rows keep HF's style
    from tests.tp_cases import inkling2

    ink = inkling2()
    assert default_plan(ink)["model.layers.*.mlp.experts.gate_up_proj"] == "packed_colwise"
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**small, num_key_value_heads=2, head_dim=8))
    assert match_plan(qwen3, default_plan(qwen3))["model.layers.0.self_attn.q_norm"][0] == (
        "replicated_with_grad_allreduce")
