"""The planner's closed-form memory model: a candidate's bytes per category on its busiest rank.

[Note: the planner's memory model] It follows memsave.estimate's walk ([Note: the estimated peak] in
memsave/estimator.py and [Note: a stage's estimate] in memsave/estimate_pp.py) with the model's sizes from its
:class:`ModelSpec` instead of its modules, so it prices 1,000s of candidates of a 70B model in a second; the
tests check it against the estimator on a grid of candidates (tests/test_plan_memory.py). Per pipeline stage:

- what is held throughout: parameters in the compute dtype (stage 3: a 1/dp shard), fp32 masters under mixed
  precision and the optimizer's state (sharded at stages 1-3), stage 0's gradient buckets; offloaded ones on the
  host or the disk, but for the offload's window of chunks and the shards read in around their use;
- gradient accumulation (``micro_batches > 1``, or a pipeline): from the first backward on, every parameter's
  full gradient in ``p.grad`` (stage 0: beside its buckets);
- activations: Korthikanti et al.'s per-layer bytes with the model's own constants (dtype, dropout, a fused
  attention kernel; Hugging Face GPT-2 with dropout on a CPU: the math kernel's scores) times the stage's
  layers; under a pipeline times the micro-batches the schedule holds at once, before and after its first
  backward (:func:`flights`: 1F1B ``p - stage``, GPipe ``m``); on the last stage the head's and the loss's per
  micro-batch and the logits at the end of a forward;
- the points the peak is taken at: the end of forward; the backward walk unit by unit at stages 1-3 (the
  activations left, the reduced gradients so far, two reduce-scatters' staging in flight, at stage 3 the unit
  gathered and the next one's gather in flight; under full recomputation the unit's activations rebuilt); the
  end of backward; and under mixed precision the step (every gradient beside its fp32 copy).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from memsave.config_sections import OffloadConfig
from memsave.estimate_cuda import allocator_extra
from memsave.models.units import REDUCES_IN_FLIGHT
from memsave.offload.tiers import BOUNCE, IO_THREADS
from memsave.plan.formulas import LayerActivations, layer_activation_bytes
from memsave.plan.spec import ModelSpec

if TYPE_CHECKING:
    from memsave.plan.cost import Candidate

__all__ = ["device_bytes", "flights", "layer_constants"]

ELEM = {"fp32": 4, "bf16": 2, "fp16": 2}
_STATE = {"adamw": 8.0, "adam": 8.0, "sgd": 4.0}  # bytes per parameter (Adafactor: its factored rows and columns)
_OFFLOAD = OffloadConfig()  # the [offload] defaults the planner's profiles keep (prefetch, chunk_mb)


def layer_constants(spec: ModelSpec, elem: int, recompute: str, device_type: str = "cuda") -> LayerActivations:
    """A layer's activation constants for ``spec``'s family under ``recompute`` (full: as none, the layer's
    input is what :func:`layer_activation_bytes` keeps) on a ``device_type`` device: a fused attention kernel,
    but for Hugging Face GPT-2 with dropout on a CPU, whose flash kernel takes no dropout (the math one runs)."""
    if spec.family == "llama":
        kv_dim = spec.kv_heads * (spec.head_dim or spec.hidden // max(spec.heads, 1))
        return LayerActivations.for_llama(elem, spec.hidden, spec.intermediate, kv_dim, spec.heads,
                                          selective=recompute == "selective")
    if spec.family == "gpt2":
        return LayerActivations.for_gpt2(elem, spec.hidden, spec.intermediate or 4 * spec.hidden, spec.heads,
                                         dropout=spec.dropout, math_attention=spec.dropout and device_type == "cpu",
                                         selective=recompute == "selective")
    if recompute == "selective":  # memsave's: the matmuls' and the fused attention's outputs are kept
        return LayerActivations(split=8 * elem, replicated=3 * elem, scores=0.0, layer_input=elem)
    return LayerActivations.for_model(elem, spec.dropout, fused_attention=True)


def state_bytes(spec: ModelSpec, params: float, optimizer: str) -> float:
    """The optimizer's state for ``params`` parameters."""
    if optimizer == "adafactor":  # row and column statistics of each h-wide matrix, ~ 2 / h of the elements
        return 4.0 * params * 2 / max(spec.hidden, 1) + 4.0 * spec.hidden * spec.layers
    return _STATE[optimizer] * params


