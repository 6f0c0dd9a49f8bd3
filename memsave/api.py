"""``memsave.wrap`` and ``memsave.parallelize``: apply a profile to a user's model (and optimizer).

``parallelize`` validates the whole profile once (memsave/validate.py), then applies the transforms in one
fixed order (torchtitan's): tensor parallel, then recompute, then ZeRO / data parallel, then the pipeline
schedule; a pipeline's stage split comes first, so that the others see this rank's stages only
(memsave/engines/pipeline.py). ``wrap`` also validates the optimizer and composes it over the engine
(:class:`~memsave.engines.MemsaveOptimizer`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memsave import dist as mdist
from memsave._logging import warn_once
from memsave.config import Profile, load_profile
from memsave.deferred import Materializer, has_meta, meta_tensors
from memsave.dist import Mesh
from memsave.engines import DataParallelEngine, Engine, MemsaveOptimizer
from memsave.model_copy import DTYPES_ATTR
from memsave.precision import cast_forward_inputs, cast_parameters
from memsave.precision.nonfinite import NonfiniteGuard
from memsave.validate import (
    Plan,
    check_arguments,
    check_optimizer_not_wrapped,
    drop_constructor_state,
    validate,
)
from memsave.wrapped import MemsaveModule, swap_class

__all__ = ["default_mesh", "parallelize", "wrap"]


def default_mesh() -> Mesh:
    """dp over the whole default process group, whoever initialized it (a world of one if nobody did)."""
    return mdist.init()


@torch.no_grad()
def sync_module_states(model: nn.Module, mesh: Mesh) -> None:
    """Broadcast parameters and buffers from dp rank 0 so every replica starts identical (as DDP does)."""
    seen: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen and t.device.type != "meta":  # a deferred unit is broadcast as it is materialized
            seen.add(id(t))
            mdist.broadcast(t.data, 0, mesh.dp_group)


def _prepare_model(model: nn.Module, mesh: Mesh, dtype: torch.dtype | None,
                   deferred: Materializer | None = None, per_unit: bool = False) -> None:
    """Move ``model`` to the mesh's device; with ``dtype`` (mixed precision) its floating-point parameters are
    cast on the way, one at a time, so the device never holds the fp32 model (a bf16 model larger than the fp32
    one would fit, as host-offloaded training needs).

    A deferred model (meta tensors) is materialized here, whole (``per_unit`` False), or, at ZeRO-3, its buffers
    only: its parameters are materialized unit by unit as ZeRO takes them (:func:`_unit_materializer`)."""
    if dtype is not None:  # what copy.deepcopy(model) gives back (memsave/model_copy.py): the user's own dtypes
        vars(model)[DTYPES_ATTR] = {n: t.dtype for n, t in [*model.named_parameters(remove_duplicate=False),
                                                            *model.named_buffers(remove_duplicate=False)]}
    if deferred is None:
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.device.type == "meta":
                raise ValueError(
                    f"model tensor {name!r} is on the meta device; materialize the model (model.to_empty(...) and "
                    "initialize) before memsave.wrap"
                )
    elif not per_unit:  # (after a pipeline split: this rank's stages only)
        deferred.materialize([t for _, t in meta_tensors(model)], device=torch.device("cpu"))
    else:
        deferred.materialize(list(model.buffers()), device=mesh.device)
        with torch.no_grad():  # what is already real (a model only partly on the meta device)
            for p in model.parameters():
                if p.device.type != "meta":
                    p.data = p.data.to(mesh.device, dtype if dtype is not None and p.is_floating_point() else None)
        return
    if dtype is not None:
        cast_parameters(model, dtype)  # where the model is: the same rounding anywhere
    model.to(mesh.device)


def _deferred(model: nn.Module, plan: Plan, init_fn: Callable[[nn.Module], None] | None,
              optimizer: torch.optim.Optimizer | None) -> Materializer | None:
    """The :class:`~memsave.deferred.Materializer` of a model with meta tensors (None without): checks first, so that
    a refusal changes nothing."""
    if not has_meta(model):
        if init_fn is not None:
            raise ValueError("init_fn= initializes a model built on the meta device (memsave.deferred_init() or "
                             "torch.device('meta')), and this model has no meta tensor; drop init_fn=")
        return None
    if plan.mesh.degree("tp") > 1:
        raise NotImplementedError(
            f"a model on the meta device with tp = {plan.mesh.degree('tp')}: tensor parallelism cuts the parameters "
            "before they are materialized, which deferred initialization does not follow yet (it is supported with "
            "data parallelism, ZeRO and pipeline parallelism); build the model eagerly for tp > 1")
    if plan.profile.recompute.policy.startswith("budget:"):
        raise NotImplementedError(
            f"[recompute] policy={plan.profile.recompute.policy!r} measures a forward of the model before ZeRO shards "
            "it, which a model on the meta device cannot run; choose a policy by name or build the model eagerly")
    if optimizer is not None and optimizer.state:
        raise ValueError(f"optimizer already has state for {len(optimizer.state)} parameters of a model on the meta "
                         "device; build the optimizer and wrap before the first step")
    return Materializer(model, init_fn)


def _unit_materializer(deferred: Materializer, plan: Plan) -> Callable[[list[nn.Parameter]], None]:
    """ZeRO-3's ``before_unit``: materialize a unit's parameters on the device, in the compute dtype, and make them
    dp rank 0's (as :func:`sync_module_states` does for an eager model); the unit then keeps this rank's rows and
    frees the rest before the next unit is materialized."""
    mesh = plan.mesh

    def before_unit(params: list[nn.Parameter]) -> None:
        mdist.trim_host_memory()  # the previous unit's full parameters, freed: out of RSS before the next one
        for t in deferred.materialize(params, device=mesh.device, dtype=plan.compute_dtype):
            mdist.broadcast(t.data, 0, mesh.dp_group)
    return before_unit


def parallelize(model: nn.Module, mesh: Mesh | None = None, profile: str | Path | Profile = "ddp", *,
                units: Sequence[nn.Module] | None = None, example_inputs: Any = None,
                tp_plan: Mapping[str, str] | None = None,
                init_fn: Callable[[nn.Module], None] | None = None) -> Engine:
    """Apply ``profile`` to ``model`` over ``mesh``, in place, and return its :class:`~memsave.engines.Engine`.

    The profile is validated against the mesh, the model and this device first (memsave/validate.py); a refusal
    (``ValueError`` or ``NotImplementedError``) changes nothing. Then, in this order: tensor parallel (``[parallel]
    tp``), recompute (``[recompute]``), ZeRO / data parallel (``[zero]``, ``[precision]``), pipeline parallel
    (``[parallel] pp``: the stage split before recompute, the schedule last; the model then has
    ``pipeline_step`` and ``pipeline_loss``). The model is moved to the mesh's device (cast to the compute dtype
    under mixed precision), its replicas made identical, and its class swapped for a subclass with ``no_sync()``,
    ``unshard()`` and ``reshard()``. A model on the meta device is materialized as in :func:`wrap`. Compose an optimizer over the engine with :class:`~memsave.engines.MemsaveOptimizer`, or call
    :func:`wrap`, which does both.
    """
    check_arguments(profile, mesh)
    if isinstance(model, MemsaveModule):
        raise ValueError(f"model of class {type(model).__name__} is already wrapped by memsave; wrap it once")
    mesh = mesh if mesh is not None else default_mesh()
    plan = validate(load_profile(profile), mesh, model, units=units, example_inputs=example_inputs)
    return _apply(model, plan, units, example_inputs, tp_plan, deferred=_deferred(model, plan, init_fn, None))


def _apply(model: nn.Module, plan: Plan, units: Sequence[nn.Module] | None, example_inputs: Any,
           tp_plan: Mapping[str, str] | None = None, optimizer: torch.optim.Optimizer | None = None,
           deferred: Materializer | None = None) -> Engine:
    """The transforms of a validated plan, in the documented order."""
    mdist.release_dead_groups(plan.mesh.device)  # [Note: group lifetime]: every rank wraps at the same point
    try:
        engine = _transform(model, plan, units, example_inputs, tp_plan, optimizer, deferred)
    finally:
        if deferred is not None:
            deferred.finish()  # the RNG as it was at wrap
    model.__dict__["memsave_profile"] = plan.profile.name  # what memsave.report names the run by when not told
    return engine


def _transform(model: nn.Module, plan: Plan, units: Sequence[nn.Module] | None, example_inputs: Any,
               tp_plan: Mapping[str, str] | None, optimizer: torch.optim.Optimizer | None,
               deferred: Materializer | None) -> Engine:
    profile, mesh = plan.profile, plan.mesh
    tp_ctx = None
    if mesh.degree("tp") > 1:  # 1. tensor parallel: cut by the plan, checked whole before anything changes
        from memsave.tp import apply_tp  # layer 3; imported here so other users never load it

        tp_ctx = apply_tp(model, mesh, tp_plan, sequence=profile.parallel.sequence, units=units)
    elif tp_plan is not None:
        raise ValueError("tp_plan= was given but the mesh has tp = 1; build the mesh with tp > 1 "
                         "(memsave.init(profile=...) with [parallel] tp, or --parallel.tp=N)")
    if plan.pp_split is not None:  # the stage split comes before ZeRO, which then shards this rank's stages only
        units = _split_stages(model, plan, units, optimizer)
    per_unit = deferred is not None and profile.zero.stage == 3
    _prepare_model(model, mesh, plan.compute_dtype, deferred, per_unit)
    if profile.precision.compute == "fp16" and mesh.device.type == "cpu":
        warn_once('[precision] compute = "fp16" on CPU: torch runs fp16 matmuls on most CPUs through a slow '
                  "fallback (measured on this project's CI CPU: a matmul 100x slower than in fp32); bf16 is the "
                  "fast half precision on CPUs")
    sync_module_states(model, mesh)
    # 2. recompute, then 3. ZeRO / DP (whose hooks on a unit then run outside the recomputed region: [Note: hooks
    # stay outside the recomputed region] in memsave/recompute/checkpoint.py)
    recomputed = None
    if plan.recompute:
        from memsave import recompute as mrecompute  # layer 3; imported here so other users never load it

        recomputed = mrecompute.apply(units, profile.recompute, model=model, example_inputs=example_inputs)
    try:
        engine = _data_parallel(model, plan, units, _unit_materializer(deferred, plan) if per_unit and deferred else None)
        if per_unit:
            mdist.trim_host_memory()  # (the last unit's full parameters)
    except BaseException:
        if recomputed is not None:  # a refused wrap leaves the model as it was
            mrecompute.remove(recomputed)
        raise
    if plan.pp_split is not None:  # 4. pipeline parallel: the schedule drives this rank's stages
        engine = _pipeline(model, plan, engine)
    if plan.compute_dtype is not None:  # an fp32 batch (images, features) meets the compute-dtype weights: cast,
        cast_forward_inputs(model, plan.compute_dtype)  # as FSDP2 does
    if tp_ctx is not None:
        from memsave.tp import full_state_dicts

        full_state_dicts(model, tp_ctx)  # after ZeRO's hooks: whole tensors in and out of state dicts
    if plan.recompute:
        _no_cache_in_training(model)
    _wrap_saved_tensors(model, profile, mesh)  # last: its hooks are the outermost around the root's forward
    if mesh.device.type == "cpu" and profile.zero.host_mmap_threshold_mb > 0:  # only once nothing can fail
        mdist.configure_host_memory(mmap_threshold=int(profile.zero.host_mmap_threshold_mb * 2**20))
    return engine


def _split_stages(model: nn.Module, plan: Plan, units: Sequence[nn.Module] | None,
                  optimizer: torch.optim.Optimizer | None) -> list[nn.Module]:
    """Strip the modules of the stages this rank does not hold (memsave/pp/split.py), drop their parameters from
    the optimizer's groups, and return the units with parameters left (ZeRO's and recompute's)."""
    from memsave.models.units import default_units
    from memsave.pp.split import load_takes_whole_model, strip_atoms

    split, mesh = plan.pp_split, plan.mesh
    pp, rank = mesh.degree("pp"), mesh.axis_rank("pp")
    chosen = list(units) if units is not None else default_units(model)
    local = [s for s in range(split.n_stages) if s % pp == rank]
    load_takes_whole_model(model, split, local)
    gone = {id(p) for p in strip_atoms(model, split, local, dtype=plan.compute_dtype)}
    if optimizer is not None:
        at = {p: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in gone]
        # where this rank's parameters stand among the whole model's: the indices of a whole model's optimizer
        # state dict (MemsaveOptimizer.whole_positions)
        vars(optimizer)["memsave_whole_positions"] = (
            [at[p] for g in optimizer.param_groups for p in g["params"]], len(at))
    return [u for u in chosen if any(True for _ in u.parameters())]


