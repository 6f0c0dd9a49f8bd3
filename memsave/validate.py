"""Every refusal of a profile, in one module: ``memsave.parallelize`` (and so ``memsave.wrap``) calls
:func:`validate` once, before anything changes, so a refused wrap loses nothing.

It checks the profile against the mesh (``[parallel]`` degrees; a ``tp`` or ``pp`` axis is never ignored), the
model (sparse gradients, nothing trainable, nested recomputed units), the hardware (what an ``[offload]`` or
``[recompute] compress`` setting does on this device) and, from ``wrap``, the optimizer (shardable by rows,
streamable by chunks, no state yet, over this model's parameters). Every refusal is a ``ValueError`` naming the
key, the value and what is allowed, or a ``NotImplementedError`` naming the combination and why. The lower
layers keep their own primitive checks (a disk's free space, a dtype cast on a device); this module decides
when they run.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memsave._logging import get_logger, warn_once
from memsave.config import OffloadConfig, OptimizerConfig, Profile, list_presets
from memsave.dist import Mesh, check_accelerate_precision, check_accelerate_world
from memsave.models.units import default_units
from memsave.offload import check_disk_path
from memsave.offload.chunks import MASTER_BYTES
from memsave.optim import Adafactor
from memsave.precision import LossScaler, compute_dtype, reduce_dtype_for, scaler_for
from memsave.wrapped import WrappedOptimizer, is_wrapped_optimizer, shared_with_wrapped, wrapped_model_of
from memsave.zero.offload import cpu_noop, estimate_state_bytes
from memsave.zero.rows import ELEMENTWISE, check_shardable, is_elementwise

__all__ = ["Plan", "check_offload", "effective_offload", "validate"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a validated profile asks for on this mesh and device (each decided here, once)."""

    profile: Profile
    mesh: Mesh
    mixed: bool  # parameters in a low-precision compute dtype, fp32 masters
    compute_dtype: torch.dtype | None  # None: fp32
    reduce_dtype: torch.dtype | None  # None: the parameters' own
    scaler: LossScaler | None  # fp16: dynamic loss scaling
    offload: OffloadConfig | None  # the [offload] settings that move something here (None: nothing moves)
    recompute: bool
    pp_split: Any = None  # pp > 1: the StageSplit (memsave/pp/split.py): which stage owns which module
    pp_balance: Any = None  # [parallel] balance = params / time: the memsave.pp.Balance chosen


