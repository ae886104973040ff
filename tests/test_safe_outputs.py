"""No lost data: atomic outputs under SIGKILL, SIGTERM and SIGINT, refusal to overwrite,
and Parquet page checksums verified on read (docs/trace-format.md, "Guarantees")."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import kvroute
from kvroute.cli import main
from kvroute.files import atomic_output

SYNTH_REQUESTS = "5000"

#: ``kvroute ARGS`` (a ``trace synth``) whose write stops part-way and waits, up to a
#: minute, for the test's signal, so that the signal comes at a known point of the write
#: however slow the machine: ``POINT`` is the fraction of the file's bytes in the temporary
#: file at the pause, or ``renamed`` (the whole file in place, the command not done yet).
#: ``MARKER`` is created at the pause. Run as ``python -c PAUSED MARKER POINT ARGS...``.
PAUSED = """
import signal, sys, time
from pathlib import Path

# As an interactive shell would start it, whatever this test's parent ignores (a shell runs
# a background job with SIGINT ignored, and Python then installs no handler of its own).
signal.signal(signal.SIGINT, signal.default_int_handler)

import kvroute.files
import kvroute.synth

marker, point = Path(sys.argv[1]), sys.argv[2]


def pause():
    marker.touch()
    time.sleep(60)


if point == "renamed":
    fsync_dir = kvroute.files._fsync_dir

    def paused_fsync_dir(folder):
        pause()
        fsync_dir(folder)

    kvroute.files._fsync_dir = paused_fsync_dir
else:
    write_trace = kvroute.synth.write_trace

    def paused_write_trace(plan, paths, *rest):
        write_trace(plan, paths, *rest)
        data = Path(paths[0]).read_bytes()
        cut = int(len(data) * float(point))
        with open(paths[0], "r+b") as f:
            f.truncate(cut)  # as if only that much had been written so far
            pause()
            f.seek(cut)
            f.write(data[cut:])

    kvroute.synth.write_trace = paused_write_trace

from kvroute.cli import main

