"""docs/profiles.md, generated from the profile dataclasses (memsave/config.py, config_sections.py) so the
reference cannot drift.

    python -m memsave.profile_docs > docs/profiles.md        # regenerate after changing a profile key
    python -m memsave.profile_docs --check docs/profiles.md  # exit 1 when the file is stale

Every key of :class:`memsave.Profile` is listed with its TOML type, default, allowed values and what it does (the
field's ``help`` and ``allowed`` metadata), then every preset in ``profiles/`` with the keys it sets, then
DeepSpeed's and FSDP's options mapped onto memsave keys. A key without ``help``, or a mapping row naming a key or
value that does not exist, raises ``ValueError`` here, and tests/test_docs.py compares the committed file with
:func:`render`: a new key without documentation fails CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import tomllib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from memsave.config import Profile, list_presets, load_profile

__all__ = ["ALWAYS", "DEEPSPEED", "FSDP", "MappingRow", "main", "render", "sections"]

COMMAND = "python -m memsave.profile_docs > docs/profiles.md"


@dataclasses.dataclass(frozen=True)
class MappingRow:
    """One option of another framework and what does its job under memsave.

    option: the option as that framework spells it.
    keys: ``"section.key"`` or ``"section.key=<TOML value>"`` items naming the memsave keys.
    instead: where ``keys`` is empty, what takes the option's place (a call, "always on"); empty: no equivalent.
    note: how the two differ.
    """

    option: str
    keys: tuple[str, ...] = ()
    instead: str = ""
    note: str = ""


ALWAYS = "always on (no key)"

# DeepSpeed's JSON config (https://www.deepspeed.ai/docs/config-json/), by the options users carry over.
DEEPSPEED: tuple[MappingRow, ...] = (
    MappingRow("zero_optimization.stage", ("zero.stage",), note="0, 1, 2, 3: the same stages."),
    MappingRow("zero_optimization.overlap_comm", instead=ALWAYS,
               note="Each unit's reduce-scatter is launched as soon as its gradients are complete, and stage 3 "
               "gathers `[zero] prefetch` units ahead."),
    MappingRow("zero_optimization.contiguous_gradients", instead=ALWAYS,
               note="Each unit reduces through one flat staging buffer."),
    MappingRow("zero_optimization.reduce_bucket_size", ("zero.bucket_mb",),
               note="At stage 0, in MiB (DeepSpeed counts elements). At stages 1-3 the bucket is the unit: choose "
               "the units with `memsave.wrap(units=...)`."),
    MappingRow("zero_optimization.allgather_bucket_size",
               note="Stages 1-2 all-gather the stepped rows unit by unit."),
    MappingRow("zero_optimization.stage3_prefetch_bucket_size", ("zero.prefetch",),
               note="Counted in units ahead, not in elements."),
    MappingRow("zero_optimization.stage3_max_live_parameters, stage3_max_reuse_distance",
               note="What is gathered at once is the current unit, `[zero] prefetch` units ahead and the root unit."),
    MappingRow("zero_optimization.stage3_param_persistence_threshold",
               note="The root unit (embeddings, final norm, head: what no block owns) stays gathered from the start "
               "of forward to the end of backward; choose the units with `memsave.wrap(units=...)`."),
    MappingRow("zero_optimization.stage3_gather_16bit_weights_on_model_save",
               instead="`model.state_dict()` (collective at stage 3)",
               note="Always the full weights, in the compute dtype; the fp32 masters are in "
               "`optimizer.state_dict()[\"master_params\"]`."),
    MappingRow("zero_optimization.offload_optimizer.device", ("offload.optimizer",),
               note='"none", "cpu" (pinned host memory, CUDA devices); "nvme" is "disk" (CPU devices for now).'),
    MappingRow("zero_optimization.offload_optimizer.nvme_path, offload_param.nvme_path", ("offload.path",),
               note="One folder for both; a run-unique subfolder is made in it and removed on close."),
    MappingRow("zero_optimization.offload_optimizer.ratio", ("offload.fraction",),
               note="The share of the optimizer state offloaded, in whole chunks."),
    MappingRow("zero_optimization.offload_optimizer.buffer_count", ("offload.prefetch",),
               note="Memory holds `prefetch + 2` chunks of `[offload] chunk_mb`."),
    MappingRow("zero_optimization.offload_optimizer.pin_memory", instead=ALWAYS,
               note="The host tier is pinned memory on CUDA."),
    MappingRow("zero_optimization.offload_optimizer.fast_init"),
    MappingRow("zero_optimization.sub_group_size", ("offload.chunk_mb",),
               note="The offloaded step's unit of work, in MiB of optimizer state (DeepSpeed counts parameters)."),
    MappingRow("zero_optimization.offload_param.device", ("zero.stage=3", "offload.params"),
               note='"cpu" on CUDA, with `optimizer = "cpu"`; "nvme" is "disk", on CPU devices, with '
               '`optimizer = "disk"`; both with `fraction = 1`.'),
    MappingRow("aio.block_size, queue_depth, thread_count, single_submit, overlap_events",
               ("offload.direct", "offload.chunk_mb", "offload.overlap"),
               note="No queue settings: `direct` chooses O_DIRECT, `chunk_mb` the I/O size, `overlap` (stage 3) "
               "steps in the background behind the next forward."),
    MappingRow("bf16.enabled", ("precision.compute=\"bf16\"",),
               note="bf16 parameters and gradients, fp32 masters sharded with the optimizer state."),
    MappingRow("fp16.enabled", ("precision.compute=\"fp16\"", "precision.loss_scale=\"dynamic\""),
               note="fp16 parameters and gradients, fp32 masters, dynamic loss scaling (preset `zero2-fp16`)."),
    MappingRow("fp16.loss_scale", ("precision.loss_scale",),
               note='DeepSpeed\'s 0 (dynamic) is "dynamic"; a positive number is the same fixed scale.'),
    MappingRow("fp16.initial_scale_power",
               note="The dynamic scale starts at 2^16 (DeepSpeed's default power, 16). By hand: "
               "`memsave.precision.LossScaler(init_scale)` with `MixedPrecisionOptimizer`."),
    MappingRow("fp16.loss_scale_window",
               note="The scale doubles after 2000 clean steps (DeepSpeed: 1000); `LossScaler(growth_interval=)` by "
               "hand."),
    MappingRow("fp16.hysteresis",
               note="1: the scale halves at the first overflow (DeepSpeed: 2); `LossScaler(hysteresis=)` by hand."),
    MappingRow("fp16.min_loss_scale", note="1; `LossScaler(min_scale=)` by hand."),
    MappingRow("communication_data_type", ("precision.reduce",),
               note='"fp32" sums and keeps the reduced gradients in fp32; "compute" communicates in bf16/fp16.'),
    MappingRow("gradient_clipping", instead="`optimizer.clip_grad_norm(max_norm)` in the loop",
               note="The global norm over every rank and shard; `memsave.Trainer` takes `TrainConfig(grad_clip=)`."),
    MappingRow("gradient_accumulation_steps", instead="`with model.no_sync():` in the loop",
               note="Around every micro-batch but the last; `memsave.Trainer` takes `TrainConfig(micro_batches=)`."),
    MappingRow("activation checkpointing (deepspeed.checkpointing.checkpoint, HF gradient_checkpointing_enable)",
               ("recompute.policy=\"full\"",),
               note='Per unit; "every:K", "selective" and "budget:<size>" keep more and recompute less.'),
    MappingRow("activation_checkpointing.cpu_checkpointing", ("offload.activations=\"cpu\"",),
               note="Moves the saved activations to pinned host memory (CUDA), with or without recomputation."),
    MappingRow("activation_checkpointing.partition_activations, contiguous_memory_optimization"),
    MappingRow("optimizer.type, optimizer.params",
               ("optimizer.name", "optimizer.lr", "optimizer.betas", "optimizer.weight_decay"),
               note="Only for `memsave demo`, `bench` and `estimate`: `memsave.wrap` takes your optimizer instance."),
    MappingRow("scheduler WarmupCosineLR (warmup_num_steps, cos_min_ratio)",
               ("optimizer.warmup_steps", "optimizer.min_lr_ratio"),
               note="The schedule of `memsave demo` (`memsave.cosine_schedule`); your own loop uses any LR "
               "scheduler."),
)

# torch FSDP (FullyShardedDataParallel), FSDP2 (fully_shard) and DDP, by constructor argument.
FSDP: tuple[MappingRow, ...] = (
    MappingRow("FSDP sharding_strategy=FULL_SHARD; FSDP2 fully_shard(reshard_after_forward=True)",
               ("zero.stage=3", "zero.reshard_after_forward=true")),
    MappingRow("FSDP sharding_strategy=SHARD_GRAD_OP; FSDP2 reshard_after_forward=False",
               ("zero.stage=3", "zero.reshard_after_forward=false"),
               note="Parameters stay gathered from a unit's forward to its backward. `[zero] stage = 2` also keeps "
               "the full parameters between steps."),
    MappingRow("FSDP sharding_strategy=NO_SHARD; torch DDP", ("zero.stage=0",)),
    MappingRow("FSDP HYBRID_SHARD, _HYBRID_SHARD_ZERO2; FSDP2 2-D mesh (replicate, shard)",
               note="ZeRO shards over the whole dp axis."),
    MappingRow("torch DDP bucket_cap_mb", ("zero.bucket_mb",)),
    MappingRow("torch ZeroRedundancyOptimizer", ("zero.stage=1",)),
    MappingRow("FSDP2 MixedPrecisionPolicy(param_dtype=torch.bfloat16)", ("precision.compute=\"bf16\"",),
               note="FSDP2 keeps fp32 shards and casts at each gather; memsave keeps bf16 parameters and the fp32 "
               "masters with the optimizer state (the same 16 bytes per parameter over N at stage 3)."),
    MappingRow("FSDP2 MixedPrecisionPolicy(reduce_dtype=torch.float32)", ("precision.reduce=\"fp32\"",)),
    MappingRow("FSDP2 MixedPrecisionPolicy(output_dtype=...)", note="Outputs are in the compute dtype."),
    MappingRow("FSDP2 MixedPrecisionPolicy(cast_forward_inputs=True)", instead=ALWAYS,
               note="Under bf16/fp16 floating-point inputs are cast, integer ones left alone."),
    MappingRow("FSDP MixedPrecision(buffer_dtype=...)", note="Buffers keep the dtype the model gave them."),
    MappingRow("FSDP2 CPUOffloadPolicy(pin_memory=True); FSDP CPUOffload(offload_params=True)",
               ("zero.stage=3", "offload.optimizer=\"cpu\"", "offload.params=\"cpu\""),
               note="CUDA devices. FSDP2 steps the optimizer on the CPU; memsave streams the state to the device "
               "in chunks and steps it there."),
    MappingRow("FSDP2 OffloadPolicy() (no offload)", ("offload.optimizer=\"none\"",)),
    MappingRow("FSDP forward_prefetch, backward_prefetch=BACKWARD_PRE; FSDP2 set_modules_to_forward_prefetch, "
               "set_modules_to_backward_prefetch", ("zero.prefetch",),
               note="A count of units ahead in both directions, not a list of modules."),
    MappingRow("FSDP limit_all_gathers", instead=ALWAYS,
               note="At most `[zero] prefetch` units are gathered ahead."),
    MappingRow("FSDP auto_wrap_policy; fully_shard applied per block", instead="`memsave.wrap(units=[...])`",
               note="Default: the blocks of the largest `nn.ModuleList`, plus the root unit with the rest."),
    MappingRow("FSDP use_orig_params=True", instead=ALWAYS,
               note="The model keeps its parameters, class (a subclass), `forward` and `state_dict` keys."),
    MappingRow("FSDP sync_module_states=True", instead=ALWAYS,
               note="`memsave.wrap` broadcasts rank 0's parameters and buffers."),
    MappingRow("FSDP state_dict_type=FULL_STATE_DICT", instead="`model.state_dict()`, `optimizer.state_dict()`",
               note="Always full. Every rank calls them: `optimizer.state_dict()` is a collective at stages 1-3, "
               "`model.state_dict()` at stage 3."),
    MappingRow("FSDP2 module.unshard(), module.reshard()", instead="`model.unshard()`, `model.reshard()`",
               note="On the wrapped model, stage 3; collectives."),
    MappingRow("torch checkpoint_wrapper / apply_activation_checkpointing", ("recompute.policy=\"full\"",)),
    MappingRow("torch selective activation checkpointing (create_selective_checkpoint_contexts)",
               ("recompute.policy=\"selective\"",), note="Matmuls and fused attention saved, the rest recomputed."),
)


def sections() -> list[tuple[str, type]]:
    """``(name, dataclass)`` of every ``[section]`` of :class:`Profile`, in the order of its fields."""
    hints = typing.get_type_hints(Profile)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(Profile) if dataclasses.is_dataclass(hints[f.name])]


def _top_level_keys() -> list[dataclasses.Field[Any]]:
    hints = typing.get_type_hints(Profile)
    return [f for f in dataclasses.fields(Profile) if not dataclasses.is_dataclass(hints[f.name])]


def _md(text: str) -> str:
    """reST roles and double backticks as Markdown; outside code spans ``<`` as an entity (``budget:<size>`` is no
    HTML tag); ``|`` escaped for table cells."""
    text = re.sub(r":\w+:`~?([\w.]+)`", lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", text)
    parts = text.replace("``", "`").split("`")
    for i in range(0, len(parts), 2):  # the even parts lie outside code spans
        parts[i] = parts[i].replace("<", "&lt;")
    return "`".join(parts).replace("|", "\\|")


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "string"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is tuple:
        args = typing.get_args(annotation)
        return f"list of {_type_name(args[0])}s" if args[-1] is Ellipsis else f"list of {len(args)} {_type_name(args[0])}s"
    names = {bool: "boolean", int: "integer", float: "number", str: "string"}
    if annotation not in names:
        raise ValueError(f"profile_docs: no TOML type name for the annotation {annotation!r}")
    return names[annotation]


def _allowed(annotation: Any, extra: str) -> str:
    parts = []
    if typing.get_origin(annotation) is Literal:
        parts.append(", ".join(f"`{_toml(a)}`" for a in typing.get_args(annotation)))
    elif annotation is bool:
        parts.append("`true`, `false`")
    if extra:
        parts.append(extra)
    return "; ".join(parts) or f"any {_type_name(annotation)}"


def _help(owner: str, f: dataclasses.Field[Any]) -> tuple[str, str]:
    what = f.metadata.get("help", "")
    if not what:
        raise ValueError(
            f"profile key '{owner}{f.name}' has no help: give the field metadata=_doc(\"what it does\", \"allowed\") "
            f"in memsave/config_sections.py, then run `{COMMAND}`"
        )
    return what, f.metadata.get("allowed", "")


def _key_table(owner: str, cls: type, fields: Sequence[dataclasses.Field[Any]]) -> list[str]:
    hints = typing.get_type_hints(cls)
    lines = ["| key | type | default | allowed | what it does |", "|---|---|---|---|---|"]
    for f in fields:
        what, extra = _help(owner, f)
        default = f"`{_toml(f.default)}`" if f.default is not dataclasses.MISSING else "-"
        lines.append(f"| `{f.name}` | {_type_name(hints[f.name])} | {default} | "
                     f"{_md(_allowed(hints[f.name], extra))} | {_md(what)} |")
    return lines


def _summary(cls: type) -> str:
    """The first paragraph of a section's docstring, on one line."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    return _md(" ".join(doc.split("\n\n")[0].split()))