def validate(profile: Profile, mesh: Mesh, model: nn.Module, *, units: Sequence[nn.Module] | None = None,
             optimizer: torch.optim.Optimizer | None = None, example_inputs: Any = None) -> Plan:
    """Check ``profile`` against ``mesh``, ``model``, this device and (from ``wrap``) ``optimizer``; return the
    :class:`Plan` the transforms follow. Raises before anything is changed."""
    check_accelerate_world(mesh.world_size)  # [Note: accelerate's process count] (wrap and parallelize)
    check_accelerate_precision(profile.precision.compute)  # [Note: accelerate's mixed precision]
    check_parallel(profile, mesh, optimizer)
    check_profile(profile)
    check_model(model, profile)
    if profile.recompute.policy.startswith("budget:") and example_inputs is None:
        raise ValueError(
            f"profile {profile.name!r}: [recompute] policy={profile.recompute.policy!r} measures the activations "
            "of one forward: pass example_inputs= (one training batch) to memsave.wrap, or call "
            "memsave.recompute.apply(units, policy, model=model, example_inputs=...) yourself before wrapping")
    prec = profile.precision
    mixed = prec.compute != "fp32"
    scaler = scaler_for(prec)
    offload = None
    if (profile.offload.optimizer, profile.offload.params) != ("none", "none"):
        offload = effective_offload(profile, mesh.device)
        if offload is not None and optimizer is not None:
            check_offload(optimizer, offload, mesh.dp_size, master_elements=None if mixed or scaler else 0)
    if profile.recompute.compress != "none":
        from memsave.recompute.compress import (
            check_compress,  # layer 3, loaded only when compression is asked
        )

        check_compress(profile.recompute.compress, mesh.device)
    if optimizer is not None:
        if (mixed or scaler is not None) and optimizer.state:
            raise ValueError(f"optimizer already has state for {len(optimizer.state)} parameters; memsave.wrap must "
                             "come before the first step (load a checkpoint with optimizer.load_state_dict after "
                             "wrapping)")
        if profile.zero.stage:
            check_shardable(optimizer, profile.zero.stage)
        check_optimizer_params(model, optimizer)
        warn_unused_optimizer_section(profile, optimizer)
    recompute = profile.recompute.policy != "none"
    if profile.zero.stage == 0 and units is not None and not recompute:
        raise NotImplementedError(
            "units= has no effect with zero.stage = 0 and no [recompute] (plain data parallel buckets by size); "
            "drop it, choose a ZeRO stage or a recompute policy")
    if recompute and profile.zero.stage == 3:
        check_not_nested(model, units if units is not None else default_units(model))
    pp_split = pp_balance = None
    if mesh.degree("pp") > 1:
        from memsave.pp.split import plan_split  # layer 3; loaded only with a pipeline

        par = profile.parallel
        if par.schedule == "zero-bubble" and recompute and profile.recompute.policy != "full":
            from memsave.recompute.checkpoint import split_backward_supported  # layer 3

            if not split_backward_supported():
                raise NotImplementedError(
                    f"profile {profile.name!r}: [parallel] schedule = \"zero-bubble\" with [recompute] policy = "
                    f"{profile.recompute.policy!r} needs torch's selective checkpoint modes (torch.utils.checkpoint."
                    f"_CachedTorchDispatchMode: read twice, by the input- and the weight-gradient pass), which torch "
                    f"{torch.__version__} does not have: use policy = \"full\" "
                    "or schedule = \"1f1b\"")
        split = par.split
        if par.balance != "count":  # [parallel] balance: the split from each block's parameters or measured time
            from memsave.pp.auto_split import choose_split  # layer 3

            if par.balance == "time" and any(p.is_meta for p in model.parameters()):
                raise NotImplementedError('[parallel] balance = "time" measures each block, which a model on the '
                                          'meta device cannot run: use balance = "params" or an explicit split')
            names, pp_balance = choose_split(model, mesh.degree("pp") * par.virtual, par.balance, example_inputs)
            split = tuple(names)
            if mesh.rank == 0:
                get_logger().info("pipeline stages by %s:\n%s", par.balance, pp_balance.to_text(
                    *(("ms", 1e3) if par.balance == "time" else ("bytes", 1.0))))
        pp_split = plan_split(model, mesh.degree("pp") * par.virtual, split)
    return Plan(profile=profile, mesh=mesh, mixed=mixed, compute_dtype=compute_dtype(prec) if mixed else None,
                reduce_dtype=reduce_dtype_for(prec), scaler=scaler, offload=offload, recompute=recompute,
                pp_split=pp_split, pp_balance=pp_balance)


def check_parallel(profile: Profile, mesh: Mesh, optimizer: torch.optim.Optimizer | None = None) -> None:
    """No mesh axis is silently ignored. ``tp``: the mesh decides the degree (``[parallel] tp`` asks for it through
    ``memsave.init(profile=...)``; a profile asking for another degree than the mesh has is a contradiction).
    ``pp`` likewise (the mesh decides); a pipeline refuses what its stages cannot compose with yet."""
    want, have = profile.parallel.tp, mesh.degree("tp")
    if want > 1 and want != have:
        raise ValueError(
            f"profile {profile.name!r}: [parallel] tp = {want} but the mesh has tp = {have}; build the mesh with "
            "memsave.init(profile=...) (or Mesh.build(tp=...)) so the two agree")
    if profile.parallel.sequence and have == 1:
        warn_once(f"profile {profile.name!r}: [parallel] sequence = true with tp = 1: there is no tp axis to cut "
                  "the sequence over, so sequence parallelism does nothing here")
    want, have = profile.parallel.pp, mesh.degree("pp")
    if want > 1 and want != have:
        raise ValueError(
            f"profile {profile.name!r}: [parallel] pp = {want} but the mesh has pp = {have}; build the mesh with "
            "memsave.init(profile=...) (or Mesh.build(pp=...)) so the two agree")
    if have == 1:
        if profile.parallel.schedule != "1f1b" or profile.parallel.split or profile.parallel.virtual != 1:
            warn_once(f"profile {profile.name!r}: [parallel] schedule / split / virtual set with pp = 1: there is no "
                      "pipeline, so they do nothing here")
        return