@functools.lru_cache(maxsize=4096)
def flights(schedule: str, pp: int, m: int, virtual: int = 1) -> tuple[tuple[float, float], ...]:
    """Per pp rank: the most micro-batches' activations of its whole stage held at once before its first backward
    and from it on (each of ``virtual`` chunks a 1/virtual share), walking its actions in order as the estimator
    does: a forward adds its chunk's, a backward (B, or W after an I) frees them."""
    if pp == 1:
        return ((1.0, 1.0 if m > 1 else 0.0),)
    from memsave.pp import build  # layer 3

    out = []
    for actions in build(schedule, pp, m, virtual, checked=False).actions:
        held, before, after, seen = 0.0, 0.0, 0.0, False
        for a in actions:
            if a.kind == "F":
                held += 1.0 / virtual
                if seen:
                    after = max(after, held)
                else:
                    before = max(before, held)
            else:
                seen = True
                if a.kind != "I":  # an I keeps the chunk's graph for its W
                    held -= 1.0 / virtual
        out.append((before, after))
    return tuple(out)


def device_bytes(spec: ModelSpec, c: Candidate, seq: int,
                 device_type: str = "cuda") -> tuple[dict[str, float], float, float, int]:
    """Bytes per category on the busiest rank of ``c`` on a ``device_type`` device ("cuda" or "cpu"), the bytes
    offloaded to the host and to the disk per rank, and which pipeline stage is the busiest ([Note: the planner's
    memory model])."""
    elem = ELEM[c.precision]
    mixed = c.precision != "fp32"
    consts = layer_constants(spec, elem, "none", device_type)
    full_layer = layer_activation_bytes(seq, c.micro_batch, spec.hidden, spec.heads, c.tp, sequence=c.sequence,
                                        consts=consts)
    layer_act = layer_activation_bytes(seq, c.micro_batch, spec.hidden, spec.heads, c.tp, sequence=c.sequence,
                                       recompute="full" if c.recompute == "full" else "none",
                                       consts=layer_constants(spec, elem, c.recompute, device_type))
    if device_type == "cuda" and not mixed and spec.kv_heads and spec.kv_heads < spec.heads:
        # grouped-query attention in fp32 on CUDA: no fused kernel takes it, the math one keeps its fp32 scores
        # and the keys and values repeated to every query head
        scores = 4.0 * spec.heads / c.tp * seq * c.micro_batch * (seq + 2 * (spec.heads - spec.kv_heads) / spec.heads
                                                                   * spec.hidden / spec.heads)
        full_layer += scores
        layer_act += 0.0 if c.recompute == "full" else scores
    rebuilt = full_layer if c.recompute == "full" else 0.0  # a unit's activations, recomputed for its backward
    unit = spec.layer_split / c.tp + spec.layer_params - spec.layer_split  # one block's parameters on this rank
    in_flight = flights(c.schedule, c.pp, c.micro_batches, c.virtual)
    accumulating = c.micro_batches > 1
    best: tuple[float, dict[str, float], float, float, int] | None = None
    for s in range(c.pp):
        psi = spec.stage_params(c.pp, s, c.tp)
        layers = spec.stage_layers(c.pp, s)
        root = psi - layers * unit  # the embedding, the final norm and the head, on the stages that hold them
        held, persistent, host, disk = _held(spec, c, psi, unit, elem, mixed, device_type)
        if c.stage == 3:  # the root and one unit gathered; a pipeline stage's units for the whole step
            held["params_gathered"] = elem * (psi if c.pp > 1 else root + unit)
        stage_act, logits = layer_act * layers, 0.0
        if s == c.pp - 1:  # the head keeps the final norm's and its own input and the loss its log-softmax (fp32),
            # per micro-batch; the logits are held once, at the end of a forward
            tokens = c.micro_batch * seq
            norm = (4 + 2 * elem if spec.family == "llama" else 2 * elem) * spec.hidden  # its fp32 copy in Llama's
            stage_act += tokens * (norm / (c.tp if c.sequence else 1) + 4.0 * spec.vocab / c.tp)
            logits = elem * tokens * spec.vocab / c.tp  # returned in the compute dtype (the loss casts its own copy)
        before, after = in_flight[min(s, len(in_flight) - 1)]
        accumulated = elem * psi if accumulating else 0.0
        points = [dict(held, activations=stage_act * before + logits)]  # the end of a forward
        if after:
            points.append(dict(held, grads=held["grads"] + accumulated, activations=stage_act * after + logits))
        # the last backward: one micro-batch's activations, the accumulated gradients beside
        base = dict(held, grads=held["grads"] + accumulated)
        # the final norm's and an untied head's gradients, from backward's start to the root's reduce at its end
        late = elem * (spec.final_params + spec.head_params / c.tp) if c.pp == 1 and not accumulating else 0.0
        points += _backward(c, base, persistent, layers, layer_act, stage_act - layer_act * layers, rebuilt, unit,
                            root, psi, elem, late)
        # the step: every reduced gradient (mixed: beside its fp32 copy on the masters, offloaded ones too)
        step = dict(held, grads=persistent + (4.0 * psi / (c.dp if c.stage >= 1 else 1) if mixed else 0.0))
        points.append(step)
        device = max(points, key=lambda b: sum(b.values()))
        if device_type == "cuda":  # [Note: the allocator's peak] in memsave/estimate_cuda.py
            extra, _ = allocator_extra(
                forward_end=int(max(sum(b.values()) for b in points[:2 if after else 1])),  # a forward's end
                step=int(sum(step.values())), peak=int(sum(device.values())),
                logits=int(c.micro_batch * seq * spec.vocab / c.tp) if s == c.pp - 1 else 0, compute=c.precision,
                optimizer_state=held["optimizer_state"] if c.offload == "none" else 0, optimizer=c.optimizer)
            device = dict(device, transient=float(extra))
        total = sum(device.values())
        if best is None or total > best[0]:
            best = (total, device, host, disk, s)
    assert best is not None
    _, device, host, disk, busiest = best
    return device, host, disk, busiest


