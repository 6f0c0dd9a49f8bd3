"""Checking a profile value against its field's annotation (memsave/config_sections.py): the one error form
of a bad key, ``ValueError`` naming the key, the value and what is allowed."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

__all__: list[str] = []


def _bad(key: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"profile key '{key}' = {value!r} is not allowed; expected {allowed}")


def _allowed(annotation: Any) -> str:
    """What one option of a union allows, in words (``a number``, ``'auto'``)."""
    if typing.get_origin(annotation) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(annotation))
    return {float: "a number", int: "an integer", bool: "true or false", str: "a string"}.get(
        annotation, getattr(annotation, "__name__", str(annotation)))


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
        raise _bad(key, value, " or ".join(_allowed(a) for a in typing.get_args(annotation)))
    if origin is tuple:
        args = typing.get_args(annotation)
        if args[-1] is Ellipsis and isinstance(value, list | tuple):  # a list of any length
            return tuple(_check_type(key, v, args[0]) for v in value)
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise _bad(key, value, "a list" if args[-1] is Ellipsis else f"a list of {len(args)} values")
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