def check_profile(profile: Profile) -> None:
    """No silent fallback: a profile asking for a technique that is not built yet is refused."""
    p = profile
    prec = p.precision
    if prec.reduce not in ("compute", prec.compute, "fp32"):
        raise NotImplementedError(
            f"profile {p.name!r}: [precision] reduce={prec.reduce!r} with compute={prec.compute!r} is not "
            "implemented: gradients are communicated in the compute dtype or in fp32; set reduce = \"compute\" "
            'or "fp32"'
        )
    if p.offload.activations != "none" and p.recompute.compress != "none":
        raise NotImplementedError(
            f"profile {p.name!r}: [offload] activations = {p.offload.activations!r} together with [recompute] "
            f"compress = {p.recompute.compress!r} is not implemented: only the innermost saved-tensor hooks apply, "
            "so one of them would be silently ignored; choose one")



def check_arguments(profile: object, mesh: object) -> None:
    """``profile`` and ``mesh`` are of the kinds :func:`wrap` takes (else the errors come from deep inside)."""
    what = ("a preset name (" + ", ".join(list_presets()) + "), a path to a .toml file or a memsave.Profile")
    if isinstance(profile, dict):
        raise ValueError(f"profile must be {what}, got a dict; build one from it with memsave.Profile.from_dict(d)")
    if not isinstance(profile, str | Path | Profile):
        raise ValueError(f"profile must be {what}, got {type(profile).__name__} {profile!r}")
    if isinstance(profile, str) and not profile.strip():
        raise ValueError(f"profile is an empty string; pass {what}")
    if mesh is not None and not isinstance(mesh, Mesh):
        raise ValueError(
            f"mesh must be a memsave.Mesh or None (dp over the whole default process group), got "
            f"{type(mesh).__name__}; build it with mesh = memsave.init() (it reads the launcher's environment, or "
            "takes the process group you initialized) and pass that")


def drop_constructor_state(optimizer: torch.optim.Optimizer) -> None:
    """[Note: state from the constructor] torch's Adagrad fills its state in ``__init__`` (``step`` 0, ``sum`` at
    ``initial_accumulator_value``) and creates the same again at its first step where it finds none. That is not a
    step taken, and memsave makes the optimizer step other tensors (row shards, fp32 masters, tp slices): the
    state is dropped, so wrap's "already has state" check (a step before wrap) does not refuse a fresh Adagrad.
    Other optimizers keep their state and that check."""
    if isinstance(optimizer, torch.optim.Adagrad) and all(
            float(s.get("step", 1)) == 0 for s in optimizer.state.values()):
        optimizer.state.clear()


def check_optimizer_not_wrapped(optimizer: torch.optim.Optimizer) -> None:
    if isinstance(optimizer, WrappedOptimizer):
        raise ValueError(
            f"optimizer is the {type(optimizer).__name__} an earlier memsave.wrap returned; pass the torch optimizer "
            "you built over this model's parameters (each model and its optimizer are wrapped once)")
    if is_wrapped_optimizer(optimizer):
        raise ValueError(
            f"optimizer ({type(optimizer).__name__}) was already wrapped by an earlier memsave.wrap, whose engine "
            "steps it now; build a new optimizer over this model's parameters (each optimizer is wrapped once)")



