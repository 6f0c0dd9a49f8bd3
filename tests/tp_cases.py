"""Shared pieces of the tensor-parallel tests (tests/test_tp.py): tiny models, batches, the single-process reference
and the TP training loop whose losses, clip norms and gathered parameters are compared with it.

The comparisons use ``rel(a, b) = max|a - b| / max|b|`` per tensor (and per loss and norm). A TP run sums the
partial products of a matmul over ``tp`` in another order than one process does, so fp32 results differ by a few
ulps, not bitwise (DESIGN.md: "TP matches within reduction-order rounding; state the tolerance"): FP32_TOL.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

import memsave
from memsave import dist as mdist
from memsave.config import Profile, load_profile
from tests.compare import rel

STEPS = 3
BATCH, SEQ = 4, 16  # the global batch: (BATCH, SEQ) tokens; each dp rank takes BATCH / dp rows
LR, MOMENTUM, CLIP = 0.5, 0.9, 1.0
FP32_TOL = 1e-6  # relative (max abs diff / max abs value), losses, clip norms and every gathered parameter

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


# -- models ---------------------------------------------------------------------------------------------------------
def gpt(vocab: int = 250, tie: bool = True, dropout: float = 0.0, n_head: int = 2) -> nn.Module:
    from memsave.models.gpt import GPT, gpt_config

    torch.manual_seed(0)
    return GPT(gpt_config("tiny", vocab_size=vocab, tie_weights=tie, dropout=dropout, n_head=n_head))


def llama(tie: bool, nkv: int, heads: int = 4) -> nn.Module:
    """An unchanged Hugging Face LlamaForCausalLM from a small config (no download): 2 layers, hidden 64, GQA."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=nkv, tie_word_embeddings=tie,
                      max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def gemma() -> nn.Module:
    """An unchanged Hugging Face GemmaForCausalLM (tied): its embedding is a subclass of nn.Embedding whose forward
    scales the lookup by sqrt(hidden) ([Note: subclasses of the cut layers] in memsave/tp/apply.py)."""
    from transformers import GemmaConfig, GemmaForCausalLM

    cfg = GemmaConfig(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return GemmaForCausalLM(cfg)


def phi3() -> nn.Module:
    """An unchanged Hugging Face Phi3ForCausalLM (GQA, fused qkv_proj): its plan gathers the fused projections'
    outputs whole ('colwise_gather_output') and cuts o_proj's input again ('rowwise_split_input')."""
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = Phi3Config(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                     bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    return Phi3ForCausalLM(cfg)


def apertus() -> nn.Module:
    """An unchanged Hugging Face ApertusForCausalLM: its MLP's activation (xIELU) has trainable parameters, read
    on this rank's features between up_proj and down_proj."""
    from transformers import ApertusConfig, ApertusForCausalLM

    cfg = ApertusConfig(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        attn_implementation="sdpa")
    torch.manual_seed(0)
    return ApertusForCausalLM(cfg)


def mixtral(aux: bool = True) -> nn.Module:
    """An unchanged Hugging Face MixtralForCausalLM (4 experts, top-2; ``aux``: its auxiliary load-balancing loss
    on, a statistic of the whole batch, which data parallelism computes per replica, as DDP does): HF's plan cuts
    every expert ('moe_tp_experts', [Note: expert tensor parallelism] in memsave/tp/apply.py)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=64, output_router_logits=aux, router_aux_loss_coef=0.02,
                        attn_implementation="sdpa")
    torch.manual_seed(0)
    return MixtralForCausalLM(cfg)


def llama4() -> nn.Module:
    """An unchanged Hugging Face Llama4ForCausalLM (text): its experts store each matrix (in, out), so HF's plan
    names gate_up_proj 'packed_rowwise' and down_proj 'colwise'; its base model is the model itself (the plan
    applies under ``model``)."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    cfg = Llama4TextConfig(vocab_size=250, hidden_size=64, intermediate_size=96, intermediate_size_mlp=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           num_local_experts=4, num_experts_per_tok=1, max_position_embeddings=64,
                           attn_implementation="sdpa")
    torch.manual_seed(0)
    return Llama4ForCausalLM(cfg)


def _hf_model(config: str, model: str, attn: str = "sdpa", **sizes: Any) -> nn.Module:
    """transformers' ``model`` class built from its ``config`` class with ``sizes`` and ``attn`` attention, seeded."""
    import transformers

    cfg = getattr(transformers, config)(**sizes, attn_implementation=attn)
    torch.manual_seed(0)
    return getattr(transformers, model)(cfg)


def deepseek_v3() -> nn.Module:
    """An unchanged Hugging Face DeepseekV3ForCausalLM (multi-head latent attention; layer 0 dense, layer 1 four
    routed experts, top-2, and a shared expert): HF's plan names the dense MLP's projections
    ('layers.*.mlp.gate_proj'), so layer 1's MLP, router included, is an MLP the plan cuts ([Note: modules beside
    the projections] in memsave/tp/plan.py)."""
    return _hf_model("DeepseekV3Config", "DeepseekV3ForCausalLM", vocab_size=250, hidden_size=64, intermediate_size=96,
                     moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                     n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                     kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                     max_position_embeddings=64, n_shared_experts=1)


def minimax() -> nn.Module:
    """An unchanged Hugging Face MiniMaxForCausalLM: layer 0 softmax attention (cut by HF's plan), layer 1 linear
    (lightning) attention, whose projections the plan does not name; four experts, top-2."""
    return _hf_model("MiniMaxConfig", "MiniMaxForCausalLM", vocab_size=250, hidden_size=64, intermediate_size=96,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)


def exaone_moe() -> nn.Module:
    """An unchanged Hugging Face ExaoneMoeForCausalLM: layer 0 a dense MLP (cut by HF's plan), layer 1 four routed
    experts, top-2, and a shared expert the plan does not name."""
    return _hf_model("ExaoneMoeConfig", "ExaoneMoeForCausalLM", vocab_size=250, hidden_size=64, intermediate_size=96,
                     moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)


def inkling2() -> nn.Module:
    """An unchanged Hugging Face Inkling2ForCausalLM (for its plan: its config keeps a vocabulary of 200k): its
    experts split the fused gate_up_proj with chunk(2), where HF's plan names it 'colwise' (taken as
    'packed_colwise', said once)."""
    return _hf_model("Inkling2TextConfig", "Inkling2ForCausalLM", "eager", vocab_size=250, hidden_size=64, intermediate_size=96,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     max_position_embeddings=64, n_routed_experts=4, num_local_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=32)


def olmoe() -> nn.Module:
    """An unchanged Hugging Face OlmoeForCausalLM (4 experts, top-1; q_norm / k_norm on the gathered query and
    key). memsave does not cut experts: :func:`olmoe_plan` leaves them whole."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    cfg = OlmoeConfig(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=1,
                      max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    return OlmoeForCausalLM(cfg)


def olmoe_plan(model: nn.Module) -> dict[str, str]:
    """HF's plan without the experts' entries (memsave's completion of the rest), the router and the experts
    whole on every rank, their gradients summed over tp under sequence parallelism."""
    from memsave.tp.plan import default_plan

    full = model.config.base_model_tp_plan
    model.config.base_model_tp_plan = {k: v for k, v in full.items() if ".experts" not in k}
    try:
        plan = default_plan(model)
    finally:
        model.config.base_model_tp_plan = full
    return {**plan, "model.layers.*.mlp.gate": "sequence_parallel", "model.layers.*.mlp.experts": "sequence_parallel"}


def gpt_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, labels=y).loss


def llama_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss  # (HF shifts the labels itself; y unused)


def batches(vocab: int, steps: int = STEPS, seed: int = 0) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (BATCH, SEQ), generator=g), torch.randint(0, vocab, (BATCH, SEQ), generator=g))
            for _ in range(steps)]


def profile(name: str, tp: int, sequence: bool) -> Profile:
    prof = load_profile(name)
    if prof.offload.optimizer == "disk":  # the spawned rank's own temporary folder, removed when it exits
        prof = dataclasses.replace(prof, offload=dataclasses.replace(prof.offload, path=_scratch()))
    return dataclasses.replace(prof, parallel=dataclasses.replace(prof.parallel, tp=tp, sequence=sequence))


_SCRATCH: list[tempfile.TemporaryDirectory[str]] = []


def _scratch() -> str:
    if not _SCRATCH:
        _SCRATCH.append(tempfile.TemporaryDirectory(prefix="memsave-tp-offload-"))
    return _SCRATCH[0].name


# -- runs -----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    losses: list[float]
    norms: list[float]
    params: dict[str, np.ndarray]  # whole tensors, float32
    evaluated: float  # the trained model's loss on the first batch, in eval mode under no_grad


def reference(build: Callable[[], nn.Module], data: list[Batch], loss_fn: LossFn) -> Run:
    """Plain single-process fp32 training on the global batch: SGD with momentum, torch's clip_grad_norm_."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses, norms = [], []
    for x, y in data:
        loss = loss_fn(model, x, y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        evaluated = loss_fn(model, *data[0]).item()
    return Run(losses, norms, {n: p.detach().float().clone().numpy() for n, p in model.named_parameters()},
               evaluated)


def gathered_params(model: nn.Module, mesh: memsave.Mesh) -> dict[str, np.ndarray]:
    """Every parameter whole: gathered over tp (memsave.tp.gather_tp, padding dropped) after ZeRO's unshard."""
    from memsave.tp import gather_tp, tp_param

    model.unshard()  # type: ignore[operator]
    out = {}
    for n, p in model.named_parameters():
        v, lay = p.detach(), tp_param(p)
        if lay is not None and lay.dim is not None:
            v = gather_tp(v, lay.dim, mesh.group("tp"), blocks=lay.blocks, full=lay.full_shape[lay.dim])
        out[n] = v.float().clone().numpy()  # (clone first: .numpy() would pin the storage stage 3 frees)
    model.reshard()  # type: ignore[operator]
    return out


def train(model: nn.Module, opt: Any, mesh: memsave.Mesh, data: list[Batch], loss_fn: LossFn,
          after_clip: Callable[[], None] | None = None, clear: str = "optimizer") -> Run:
    """Each dp rank its rows of every global batch; the losses averaged over dp (equal token counts per rank).
    ``clear``: the gradients are cleared after each step by ``optimizer.zero_grad()``, ``model.zero_grad()`` or by
    hand (``"hand"``: ``p.grad = None`` over the model's parameters)."""
    dp, r = mesh.degree("dp"), mesh.axis_rank("dp")
    losses, norms = [], []
    for x, y in data:
        rows = x.shape[0] // dp
        loss = loss_fn(model, x[r * rows : (r + 1) * rows], y[r * rows : (r + 1) * rows])
        opt.backward(loss)
        norms.append(float(opt.clip_grad_norm(CLIP)))
        if after_clip is not None:
            after_clip()
        opt.step()
        if clear == "hand":
            for p in model.parameters():
                p.grad = None
        else:
            (opt if clear == "optimizer" else model).zero_grad()
        losses.append(_dp_mean(loss, mesh))
    model.eval()
    with torch.no_grad():  # (the forward without autograd: no saved inputs, no regather)
        x, y = data[0]
        evaluated = _dp_mean(loss_fn(model, x[r * rows : (r + 1) * rows], y[r * rows : (r + 1) * rows]), mesh)
    model.train()
    return Run(losses, norms, gathered_params(model, mesh), evaluated)


def _dp_mean(loss: torch.Tensor, mesh: memsave.Mesh) -> float:
    mean = loss.detach().float().reshape(1).clone()
    mdist.all_reduce(mean, mesh.dp_group, count_as="test")
    return mean.item() / mesh.degree("dp")




def compare(run: Run, ref: Run) -> dict[str, tuple[float, str]]:
    """The worst relative difference of the losses, the clip norms, the trained model's eval loss and the parameters
    (with the worst's name)."""
    assert run.params.keys() == ref.params.keys(), (sorted(run.params), sorted(ref.params))
    worst = max(((rel(run.params[n], ref.params[n]), n) for n in ref.params), default=(0.0, ""))
    return {"loss": (rel(run.losses, ref.losses), f"{run.losses} vs {ref.losses}"),
            "norm": (rel(run.norms, ref.norms), f"{run.norms} vs {ref.norms}"),
            "eval": (rel(run.evaluated, ref.evaluated), f"{run.evaluated} vs {ref.evaluated}"),
            "param": worst}
