"""Profiles: what memsave does to a model, as validated dataclasses that map one-to-one onto TOML.

A :class:`Profile` has one section per technique. Each section is a frozen ``kw_only`` dataclass whose fields
are the TOML keys of the section of the same name (the sections are in memsave/config_sections.py and are
imported from here)::

    [zero]
    stage = 3
    prefetch = 1

Profiles load from a preset name (``profiles/<name>.toml`` at the top of the repository, installed as the package
``memsave.profiles``), from a path to a TOML file, or are built in code. ``section.key=value`` overrides (the
command line's ``--zero.stage=2``) apply on top. Unknown sections or keys, wrong types and bad values raise
:class:`ValueError` naming the key, the value and what is allowed.

[Note: where the presets are] The presets live in the repository's top-level ``profiles/`` folder, which
pyproject.toml installs as the package ``memsave.profiles`` (``package-dir``). Where memsave runs from a checkout
(the folder above ``memsave/`` holds pyproject.toml and ``profiles/``: ``PYTHONPATH=.`` with nothing installed,
as the GPU machines run it, or an editable install) that folder is read directly. It is looked for first because
``memsave.profiles`` may be answered by another checkout's editable install in the same environment (its import
finder maps ``memsave.profiles`` to its own tree), and a checkout must read its own presets. Anywhere else (a
wheel, ``pip install .``) they are read with ``importlib.resources`` from ``memsave.profiles``.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import tomllib
import typing
from dataclasses import dataclass, field
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from memsave.config_sections import (
    OffloadConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    RecomputeConfig,
    ZeroConfig,
    _bad,
    _check_type,
    _doc,
)

__all__ = [
    "PRESET_DIR",
    "OffloadConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "Profile",
    "RecomputeConfig",
    "ZeroConfig",
    "list_presets",
    "load_profile",
    "preset_dir",
]

PRESET_PACKAGE = "memsave.profiles"


def preset_dir() -> Traversable:
    """The folder of the preset TOML files: the checkout's ``profiles/``, else the installed ``memsave.profiles``
    (see [Note: where the presets are])."""
    root = Path(__file__).resolve().parents[1]
    beside = root / "profiles"
    if (root / "pyproject.toml").is_file() and beside.is_dir():
        return beside
    try:
        return importlib.resources.files(PRESET_PACKAGE)
    except ModuleNotFoundError:  # an install without its presets: list_presets() is empty and says where it looked
        return beside


PRESET_DIR = preset_dir()


_SECTIONS: dict[str, type] = {
    "parallel": ParallelConfig,
    "zero": ZeroConfig,
    "precision": PrecisionConfig,
    "offload": OffloadConfig,
    "recompute": RecomputeConfig,
    "optimizer": OptimizerConfig,
}


@dataclass(frozen=True, kw_only=True)
class Profile:
    """Everything memsave does to a model. Load with :func:`load_profile` or :meth:`Profile.load`."""

    name: str = field(default="custom", metadata=_doc(
        "The profile's name (by default a preset's name or the TOML file's stem)."))
    description: str = field(default="", metadata=_doc("One line on what the profile trades (memsave profiles lists it)."))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
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
    """Names of the preset profiles shipped in ``profiles/`` (the package ``memsave.profiles``)."""
    if not PRESET_DIR.is_dir():
        return []
    return sorted(p.name.removesuffix(".toml") for p in PRESET_DIR.iterdir() if p.name.endswith(".toml"))


def load_profile(source: str | Path | Profile, overrides: typing.Sequence[str] = ()) -> Profile:
    """A profile from a preset name, a TOML path or a :class:`Profile`, with ``section.key=value`` overrides."""
    if isinstance(source, Profile):
        if not overrides:
            return source
        return Profile.from_dict(apply_overrides(source.to_dict(), overrides), name=source.name)
    path = Path(source)
    file: Traversable = path
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise ValueError(f"profile file {str(path)!r} does not exist")
        name = path.stem
    else:
        if str(source) not in list_presets():
            raise ValueError(
                f"profile {str(source)!r} is neither a preset nor a .toml file; presets: "
                f"{', '.join(list_presets()) or f'none found in {PRESET_DIR} (memsave.profiles is not installed)'}"
            )
        name = str(source)
        file = PRESET_DIR / f"{name}.toml"
    try:
        data = tomllib.loads(file.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"profile file {str(file)!r} is not valid TOML: {exc}") from exc
    data.setdefault("name", name)
    return Profile.from_dict(apply_overrides(data, overrides), name=name)