def check_model(model: nn.Module, profile: Profile) -> None:
    """What no engine can train: sparse gradients anywhere; nothing trainable under plain data parallelism;
    torch.compile's wrapper under ZeRO-3; a parameter another wrapped model holds. Said: a tie the config
    promises but the model lost (accelerate's ``init_empty_weights`` unties them; trained apart, silently)."""
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        try:
            pair = (model.get_input_embeddings(), model.get_output_embeddings())  # type: ignore[operator]
        except (AttributeError, NotImplementedError, TypeError):
            pair = (None, None)
        if all(hasattr(m, "weight") for m in pair) and pair[0].weight is not pair[1].weight:  # type: ignore[union-attr]
            warn_once(f"{type(model).__name__}: config.tie_word_embeddings is true but the input embedding and the "
                      "output head are two parameters (accelerate's init_empty_weights unties them): they train "
                      "apart; call model.tie_weights() before memsave.wrap")
    shared = shared_with_wrapped(model)
    if shared is not None:  # two engines would each reduce, shard and step it: wrong numbers, timing-dependent
        name, other, there = shared
        raise ValueError(
            f"parameter {name!r} of this {type(model).__name__} is also parameter {there!r} of a "
            f"{type(other).__name__} already wrapped by memsave: two engines would each reduce (or shard) its "
            "gradient and step it. Wrap one module that holds both models (one engine, one optimizer with a param "
            "group per model), or give the second model its own copy of the shared module")
    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.sparse and m.weight.requires_grad:
            raise NotImplementedError(
                f"{type(m).__name__} {name or '<root>'!r} has sparse=True: the gradient of "
                f"{(name + '.' if name else '') + 'weight'!r} is a sparse tensor, which memsave's gradient buckets "
                "and ZeRO shards do not hold; construct it with sparse=False (the default)")
        if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.max_norm is not None and profile.zero.stage == 3:
            raise NotImplementedError(  # the forward renormalizes the gathered copy, freed at reshard: lost silently
                f"{type(m).__name__} {name or '<root>'!r} has max_norm={m.max_norm}: its forward renormalizes the "
                "looked-up rows of its weight in place, which under zero.stage = 3 land in the gathered copy and "
                "are lost when it is freed; use zero.stage 0-2, or renormalize in the model's own code")
    if profile.zero.stage == 3 and hasattr(model, "_orig_mod") and hasattr(model, "_torchdynamo_orig_callable"):
        raise NotImplementedError(
            f"profile {profile.name!r} (zero.stage = 3): the model is torch.compile's wrapper (OptimizedModule), "
            "whose root hooks would run outside the model memsave shards; wrap the model itself, then compile it: "
            "model, opt = memsave.wrap(model, opt, ...); model.compile() (or torch.compile(model))")
    if profile.zero.stage == 0 and not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"profile {profile.name!r} (zero.stage = 0): model {type(model).__name__} has no trainable parameters "
            f"({len(list(model.parameters()))} parameters, none with requires_grad=True), so there is no gradient "
            "to average; set requires_grad=True on the parameters to train before memsave.wrap (a frozen model "
            "used without training, a distillation teacher: leave it unwrapped, or shard it with zero3)")



def warn_unused_optimizer_section(profile: Profile, optimizer: torch.optim.Optimizer) -> None:
    """``[optimizer]`` describes the optimizer the trainer and ``memsave demo`` build; :func:`wrap` steps the one it
    is given. Said once when the section is set and the optimizer passed is not the one it describes."""
    cfg, default = profile.optimizer, OptimizerConfig()
    if cfg == default or profile.name == "auto":  # (auto: the planner wrote it from the optimizer passed)
        return
    from memsave.optim import build_optimizer  # layer 1

    ref = build_optimizer([torch.zeros(1, requires_grad=True)], cfg)
    if type(ref) is type(optimizer) and all(optimizer.defaults.get(k) == v for k, v in ref.defaults.items()):
        return  # built from the section (memsave.optim.build_optimizer)
    keys = ", ".join(f"{f.name} = {getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg)
                     if getattr(cfg, f.name) != getattr(default, f.name))
    warn_once(f"profile {profile.name!r}: its [optimizer] section ({keys}) is ignored by memsave.wrap, which steps "
              f"the optimizer you pass ({type(optimizer).__name__}); to use the section, build the optimizer with "
              "memsave.optim.build_optimizer(model.parameters(), profile.optimizer)")



