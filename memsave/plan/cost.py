"""One configuration priced: per-rank bytes by category and step seconds by term, from closed forms.

Memory: [Note: the planner's memory model] in memsave/plan/memory.py.

[Note: the planner's time model] Step seconds are a sum of terms, each bytes or FLOPs over a rate of
:class:`memsave.plan.hardware.Hardware`:
- compute: FLOPs (Narayanan et al.'s count, recomputation included) spread over every rank, plus the host's
  measured cost per layer and micro-batch and what the recomputation policy adds to it ([Note: the host's cost
  per layer] in memsave/plan/calibrate_step.py); stretched by the schedule's bubble;
- the collectives, counted one by one as the engines issue them (:func:`collective_counts`), each paying its
  kind's latency and its bytes at its kind's bandwidth (both measured per kind by ``memsave calibrate``): the
  agreements, tensor parallelism's gathers and scatters (never hidden), data parallelism's reduction and
  gathers (hidden behind the backward up to the hardware's ``overlap``), pipeline sends on the critical path;
- the optimizer step (every byte of state read and written once) on the device or, offloaded, on the host with
  the gradients down and the parameters back up; the offload tier's reads and writes;
- on calibrated hardware, what each engine family was measured to pay beyond these
  (memsave/plan/calibrate_engines.py): a stretch of its compute, a cost per byte of the stage's parameters and
  per step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from memsave.plan.formulas import gpt_step_flops
from memsave.plan.hardware import Hardware
from memsave.plan.memory import ELEM as _ELEM
from memsave.plan.memory import device_bytes
from memsave.plan.memory import state_bytes as _state_bytes
from memsave.plan.spec import ModelSpec

__all__ = ["Candidate", "Priced", "collective_counts", "price"]

# bytes per second of parameters, gradients and state a host-side AdamW step goes through behind a GPU, where no
# measured ``host_step_bw`` is given (vendor entries): an assumption (the order of DeepSpeed's CPU-Adam on a
# server CPU)
_HOST_STEP_BW = 10e9


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration: the mesh, the ZeRO stage, precision, recomputation, offload and the batch split.
    ``micro_batch``: rows per micro-batch on each data-parallel rank; ``micro_batches``: per step (the pipeline's
    ``m``, or gradient accumulation without one)."""

    dp: int
    tp: int
    pp: int
    stage: int
    precision: str
    recompute: str
    offload: str  # "none", "optimizer" or "optimizer+params" to the host; with ":disk", to the disk
    micro_batch: int
    micro_batches: int
    schedule: str = "1f1b"
    virtual: int = 1
    sequence: bool = False
    optimizer: str = "adamw"

    @property
    def family(self) -> str:
        return f"zero{self.stage}" + ("" if self.offload == "none" else f"+offload {self.offload}")

    def label(self) -> str:
        mesh = f"dp{self.dp}" + (f" tp{self.tp}" + (" sp" if self.sequence else "") if self.tp > 1 else "") + (
            f" pp{self.pp} {self.schedule}" + (f" v{self.virtual}" if self.virtual > 1 else "") if self.pp > 1 else "")
        return (f"{mesh} {self.family} {self.precision} recompute={self.recompute} "
                f"mb={self.micro_batch}x{self.micro_batches}")


@dataclasses.dataclass(frozen=True)
class Priced:
    candidate: Candidate
    device: dict[str, float]  # bytes per category on the busiest rank
    host: float
    disk: float
    time: dict[str, float]  # seconds per term
    stage: int  # the busiest pipeline stage
    exact: bool = False  # device bytes from memsave.estimate on the model itself, not the closed forms

    @property
    def peak(self) -> float:
        return sum(self.device.values())

    @property
    def step_time(self) -> float:
        return sum(self.time.values())

    @property
    def bottleneck(self) -> str:
        return max(self.time, key=self.time.__getitem__)

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.candidate.label(), **dataclasses.asdict(self.candidate), "device": self.device,
                "peak": self.peak, "host": self.host, "disk": self.disk, "time": self.time,
                "step_time": self.step_time, "bottleneck": self.bottleneck,
                "memory_source": "memsave.estimate" if self.exact else "closed forms"}


def price(spec: ModelSpec, c: Candidate, hw: Hardware, seq: int, *, gpus_per_node: int = 8) -> Priced:
    """:class:`Priced` figures of ``c`` for ``spec`` at sequence length ``seq`` on ``hw``
    ([Note: the planner's memory model] in memsave/plan/memory.py, [Note: the planner's time model])."""
    device, host, disk, busiest = device_bytes(spec, c, seq, hw.device)
    return Priced(c, device, host, disk, _time(spec, c, hw, seq, _ELEM[c.precision], gpus_per_node), busiest)


