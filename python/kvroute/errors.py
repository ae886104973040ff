"""Exceptions raised by kvroute.

Every error is a :class:`KvrouteError` and also an instance of the builtin a caller would
expect (``ValueError`` for a bad value, ``TypeError`` for a bad type, ...), so both
``except kvroute.KvrouteError`` and ``except ValueError`` work.
"""

from __future__ import annotations


class KvrouteError(Exception):
    """Base class of every kvroute error."""


class InvalidArgumentError(KvrouteError, ValueError):
    """An argument outside its domain (negative length, non-positive block size, ...)."""


class UnknownPolicyError(InvalidArgumentError):
    """A policy name that ``kvroute.policies()`` does not list."""


class UnknownInstanceError(InvalidArgumentError, IndexError):
    """An instance index the router does not have."""


class DuplicateRequestError(InvalidArgumentError):
    """``route`` called for a request id that is still in flight."""


class CorruptFileError(InvalidArgumentError):
    """A file that cannot be read as what it claims to be (truncated, damaged, checksum
    mismatch); the message names the file."""


class OutputExistsError(KvrouteError, FileExistsError):
    """An output file that already exists, written only with ``force=True`` (``--force``)."""


class KvrouteTypeError(KvrouteError, TypeError):
    """An argument of the wrong type (e.g. ``hash_ids`` of floats)."""


class NoInstanceAvailableError(KvrouteError, RuntimeError):
    """Every instance is marked down or none was added."""


class MissingExtraError(KvrouteError, ImportError):
    """An optional dependency that is not installed; the message names the extra that
    brings it (e.g. ``pip install 'kvroute[ray]'``)."""


class DebugBuildWarning(RuntimeWarning):
    """The native extension is a debug build: fine for tests, wrong for measurements."""


__all__ = [
    "CorruptFileError",
    "DebugBuildWarning",
    "DuplicateRequestError",
    "InvalidArgumentError",
    "KvrouteError",
    "KvrouteTypeError",
    "MissingExtraError",
    "NoInstanceAvailableError",
    "OutputExistsError",
    "UnknownInstanceError",
    "UnknownPolicyError",
]
