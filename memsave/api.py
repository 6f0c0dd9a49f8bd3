"""``memsave.wrap``: apply a profile to a user's model and optimizer.

Transforms apply in one documented order (torchtitan's): tensor parallel, then recompute, then ZeRO / data
parallel, then the pipeline schedule. Today recomputation and the data-parallel engines (stage 0: DDP-style;
stages 1-3: ZeRO) are built; the other transforms raise ``NotImplementedError`` until they land, rather than
being ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memsave import dist as mdist
from memsave._logging import warn_once
from memsave.config import OffloadConfig, OptimizerConfig, Profile, list_presets, load_profile
from memsave.dist import Mesh
from memsave.engines.dp import DataParallelEngine, DataParallelOptimizer
from memsave.models.units import default_units
from memsave.precision import (
    cast_forward_inputs,
    cast_parameters,
    compute_dtype,
    reduce_dtype_for,
    scaler_for,
)
from memsave.precision.nonfinite import NonfiniteGuard
from memsave.wrapped import (
    MemsaveModule,
    MemsaveOptimizer,
    is_wrapped_optimizer,
    swap_class,
    wrapped_model_of,
)

__all__ = ["default_mesh", "wrap"]


def default_mesh() -> Mesh:
    """dp over the whole default process group, whoever initialized it (a world of one if nobody did)."""
    return mdist.init()


def _check_supported(profile: Profile) -> None:
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
            "so one of them would be silently ignored; choose one"
        )


@torch.no_grad()
def sync_module_states(model: nn.Module, mesh: Mesh) -> None:
    """Broadcast parameters and buffers from dp rank 0 so every replica starts identical (as DDP does)."""
    seen: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            mdist.broadcast(t.data, 0, mesh.dp_group)


def _prepare_model(model: nn.Module, mesh: Mesh, dtype: torch.dtype | None) -> None:
    """Move ``model`` to the mesh's device; with ``dtype`` (mixed precision) its floating-point parameters are
    cast on the way, one at a time, so the device never holds the fp32 model (a bf16 model larger than the fp32
    one would fit, as host-offloaded training needs)."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device.type == "meta":
            raise ValueError(
                f"model tensor {name!r} is on the meta device; materialize the model (model.to_empty(...) and "
                "initialize) before memsave.wrap"
            )
    if dtype is not None:
        cast_parameters(model, dtype)  # where the model is: the same rounding anywhere
    model.to(mesh.device)


def _check_arguments(profile: object, mesh: object) -> None:
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
            "takes the process group you initialized) and pass that"
        )


def _check_optimizer_not_wrapped(optimizer: torch.optim.Optimizer) -> None:
    if isinstance(optimizer, MemsaveOptimizer):
        raise ValueError(
            f"optimizer is the {type(optimizer).__name__} an earlier memsave.wrap returned; pass the torch optimizer "
            "you built over this model's parameters (each model and its optimizer are wrapped once)"
        )
    if is_wrapped_optimizer(optimizer):
        raise ValueError(
            f"optimizer ({type(optimizer).__name__}) was already wrapped by an earlier memsave.wrap, whose engine "
            "steps it now; build a new optimizer over this model's parameters (each optimizer is wrapped once)"
        )


def _check_model(model: nn.Module, profile: Profile) -> None:
    """What no engine can train: sparse gradients anywhere; nothing trainable under plain data parallelism."""
    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.sparse and m.weight.requires_grad:
            raise NotImplementedError(
                f"{type(m).__name__} {name or '<root>'!r} has sparse=True: the gradient of "
                f"{(name + '.' if name else '') + 'weight'!r} is a sparse tensor, which memsave's gradient buckets "
                "and ZeRO shards do not hold; construct it with sparse=False (the default)"
            )
    if profile.zero.stage == 0 and not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"profile {profile.name!r} (zero.stage = 0): model {type(model).__name__} has no trainable parameters "
            f"({len(list(model.parameters()))} parameters, none with requires_grad=True), so there is no gradient "
            "to average; set requires_grad=True on the parameters to train before memsave.wrap"
        )


def _warn_unused_optimizer_section(profile: Profile, optimizer: torch.optim.Optimizer) -> None:
    """``[optimizer]`` describes the optimizer the trainer and ``memsave demo`` build; :func:`wrap` steps the one it
    is given. Said once when the section is set and the optimizer passed is not the one it describes."""
    cfg, default = profile.optimizer, OptimizerConfig()
    if cfg == default:
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