def _held(spec: ModelSpec, c: Candidate, psi: float, unit: float, elem: int, mixed: bool,
          device_type: str) -> tuple[dict[str, float], float, float, float]:
    """What a rank of a stage with ``psi`` parameters holds besides activations after ``zero_grad``, the
    gradients it keeps from backward to the step, and what it offloads to the host and to the disk."""
    dp = c.dp
    shard = psi / (dp if c.stage >= 1 else 1)
    params = elem * psi / (dp if c.stage >= 3 else 1)
    persistent = elem * psi / (dp if c.stage >= 2 else 1)
    master = 4.0 * shard if mixed else 0.0
    state = state_bytes(spec, shard, c.optimizer)
    held = {"params": params, "grads": persistent if c.stage == 0 else 0.0, "master": master,
            "optimizer_state": state, "params_gathered": 0.0, "comm": 0.0}
    host = disk = 0.0
    if c.offload == "none":
        return held, persistent, host, disk
    on_disk = c.offload.endswith(":disk")
    moved = master + state
    held["master"] = 0.0
    if on_disk and device_type == "cpu":  # stepped chunk by chunk through a window of prefetch + 2 buffers and
        # snapshots of its parameters, in (host) memory
        per_elem = moved / max(shard, 1.0)
        # a chunk: whole rows of one unit's shard
        window = min(_OFFLOAD.chunk_bytes(device_type, mixed=False), per_elem * unit / dp)
        held["optimizer_state"] = (_OFFLOAD.prefetch + 2) * window
        held["comm"] += (_OFFLOAD.prefetch + 2) * window / per_elem * elem
    else:  # behind a GPU the step runs on the host, its window in host memory
        held["optimizer_state"] = 0.0
    if c.offload.startswith("optimizer+params"):  # the shards but the prefetch + 1 around their use
        moved += params
        held["params"] = min(params, (_OFFLOAD.prefetch + 1) * elem * unit / dp)
        if on_disk:
            held["comm"] += IO_THREADS * BOUNCE
    if on_disk:
        disk = moved
    else:
        host = moved
    return held, persistent, host, disk


def _backward(c: Candidate, base: dict[str, float], persistent: float, layers: int, layer_act: float, head: float,
              rebuilt: float, unit: float, root: float, psi: float, elem: int, late: float = 0.0
              ) -> list[dict[str, float]]:
    """The samples of the last backward, unit by unit, as memsave.estimate's walk takes them: before a unit's
    backward with ``d`` units done (the largest is at the first units or the last: every other step only trades
    a unit's activations for its reduced gradient), and the end. ``late``: the gradients of the root's
    parameters used after the last unit, held throughout at stages 1-3."""
    stage, dp = c.stage, c.dp
    if stage == 0:
        return [dict(base, activations=layer_act * layers + head + rebuilt)]
    first = base["grads"] + late if stage >= 2 else max(base["grads"], late)
    points = [dict(base, activations=layer_act * layers + head + rebuilt, grads=first)]
    reduced = elem * unit * (1.0 if stage == 1 else 1.0 / dp)  # what one unit's reduce-scatter leaves
    staging = elem * unit + (elem * unit / dp if stage == 1 else 0.0)  # one reduce-scatter in flight
    gather = c.pp > 1  # at stage 3 a stage's units stay gathered for the step ([parallel] gather = "step")
    for d in sorted({1, 2, layers - 1, layers}):
        if not 1 <= d <= layers:
            continue
        left = layers - d
        p = dict(base, activations=layer_act * left + (rebuilt if left else 0.0))
        grads = late + d * reduced
        p["grads"] = max(base["grads"], grads) if stage == 1 else base["grads"] + grads
        p["comm"] = base["comm"] + min(d, REDUCES_IN_FLIGHT) * staging
        if stage == 3:
            p["params_gathered"] = elem * (psi if gather else root + (unit if left else 0.0))
            if left > 1 and not gather:  # the next unit's gather in flight
                p["comm"] += elem * unit
        points.append(p)
    points.append(dict(base, activations=0.0, grads=persistent))
    return points