def _field_of(spec: str) -> tuple[str, str, Any]:
    """``"section.key[=value]"`` -> (section, key, parsed value or ``...``); raises when the key or value does not
    exist, so the mapping tables cannot drift from the dataclasses either."""
    path, sep, raw = spec.partition("=")
    section, _, key = path.partition(".")
    classes = dict(sections())
    if section not in classes or key not in {f.name for f in dataclasses.fields(classes[section])}:
        raise ValueError(f"profile_docs: a mapping row names '{path}', which is no profile key")
    if not sep:
        return section, key, ...
    value = tomllib.loads(f"v = {raw}")["v"]
    annotation = typing.get_type_hints(classes[section])[key]
    if typing.get_origin(annotation) is Literal:
        ok = value in typing.get_args(annotation)
    else:
        expected = {bool: bool, int: int, float: int | float, str: str}.get(annotation, object)
        ok = isinstance(value, expected) and (annotation is bool or not isinstance(value, bool))
    if not ok:
        raise ValueError(f"profile_docs: a mapping row sets '{path}' = {raw}, which that key does not allow")
    return section, key, value


def _mapping_table(rows: Sequence[MappingRow], title: str) -> list[str]:
    lines = [f"| {title} | memsave | notes |", "|---|---|---|"]
    for row in rows:
        keys = []
        for spec in row.keys:
            section, key, value = _field_of(spec)
            keys.append(f"`[{section}] {key}`" if value is ... else f"`[{section}] {key} = {_toml(value)}`")
        target = ", ".join(keys) or _md(row.instead) or "no equivalent"
        lines.append(f"| `{row.option}` | {target} | {_md(row.note)} |")
    return lines