def _check_optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every parameter the optimizer updates must belong to the model (else it would never be synchronized)."""
    names = {p: n for n, p in model.named_parameters(remove_duplicate=False)}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            owner = wrapped_model_of(p) if p not in names else None
            if owner is not None:
                raise ValueError(
                    f"optimizer param_groups[{gi}] holds parameter {owner[1]!r} of another model, which memsave.wrap "
                    f"already wrapped ({type(owner[0]).__name__}); build the optimizer over this model's parameters()"
                )
            if p not in names:
                raise ValueError(
                    f"optimizer param_groups[{gi}] holds a tensor of shape {tuple(p.shape)} that is not a parameter "
                    "of the model; build the optimizer over model.parameters()"
                )


def wrap(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    profile: str | Path | Profile = "ddp",
    *,
    mesh: Mesh | None = None,
    units: Sequence[nn.Module] | None = None,
    example_inputs: Any = None,
) -> tuple[nn.Module, MemsaveOptimizer]:
    """Wrap ``model`` and its ``optimizer`` for training under ``profile``.

    Args:
        model: any ``nn.Module``. It is modified in place (moved to the mesh's device, hooks installed, its
            class swapped for a subclass that adds ``no_sync()``) and returned.
        optimizer: the user's optimizer instance over ``model``'s parameters (any ``torch.optim.Optimizer``,
            any param groups).
        profile: a preset name (``"ddp"``, ``"zero3"``, ...), a path to a TOML file, or a :class:`Profile`.
        mesh: the layout from :func:`memsave.init`; ``None`` means dp over the whole default process group.
        units: the modules that communicate, and are recomputed, together (later: offloaded); default: the
            blocks of the model's largest ``nn.ModuleList`` plus the root (the root is never recomputed).
        example_inputs: for a ``[recompute] policy = "budget:<size>"`` only: one batch like the training
            ones (dict of keyword arguments, tuple of positional ones, or a tensor) or a callable running one
            forward; each rank measures the activations of its own (see :func:`memsave.recompute.apply`).

    Returns:
        ``(model, optimizer)``: the same model object and a :class:`~memsave.wrapped.MemsaveOptimizer` with
        ``backward``, ``clip_grad_norm``, ``step``, ``zero_grad``, ``state_dict`` and ``load_state_dict``.

    Raises:
        ValueError (bad arguments) or NotImplementedError (an unsupported combination), before the model or the
        optimizer is changed: a refused wrap loses nothing.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, MemsaveModule):
        raise ValueError(f"model of class {type(model).__name__} is already wrapped by memsave; wrap it once")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"optimizer must be a torch.optim.Optimizer instance, got {type(optimizer).__name__}; "
            "build it over model.parameters() before calling memsave.wrap"
        )
    _check_optimizer_not_wrapped(optimizer)
    _check_arguments(profile, mesh)
    profile = load_profile(profile)
    _check_supported(profile)
    _check_model(model, profile)
    if profile.recompute.policy.startswith("budget:") and example_inputs is None:
        raise ValueError(
            f"profile {profile.name!r}: [recompute] policy={profile.recompute.policy!r} measures the activations "
            "of one forward: pass example_inputs= (one training batch) to memsave.wrap, or call "
            "memsave.recompute.apply(units, policy, model=model, example_inputs=...) yourself before wrapping"
        )
    mesh = mesh if mesh is not None else default_mesh()
    offload = None
    if (profile.offload.optimizer, profile.offload.params) != ("none", "none"):  # before anything changes
        from memsave.zero.offload import check_offload, effective_offload

        offload = effective_offload(profile, mesh.device)
        if offload is not None:
            mixed = profile.precision.compute != "fp32" or profile.precision.loss_scale != "none"
            check_offload(optimizer, offload, mesh.dp_size, master_elements=None if mixed else 0)
    if profile.recompute.compress != "none":  # before anything changes: a refused wrap changes nothing
        from memsave.recompute.compress import check_compress

        check_compress(profile.recompute.compress, mesh.device)
    prec = profile.precision
    mixed = prec.compute != "fp32"
    scaler = scaler_for(prec)
    if (mixed or scaler is not None) and optimizer.state:  # before the cast: a refused wrap changes nothing
        raise ValueError(f"optimizer already has state for {len(optimizer.state)} parameters; memsave.wrap must "
                         "come before the first step (load a checkpoint with optimizer.load_state_dict after wrapping)")
    if mixed and profile.zero.stage:
        from memsave.zero import ZeroOptimizer

        ZeroOptimizer.check(optimizer, profile.zero.stage)  # before the cast, for the same reason
    _check_optimizer_params(model, optimizer)
    _warn_unused_optimizer_section(profile, optimizer)
    recompute = profile.recompute.policy != "none"
    if profile.zero.stage == 0 and units is not None and not recompute:
        raise NotImplementedError(
            "units= has no effect with zero.stage = 0 and no [recompute] (plain data parallel buckets by size); "
            "drop it, choose a ZeRO stage or a recompute policy"
        )
    if recompute and profile.zero.stage == 3:
        _check_not_nested(model, units if units is not None else default_units(model))
    _prepare_model(model, mesh, compute_dtype(prec) if mixed else None)
    if prec.compute == "fp16" and mesh.device.type == "cpu":
        warn_once('[precision] compute = "fp16" on CPU: torch runs fp16 matmuls on most CPUs through a slow '
                  "fallback (measured on this project's CI CPU: a matmul 100x slower than in fp32); bf16 is the fast half precision on CPUs")
    reduce_dtype = reduce_dtype_for(prec)
    sync_module_states(model, mesh)
    # The documented order: recompute, then ZeRO / DP (whose hooks on a unit then run outside the recomputed
    # region: [Note: hooks stay outside the recomputed region] in memsave/recompute/checkpoint.py).
    plan = None
    if recompute:
        from memsave import recompute as mrecompute  # layer 3; imported here so other users never load it

        plan = mrecompute.apply(units, profile.recompute, model=model, example_inputs=example_inputs)
    try:
        wrapped = _wrap_data_parallel(model, optimizer, profile, mesh, units, mixed, scaler, reduce_dtype, offload)
    except BaseException:
        if plan is not None:  # a refused wrap leaves the model as it was
            mrecompute.remove(plan)
        raise
    if mixed:  # an fp32 batch (images, features) meets the compute-dtype weights: cast, as FSDP2 does
        cast_forward_inputs(model, compute_dtype(prec))
    if recompute:
        _no_cache_in_training(model)
    _wrap_saved_tensors(model, profile, mesh)  # last: its hooks are the outermost around the root's forward
    if mesh.device.type == "cpu" and profile.zero.host_mmap_threshold_mb > 0:  # only once nothing can fail
        mdist.configure_host_memory(mmap_threshold=int(profile.zero.host_mmap_threshold_mb * 2**20))
    return wrapped