main(sys.argv[3:], prog_name="kvroute")
"""


@contextlib.contextmanager
def _synth(out: Path, point: str) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """``kvroute trace synth`` writing ``out``, paused at ``point``; the pause's marker. The
    process is killed and reaped on the way out, whatever the test did."""
    marker = out.parent / f"paused-{point}"
    cmd = ["trace", "synth", "--requests", SYNTH_REQUESTS, "--force", "-o", str(out)]
    with subprocess.Popen(
        [sys.executable, "-c", PAUSED, str(marker), point, *cmd],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        try:
            yield proc, marker
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def _temps(folder: Path) -> list[Path]:
    return sorted(folder.glob(".*.tmp-*"))


def _wait_for_pause(proc: subprocess.Popen[bytes], marker: Path, limit_s: float = 120) -> None:
    """Wait until the command has paused in the middle of its write."""
    deadline = time.monotonic() + limit_s
    while not marker.exists():
        if proc.poll() is not None:
            raise AssertionError(f"finished without pausing: {proc.communicate()[1]!r}")
        if time.monotonic() > deadline:
            raise AssertionError("the command never paused")
        time.sleep(0.01)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
@pytest.mark.parametrize("point", ["0.1", "0.5", "0.9", "1.0", "renamed"])
def test_killed_while_writing_keeps_the_old_file(
    tmp_path: Path, sig: signal.Signals, point: str
) -> None:
    """A signal while the new file is being written (a part of it, or all of it but not yet
    renamed) leaves the old file; after the rename, the whole new one."""
    target = tmp_path / "trace.parquet"
    old = kvroute.read_trace(_bundled())
    kvroute.write_trace(old, target)
    before = target.read_bytes()
    with _synth(target, point) as (proc, marker):
        _wait_for_pause(proc, marker)
        assert _temps(tmp_path) or point == "renamed", "no temporary file while writing"
        proc.send_signal(sig)
        stderr = proc.communicate(timeout=60)[1].decode()
        rc = proc.returncode
    if point == "renamed":
        assert kvroute.read_trace(target).num_rows == int(SYNTH_REQUESTS)
        if sig == signal.SIGTERM:
            assert rc == 143, stderr
            assert f"kept 1 complete output(s): {target}" in stderr
        else:
            assert rc == -signal.SIGKILL
        assert not _temps(tmp_path)
        return
    assert target.read_bytes() == before
    assert kvroute.read_trace(target).num_rows == old.num_rows
    if sig == signal.SIGTERM:
        assert rc == 143, stderr
        assert "interrupted (SIGTERM): no output was written" in stderr
        assert "Traceback" not in stderr
        assert not _temps(tmp_path), "a temporary file was left behind"
    else:
        assert rc == -signal.SIGKILL


def test_sigint_says_nothing_was_written(tmp_path: Path) -> None:
    target = tmp_path / "trace.parquet"
    with _synth(target, "0.3") as (proc, marker):
        _wait_for_pause(proc, marker)
        proc.send_signal(signal.SIGINT)
        stderr = proc.communicate(timeout=60)[1].decode()
    assert proc.returncode == 130, stderr
    assert "interrupted (SIGINT): no output was written" in stderr
    assert "Aborted" not in stderr and "Traceback" not in stderr
    assert not target.exists() and not _temps(tmp_path)


def test_atomic_output_error_leaves_target_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "x.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_output(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("disk full")
    assert target.read_text() == "old" and not _temps(tmp_path)
    with atomic_output(target) as tmp:
        tmp.write_text("new")
    assert target.read_text() == "new" and not _temps(tmp_path)
    assert oct(target.stat().st_mode & 0o777) != oct(0o600)  # umask-default, not mkstemp's


def _bundled() -> Path:
    return Path(__file__).parent.parent / "traces" / "mooncake_conversation_head1000.jsonl"


@pytest.mark.parametrize(
    "command",
    [
        ["trace", "convert", "{src}", "-o", "{out}"],
        ["trace", "cap", "{src}", "-o", "{out}"],
        ["trace", "sample", "{src}", "-o", "{out}"],
        ["trace", "annotate-ttp", "{src}", "-o", "{out}"],
        ["trace", "synth", "--profile", "w600", "-o", "{out}"],
        ["trace", "stats", "{src}", "--plot", "{out}.png"],
        ["ceilings", "{src}", "-o", "{out}"],
    ],
)
def test_existing_output_is_refused_without_force(tmp_path: Path, command: list[str]) -> None:
    out = tmp_path / ("notes.txt.png" if "--plot" in command else "notes.txt")
    out.write_text("precious")
    args = [a.format(src=_bundled(), out=tmp_path / "notes.txt") for a in command]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2, res.output
    assert f"{out} exists" in res.output and "--force" in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    assert out.read_text() == "precious"
    res = CliRunner().invoke(main, [*args, "--force"])
    assert res.exit_code == 0, res.output
    assert out.read_bytes() != b"precious"


def test_existing_output_folder_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "t.parquet"
    kvroute.write_trace(kvroute.read_trace(_bundled()), src)
    out = tmp_path / "runs"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    args = ["simulate", str(src), "--mode", "tracets", "--out", str(out)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and "not empty" in res.output, res.output
    res = CliRunner().invoke(main, [*args, "--force"])
    assert res.exit_code == 0, res.output
    assert (out / "summary.json").exists() and (out / "keep.txt").exists()


def _damage_a_page(path: Path) -> None:
    """64 bytes of 0xFF in the middle of the hash_ids column chunk's data."""
    meta = pq.ParquetFile(path).metadata
    rg = meta.row_group(0)
    col = next(
        rg.column(i)
        for i in range(rg.num_columns)
        if rg.column(i).path_in_schema.startswith("hash_ids")
    )
    first = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
    start = first + col.total_compressed_size // 2
    with path.open("r+b") as f:
        f.seek(start)
        f.write(b"\xff" * 64)


def test_damaged_page_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    table = kvroute.read_trace(_bundled())
    # Uncompressed, so that the damage decodes to other values instead of a zstd error:
    # only the checksum can tell.
    pq.write_table(table, path, compression="none", use_dictionary=False, write_page_checksum=True)
    _damage_a_page(path)
    unchecked = pq.read_table(path)
    assert unchecked.column("hash_ids") != table.column("hash_ids"), "the damage went unseen"
    with pytest.raises(kvroute.CorruptFileError, match=r"t\.parquet.*(CRC|checksum)"):
        kvroute.read_trace(path)
    for args in (
        ["trace", "convert", str(path), "-o", str(tmp_path / "o.parquet")],
        ["trace", "cap", str(path), "-o", str(tmp_path / "c.parquet")],
        ["trace", "sample", str(path), "-o", str(tmp_path / "s.parquet")],
        ["trace", "annotate-ttp", str(path), "-o", str(tmp_path / "a.parquet")],
        ["trace", "stats", str(path)],
        ["ceilings", str(path)],
        ["simulate", str(path)],
    ):
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 2 and str(path) in res.output, (args, res.output)
        assert "Traceback" not in res.output


def test_written_traces_carry_checksums(tmp_path: Path) -> None:
    path = kvroute.write_trace(kvroute.read_trace(_bundled()), tmp_path / "t.parquet")
    _damage_a_page(path)
    with pytest.raises(kvroute.CorruptFileError, match=r"t\.parquet"):
        kvroute.read_trace(path)
