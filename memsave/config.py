"""Profiles: what memsave does to a model, as validated dataclasses that map one-to-one onto TOML.

A :class:`Profile` has one section per technique. Each section is a frozen ``kw_only`` dataclass whose fields
are the TOML keys of the section of the same name::

    [zero]
    stage = 3
    prefetch = 1

Profiles load from a preset name (``memsave/profiles/<name>.toml``), from a path to a TOML file, or are built
in code. ``section.key=value`` overrides (the command line's ``--zero.stage=2``) apply on top. Unknown
sections or keys, wrong types and bad values raise :class:`ValueError` naming the key, the value and what is
allowed.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "OffloadConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "Profile",
    "RecomputeConfig",
    "ZeroConfig",
    "list_presets",
    "load_profile",
]

PRESET_DIR = Path(__file__).parent / "profiles"

_RECOMPUTE_POLICY = re.compile(r"^(none|full|selective|every:[1-9][0-9]*|budget:[0-9.]+\s*(B|KiB|MiB|GiB|TiB))$")


def _bad(key: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"profile key '{key}' = {value!r} is not allowed; expected {allowed}")


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
    """``[zero]``: data parallelism and ZeRO sharding (Rajbhandari et al., 2020).

    stage: 0 replicates everything (DDP-style bucketed all-reduce); 1 shards optimizer state; 2 also shards
        gradients; 3 also shards parameters.
    bucket_mb: size of a gradient communication bucket (stage 0) in MiB.
    prefetch: stage 3: how many units ahead are gathered while the current one computes.
    reshard_after_forward: stage 3: free gathered parameters after forward (True) or keep them until the
        backward of that unit (False; more memory, one all-gather fewer per unit).
    host_mmap_threshold_mb: on CPU, pin glibc's mmap threshold (MiB; 0 = leave it) so freed large buffers go
        back to the OS: lower peak RSS for some step time (see memsave/dist/host_memory.py).
    """

    stage: int = 0
    bucket_mb: float = 25.0
    prefetch: int = 1
    reshard_after_forward: bool = True
    host_mmap_threshold_mb: float = 0.0

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
    """``[precision]``: dtypes (Micikevicius et al., 2018).

    compute: dtype of parameters and activations in forward/backward.
    master: dtype of the master weights the optimizer updates.
    reduce: dtype of gradient communication; "compute" means the compute dtype.
    loss_scale: "none", "dynamic", or a fixed positive scale.
    """

    compute: Literal["fp32", "bf16", "fp16"] = "fp32"
    master: Literal["fp32"] = "fp32"
    reduce: Literal["fp32", "bf16", "fp16", "compute"] = "compute"
    loss_scale: str | float = "none"

    _section = "precision"

    def __post_init__(self) -> None:
        self._check_fields()
        ls = self.loss_scale
        if isinstance(ls, str) and ls not in ("none", "dynamic"):
            raise _bad("precision.loss_scale", ls, '"none", "dynamic" or a positive number')
        if not isinstance(ls, str) and not ls > 0:
            raise _bad("precision.loss_scale", ls, '"none", "dynamic" or a positive number')


@dataclass(frozen=True, kw_only=True)
class OffloadConfig(_Checked):
    """``[offload]``: where state lives when it is not on the compute device (ZeRO-Offload, Ren et al., 2021;
    ZeRO-Infinity, Rajbhandari et al., 2021).

    optimizer: "none", "cpu" (pinned host memory, on a CUDA device; on CPU nothing moves) or "disk" (files under
        ``path``): where the optimizer state of ZeRO's shards lives between steps (zero.stage >= 1).
    params: "none", "cpu" or "disk": where stage 3 keeps its parameter shards between uses: "cpu" is pinned host
        memory on a CUDA device (with optimizer = "cpu", fraction = 1; on a CPU device nothing moves), "disk" is
        files under ``path`` on a CPU device (with optimizer = "disk", fraction = 1).
    activations: "none" or "cpu": saved activations moved to host memory between forward and backward.
    fraction: share of the optimizer state that is offloaded, 0..1 (whole chunks; the rest stays in memory: the
        last units' chunks, or with ``overlap`` the first units', which the next forward needs first).
    path: folder for the disk tier (a run-unique subfolder is created in it and removed on close).
    prefetch: chunks of optimizer state read ahead while one is stepped; 0 = synchronous.
    chunk_mb: optimizer state per chunk in MiB; the step holds ``prefetch + 2`` chunks in memory.
    direct: the disk tier reads and writes with O_DIRECT (no page cache) where the file system supports it (else
        buffered, said once); false: always buffered.
    overlap: stage 3: the offloaded chunks are stepped in the background, overlapped with what follows
        ``optimizer.step()`` (zero_grad, the next batch, the next forward); each unit's gather waits for its own
        chunks only.
    """

    optimizer: Literal["none", "cpu", "disk"] = "none"
    params: Literal["none", "cpu", "disk"] = "none"
    activations: Literal["none", "cpu"] = "none"
    fraction: float = 1.0
    path: str = ""
    prefetch: int = 2
    chunk_mb: float = 1.0
    direct: bool = True
    overlap: bool = False

    _section = "offload"

    def __post_init__(self) -> None:
        self._check_fields()
        if not 0.0 <= self.fraction <= 1.0:
            raise _bad("offload.fraction", self.fraction, "a number from 0 to 1")
        if "disk" in (self.optimizer, self.params) and not self.path:
            raise _bad("offload.path", self.path, 'a folder when optimizer or params = "disk"')
        if self.prefetch < 0:
            raise _bad("offload.prefetch", self.prefetch, "a count of chunks >= 0")
        if not self.chunk_mb > 0:
            raise _bad("offload.chunk_mb", self.chunk_mb, "a positive size in MiB")
        if self.overlap and self.optimizer == "none":
            raise _bad("offload.overlap", self.overlap, 'false when optimizer = "none" (no offloaded step to overlap)')


@dataclass(frozen=True, kw_only=True)
class RecomputeConfig(_Checked):
    """``[recompute]``: activation recomputation (Chen et al., 2016).

    policy: "none", "full", "every:K", "selective" or "budget:<size>" (e.g. "budget:2GiB").
    compress: "none", "bf16" or "fp8": fp32 activations kept for backward are stored in that dtype and restored
        for backward (Gist, Jain et al., 2018): about half (bf16) or a quarter (fp8) of their bytes, gradients
        no longer exact. See memsave/recompute/compress.py.
    """

    policy: str = "none"
    compress: Literal["none", "bf16", "fp8"] = "none"

    _section = "recompute"

    def __post_init__(self) -> None:
        self._check_fields()
        if not _RECOMPUTE_POLICY.match(self.policy):
            raise _bad("recompute.policy", self.policy, '"none", "full", "every:K", "selective" or "budget:<size>"')


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig(_Checked):
    """``[optimizer]``: the optimizer that the trainer and ``memsave demo`` build (``memsave.wrap`` takes yours).

    name: "adamw", "adam", "sgd" or "adafactor" (:class:`memsave.optim.Adafactor`, explicit-lr mode, so the
    trainer's schedule applies; with ``scale_parameter`` the step is ``lr * RMS(parameter)``).
    lr, weight_decay, betas, momentum: the usual hyperparameters (betas: Adam's; momentum: SGD's).
    warmup_steps: linear warm-up, then cosine decay to ``min_lr_ratio * lr``.
    scale_parameter, clip_threshold, decay_rate, beta1, momentum_dtype: Adafactor's (see its docstring);
    ``beta1 = 0`` keeps no first moment, ``momentum_dtype = "bf16"`` stores it in 2 bytes per parameter.
    """

    name: Literal["adamw", "adam", "sgd", "adafactor"] = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    momentum: float = 0.9
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    scale_parameter: bool = True
    clip_threshold: float = 1.0
    decay_rate: float = -0.8
    beta1: float = 0.0
    momentum_dtype: Literal["fp32", "bf16"] = "fp32"

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


_SECTIONS: dict[str, type] = {
    "zero": ZeroConfig,
    "precision": PrecisionConfig,
    "offload": OffloadConfig,
    "recompute": RecomputeConfig,
    "optimizer": OptimizerConfig,
}


@dataclass(frozen=True, kw_only=True)
class Profile:
    """Everything memsave does to a model. Load with :func:`load_profile` or :meth:`Profile.load`."""

    name: str = "custom"
    description: str = ""
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)

    def __post_init__(self) -> None:
        if self.offload.params != "none" and self.zero.stage != 3:
            raise ValueError(
                f"profile key 'offload.params' = {self.offload.params!r} needs zero.stage = 3 "
                f"(got {self.zero.stage}): only stage 3 owns sharded parameters it can offload"
            )

    @classmethod
    def load(cls, source: str | Path | Profile, overrides: typing.Sequence[str] = ()) -> Profile:
        return load_profile(source, overrides)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, name: str = "custom") -> Profile:
        """Build from a nested dict shaped like the TOML file; strict about keys and types."""
        kwargs: dict[str, Any] = {"name": data.get("name", name)}
        for key, value in data.items():
            if key in ("name", "description"):
                if not isinstance(value, str):
                    raise _bad(key, value, "a string")
                kwargs[key] = value
            elif key in _SECTIONS:
                if not isinstance(value, dict):
                    raise _bad(key, value, f"a [{key}] table")
                kwargs[key] = _build_section(key, _SECTIONS[key], value)
            else:
                raise ValueError(
                    f"profile has an unknown section '{key}'; allowed: name, description, {', '.join(_SECTIONS)}"
                )
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["optimizer"]["betas"] = list(out["optimizer"]["betas"])
        return out

    def replace(self, **sections: Any) -> Profile:
        return dataclasses.replace(self, **sections)


def _check_type(key: str, value: Any, annotation: Any) -> Any:
    """Check ``value`` against a field annotation; return it converted where lossless (int -> float, list -> tuple)."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        allowed = typing.get_args(annotation)
        if value not in allowed:
            raise _bad(key, value, "one of " + ", ".join(repr(a) for a in allowed))
        return value
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            try:
                return _check_type(key, value, option)
            except ValueError:
                continue
        raise _bad(key, value, " or ".join(getattr(a, "__name__", str(a)) for a in typing.get_args(annotation)))
    if origin is tuple:
        args = typing.get_args(annotation)
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise _bad(key, value, f"a list of {len(args)} values")
        return tuple(_check_type(key, v, a) for v, a in zip(value, args))
    if annotation is bool:
        if not isinstance(value, bool):
            raise _bad(key, value, "true or false")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(key, value, "an integer")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _bad(key, value, "a number")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise _bad(key, value, "a string")
        return value
    raise AssertionError(f"unhandled annotation {annotation!r} for {key}")


def _build_section(section: str, cls: type, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            raise ValueError(f"profile has an unknown key '{section}.{key}'; allowed in [{section}]: {', '.join(names)}")
        kwargs[key] = _check_type(f"{section}.{key}", value, hints[key])
    return cls(**kwargs)


def _parse_value(text: str) -> Any:
    """A command-line value: a TOML literal (3, 2.5, true, "x", [1, 2]) or else a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: typing.Sequence[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` strings (a leading ``--`` is accepted) to a nested profile dict."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for item in overrides:
        spec = item[2:] if item.startswith("--") else item
        path, sep, raw = spec.partition("=")
        section, dot, key = path.partition(".")
        if not sep or not dot or not key:
            raise ValueError(f"override {item!r} is not of the form section.key=value (e.g. zero.stage=2)")
        if section not in _SECTIONS:
            raise ValueError(f"override {item!r} names an unknown section '{section}'; allowed: {', '.join(_SECTIONS)}")
        out.setdefault(section, {})[key] = _parse_value(raw)
    return out


def list_presets() -> list[str]:
    """Names of the preset profiles shipped in ``memsave/profiles``."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def load_profile(source: str | Path | Profile, overrides: typing.Sequence[str] = ()) -> Profile:
    """A profile from a preset name, a TOML path or a :class:`Profile`, with ``section.key=value`` overrides."""
    if isinstance(source, Profile):
        if not overrides:
            return source
        return Profile.from_dict(apply_overrides(source.to_dict(), overrides), name=source.name)
    path = Path(source)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise ValueError(f"profile file {str(path)!r} does not exist")
        name = path.stem
    else:
        if str(source) not in list_presets():
            raise ValueError(
                f"profile {str(source)!r} is neither a preset nor a .toml file; presets: {', '.join(list_presets())}"
            )
        name = str(source)
        path = PRESET_DIR / f"{name}.toml"
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"profile file {str(path)!r} is not valid TOML: {exc}") from exc
    data.setdefault("name", name)
    return Profile.from_dict(apply_overrides(data, overrides), name=name)