def _pipeline(model: nn.Module, plan: Plan, inner: Engine) -> Engine:
    from memsave.engines.pipeline import PipelineEngine
    from memsave.pp.runtime import StageRunner

    mesh, par = plan.mesh, plan.profile.parallel
    group = mesh.group("pp")
    runner = StageRunner(model, plan.pp_split, pp_rank=mesh.axis_rank("pp"), pp_size=mesh.degree("pp"),
                         peer=lambda r: mdist.global_rank(group, r), pp_group=group, device=mesh.device)
    runner.install()
    engine = PipelineEngine(inner, runner, plan.pp_split, schedule=par.schedule, virtual=par.virtual,
                            gather=par.gather)
    engine.balance = plan.pp_balance  # [parallel] balance: the split chosen and its costs (None: by count)
    engine.balance_by = par.balance if plan.pp_balance is not None else "count"
    for name, value in (("memsave_engine", engine), ("pipeline_step", engine.pipeline_step),
                        ("pipeline_loss", engine.pipeline_loss)):
        setattr(model, name, value)  # (plain attributes: nn.Module keeps non-tensor values in __dict__)
    return engine


def _data_parallel(model: nn.Module, plan: Plan, units: Sequence[nn.Module] | None,
                   before_unit: Callable[[list[nn.Parameter]], None] | None = None) -> Engine:
    zero = plan.profile.zero
    engine: Engine
    if zero.stage == 0:
        engine = DataParallelEngine(model, plan.mesh, bucket_mb=zero.bucket_mb, reduce_dtype=plan.reduce_dtype)
        swap_class(model, engine)
    else:
        from memsave.zero import shard  # layer 3; imported here so stage 0 users never load it

        engine = shard(model, stage=zero.stage, mesh=plan.mesh, units=units, config=zero,
                       reduce_dtype=plan.reduce_dtype, before_unit=before_unit)
        if zero.stage == 3 and plan.mesh.dp_size > 1:
            # every forward gathers over dp: Hugging Face's generate then keeps the ranks stepping together
            # (synced_gpus) until all are done, as it does for FSDP and DeepSpeed ZeRO-3; a rank whose prompts
            # ended early waited alone in the next gather until the collective timeout
            model.__dict__["_is_fsdp_managed_module"] = True  # (a plain attribute, as nn.Module keeps a bool)
    return engine


