"""Checks of the Python entry points' arguments, each raising kvroute's errors naming the
argument: :class:`~kvroute.errors.KvrouteTypeError` for a wrong type,
:class:`~kvroute.errors.InvalidArgumentError` for a value outside its domain. numpy scalars
count as the matching Python type; bools are not ints. O(1) (O(n) for sequences); stateless.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvroute.errors import InvalidArgumentError, KvrouteTypeError

MAX_SIZE = 1 << 40
"""The largest count or size argument (tokens, blocks, requests, instances)."""


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r:.40}"


def is_int(value: Any) -> bool:
    """An int or a numpy integer, not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def integer(value: Any, name: str, lo: int = 0, hi: int = MAX_SIZE) -> int:
    """An int in ``[lo, hi]``."""
    if not is_int(value):
        raise KvrouteTypeError(f"{name} must be an int, got {_show(value)}")
    if not lo <= int(value) <= hi:
        raise InvalidArgumentError(f"{name} must be an int in [{lo}, {hi}], got {value}")
    return int(value)


def number(value: Any, name: str, lo: float = -math.inf, *, above: bool = False) -> float:
    """A finite int or float ``>= lo`` (``> lo`` with ``above``)."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.number):
        raise KvrouteTypeError(f"{name} must be a number, got {_show(value)}")
    try:
        v = float(value)
    except OverflowError:
        v = math.inf
    if not math.isfinite(v) or v < lo or (above and v == lo):
        bound = "" if lo == -math.inf else f" > {lo:g}" if above else f" >= {lo:g}"
        raise InvalidArgumentError(f"{name} must be a finite number{bound}, got {value}")
    return v


def flag(value: Any, name: str) -> bool:
    """A bool (or a numpy bool)."""
    if not isinstance(value, bool | np.bool_):
        raise KvrouteTypeError(f"{name} must be a bool, got {_show(value)}")
    return bool(value)


def text(value: Any, name: str, choices: Iterable[str] | None = None) -> str:
    """A str, one of ``choices`` when given."""
    if not isinstance(value, str):
        raise KvrouteTypeError(f"{name} must be a str, got {_show(value)}")
    if choices is not None and value not in (known := list(choices)):
        raise InvalidArgumentError(f"{name} must be one of {', '.join(known)}, got {value!r}")
    return value


def names(value: Any, name: str) -> list[str]:
    """A str or a sequence of str."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, Iterable) or isinstance(value, bytes | Mapping):
        raise KvrouteTypeError(f"{name} must be a str or a sequence of str, got {_show(value)}")
    return [text(v, f"{name}[{i}]") for i, v in enumerate(value)]


def path(value: Any, name: str) -> Path:
    """A non-empty str or path-like naming a file, as a Path."""
    if isinstance(value, bytes) or not isinstance(value, str | os.PathLike):
        raise KvrouteTypeError(f"{name} must be a path (a str or a Path), got {_show(value)}")
    text_ = os.fspath(value)
    if not isinstance(text_, str) or text_ == "" or "\0" in text_:
        raise InvalidArgumentError(
            f"{name} must be a non-empty path without NUL, got {value!r:.40}"
        )
    return Path(text_)


def sequence(value: Any, name: str) -> Sequence[Any]:
    """A list or tuple (not a str, bytes or mapping)."""
    if not isinstance(value, list | tuple | range):
        raise KvrouteTypeError(f"{name} must be a list or tuple, got {_show(value)}")
    return value


def mapping(value: Any, name: str) -> Mapping[str, Any]:
    """A mapping with str keys (None: empty)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise KvrouteTypeError(f"{name} must be a mapping, got {_show(value)}")
    for k in value:
        text(k, f"a key of {name}")
    return value


__all__ = [
    "MAX_SIZE",
    "flag",
    "integer",
    "is_int",
    "mapping",
    "names",
    "number",
    "path",
    "sequence",
    "text",
]