def _collective(hw: Hardware, kind: str, volume: float, inter: bool, count: float = 1.0) -> float:
    """Seconds of ``count`` collectives of ``kind`` (``all_reduce``, ``reduce_scatter``, ``all_gather``, ``p2p``)
    moving ``volume`` bytes per rank in all: each pays the kind's latency, the bytes its bandwidth (measured per
    kind by ``memsave calibrate``, else the link's bus bandwidth and ``latency``)."""
    lat, bw = hw.collectives.get(kind, (hw.latency, 0.0))
    if not bw or inter:
        bw = (hw.inter_bw if inter else hw.intra_bw) * hw.bw_efficiency
    return count * lat + volume / bw


def collective_counts(spec: ModelSpec, c: Candidate) -> dict[str, int]:
    """Collectives one rank of the busiest stage issues in a step of ``c``, by kind, as memsave's engines issue
    them (tests/test_plan.py checks them against :data:`memsave.dist.COMM_STATS`):

    - ``all_reduce``: the agreements, a few bytes each (a step's loss scale and skip; data parallelism's
      used-gradient flags and checks, ZeRO one more and one per micro-batch at stage 3; the pipeline's check of
      its micro-batches, its loss, a message from the last stage, and, with tied weights, their reduction; tensor
      parallelism's loss reductions, three per micro-batch, each forward's check and its gradient check), and
      stage 0's gradient buckets;
    - ``reduce_scatter`` / ``all_gather``: ZeRO's, one per unit (the stage's blocks and its root) and, at stage 3,
      a gather per block for forward and again for backward, every micro-batch without a pipeline; tensor
      parallelism's with sequence parallelism, per block and micro-batch four of each, two re-gathers in
      backward and, under full recomputation, two gathers and a scatter more, and the head's three;
    - ``p2p``: a pipeline rank's sends and receives, one each per micro-batch, chunk and neighbour.
    """
    terms = _count_terms(spec, c)
    kinds = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0, "p2p": 0}
    for term, count in terms.items():
        kinds[_KIND[term]] += count
    return kinds


_KIND = {"agreements": "all_reduce", "dp buckets": "all_reduce", "dp scatters": "reduce_scatter",
         "dp gathers": "all_gather", "tp all-reduces": "all_reduce", "tp gathers": "all_gather",
         "tp scatters": "reduce_scatter", "pp sends": "p2p"}


def _count_terms(spec: ModelSpec, c: Candidate) -> dict[str, int]:
    m, layers = c.micro_batches, spec.stage_layers(c.pp, 0)
    n = dict.fromkeys(_KIND, 0)
    n["agreements"] = 1
    if c.dp > 1:
        n["agreements"] += 2 + (c.stage >= 1) + (m if c.stage >= 3 else 0)
        if c.stage == 0:
            psi = max(spec.stage_params(c.pp, s, c.tp) for s in range(c.pp))
            n["dp buckets"] = max(1, math.ceil(psi * _ELEM[c.precision] / (25 * 2**20)))
        else:
            n["dp scatters"] = layers + 1
            n["dp gathers"] = 2 * layers * (m if c.pp == 1 else 1) if c.stage >= 3 else layers + 1
    if c.tp > 1 and c.pp == 1:
        n["agreements"] += m  # each forward's check over tp, with its inputs ([Note: one input per tp group])
    if c.pp > 1:
        n["agreements"] += 2 + spec.tied  # the micro-batches' check; the loss from the last stage; the ties
        # each of the rank's v chunks sends to and receives from both neighbours (the model's first and last
        # chunk from one), forward and backward, every micro-batch; with p = 2 a rank holds one of those two
        n["pp sends"] = 2 * m * (2 * c.virtual - (1 if c.pp == 2 else 0))
    if c.tp > 1:
        n["agreements"] += 1 + 3 * m
        if c.sequence:
            n["tp gathers"] = m * ((6 if c.recompute == "full" else 4) * layers + 2 + 2 * layers + 1)
            n["tp scatters"] = m * ((5 if c.recompute == "full" else 4) * layers + 1)
        else:
            n["tp all-reduces"] = m * (6 if c.recompute == "full" else 4) * layers
    return n