def wrap(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    profile: str | Path | Profile = "ddp",
    *,
    mesh: Mesh | None = None,
    units: Sequence[nn.Module] | None = None,
    example_inputs: Any = None,
    tp_plan: Mapping[str, str] | None = None,
    budget: str | int | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
) -> tuple[nn.Module, MemsaveOptimizer]:
    """Wrap ``model`` and its ``optimizer`` for training under ``profile``: :func:`parallelize`, then the one
    :class:`~memsave.engines.MemsaveOptimizer` over its engine.

    Args:
        model: any ``nn.Module``. It is modified in place (moved to the mesh's device, hooks installed, its
            class swapped for a subclass that adds ``no_sync()``) and returned.
        optimizer: the user's optimizer instance over ``model``'s parameters (any ``torch.optim.Optimizer``,
            any param groups). For a model on the meta device, the optimizer built over its meta parameters: they
            are materialized in place (the same objects), so its param groups and their options carry over.
        profile: a preset name (``"ddp"``, ``"zero3"``, ...), a path to a TOML file, or a :class:`Profile`;
            ``"auto"``: the fastest ZeRO stage, recomputation and offload whose estimated peak fits ``budget``
            (:func:`memsave.plan.auto.auto_profile`; needs ``example_inputs``).
        mesh: the layout from :func:`memsave.init`; ``None`` means dp over the whole default process group.
        units: the modules that communicate, and are recomputed, together (later: offloaded); default: the
            blocks of the model's largest ``nn.ModuleList`` plus the root (the root is never recomputed).
        example_inputs: for a ``[recompute] policy = "budget:<size>"`` only: one batch like the training
            ones (dict of keyword arguments, tuple of positional ones, or a tensor) or a callable running one
            forward; each rank measures the activations of its own (see :func:`memsave.recompute.apply`).
            With ``profile="auto"``: the micro-batch each candidate's activations are estimated on.
        budget: with ``profile="auto"`` only: bytes per rank (an int, or ``"16GiB"``).
        init_fn: for a model on the meta device: ``init_fn(module)`` initializes a module whose tensors nothing
            recorded writes (default: its ``reset_parameters()``), e.g. ``model._init_weights`` of a Hugging Face
            model built under plain ``torch.device("meta")``. A model built under :func:`memsave.deferred_init`
            replays its own construction and needs none (see README, "Deferred initialization").

    Returns:
        ``(model, optimizer)``: the same model object and a :class:`~memsave.engines.MemsaveOptimizer` with
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
    check_optimizer_not_wrapped(optimizer)
    if isinstance(profile, str) and profile == "auto":
        from memsave.plan.auto import auto_profile  # layer 5

        profile = auto_profile(model, optimizer, mesh if mesh is not None else default_mesh(), budget=budget,
                               example_inputs=example_inputs)
        example_inputs = None  # the choice's batch: no budget:<size> recompute policy is chosen to use it
    elif budget is not None:
        raise ValueError(f'budget = {budget!r} is only allowed with profile = "auto", not {profile!r}')
    check_arguments(profile, mesh)
    profile = load_profile(profile)
    mesh = mesh if mesh is not None else default_mesh()
    drop_constructor_state(optimizer)  # a fresh torch Adagrad ([Note: state from the constructor])
    plan = validate(profile, mesh, model, units=units, optimizer=optimizer, example_inputs=example_inputs)
    deferred = _deferred(model, plan, init_fn, optimizer)
    engine = _apply(model, plan, units, example_inputs, tp_plan, optimizer, deferred)
    nonfinite = NonfiniteGuard(profile.precision.nonfinite, profile.precision.max_skipped)
    return model, MemsaveOptimizer(optimizer, engine, mixed_precision=plan.mixed, scaler=plan.scaler,
                                   offload=plan.offload, nonfinite=nonfinite)


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
    does, and say so once: to the model and to every HF model inside it (a reward or classifier head around one).
    Packed rows (``position_ids`` restarting inside a row, no attention mask) then get transformers' per-document
    mask where the model at its default used one causal mask: said too, since the numbers change with it."""
    for sub in model.modules():
        config = getattr(sub, "config", None)
        if config is not None and hasattr(config, "use_cache") and _takes_use_cache(sub):
            sub.register_forward_pre_hook(_no_cache_hook(config), with_kwargs=True)


def _takes_use_cache(module: nn.Module) -> bool:
    """Whether ``module``'s forward names a ``use_cache`` argument (a model, not its rotary table)."""
    try:
        return "use_cache" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _no_cache_hook(config: Any) -> Callable[..., tuple[Any, dict[str, Any]] | None]:
    def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
        if not module.training or kwargs.get("use_cache") is False:
            return None
        if kwargs.get("use_cache") is not None or getattr(config, "use_cache", False):
            warn_once("[recompute] with a Hugging Face model in training mode: use_cache=False is passed to its "
                      "forward (a recomputed forward must not append to the key/value cache again), as HF's "
                      "gradient checkpointing does")
            if kwargs.get("position_ids") is not None and kwargs.get("attention_mask") is None:
                warn_once("[recompute] position_ids without an attention_mask (packed rows?): with use_cache=False "
                          "transformers masks each document of a row apart where position_ids restart, where the "
                          "model at its default use_cache masked the whole row causally, so the losses differ from "
                          "a run without recomputation (as under HF's gradient_checkpointing_enable()); pass "
                          "use_cache=False in your loop too for the same numbers with and without it")
            return args, {**kwargs, "use_cache": False}
        return None

    return hook
