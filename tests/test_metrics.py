"""Run metrics and the record schema, checked against values computed by hand."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

import kvroute
from kvroute.metrics import overlap_from_intervals, summarize
from kvroute.records import read_records, record_schema, run_info, write_records


def _records(rows: list[tuple]) -> pa.Table:
    """rows of (instance, send, first, finish, input, output, cached)."""
    cols = list(zip(*rows, strict=True))
    n = len(rows)
    schema = record_schema(run={"instances": 3, "policy": "unified", "source": "test"})
    data = {
        "request_id": list(range(n)),
        "session_id": list(range(n)),
        "turn": [0] * n,
        "instance": cols[0],
        "send": cols[1],
        "first_token": cols[2],
        "finish": cols[3],
        "input_length": cols[4],
        "output_length": cols[5],
        "cached_tokens": cols[6],
    }
    return pa.table({f.name: data.get(f.name, [None] * n) for f in schema}, schema=schema)


def test_summary_by_hand(tmp_path: Path) -> None:
    recs = _records(
        [
            # inst, send, first, finish, in, out, cached
            (0, 0.0, 1.0, 11.0, 100, 11, 50),  # decode (1, 11) overlaps request 1's prefill [2, 4)
            (0, 2.0, 4.0, 5.0, 100, 2, 0),  # decode (4, 5): request 0's prefill ended at 1: clean
            (1, 0.0, 0.5, 2.5, 200, 3, 100),  # alone on instance 1: clean
            (1, 3.0, 3.5, 3.5, 100, 1, None),  # one token: no TPOT; cached unknown
        ]
    )
    s = summarize(recs)
    assert s["requests"] == 4 and s["errors"] == 0
    assert s["per_instance_requests"] == [2, 2, 0]
    assert s["req_bal"] == pytest.approx(2 / (4 / 3))
    assert s["apc"] == pytest.approx(150 / 400)  # the unknown one is left out of both sums
    # TPOTs: 1.0 (overlap), 1.0 (clean: (5-4)/1), 1.0 (clean: 2/2).
    assert s["tpot"]["p50"] == pytest.approx(1.0)
    assert s["interference_index"] == pytest.approx(1.0)
    # TTFTs 1, 2 on instance 0 -> p90 1.9; 0.5, 0.5 on instance 1 -> 0.5; none on 2.
    assert s["per_instance_ttft_p90"][:2] == pytest.approx([1.9, 0.5])
    assert s["hotspot_index"] == pytest.approx(1.9 / 1.2)
    assert s["e2e"]["p50"] == pytest.approx((2.5 + 3.0) / 2)
    out = write_records(recs, tmp_path / "r.parquet")
    back = read_records(out)
    assert back.equals(recs) and run_info(back)["policy"] == "unified"


def test_overlap_flags() -> None:
    import numpy as np

    inst = np.array([0, 0, 0, 1])
    send = np.array([0.0, 2.0, 20.0, 2.0])
    first = np.array([1.0, 4.0, 21.0, 4.0])
    finish = np.array([11.0, 5.0, 22.0, 9.0])
    assert overlap_from_intervals(inst, send, first, finish).tolist() == [True, False, False, False]


def test_errors_and_missing_columns() -> None:
    recs = _records([(0, 0.0, 1.0, 2.0, 10, 2, 0), (0, 0.0, None, 3.0, 10, 0, None)])
    recs = recs.set_column(
        recs.schema.get_field_index("error"), "error", pa.array([None, "backend died"])
    )
    s = summarize(recs)
    assert s["requests"] == 2 and s["errors"] == 1 and s["ttft"]["p50"] == 1.0
    with pytest.raises(kvroute.InvalidArgumentError, match="missing record column"):
        summarize(pa.table({"request_id": [1]}))