def _time(spec: ModelSpec, c: Candidate, hw: Hardware, seq: int, elem: int, gpus_per_node: int) -> dict[str, float]:
    world = c.dp * c.tp * c.pp
    rows = c.dp * c.micro_batch * c.micro_batches
    # a zero-bubble schedule recomputes in its input- and again in its weight-gradient pass
    # ([Note: one recomputation per weight pass] in memsave/pp/split_backward.py)
    rebuilds = 2 if c.pp > 1 and c.schedule.startswith("zero-bubble") else 1
    if spec.heads and spec.vocab:
        flops = gpt_step_flops(rows, seq, spec.layers, spec.hidden, spec.vocab, recompute=c.recompute,
                               rebuilds=rebuilds)
    else:
        flops = (6 + 2 * rebuilds if c.recompute == "full" else 6) * spec.num_params * rows * seq
    compute = flops / world / hw.rate(c.precision)
    layers = spec.stage_layers(c.pp, 0)
    # the host's cost per layer and micro-batch on the busiest stage, and what the recomputation adds to it (each
    # rebuild); without a measured figure for the policy, a forward more under full recomputation
    per_layer = hw.layer_overhead * (1 + rebuilds / 3 if c.recompute == "full" else 1)
    if c.recompute in hw.recompute_overhead:
        per_layer = hw.layer_overhead + rebuilds * hw.recompute_overhead[c.recompute]
    # added to the FLOPs' time, on a GPU too ([Note: the host's cost per layer] in memsave/plan/calibrate_step.py)
    compute += per_layer * layers * c.micro_batches
    if c.pp > 1:
        from memsave.pp import bubble_formula  # layer 3

        compute /= 1 - bubble_formula(c.schedule, c.pp, c.micro_batches, c.virtual)
    eff = hw.bw_efficiency
    psi = max(spec.stage_params(c.pp, s, c.tp) for s in range(c.pp))
    t: dict[str, float] = {"compute": compute}
    n = _count_terms(spec, c)
    if hw.engine:  # what the engine pays besides FLOPs and collectives, calibrated on this machine
        from memsave.plan.calibrate_engines import engine_units, family_of

        per_step, per_byte, stretch = hw.engine.get(family_of(c.tp, c.pp, c.stage), (0.0, 0.0, 1.0))
        t["compute"] = compute * stretch
        t["engine"] = per_step * engine_units(n, c.tp) + per_byte * psi * elem
    t["agreements"] = _collective(hw, "all_reduce", 0.0, world > gpus_per_node, n["agreements"])
    if c.tp > 1:
        inter = c.tp > gpus_per_node
        share = (c.tp - 1) / c.tp * c.micro_batch * seq * spec.hidden * elem  # of a block's activations
        t["tp comm"] = (_collective(hw, "all_gather", n["tp gathers"] * share, inter, n["tp gathers"])
                        + _collective(hw, "reduce_scatter", n["tp scatters"] * share, inter, n["tp scatters"])
                        + _collective(hw, "all_reduce", n["tp all-reduces"] * 2 * share, inter, n["tp all-reduces"]))
    if c.dp > 1:
        inter = world > gpus_per_node
        share = (c.dp - 1) / c.dp * psi * elem
        if c.stage == 0:
            comm = _collective(hw, "all_reduce", 2 * share, inter, n["dp buckets"])
        else:  # ZeRO: the gradients scattered once; the parameters gathered after the step, or at stage 3 for
            # forward and again for backward, every micro-batch without a pipeline
            m = c.micro_batches if c.stage >= 3 and c.pp == 1 else 1
            comm = (_collective(hw, "reduce_scatter", share, inter, n["dp scatters"])
                    + _collective(hw, "all_gather", (2 if c.stage >= 3 else 1) * m * share, inter, n["dp gathers"]))
        t["dp comm"] = max(comm - hw.overlap * compute * 2 / 3, (1 - hw.overlap) * comm)
    if c.pp > 1:
        per = c.micro_batch * seq * spec.hidden * elem
        # on the critical path: every micro-batch (through each of the rank's chunks), the fill and the drain
        hops = 2 * (c.micro_batches * c.virtual + c.pp - 1)
        t["pp p2p"] = _collective(hw, "p2p", hops * per, c.tp * c.pp > gpus_per_node, hops)
    shard = psi / (c.dp if c.stage >= 1 else 1)
    state_bytes = shard * (elem + (4 if c.precision != "fp32" else 0)) + _state_bytes(spec, shard, c.optimizer)
    if c.offload == "none":
        # a measured AdamW step rate (bytes of parameters, gradients and state per second), else memory traffic
        t["optimizer"] = ((state_bytes + shard * elem) / hw.step_bw if hw.step_bw
                          else 2 * (state_bytes + shard * elem) / (hw.mem_bw * eff))
    else:
        # the step runs on the host: on a CPU device the measured rate; behind a GPU the rate measured for
        # memsave's host step (memsave/plan/calibrate_step.py), else an assumed one
        host_step = (hw.step_bw or hw.mem_bw * eff / 2) if hw.device == "cpu" else hw.host_step_bw or _HOST_STEP_BW
        t["optimizer"] = (state_bytes + shard * 4) / host_step
        tier_bw = (hw.disk_bw if c.offload.endswith(":disk") else hw.host_bw) * eff
        t["offload"] = 2 * shard * elem / (hw.host_bw * eff)  # gradients down, parameters back up
        if c.offload.endswith(":disk"):
            t["offload"] += 2 * state_bytes / tier_bw  # the state read and written back
        if c.offload.startswith("optimizer+params"):  # each gather reads the shard from its tier
            t["offload"] += 2 * psi / c.dp * elem * c.micro_batches / tier_bw
    return t
