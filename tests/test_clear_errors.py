"""Clear errors for bad input: kvroute's exception classes naming the argument, or the file,
row and field; CLI errors in one line (exit 2 for bad input), never a traceback."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import kvroute
from kvroute.cli import main

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "traces" / "mooncake_conversation_head1000.jsonl"


@pytest.mark.parametrize(
    ("call", "error", "names"),
    [
        (lambda: kvroute.Router(2**31), kvroute.InvalidArgumentError, "num_instances"),
        (lambda: kvroute.Router(1.5), kvroute.KvrouteTypeError, "num_instances"),
        (lambda: kvroute.Router("4"), kvroute.KvrouteTypeError, "num_instances"),
        (lambda: kvroute.Router(None), kvroute.KvrouteTypeError, "num_instances"),
        (lambda: kvroute.Router(2**64), kvroute.InvalidArgumentError, "num_instances"),
        (lambda: kvroute.Router(4, block_size=1.5), kvroute.KvrouteTypeError, "block_size"),
        (lambda: kvroute.Router(4, seed=2**64), kvroute.InvalidArgumentError, "seed"),
        (lambda: kvroute.Router(4, policy=3), kvroute.KvrouteTypeError, "policy"),
        (
            lambda: kvroute.Router(4, cache_capacity_blocks=2**62),
            kvroute.InvalidArgumentError,
            "cache_capacity_blocks",
        ),
        (
            lambda: kvroute.Router(4, temperature=math.nan),
            kvroute.InvalidArgumentError,
            "temperature",
        ),
        (lambda: kvroute.block_hashes([1, 2, 3], 1.5), kvroute.KvrouteTypeError, "block_size"),
        (
            lambda: kvroute.block_hashes([1, 2, 3], 2**70),
            kvroute.InvalidArgumentError,
            "block_size",
        ),
        (lambda: kvroute.EngineModel(preset=7), kvroute.KvrouteTypeError, "preset"),
    ],
)
def test_bad_arguments_raise_kvroute_errors_naming_them(call: Any, error: type, names: str) -> None:
    with pytest.raises(error, match=names):
        call()


def test_a_huge_router_cannot_abort_the_process() -> None:
    r = kvroute.Router(1)
    with pytest.raises(kvroute.InvalidArgumentError, match="capacity"):
        r.set_cache_capacity(0, 2**50)
    # A large but allowed capacity reserves a bounded table, not 2**40 entries.
    events = kvroute.Router(2, cache_view="events")
    events.set_cache_capacity(0, 2**40)
    assert events.kv_memory_bytes < 2**30


def test_a_tiny_sample_interval_is_refused_not_a_hang() -> None:
    from kvroute.trace_ops import annotate_ttp

    trace = annotate_ttp(kvroute.read_trace(BUNDLED).slice(0, 40))
    with pytest.raises(kvroute.InvalidArgumentError, match="sample_interval"):
        kvroute.simulate(trace, instances=2, mode="tracets", sample_interval=1e-300)


def test_router_max_instances() -> None:
    r = kvroute.Router(65536)
    with pytest.raises(kvroute.InvalidArgumentError, match="at most 65536"):
        r.add_instance()


def test_top_level_api() -> None:
    for name in (
        "read_trace",
        "read_trace_with_report",
        "write_trace",
        "simulate",
        "sweep",
        "sustainable_rate",
        "synthesize",
        "make_report",
        "write_report",
    ):
        assert callable(getattr(kvroute, name)), name
        assert name in kvroute.__all__
    from kvroute.trace import read_trace

    assert kvroute.read_trace is read_trace
    with pytest.raises(AttributeError):
        _ = kvroute.no_such_thing  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('"hash_ids": [1, 9223372036854775808]', "hash_ids"),
        ('"hash_ids": [1], "timestamp": 1e400', "timestamp"),
    ],
)
def test_jsonl_errors_name_the_field(tmp_path: Path, line: str, field: str) -> None:
    good = '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}'
    bad = '{"input_length": 1, "output_length": 1, "timestamp": 1, ' + line + "}"
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([good, good, good, bad]) + "\n")
    with pytest.raises(kvroute.InvalidArgumentError, match=rf"t\.jsonl:4: field {field}"):
        kvroute.read_trace(path)


def _canonical(**replace: list[Any]) -> pa.Table:
    cols: dict[str, Any] = {
        "timestamp": [0.0, 1.0, 2.0],
        "session_id": [1, 1, 2],
        "turn": [0, 1, 0],
        "input_length": [10, 20, 30],
        "output_length": [1, 1, 1],
        "hash_ids": [[1], [1, 2], [3]],
    }
    cols.update(replace)
    return pa.table(cols)


BAD_VALUES = [
    ({"timestamp": [0.0, math.nan, 2.0]}, "row 1: field timestamp: not a finite number"),
    ({"timestamp": [0.0, 1.0, math.inf]}, "row 2: field timestamp: not a finite number"),
    ({"input_length": [10, -1, 30]}, "row 1: field input_length: negative"),
    ({"output_length": [-5, 1, 1]}, "row 0: field output_length: negative"),
    ({"turn": [0, -1, 0]}, "row 1: field turn: negative"),
    ({"session_id": [1, None, 2]}, "row 1: field session_id: null"),
    ({"hash_ids": [[1], [1, None], [3]]}, "row 1: field hash_ids: a null key"),
]


@pytest.mark.parametrize(("replace", "message"), BAD_VALUES)
def test_parquet_values_are_validated_on_every_read(
    tmp_path: Path, replace: dict[str, list[Any]], message: str
) -> None:
    path = tmp_path / "bad.parquet"
    pq.write_table(_canonical(**replace), path)
    with pytest.raises(kvroute.InvalidArgumentError, match=rf"bad\.parquet: {message}"):
        kvroute.read_trace(path)
    for args in (
        ["trace", "convert", str(path), "-o", str(tmp_path / "o.parquet")],
        ["trace", "cap", str(path), "-o", str(tmp_path / "c.parquet")],
        ["trace", "stats", str(path)],
        ["simulate", str(path), "--mode", "tracets"],
    ):
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 2, (args, res.output)
        assert message in res.output and "Traceback" not in res.output, (args, res.output)
        assert res.output.count("\n") <= 2, res.output  # the load summary line at most


def test_ceilings_refuse_infinite_timestamps(tmp_path: Path) -> None:
    path = tmp_path / "inf.parquet"
    pq.write_table(_canonical(timestamp=[0.0, math.inf, 1.0]), path)
    with pytest.raises(kvroute.InvalidArgumentError, match=r"inf\.parquet: row 1: field timestamp"):
        kvroute.ceilings(path)
    res = CliRunner().invoke(main, ["ceilings", str(path)])
    assert res.exit_code == 2 and "row 1: field timestamp" in res.output


def test_cli_errors_are_one_line_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    path = tmp_path / "nulls.parquet"
    pq.write_table(_canonical(session_id=[1, None, 2]), path)
    res = CliRunner().invoke(main, ["simulate", str(path)])
    assert res.exit_code == 2 and res.output.startswith("Error: ") and "Traceback" not in res.output
    res = CliRunner().invoke(main, ["--debug", "simulate", str(path)])
    assert isinstance(res.exception, kvroute.InvalidArgumentError)


def test_an_internal_error_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    cli_trace = sys.modules["kvroute.cli.trace"]

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("unexpected")

    monkeypatch.setattr(cli_trace, "trace_stats", boom)
    res = CliRunner().invoke(main, ["trace", "stats", str(BUNDLED)])
    assert res.exit_code == 1
    assert "internal error: RuntimeError: unexpected" in res.output and "--debug" in res.output


def test_figure_with_unknown_format_is_bad_input(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        main, ["trace", "stats", str(BUNDLED), "--plot", str(tmp_path / "a.xyz")]
    )
    assert res.exit_code == 2 and "cannot be written as 'xyz'" in res.output


def test_a_simulation_of_nothing_is_an_error(tmp_path: Path) -> None:
    """Requests no engine can hold are not simulated: said on stderr, and an error when no
    request of a run is left (its table would be only dashes)."""
    lines = BUNDLED.read_text().splitlines()[:3]
    huge = lines[0].replace('"output_length": 500', '"output_length": 1000000000')
    (tmp_path / "one.jsonl").write_text(huge + "\n")
    res = CliRunner().invoke(main, ["simulate", str(tmp_path / "one.jsonl"), "--mode", "tracets"])
    assert res.exit_code == 2 and "1 of 1 request(s) not simulated" in res.output, res.output
    assert "exceeds the engine's KV capacity" in res.output
    (tmp_path / "some.jsonl").write_text("\n".join([huge, *lines[1:]]) + "\n")
    res = CliRunner().invoke(main, ["simulate", str(tmp_path / "some.jsonl"), "--mode", "tracets"])
    assert res.exit_code == 0 and "1 of 3 request(s) not simulated" in res.output, res.output


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_float_options_refuse_what_is_not_a_finite_number_in_range(value: str) -> None:
    res = CliRunner().invoke(main, ["simulate", str(BUNDLED), "--slo-ttft-p90", value])
    assert res.exit_code == 2 and "--slo-ttft-p90" in res.output, res.output


def test_unbounded_numbers_say_finite_without_a_bound() -> None:
    with pytest.raises(kvroute.InvalidArgumentError) as got:
        kvroute.Router(2, overload_factor=math.inf)
    assert str(got.value).startswith("overload_factor must be a finite number, got inf")
    with pytest.raises(kvroute.InvalidArgumentError, match=r"finite number, got nan$"):
        kvroute.args.number(math.nan, "x")
