"""Type checks at the public API's entry: a wrong type is one TypeError line naming the argument
and what it must be, never an AttributeError from deep inside (issue "Faults and hostile input")."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

__all__ = ["require", "require_int", "require_paths", "require_strings"]


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


def require(name: str, value: Any, kinds: type | tuple[type, ...], what: str, *, optional: bool = False) -> None:
    """TypeError unless `value` is an instance of `kinds` (bools are not ints), or None if `optional`."""
    if value is None and optional:
        return
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise TypeError(f"{name} must be {what}, got {_show(value)}")


def require_int(name: str, value: Any, *, low: int = 1, high: int | None = None, optional: bool = False) -> None:
    """An int (not a bool) from `low` to `high`: TypeError for another type, ValueError out of range."""
    require(name, value, int, "an integer", optional=optional)
    if value is None:
        return
    if value < low or (high is not None and value > high):
        bound = f"from {low:,} to {high:,}" if high is not None else f"at least {low:,}"
        raise ValueError(f"{name} {value!r} must be {bound}")


def require_strings(name: str, value: Any) -> None:
    """A sequence of strings (not one string: its characters would be taken one by one)."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{name} must be a list of strings, got {_show(value)}")


def require_paths(name: str, value: Any) -> None:
    """A path, or a sequence of paths."""
    if isinstance(value, str | os.PathLike):
        return
    if not isinstance(value, Sequence) or not all(isinstance(v, str | os.PathLike) for v in value):
        raise TypeError(f"{name} must be a path or a list of paths, got {_show(value)}")