def check_optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every parameter the optimizer updates must belong to the model (else it would never be synchronized)."""
    names = {p: n for n, p in model.named_parameters(remove_duplicate=False)}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            owner = wrapped_model_of(p) if p not in names else None
            if owner is not None:
                raise ValueError(
                    f"optimizer param_groups[{gi}] holds parameter {owner[1]!r} of another model, which memsave.wrap "
                    f"already wrapped ({type(owner[0]).__name__}); build the optimizer over this model's parameters()")
            if p not in names:
                raise ValueError(
                    f"optimizer param_groups[{gi}] holds a tensor of shape {tuple(p.shape)} that is not a parameter "
                    "of the model; build the optimizer over model.parameters()")



def check_not_nested(model: nn.Module, units: Sequence[nn.Module]) -> None:
    """Stage 3 gathers in hooks on each unit; inside another recomputed unit those hooks would run again during
    its recomputation (extra gathers, out of order), so recomputed units must not contain one another."""
    for outer in units:
        for inner in units:
            if inner is not outer and any(inner is m for m in outer.modules()):
                names = {id(m): n for n, m in model.named_modules()}
                raise NotImplementedError(
                    f"[recompute] with zero.stage = 3 is not implemented for nested units: {names.get(id(inner))!r} "
                    f"is inside {names.get(id(outer))!r}, so its gather hooks would run again when the outer unit is "
                    "recomputed; pass units= that do not contain one another")



def effective_offload(profile: Profile, device: torch.device) -> OffloadConfig | None:
    """The ``[offload]`` settings that move something on ``device`` (None: nothing moves); refuses what is not
    implemented and says once what is ignored on this hardware."""
    off = profile.offload
    name = profile.name
    if off.params == "cpu" and device.type == "cuda" and (off.optimizer != "cpu" or off.fraction != 1.0
                                                          or profile.zero.stage != 3):
        raise NotImplementedError(
            f"profile {name!r}: [offload] params = \"cpu\" on a CUDA device is not implemented with optimizer = "
            f"{off.optimizer!r}, fraction = {off.fraction}, zero.stage = {profile.zero.stage}: it needs optimizer = "
            '"cpu", fraction = 1 and zero.stage = 3 (the step streams each unit\'s parameters with its optimizer '
            "state)")
    if off.params == "disk" and (device.type != "cpu" or off.optimizer != "disk" or off.fraction != 1.0):
        raise NotImplementedError(
            f"profile {name!r}: [offload] params = \"disk\" is not implemented with optimizer = {off.optimizer!r}, "
            f"fraction = {off.fraction} on a {device.type} device: it needs optimizer = \"disk\" and fraction = 1 "
            "on a CPU device (the step streams each unit's parameters with its optimizer state)")
    if off.params == "cpu" and device.type != "cuda":
        warn_once(f'[offload] params = "cpu" on a {device.type} device: the parameters already live in host '
                  "memory, nothing is moved")
    host = off.steps_on_host(device.type, mixed=profile.precision.compute != "fp32")
    if off.overlap and (profile.zero.stage != 3 or device.type != "cpu"):
        # On CUDA the host step overlapped with the next forward ran, equal to the synchronous one, but 2.1x slower
        # per step on one H100 (the CPU kernel's threads and the forward's kernel launches contend for the host):
        # refused rather than offered as a slower "optimization" (docs/benchmarks.md, Offload).
        raise NotImplementedError(
            f"profile {name!r}: [offload] overlap = true with optimizer = {off.optimizer!r}, step = {off.step!r}, "
            f"zero.stage = {profile.zero.stage} on a {device.type} device is not implemented: it overlaps the "
            "offloaded optimizer step with the next forward, whose stage-3 gathers wait for each unit's rows; it "
            "needs zero.stage = 3 on a CPU device (on CUDA it measured slower than the synchronous host step; "
            "set overlap = false)")
    if off.optimizer == "none":
        return None
    if profile.zero.stage == 0:
        raise NotImplementedError(
            f"profile {name!r}: [offload] optimizer = {off.optimizer!r} with zero.stage = 0 is not implemented: "
            "offload streams ZeRO's optimizer shards; use zero.stage = 1, 2 or 3")
    if off.optimizer == "cpu" and device.type != "cuda":
        warn_once(cpu_noop(device))
        return None
    if device.type not in ("cpu", "cuda"):
        raise NotImplementedError(f"profile {name!r}: [offload] optimizer = {off.optimizer!r} on a {device.type} "
                                  "device is not implemented (CPU and CUDA devices only)")
    if device.type == "cuda" and not host and off.optimizer == "disk":
        raise NotImplementedError(
            f"profile {name!r}: [offload] optimizer = \"disk\" with step = \"device\" on CUDA is not implemented: "
            'the files are read into host buffers, so the step runs on the host (step = "host" or "auto")')
    if device.type == "cuda" and host and off.fraction != 1.0:
        raise NotImplementedError(
            f"profile {name!r}: [offload] fraction = {off.fraction} with the step on the host (step = {off.step!r}, "
            f'optimizer = {off.optimizer!r}) on CUDA is not implemented: a part stepped on the device and a part on '
            'the host; use fraction = 1, or step = "device" with optimizer = "cpu"')
    if device.type == "cuda" and host and off.params == "cpu" and profile.precision.compute == "fp32":
        raise NotImplementedError(
            f"profile {name!r}: [offload] params = \"cpu\" with step = {off.step!r} (the step on the host) and fp32 "
            "compute is not implemented on CUDA: the host step reads each chunk's fp32 parameters from the device, "
            'which holds the shards only while they are gathered; use precision.compute = "bf16" (the fp32 masters '
            'then live on the host) or step = "device"')
    return off



def check_offload(optimizer: torch.optim.Optimizer, off: OffloadConfig, dp_size: int, *,
                  master_elements: int | None = None) -> None:
    """Before anything changes: the optimizer can be streamed in chunks, and the disk has room (for the state, and
    ``master_elements`` fp32 masters on this rank; None: as many as it has elements, an upper bound)."""
    name = type(optimizer).__name__
    if isinstance(optimizer, Adafactor) and (off.params != "none" or off.overlap or off.fraction != 1.0):
        bad = {"params": (off.params, "none", '"none"'), "overlap": (off.overlap, False, "false"),
               "fraction": (off.fraction, 1.0, "1")}
        keys = [k for k, (v, ok, _) in bad.items() if v != ok]
        raise NotImplementedError(
            f"[offload] optimizer = {off.optimizer!r} with memsave.optim.Adafactor and "
            f"{', '.join(f'{k} = {bad[k][0]!r}' for k in keys)} is not implemented: Adafactor's statistics span "
            "every row of a shard, so it steps whole shards in one call ([Note: whole-shard offload] in "
            f"memsave/offload/whole.py); set {' and '.join(f'{k} = {bad[k][2]}' for k in keys)}")
    if not is_elementwise(optimizer) and not isinstance(optimizer, Adafactor):
        raise NotImplementedError(
            f"[offload] optimizer = {off.optimizer!r} with {name} is not implemented: offload steps the state chunk "
            f"by chunk, which is exact only for elementwise optimizers ({', '.join(sorted(ELEMENTWISE))}, or a "
            "subclass of one of torch's)")
    if off.optimizer == "disk":
        per_elem, total = estimate_state_bytes(optimizer, dp_size)
        if master_elements is None:
            master_elements = total // max(per_elem, 1)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        check_disk_path(off.path, int(2 * (total + MASTER_BYTES * master_elements) * off.fraction * local))


