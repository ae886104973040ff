"""Writing and reading kvroute's files without losing data.

Every file kvroute writes (traces, records, reports, figures, JSON summaries) goes through
:func:`atomic_output`: it is written to a temporary file in the target's folder, flushed
and fsynced, then renamed over the target, so a reader sees the old file or the whole new
one and never a truncated one; on any error (or an interrupt) the temporary file is
removed and the target is unchanged. Only a SIGKILL can leave a temporary file behind
(``.NAME.tmp-*``, beside the target); the target itself is still intact.

Parquet is written with page checksums (CRC32) and read with them verified, so a damaged
page is an error naming the file instead of silently changed values.

:data:`written` lists the outputs completed by this process, so that an interrupted command
can say what it kept. O(file size); the functions are thread-safe (each call uses its own
temporary file); ``written`` is appended under the GIL.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from kvroute import args
from kvroute.errors import CorruptFileError, InvalidArgumentError, OutputExistsError

written: list[Path] = []
"""Outputs this process completed, in order (for "what was kept" after an interrupt)."""


def check_output(path: str | Path, *, force: bool = False) -> Path:
    """``path`` as a Path; :class:`OutputExistsError` if it exists and ``force`` is False."""
    out = args.path(path, "path")
    if out.is_dir():
        raise InvalidArgumentError(f"{out} is a folder, not a file")
    if not force and out.exists():
        raise OutputExistsError(
            f"{out} exists; pass --force (force=True in Python) to overwrite it"
        )
    return out


@contextlib.contextmanager
def atomic_output(path: str | Path, *, force: bool = True) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces ``path`` atomically.

    ``force=False`` refuses an existing ``path`` before anything is written."""
    out = check_output(path, force=force)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.tmp-", dir=out.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with tmp.open("rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, out)
        written.append(out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(out.parent)


def write_text(path: str | Path, text: str, *, force: bool = True) -> Path:
    """Write ``text`` (UTF-8) atomically."""
    with atomic_output(path, force=force) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_parquet(table: pa.Table, path: str | Path, *, force: bool = True) -> Path:
    """Write ``table`` as zstd Parquet with page checksums, atomically."""
    with atomic_output(path, force=force) as tmp:
        pq.write_table(table, tmp, compression="zstd", write_page_checksum=True)
    return Path(path)


def save_figure(fig: Any, path: str | Path, *, dpi: int, force: bool = True) -> Path:
    """Save a matplotlib figure atomically (the format from the target's suffix)."""
    out = Path(path)
    fmt = out.suffix.lstrip(".").lower() or "png"
    known = fig.canvas.get_supported_filetypes()
    if fmt not in known:
        raise InvalidArgumentError(
            f"{out}: a figure cannot be written as {fmt!r}; use one of {', '.join(sorted(known))}"
        )
    with atomic_output(out, force=force) as tmp:
        fig.savefig(tmp, dpi=dpi, format=fmt)
    return out


def read_parquet(path: str | Path, columns: list[str] | None = None) -> pa.Table:
    """Read a Parquet file, verifying page checksums; a damaged or non-Parquet file is a
    :class:`CorruptFileError` naming it."""
    with _parquet_errors(path):
        return pq.read_table(path, columns=columns, page_checksum_verification=True)


def read_parquet_present(path: str | Path, columns: list[str]) -> pa.Table:
    """:func:`read_parquet` of those of ``columns`` the file has (the others are left to
    the caller's checks, which name them)."""
    names = read_parquet_schema(path).names
    return read_parquet(path, columns=[c for c in columns if c in names])


def read_parquet_schema(path: str | Path) -> pa.Schema:
    """The schema of a Parquet file (:class:`CorruptFileError` when it has none)."""
    with _parquet_errors(path):
        return pq.read_schema(path)


@contextlib.contextmanager
def _parquet_errors(path: str | Path) -> Iterator[None]:
    try:
        yield
    except MemoryError:
        raise  # out of memory (pyarrow's is also an ArrowException): not a damaged file
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise CorruptFileError(f"{path}: not a readable Parquet file: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _read_umask() -> int:
    # os.umask can only be read by setting it: done once, at import.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def _fsync_dir(folder: Path) -> None:
    # Makes the rename itself durable; not every platform can open a folder.
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


__all__ = [
    "atomic_output",
    "check_output",
    "read_parquet",
    "read_parquet_schema",
    "save_figure",
    "write_parquet",
    "write_text",
    "written",
]
