"""Fidelity checks of the simulator against the study (``docs/simulator.md``, "Fidelity"):

- :func:`b2_microbench`: the study's B2 interference microbenchmark on two simulated
  engines (driven through :class:`kvroute.EngineModel`, the real-time API): a steady decode
  load on engine 0, large one-token prefill injections on the same engine or the other one.
- :func:`b3_compare`: the study's B3 / exp (d) policy sweeps next to a simulated sweep.
- ``python -m kvroute.sim.fidelity W600.parquet`` prints both as Markdown tables.

The study's numbers are transcribed from its research notes (B2 and B3: window-1
results; both modes: exp (d)). Deterministic; O(requests) per cell.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from kvroute._core import EngineModel

#: B2 (study): variant, prefill tokens -> (TPOT idx, TTFT idx); "different" spans 2k-65k.
STUDY_B2 = {
    ("different", "2k-65k"): ("0.92-1.02", "0.96-1.00"),
    ("same", 2048): (1.16, 2.15),
    ("same", 8192): (1.90, 12.1),
    ("same", 16384): (3.37, 30.8),
    ("same", 32768): (7.89, 94.6),
    ("same", 65536): (2.26, 218.0),
}
#: B3 (study, tracets, full w600): TTFT p50/p90/p99 s, TPOT p50/p90/p99 ms, E2E p50/p90/p99 s,
#: APC, interference index (None: lost), hotspot index.
STUDY_B3: dict[str, tuple[Any, ...]] = {
    "lmetric": ((0.94, 15.67, 53.57), (8.9, 21.2, 176.9), (2.75, 24.82, 79.83), 0.569, 6.53, 2.253),
    "load_only": (
        (1.26, 20.20, 52.84),
        (9.2, 26.9, 320.7),
        (3.59, 33.46, 93.93),
        0.541,
        9.16,
        1.294,
    ),
    "sticky": (
        (0.54, 18.02, 74.09),
        (8.9, 36.4, 357.2),
        (2.08, 34.63, 134.36),
        0.772,
        13.65,
        2.728,
    ),
    "unified": ((0.50, 7.35, 42.34), (8.1, 17.1, 118.3), (1.75, 18.03, 68.43), 0.794, None, 3.667),
    "capped": ((1.20, 12.83, 46.62), (7.2, 16.0, 101.7), (2.59, 21.25, 73.79), 0.316, 6.33, 2.020),
}
#: exp (d) (study, first 600 s of w600): (policy, mode) -> TTFT p90 s, E2E p90 s, TPOT p90 ms,
#: APC, req_bal. ``unified`` is the study's "unified default".
STUDY_EXPD: dict[tuple[str, str], tuple[float, float, float, float, float]] = {
    ("leastwork", "tracets"): (11.099, 25.366, 33, 0.650, 1.49),
    ("leastwork", "thinktime"): (6.713, 17.635, 18, 0.676, 1.94),
    ("unified", "tracets"): (12.997, 22.819, 20, 0.693, 1.56),
    ("unified", "thinktime"): (11.268, 24.096, 22, 0.693, 2.91),
    ("lmetric", "tracets"): (16.492, 27.791, 39, 0.495, 2.19),
    ("lmetric", "thinktime"): (15.607, 27.819, 30, 0.483, 2.10),
    ("sticky", "tracets"): (15.236, 27.974, 31, 0.693, 2.06),
    ("sticky", "thinktime"): (14.838, 24.966, 24, 0.694, 2.48),
}


@dataclass(frozen=True)
class B2Cell:
    """One B2 cell: p90s over the decode requests whose ``[first_token, finish]`` window
    overlaps an injection window (``overlap``) or not (``clean``)."""

    variant: str
    prefill_tokens: int
    n_overlap: int
    n_clean: int
    tpot_p90_overlap: float
    tpot_p90_clean: float
    ttft_p90_overlap: float
    ttft_p90_clean: float

    @property
    def tpot_idx(self) -> float:
        return self.tpot_p90_overlap / self.tpot_p90_clean

    @property
    def ttft_idx(self) -> float:
        return self.ttft_p90_overlap / self.ttft_p90_clean


def drive(
    engines: list[EngineModel],
    arrivals: list[tuple[float, int, int, int | str, int, int]],
    block_size: int = 512,
) -> dict[Any, list[float]]:
    """Submit ``(t, engine, order, id, input, output)`` arrivals by ``(t, order)``, each
    with keys of its own (``block_size`` tokens a key: nothing is cached); returns
    ``id -> [send, first_token, finish]``."""
    times: dict[Any, list[float]] = {}
    rng = np.random.default_rng(7)

    def collect(now: float) -> None:
        for e in engines:
            for ev in e.advance(now):
                if ev[0] == "first_token":
                    times[ev[1]][1] = ev[2]
                elif ev[0] == "finish":
                    times[ev[1]][2] = ev[2]

    for t, eng, _, rid, n_in, n_out in sorted(arrivals, key=lambda a: (a[0], a[2])):
        collect(t)
        keys = rng.integers(0, 2**63, size=-(-n_in // block_size), dtype=np.uint64)
        engines[eng].submit(rid, keys, n_in, n_out, t)
        times[rid] = [t, np.nan, np.nan]
    while True:
        nxt = [x for x in (e.next_event_time() for e in engines) if x is not None]
        if not nxt:
            break
        collect(min(nxt))
    return times


def b2_microbench(
    sizes: tuple[int, ...] = (2048, 8192, 16384, 32768, 65536),
    *,
    preset: str = "h20-qwen3-coder-30b-a3b",
    duration: float = 60.0,
    decode_rate: float = 4.0,
    decode_prompt: int = 128,
    decode_output: int = 128,
    injections: int = 4,
    interval: float = 12.0,
    **engine: float,
) -> list[B2Cell]:
    """The B2 cells for ``same`` and ``different`` at each prefill size: decode requests
    every ``1/decode_rate`` s for ``duration`` s on engine 0; ``injections`` one-token
    prompts of ``size`` tokens every ``interval`` s (from ``interval``) on engine 0
    (``same``) or engine 1 (``different``)."""
    cells = []
    for variant in ("same", "different"):
        for size in sizes:
            engines = [EngineModel(preset, **engine), EngineModel(preset, **engine)]
            n_dec = int(duration * decode_rate)
            arr: list[tuple[float, int, int, int | str, int, int]] = [
                (i / decode_rate, 0, 1, i, decode_prompt, decode_output) for i in range(n_dec)
            ]
            inj = [f"inj{k}" for k in range(injections)]
            target = 0 if variant == "same" else 1
            arr += [(interval * (k + 1), target, 0, rid, size, 1) for k, rid in enumerate(inj)]
            times = drive(engines, arr)
            windows = [(times[r][0], times[r][2]) for r in inj]
            d = np.array([times[i] for i in range(n_dec)])
            send, first, fin = d[:, 0], d[:, 1], d[:, 2]
            over = np.array(
                [
                    any(f <= we and fi >= ws for ws, we in windows)
                    for f, fi in zip(first, fin, strict=True)
                ]
            )
            tpot = (fin - first) / max(decode_output - 1, 1)
            ttft = first - send
            p90 = _p90
            cells.append(
                B2Cell(
                    variant,
                    size,
                    int(over.sum()),
                    int((~over).sum()),
                    p90(tpot[over]),
                    p90(tpot[~over]),
                    p90(ttft[over]),
                    p90(ttft[~over]),
                )
            )
    return cells


def _p90(x: npt.NDArray[np.float64]) -> float:
    return float(np.percentile(x, 90)) if len(x) else float("nan")


def first_seconds(table: pa.Table, seconds: float = 600.0) -> pa.Table:
    """The requests with ``timestamp < seconds`` (the study's ``first600s`` trace)."""
    return table.filter(pc.less(table.column("timestamp"), seconds))


def _fmt(x: Any, scale: float = 1.0, nd: int = 2) -> str:
    return "n/a" if x is None else f"{x * scale:.{nd}f}"


def _md(header: list[str], rows: list[list[str]], align: str = "---:") -> str:
    """A Markdown table; the first column left-aligned."""
    sep = ["---"] + [align] * (len(header) - 1)
    lines = ["| " + " | ".join(r) + " |" for r in [header, sep, *rows]]
    return "\n".join(lines)


def _trip(d: dict[str, Any], scale: float = 1.0) -> str:
    return "/".join(_fmt(d[q], scale) for q in ("p50", "p90", "p99"))


def b2_markdown(cells: list[B2Cell]) -> str:
    """The B2 table, simulation next to the study."""
    rows = []
    for c in cells:
        st = STUDY_B2.get((c.variant, c.prefill_tokens), STUDY_B2[("different", "2k-65k")])
        rows.append(
            [
                c.variant,
                f"{c.prefill_tokens // 1024}k",
                str(c.n_overlap),
                str(c.n_clean),
                f"{c.tpot_idx:.2f}",
                str(st[0]),
                f"{c.ttft_idx:.2f}",
                str(st[1]),
            ]
        )
    head = ["variant", "prefill", "n_overlap", "n_clean"]
    head += ["TPOT idx sim", "TPOT idx study", "TTFT idx sim", "TTFT idx study"]
    return _md(head, rows)


def b3_markdown(results: list[Any]) -> str:
    """Simulated runs (``kvroute.sim.SimResult``) next to the study's B3 (tracets) numbers."""
    rows = []
    for r in results:
        s, pol, mode = r.summary, r.spec.policy, r.spec.mode
        rows.append(
            [
                pol,
                mode,
                "sim",
                _trip(s["ttft"]),
                _trip(s["tpot"], 1e3),
                _trip(s["e2e"]),
                f"{s['apc']:.1%}",
                _fmt(s["interference_index"]),
                _fmt(s["hotspot_index"], nd=3),
                _fmt(s["req_bal"]),
            ]
        )
        st = STUDY_B3.get(pol)
        if st is not None and mode == "tracets":
            trips = ["/".join(map(str, t)) for t in st[:3]]
            rows.append(
                [pol, mode, "study", *trips, f"{st[3]:.1%}", _fmt(st[4]), f"{st[5]:.3f}", ""]
            )
    head = ["policy", "mode", "src", "TTFT p50/p90/p99 s", "TPOT p50/p90/p99 ms"]
    head += ["E2E p50/p90/p99 s", "APC", "interference", "hotspot", "req_bal"]
    return _md(head, rows)


def expd_markdown(results: list[Any]) -> str:
    """Simulated runs next to the study's exp (d) numbers (both modes, first 600 s)."""
    rows = []
    for r in results:
        s, st = r.summary, STUDY_EXPD.get((r.spec.policy, r.spec.mode))
        if st is None:
            continue
        rows.append(
            [
                r.spec.policy,
                r.spec.mode,
                f"{s['ttft']['p90']:.2f} / {st[0]:.2f}",
                f"{s['e2e']['p90']:.2f} / {st[1]:.2f}",
                f"{s['tpot']['p90'] * 1e3:.0f} / {st[2]:.0f}",
                f"{s['apc']:.3f} / {st[3]:.3f}",
                f"{s['req_bal']:.2f} / {st[4]:.2f}",
            ]
        )
    head = ["policy", "mode", "TTFT p90 s sim / study", "E2E p90 s sim / study"]
    head += ["TPOT p90 ms sim / study", "APC sim / study", "req_bal sim / study"]
    return _md(head, rows)


def main(argv: list[str]) -> None:
    """``python -m kvroute.sim.fidelity [W600.parquet]``: print the fidelity tables."""
    import kvroute.sim as ks
    from kvroute.trace import read_trace

    print("## B2\n")
    print(b2_markdown(b2_microbench()))
    if argv:
        table = read_trace(argv[0])
        print("\n## B3 (w600, 8 engines)\n")
        print(
            b3_markdown(
                ks.sweep(
                    table,
                    policies=[*ks.STUDY_POLICIES, "leastwork"],
                    modes=["tracets", "thinktime"],
                )
            )
        )
        print("\n## exp (d) (first 600 s of w600, 8 engines)\n")
        runs = ks.sweep(
            first_seconds(table),
            policies=["leastwork", "unified", "lmetric", "sticky"],
            modes=["tracets", "thinktime"],
        )
        print(expd_markdown(runs))


if __name__ == "__main__":
    main(sys.argv[1:])
