"""The sections of a profile: one frozen ``kw_only`` dataclass per TOML table, each field a key.

Each field's ``help`` metadata says what the key does and ``allowed`` what its checks accept (rendered into
docs/profiles.md by memsave.profile_docs). Every section checks its fields against their annotations and its own
ranges in ``__post_init__``, also when built in code, and raises :class:`ValueError` naming the key, the value and
what is allowed. :class:`memsave.config.Profile` composes the sections and reads them from TOML; import them
from ``memsave.config``.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from typing import Literal

from memsave.config_types import _bad, _check_type

__all__ = [
    "OffloadConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "RecomputeConfig",
    "ZeroConfig",
]

_RECOMPUTE_POLICY = re.compile(r"^(none|full|selective|every:[1-9][0-9]*|budget:[0-9.]+\s*(B|KiB|MiB|GiB|TiB))$")


def _doc(what: str, allowed: str = "") -> dict[str, str]:
    """A profile key's ``field`` metadata: ``help`` says what it does, ``allowed`` what values its checks accept
    where the annotation does not say it all. memsave.profile_docs renders both into docs/profiles.md, and a key
    without ``help`` fails that test."""
    return {"help": what, "allowed": allowed}



class _Checked:
    """Checks every field against its annotation, also for sections built in code (not only from TOML)."""

    _section: str = ""

    def _check_fields(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            checked = _check_type(f"{self._section}.{f.name}", value, hints[f.name])
            if checked is not value:  # lossless conversions (int -> float, list -> tuple)
                object.__setattr__(self, f.name, checked)


@dataclass(frozen=True, kw_only=True)
class ZeroConfig(_Checked):
    """``[zero]``: data parallelism and ZeRO sharding over the dp ranks (Rajbhandari et al., 2020).

    Each field's ``help`` metadata says what it does (rendered in docs/profiles.md).
    """

    stage: int = field(default=0, metadata=_doc(
        "0: plain data parallelism, everything replicated, gradients averaged by bucketed all-reduces overlapped "
        "with backward (as torch DDP). 1: the optimizer state (and under mixed precision the fp32 masters) is "
        "sharded over the dp ranks; each rank steps its rows and the parameters are all-gathered after the step. "
        "2: gradients too: each unit's gradients are reduce-scattered as soon as its backward is done. 3: "
        "parameters too: each unit is all-gathered before its forward and again before its backward, and freed "
        "after use.",
        "0, 1, 2 or 3"))
    bucket_mb: float = field(default=25.0, metadata=_doc(
        "Stage 0: size of a gradient all-reduce bucket in MiB (torch DDP's bucket_cap_mb). At stages 1-3 the "
        "communication bucket is the unit (choose the units with memsave.wrap(units=...)).",
        "a positive number of MiB"))
    prefetch: int = field(default=1, metadata=_doc(
        "Stage 3: how many units ahead are gathered while the current one computes, in forward and in backward "
        "order; 0 gathers a unit only when it is reached.",
        "a count of units >= 0"))
    reshard_after_forward: bool = field(default=True, metadata=_doc(
        "Stage 3: free a unit's gathered parameters after its forward (true), or keep them until its backward "
        "(false: more memory, one all-gather fewer per unit; FSDP2's reshard_after_forward=False, FSDP's "
        "SHARD_GRAD_OP). The root unit stays gathered from the start of forward to the end of backward either way."))
    host_mmap_threshold_mb: float = field(default=0.0, metadata=_doc(
        "CPU only: pin glibc's mmap threshold at this many MiB, so freed buffers at least this large go straight "
        "back to the OS: lower peak RSS for some step time (the zero3 presets set 8; MEMSAVE_MMAP_THRESHOLD=<bytes> "
        "overrides; see memsave/dist/host_memory.py). 0 leaves glibc's dynamic threshold.",
        "a size in MiB >= 0 (0 = off)"))

    _section = "zero"

    def __post_init__(self) -> None:
        self._check_fields()
        if self.stage not in (0, 1, 2, 3):
            raise _bad("zero.stage", self.stage, "0 (plain data parallel), 1, 2 or 3")
        if not self.bucket_mb > 0:
            raise _bad("zero.bucket_mb", self.bucket_mb, "a positive number of MiB")
        if self.prefetch < 0:
            raise _bad("zero.prefetch", self.prefetch, "a count of units >= 0")
        if self.host_mmap_threshold_mb < 0:
            raise _bad("zero.host_mmap_threshold_mb", self.host_mmap_threshold_mb, "a size in MiB >= 0 (0 = off)")


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig(_Checked):
    """``[precision]``: dtypes and loss scaling (mixed precision, Micikevicius et al., 2018).

    Each field's ``help`` metadata says what it does (rendered in docs/profiles.md).
    """

    compute: Literal["fp32", "bf16", "fp16"] = field(default="fp32", metadata=_doc(
        "dtype of the parameters, activations and gradients in forward and backward. bf16/fp16: memsave.wrap "
        "casts every floating-point parameter (frozen ones too; tied weights stay tied), floating-point forward "
        "inputs are cast at each call (integer inputs are left alone), buffers keep their dtype, and the "
        "optimizer steps fp32 masters."))
    master: Literal["fp32"] = field(default="fp32", metadata=_doc(
        "dtype of the master weights the optimizer steps, sharded like its state at stages 1-3 and cast into the "
        "parameters after each step. With compute = \"fp32\" the parameters are their own masters."))
    reduce: Literal["fp32", "bf16", "fp16", "compute"] = field(default="compute", metadata=_doc(
        "dtype gradients are communicated and kept in after reduction: \"compute\" (the compute dtype: 2 bytes "
        "under bf16/fp16) or \"fp32\" (summed in fp32 and kept in fp32, as FSDP2's reduce_dtype=torch.float32).",
        "\"bf16\" or \"fp16\" only when it is the compute dtype (else NotImplementedError at wrap)"))
    loss_scale: str | float = field(default="none", metadata=_doc(
        "Loss scaling, for fp16: \"dynamic\" starts at 2^16, doubles after 2000 steps without overflow and "
        "halves on one; a number is a fixed scale. optimizer.backward(loss) scales, clip_grad_norm unscales first, "
        "and a step whose gradients overflowed on any rank is skipped on every rank. fp16 wants one (its range "
        "ends at 65504 and small gradients underflow); bf16 has fp32's range and needs none.",
        "\"none\", \"dynamic\" or a positive number"))
    nonfinite: Literal["skip", "raise"] = field(default="skip", metadata=_doc(
        "A step whose gradients hold an inf or NaN on any rank (at any precision; decided on every rank alike, "
        "from clip_grad_norm's global norm when it ran) is never applied: \"skip\" skips it on every rank and "
        "says so once with the step number, \"raise\" raises naming the step. fp16's overflow skips count only "
        "once the loss scale is at its minimum."))
    max_skipped: int = field(default=10, metadata=_doc(
        "With nonfinite = \"skip\": after this many consecutive skipped steps, raise naming them (a NaN in the "
        "data or a diverged run, or fp16's scale stuck at its minimum, instead of training on with no update).",
        "an integer >= 1"))

    _section = "precision"

    def __post_init__(self) -> None:
        self._check_fields()
        if not isinstance(self.max_skipped, int) or isinstance(self.max_skipped, bool) or self.max_skipped < 1:
            raise _bad("precision.max_skipped", self.max_skipped, "an integer >= 1")
        ls = self.loss_scale
        if isinstance(ls, str) and ls not in ("none", "dynamic"):
            raise _bad("precision.loss_scale", ls, '"none", "dynamic" or a positive number')
        if not isinstance(ls, str) and not ls > 0:
            raise _bad("precision.loss_scale", ls, '"none", "dynamic" or a positive number')


@dataclass(frozen=True, kw_only=True)
class OffloadConfig(_Checked):
    """``[offload]``: where state lives when it is not on the compute device (ZeRO-Offload, Ren et al., 2021;
    ZeRO-Infinity, Rajbhandari et al., 2021).

    Each field's ``help`` metadata says what it does (rendered in docs/profiles.md).
    """

    optimizer: Literal["none", "cpu", "disk"] = field(default="none", metadata=_doc(
        "Where the optimizer state of this rank's shards lives between steps (zero.stage >= 1; under mixed "
        "precision the fp32 masters move with it): \"cpu\" is host memory on a CUDA device (stepped there or on the "
        "device: see step; on a CPU device nothing moves: said once); \"disk\" is files under path, read "
        "through host buffers (on CUDA stepped on the host)."))
    params: Literal["none", "cpu", "disk"] = field(default="none", metadata=_doc(
        "Stage 3: where the units' parameter shards live between uses, loaded prefetch units ahead of each "
        "gather: \"cpu\" is pinned host memory on a CUDA device (with optimizer = \"cpu\", fraction = 1; on a "
        "CPU device nothing moves), \"disk\" is files under path on a CPU device (with optimizer = \"disk\", "
        "fraction = 1).",
        "\"none\" at zero.stage 0-2"))
    activations: Literal["none", "cpu"] = field(default="none", metadata=_doc(
        "\"cpu\": on a CUDA device the activations saved for backward are copied to pinned host memory on a "
        "side stream during forward and back when backward needs them (on a CPU device nothing moves: said "
        "once).",
        "\"none\" when [recompute] compress is set (NotImplementedError at wrap)"))
    step: Literal["auto", "device", "host"] = field(default="auto", metadata=_doc(
        "On a CUDA device, where the step of the offloaded state runs. \"host\" (DeepSpeed's ZeRO-Offload): the "
        "state and fp32 masters stay in host memory, each chunk's gradients are copied down through pinned "
        "buffers, stepped by the CPU (torch's fused CPU kernel for Adam, AdamW, SGD and Adagrad) and its new "
        "parameters copied up: 4-8 bytes per element cross PCIe, not the state both ways. \"device\": the state "
        "is streamed to the device in chunks and stepped there. \"auto\": \"host\", except \"device\" for "
        "optimizer = \"cpu\" with fraction < 1 or with params = \"cpu\" under fp32 compute (what the host step "
        "does not serve). On a CPU device the step always "
        "runs on the host.",
        "\"auto\", \"device\" or \"host\"; \"device\" needs optimizer = \"cpu\" on CUDA; \"host\" needs fraction = 1 "
        "on CUDA"))
    fraction: float = field(default=1.0, metadata=_doc(
        "Share of the optimizer state that is offloaded, in whole chunks; the rest stays in memory (the last "
        "units' chunks, or with overlap the first units', which the next forward needs first).",
        "a number from 0 to 1"))
    path: str = field(default="", metadata=_doc(
        "Folder for the disk tier: a run-unique subfolder is made in it and removed on close. An unwritable path, "
        "or a disk without room for twice the offloaded state, raises at wrap.",
        "a folder; needed when optimizer or params = \"disk\""))
    prefetch: int = field(default=2, metadata=_doc(
        "Chunks of optimizer state (and with params, units) read ahead while one is stepped (used); 0 = "
        "synchronous.",
        "a count of chunks >= 0"))
    chunk_mb: float | Literal["auto"] = field(default="auto", metadata=_doc(
        "Optimizer state per chunk in MiB (row slices of the shards, small tensors packed together); the step "
        "holds prefetch + 2 chunks in memory. \"auto\": 64 for the host step on a CUDA device (its chunks are "
        "pinned host slots: each costs a copy down, a CPU step and a copy up, and 1 MiB chunks made a "
        "110M-parameter bf16 optimizer step on an H100 5-7x slower), 1 elsewhere (the window a CPU device streams its "
        "offloaded state through).",
        "a positive size in MiB, or \"auto\""))
    direct: bool = field(default=True, metadata=_doc(
        "Disk tier: read and write with O_DIRECT (no page cache) where the file system supports it (else "
        "buffered, said once); false: always buffered (the page cache then keeps a copy that RSS does not show)."))
    overlap: bool = field(default=False, metadata=_doc(
        "Stage 3: optimizer.step() returns once its inputs are captured and the offloaded chunks are stepped in "
        "the background, overlapped with what follows (zero_grad, the next batch, the next forward); each unit's "
        "gather waits for its own chunks only. The result is the synchronous step's, bit for bit.",
        "false when optimizer = \"none\"; not at stages 1-2 or on CUDA (NotImplementedError)"))

    _section = "offload"

    def steps_on_host(self, device_type: str, *, mixed: bool) -> bool:
        """Where ``step`` puts the offloaded step on a ``device_type`` device, ``mixed``: under mixed precision
        (see the field's help)."""
        if device_type == "cpu":
            return True
        if self.step == "auto":
            return self.optimizer == "disk" or ((self.params != "cpu" or mixed) and self.fraction == 1.0)
        return self.step == "host"

    def chunk_bytes(self, device_type: str, *, mixed: bool) -> int:
        """Bytes of optimizer state per chunk on a ``device_type`` device (``chunk_mb``, "auto" resolved)."""
        if self.chunk_mb == "auto":
            return (64 if device_type == "cuda" and self.steps_on_host(device_type, mixed=mixed) else 1) * 2**20
        return int(self.chunk_mb * 2**20)

    def __post_init__(self) -> None:
        self._check_fields()
        if not 0.0 <= self.fraction <= 1.0:
            raise _bad("offload.fraction", self.fraction, "a number from 0 to 1")
        if "disk" in (self.optimizer, self.params) and not self.path:
            raise _bad("offload.path", self.path, 'a folder when optimizer or params = "disk"')
        if self.prefetch < 0:
            raise _bad("offload.prefetch", self.prefetch, "a count of chunks >= 0")
        if self.chunk_mb != "auto" and not self.chunk_mb > 0:
            raise _bad("offload.chunk_mb", self.chunk_mb, 'a positive size in MiB, or "auto"')
        if self.step != "auto" and self.optimizer == "none":
            raise _bad("offload.step", self.step, '"auto" when optimizer = "none" (no offloaded step to place)')
        if self.overlap and self.optimizer == "none":
            raise _bad("offload.overlap", self.overlap, 'false when optimizer = "none" (no offloaded step to overlap)')


@dataclass(frozen=True, kw_only=True)
class RecomputeConfig(_Checked):
    """``[recompute]``: activation recomputation (Chen et al., 2016) and compressed saved activations.

    Each field's ``help`` metadata says what it does (rendered in docs/profiles.md).
    """

    policy: str = field(default="none", metadata=_doc(
        "What each unit keeps from forward for backward; the rest is recomputed in backward (the root unit never "
        "is; losses and gradients are unchanged). \"full\": its input only. \"every:K\": units 0, K, 2K, ... "
        "keep their input only, the others everything. \"selective\": the outputs of matmuls and fused "
        "attention; norms, activations, residual adds and dropout are recomputed (Korthikanti et al., 2022). "
        "\"budget:<size>\": chosen per unit from one measured forward of memsave.wrap(example_inputs=...) so "
        "that the saved activations fit the size.",
        "\"none\", \"full\", \"every:K\" (K >= 1), \"selective\" or \"budget:<size>\" (B, KiB, MiB, GiB "
        "or TiB, e.g. \"budget:2GiB\")"))
    compress: Literal["none", "bf16", "fp8"] = field(default="none", metadata=_doc(
        "Every fp32 activation kept for backward (floating point, at least 1024 elements, not a parameter or "
        "buffer) is stored in this dtype and restored for backward (Gist, Jain et al., 2018): about half (bf16) "
        "or a quarter (fp8 e4m3 with a per-tensor scale) of its bytes; gradients are no longer exact. fp8 needs a "
        "torch with torch.float8_e4m3fn. See memsave/recompute/compress.py."))

    _section = "recompute"

    def __post_init__(self) -> None:
        self._check_fields()
        if not _RECOMPUTE_POLICY.match(self.policy):
            raise _bad("recompute.policy", self.policy, '"none", "full", "every:K", "selective" or "budget:<size>"')


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig(_Checked):
    """``[optimizer]``: the optimizer that ``memsave demo`` and ``memsave bench`` build and ``memsave.estimate``
    counts (``memsave.wrap`` and the :class:`~memsave.trainer.Trainer` take your instance).

    Each field's ``help`` metadata says what it does (rendered in docs/profiles.md).
    """

    name: Literal["adamw", "adam", "sgd", "adafactor"] = field(default="adamw", metadata=_doc(
        "torch.optim.AdamW, Adam, SGD, or memsave.optim.Adafactor (explicit-lr mode, so the trainer's schedule "
        "applies; with scale_parameter the step is lr * RMS(parameter))."))
    lr: float = field(default=1e-3, metadata=_doc("Peak learning rate.", "a positive number"))
    weight_decay: float = field(default=0.0, metadata=_doc(
        "Weight decay, as the optimizer named applies it (decoupled for adamw and adafactor).", "a number >= 0"))
    betas: tuple[float, float] = field(default=(0.9, 0.95), metadata=_doc(
        "Adam's and AdamW's (beta1, beta2).", "two numbers in [0, 1)"))
    momentum: float = field(default=0.9, metadata=_doc("SGD's momentum."))
    warmup_steps: int = field(default=0, metadata=_doc(
        "The schedule of memsave demo: linear warm-up over this many steps, then cosine decay to "
        "min_lr_ratio * lr at the last step (memsave.cosine_schedule).",
        "a count of steps >= 0"))
    min_lr_ratio: float = field(default=0.1, metadata=_doc(
        "Where the cosine decay ends, as a share of lr.", "a number from 0 to 1"))
    scale_parameter: bool = field(default=True, metadata=_doc(
        "Adafactor: the step is lr * max(eps2, RMS(parameter)) (relative to the parameter's scale).",
        "the default unless name = \"adafactor\""))
    clip_threshold: float = field(default=1.0, metadata=_doc(
        "Adafactor: update clipping threshold (the paper's d).",
        "a number > 0; the default unless name = \"adafactor\""))
    decay_rate: float = field(default=-0.8, metadata=_doc(
        "Adafactor: beta2_t = 1 - t^decay_rate.",
        "a number in [-1, 0) (the paper uses -0.8); the default unless name = \"adafactor\""))
    beta1: float = field(default=0.0, metadata=_doc(
        "Adafactor: first-moment coefficient; 0 keeps no first moment.",
        "a number in [0, 1); the default unless name = \"adafactor\""))
    momentum_dtype: Literal["fp32", "bf16"] = field(default="fp32", metadata=_doc(
        "Adafactor: dtype of the first moment; \"bf16\" stores it in 2 bytes per parameter.",
        "\"fp32\" while beta1 = 0; the default unless name = \"adafactor\""))

    _section = "optimizer"
    _ADAFACTOR_ONLY = {"scale_parameter": True, "clip_threshold": 1.0, "decay_rate": -0.8, "beta1": 0.0,
                       "momentum_dtype": "fp32"}

    def __post_init__(self) -> None:
        self._check_fields()
        if not self.lr > 0:
            raise _bad("optimizer.lr", self.lr, "a positive number")
        if self.weight_decay < 0:
            raise _bad("optimizer.weight_decay", self.weight_decay, "a number >= 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise _bad("optimizer.betas", self.betas, "two numbers in [0, 1)")
        if self.warmup_steps < 0:
            raise _bad("optimizer.warmup_steps", self.warmup_steps, "a count of steps >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise _bad("optimizer.min_lr_ratio", self.min_lr_ratio, "a number from 0 to 1")
        if not self.clip_threshold > 0:
            raise _bad("optimizer.clip_threshold", self.clip_threshold, "a number > 0")
        if not -1.0 <= self.decay_rate < 0.0:
            raise _bad("optimizer.decay_rate", self.decay_rate, "a number in [-1, 0) (the paper uses -0.8)")
        if not 0.0 <= self.beta1 < 1.0:
            raise _bad("optimizer.beta1", self.beta1, "a number in [0, 1) (0: no first moment)")
        if self.momentum_dtype != "fp32" and self.beta1 == 0.0:
            raise _bad("optimizer.momentum_dtype", self.momentum_dtype, '"fp32" while beta1 = 0 (no first moment)')
        if self.name != "adafactor":
            for key, default in self._ADAFACTOR_ONLY.items():
                if getattr(self, key) != default:
                    raise _bad(f"optimizer.{key}", getattr(self, key),
                               f'the default {default!r}: it applies to name = "adafactor" only, not {self.name!r}')


@dataclass(frozen=True, kw_only=True)
class ParallelConfig(_Checked):
    """``[parallel]``: the mesh degrees besides data parallelism; dp is what is left, world size / (tp * pp).

    Each field's ``help`` metadata says what it does (rendered in docs/profiles.md).
    """

    tp: int = field(default=1, metadata=_doc(
        "Tensor-parallel degree: the size of the mesh's tp axis, whose ranks split each layer's weights "
        "(Megatron-LM, Shoeybi et al., 2019). memsave.init(profile=...), memsave demo and --parallel.tp=N "
        "build the mesh with it; memsave.wrap cuts the model's layers by a plan (memsave.tp).",
        "a positive integer; tp * pp divides the world size"))
    pp: int = field(default=1, metadata=_doc(
        "Pipeline-parallel degree: the size of the mesh's pp axis; the model's layer list is cut into pp x virtual stages "
        "(GPipe; embeddings first, head last), and a step runs as model.pipeline_step(micro_batches). Read like tp.",
        "a positive integer; tp * pp divides the world size"))
    schedule: Literal["gpipe", "1f1b", "interleaved", "zero-bubble"] = field(default="1f1b", metadata=_doc(
        "Pipeline schedule over a step's micro-batches (pp > 1): gpipe, 1f1b (PipeDream-flush), interleaved "
        "(virtual stages, Megatron), zero-bubble (ZB-H1: backward split into input- and weight-gradient passes)."))
    virtual: int = field(default=1, metadata=_doc(
        "Stages per pp rank (stage s on pp rank s % pp).", "a positive integer; 1 unless schedule = interleaved"))
    split: tuple[str, ...] = field(default=(), metadata=_doc('Module names where stages 1, 2, ... begin (["layers.4"]); '
        "empty: the blocks divided evenly by count.", "pp x virtual - 1 names of blocks or of modules beside them, in order"))
    balance: Literal["count", "params", "time"] = field(default="count", metadata=_doc(
        "How the blocks are divided into stages when split is empty: count (equal numbers of blocks), params (equal "
        "parameter counts) or time (each block's forward and backward measured on memsave.wrap's example_inputs, "
        "as torchgpipe's balance_by_time; rank 0's figures, so every rank cuts alike). The modules before the first "
        "block and after the last stay on the first and last stage, counted with their block. The chosen split is "
        "logged (stage, blocks, ms, bytes) and kept in model.memsave_engine.balance."))
    gather: Literal["step", "micro-batch"] = field(default="step", metadata=_doc(
        "ZeRO-3 with pp > 1: gather a stage's units once per step (its full parameters held through the step), or "
        "around each micro-batch's forward and backward (ZeRO-3's memory; two all-gathers per unit per micro-batch)."))
    sequence: bool = field(default=False, metadata=_doc(
        "Sequence parallelism (Korthikanti et al., 2022) with tp > 1: norms, dropout and the residual stream "
        "between blocks run on each tp rank's slice of the sequence (an all-gather before each column-parallel "
        "region, a reduce-scatter after each row-parallel one), so their activations take 1/tp of the memory. "
        "The sequence length must divide by tp. Ignored (said once in the log) with tp = 1.",
        "true or false"))

    _section = "parallel"

    def __post_init__(self) -> None:
        self._check_fields()
        for key in ("tp", "pp", "virtual"):
            if getattr(self, key) < 1:
                raise _bad(f"parallel.{key}", getattr(self, key), "a positive integer")
        if self.balance != "count" and self.split:
            raise _bad("parallel.balance", self.balance, f'"count" with split = {list(self.split)!r} (split says '
                       "where stages begin; balance chooses it)")
        if self.virtual > 1 and self.schedule != "interleaved":
            raise _bad("parallel.virtual", self.virtual, f'1 with schedule = {self.schedule!r} (or "interleaved")')