def _wrap_saved_tensors(model: nn.Module, profile: Profile, mesh: Mesh) -> None:
    """``[recompute] compress`` and ``[offload] activations``: the root's whole forward (the ZeRO / DP hooks on it
    included) runs under saved-tensor hooks; inside recomputed units the checkpoint's own hooks take over
    ([Note: compression inside a recomputed unit] in memsave/recompute/compress.py)."""
    from memsave.offload import forward_under, offload_saved

    kind = profile.recompute.compress
    if kind != "none":
        from memsave.recompute.compress import compress_saved

        model.memsave_saved_tensors = forward_under(model, lambda: compress_saved(kind, model))  # type: ignore[assignment]
    elif profile.offload.activations == "cpu":
        if mesh.device.type != "cuda":
            warn_once(f"profile {profile.name!r}: " + "[offload] activations = \"cpu\" on a "
                      f"{mesh.device.type} device: saved activations already live in host memory, nothing is moved")
            return
        model.memsave_saved_tensors = forward_under(model, lambda: offload_saved(model))  # type: ignore[assignment]


def _no_cache_in_training(model: nn.Module) -> None:
    """A recomputed forward must compute what it did the first time; a Hugging Face model left at its default
    ``use_cache=True`` appends to its key/value cache again in the replay (wrong shapes with an attention mask,
    right only by chance without). In training mode pass ``use_cache=False``, as HF's own gradient checkpointing
    does, and say so once."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "use_cache"):
        return

    def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
        if not module.training or kwargs.get("use_cache") is False:
            return None
        if kwargs.get("use_cache") is not None or getattr(config, "use_cache", False):
            warn_once("[recompute] with a Hugging Face model in training mode: use_cache=False is passed to its "
                      "forward (a recomputed forward must not append to the key/value cache again), as HF's "
                      "gradient checkpointing does")
            return args, {**kwargs, "use_cache": False}
        return None

    model.register_forward_pre_hook(hook, with_kwargs=True)


def _check_not_nested(model: nn.Module, units: Sequence[nn.Module]) -> None:
    """Stage 3 gathers in hooks on each unit; inside another recomputed unit those hooks would run again during
    its recomputation (extra gathers, out of order), so recomputed units must not contain one another."""
    for outer in units:
        for inner in units:
            if inner is not outer and any(inner is m for m in outer.modules()):
                names = {id(m): n for n, m in model.named_modules()}
                raise NotImplementedError(
                    f"[recompute] with zero.stage = 3 is not implemented for nested units: {names.get(id(inner))!r} "
                    f"is inside {names.get(id(outer))!r}, so its gather hooks would run again when the outer unit is "
                    "recomputed; pass units= that do not contain one another"
                )


def _wrap_data_parallel(model: nn.Module, optimizer: torch.optim.Optimizer, profile: Profile, mesh: Mesh,
                        units: Sequence[nn.Module] | None, mixed: bool, scaler: Any,
                        reduce_dtype: torch.dtype | None,
                        offload: OffloadConfig | None = None) -> tuple[nn.Module, MemsaveOptimizer]:
    nonfinite = NonfiniteGuard(profile.precision.nonfinite, profile.precision.max_skipped)
    if profile.zero.stage == 0:
        engine = DataParallelEngine(model, mesh, bucket_mb=profile.zero.bucket_mb, reduce_dtype=reduce_dtype)
        swap_class(model, engine)
        wrapped: tuple[nn.Module, MemsaveOptimizer] = (
            model, DataParallelOptimizer(optimizer, engine, mixed_precision=mixed, scaler=scaler,
                                         nonfinite=nonfinite))
    else:
        from memsave.zero import shard  # layer 3; imported here so stage 0 users never load it

        wrapped = shard(model, optimizer, stage=profile.zero.stage, mesh=mesh, units=units, config=profile.zero,
                        nonfinite=nonfinite,
                        mixed_precision=mixed, scaler=scaler, reduce_dtype=reduce_dtype, offload=offload)
    return wrapped