def _preset_rows() -> list[str]:
    lines = ["| preset | what it trades | keys it sets (the rest are the defaults) |", "|---|---|---|"]
    defaults = Profile().to_dict()
    for name in list_presets():
        data = load_profile(name).to_dict()
        changed = [f"`{section}.{key} = {_toml(value)}`"
                   for section, _ in sections() for key, value in data[section].items()
                   if value != defaults[section][key]]
        lines.append(f"| `{name}` | {_md(data['description'])} | {', '.join(changed) or '-'} |")
    return lines


def render() -> str:
    """The whole of docs/profiles.md."""
    out = [
        f"<!-- Generated from memsave/config.py and config_sections.py by `{COMMAND}`; do not edit by hand.",
        "     tests/test_docs.py fails when this file and the code differ. -->",
        "",
        "# Profile reference",
        "",
        "A profile (`memsave.Profile`) says what memsave does to a model. It is a TOML file whose sections mirror "
        "the dataclasses in `memsave/config_sections.py`, a preset name (the files in the repository's top-level "
        "`profiles/` folder, installed as the package `memsave.profiles`), or a "
        "`memsave.Profile` built in code. `section.key=value` overrides apply on top (`--zero.stage=2` on the "
        "command line, `memsave.load_profile(\"zero3\", [\"zero.prefetch=2\"])` in code). Unknown sections or "
        "keys, wrong types and bad values raise `ValueError` naming the key, the value and what is allowed; "
        "combinations that are not built raise `NotImplementedError` at `memsave.wrap`.",
        "",
        "```toml",
        "# my_profile.toml",
        'description = "ZeRO-3 in bf16 with selective recomputation"',
        "",
        "[zero]",
        "stage = 3",
        "prefetch = 1",
        "",
        "[precision]",
        'compute = "bf16"',
        "",
        "[recompute]",
        'policy = "selective"',
        "```",
        "",
        "Contents: [top-level keys](#top-level-keys), "
        + ", ".join(f"[`[{name}]`](#{name})" for name, _ in sections())
        + ", [presets](#presets), [from DeepSpeed and FSDP](#from-deepspeed-and-fsdp).",
        "",
        "## Top-level keys",
        "",
        *_key_table("", Profile, _top_level_keys()),
    ]
    for name, cls in sections():
        out += ["", f"## `[{name}]`", "", _summary(cls), "", *_key_table(f"{name}.", cls, dataclasses.fields(cls))]
    out += [
        "",
        "## Presets",
        "",
        "Load one by name (`memsave.wrap(model, optimizer, \"zero3\")`, `memsave demo --profile zero3`); "
        "`memsave profiles` lists them, and each file in `profiles/` explains in comments what it trades.",
        "",
        *_preset_rows(),
        "",
        "## From DeepSpeed and FSDP",
        "",
        "Where a DeepSpeed config option or an FSDP / FSDP2 argument has a memsave key, and where it has none. "
        "Options not listed have no equivalent.",
        "",
        "### DeepSpeed config",
        "",
        *_mapping_table(DEEPSPEED, "DeepSpeed"),
        "",
        "### torch FSDP, FSDP2 and DDP",
        "",
        *_mapping_table(FSDP, "torch"),
    ]
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memsave.profile_docs", description=__doc__.splitlines()[0])
    parser.add_argument("--check", metavar="PATH", help="exit 1 if PATH differs from the generated text")
    args = parser.parse_args(argv)
    text = render()
    if args.check is None:
        sys.stdout.write(text)
        return 0
    if Path(args.check).read_text() != text:
        print(f"{args.check} is stale; regenerate it with `{COMMAND}`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
