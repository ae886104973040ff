"""Turn a bench run into the markdown tables of benches/README.md.

    .venv/bin/python benches/report.py --run          # run the Python benches, then report
    .venv/bin/python benches/report.py                # report the last run (and criterion's)
    .venv/bin/python benches/report.py --run --repeat 3 benches/test_*.py  # median of 3 runs
    .venv/bin/python benches/report.py --run benches/test_route.py -- -k 8x128
    .venv/bin/python benches/report.py --readme benches/README.md   # refresh its tables

``--run`` runs ``pytest benches --benchmark-only --benchmark-json=.benchmarks/report.json``.
The criterion numbers (``cargo bench -p kvroute-bench``) are read from
``target/criterion/**/new/{benchmark,estimates}.json`` when present. Times are medians (p50).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = ROOT / ".benchmarks" / "report.json"
DEFAULT_CRITERION = ROOT / "target" / "criterion"

MARK_START = "<!-- report.py:start -->"
MARK_END = "<!-- report.py:end -->"
ROUTE_RATIO_TARGET = 20.0
BLOCK_HASHES_TARGET_US = 50.0


def run_pytest(json_path: Path, args: list[str]) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *args,
        "-q",
        "-p",
        "no:cacheprovider",
        "--benchmark-only",
        "--benchmark-disable-gc",
        "--benchmark-columns=min,median,mean,rounds",
        f"--benchmark-json={json_path}",
    ]
    subprocess.run(cmd, cwd=ROOT, check=True)


def us(seconds: float) -> str:
    v = seconds * 1e6
    return f"{v:.2f}" if v < 100 else f"{v:.0f}"


STAT_KEYS = ("median", "q1", "q3", "min", "mean")


def load_python(paths: list[Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Benchmarks of one or more runs; with several, each stat is the median over the runs."""
    runs = [json.loads(p.read_text()) for p in paths]
    by_name: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        for b in run["benchmarks"]:
            by_name.setdefault(b["fullname"], []).append(b)
    merged = []
    for group in by_name.values():
        b = dict(group[0])
        b["stats"] = {k: float(np.median([g["stats"][k] for g in group])) for k in STAT_KEYS}
        b["runs"] = len(group)
        merged.append(b)
    return merged, [run.get("machine_info", {}) for run in runs]


DEFAULT_SESSIONS = 1024  # workload.sessions_for: max(1024, instances)


def route_rows(benches: list[dict[str, Any]]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Stats by (impl, policy, instances, keys) for the default session count, and by
    (impl, policy, instances, keys, sessions) for the others."""
    out = {}
    for b in benches:
        e = b.get("extra_info", {})
        if e.get("kind") == "route":
            key = (e["impl"], e["policy"], e["instances"], e["keys"])
            if e["sessions"] != max(DEFAULT_SESSIONS, e["instances"]):
                key = (*key, e["sessions"])
            out[key] = b["stats"]
    return out


def fmt_ratio(ref: dict[str, Any] | None, kv: dict[str, Any] | None) -> str:
    if ref is None or kv is None:
        return "n/a"
    return f"{ref['median'] / kv['median']:.1f}x"


def route_section(benches: list[dict[str, Any]]) -> list[str]:
    rows = route_rows(benches)
    if not rows:
        return []
    instances = sorted({k[2] for k in rows if k[1] == "unified" and len(k) == 4})
    keys = sorted({k[3] for k in rows if k[1] == "unified" and len(k) == 4})
    lines = [
        "### route() from Python, `unified`, warm cache",
        "",
        "p50 of single `route()` calls (finish() outside the clock); p25-p75 in brackets.",
        "",
        "| instances | keys | kvroute p50 (us) | reference p50 (us) | reference / kvroute |",
        "|---:|---:|---:|---:|---:|",
    ]
    for k in keys:
        for i in instances:
            kv = rows.get(("kvroute", "unified", i, k))
            ref = rows.get(("reference", "unified", i, k))
            kv_s = f"{us(kv['median'])} [{us(kv['q1'])}-{us(kv['q3'])}]" if kv else "n/a"
            ref_s = f"{us(ref['median'])} [{us(ref['q1'])}-{us(ref['q3'])}]" if ref else "n/a"
            lines.append(f"| {i} | {k} | {kv_s} | {ref_s} | {fmt_ratio(ref, kv)} |")
    for impl in ("kvroute", "reference"):
        cells = {(i, k): rows.get((impl, "unified", i, k)) for i in instances for k in keys}
        if len(instances) < 2 or len(keys) < 2 or any(v is None for v in cells.values()):
            continue
        lines += [
            "",
            f"Growth, {impl} p50 (us), keys (rows) x instances (columns):",
            "",
            "| keys \\ instances | " + " | ".join(str(i) for i in instances) + " |",
            "|---:|" + "---:|" * len(instances),
        ]
        for k in keys:
            vals = " | ".join(us(cells[(i, k)]["median"]) for i in instances)  # type: ignore[index]
            lines.append(f"| {k} | {vals} |")
        lines += ["", *growth_summary(impl, cells, instances, keys)]
    lines += ["", *policy_section(rows)]
    return lines


def growth_summary(
    impl: str,
    cells: dict[tuple[int, int], Any],
    instances: list[int],
    keys: list[int],
) -> list[str]:
    """Is the cost additive in keys and instances, or their product?

    Additive (a + b*keys + c*instances): the extra cost of more keys is the same at any
    instance count, and vice versa. Product: it scales with the other factor.
    """
    t = {c: v["median"] * 1e6 for c, v in cells.items()}
    i_lo, i_hi, k_lo, k_hi = instances[0], instances[-1], keys[0], keys[-1]
    dk_lo = t[(i_lo, k_hi)] - t[(i_lo, k_lo)]
    dk_hi = t[(i_hi, k_hi)] - t[(i_hi, k_lo)]
    di_lo = t[(i_hi, k_lo)] - t[(i_lo, k_lo)]
    di_hi = t[(i_hi, k_hi)] - t[(i_lo, k_hi)]
    return [
        f"- {impl}: {k_lo} -> {k_hi} keys adds {dk_lo:.2f} us at {i_lo} instances and "
        f"{dk_hi:.2f} us at {i_hi} instances: x{dk_hi / dk_lo:.2f} "
        f"(additive: x1; keys x instances: x{i_hi / i_lo:.0f}).",
        f"- {impl}: {i_lo} -> {i_hi} instances adds {di_lo:.2f} us at {k_lo} keys and "
        f"{di_hi:.2f} us at {k_hi} keys: x{di_hi / di_lo:.2f} "
        f"(additive: x1; keys x instances: x{k_hi / k_lo:.0f}).",
    ]


def policy_section(rows: dict[tuple[Any, ...], Any]) -> list[str]:
    lines = [
        "### route() at 8 instances x 128 keys, per policy",
        "",
        "| policy | kvroute p50 (us) | reference p50 (us) | reference / kvroute |",
        "|---|---:|---:|---:|",
    ]
    for policy in ("unified", "lmetric", "leastwork"):
        kv = rows.get(("kvroute", policy, 8, 128))
        ref = rows.get(("reference", policy, 8, 128))
        kv_s = us(kv["median"]) if kv else "n/a"
        ref_s = us(ref["median"]) if ref else "n/a"
        lines.append(f"| {policy} | {kv_s} | {ref_s} | {fmt_ratio(ref, kv)} |")
    lst = rows.get(("kvroute[list]", "unified", 8, 128))
    ref = rows.get(("reference", "unified", 8, 128))
    if lst:
        lines.append(
            f"| unified, keys as a list | {us(lst['median'])} | "
            f"{us(ref['median']) if ref else 'n/a'} | {fmt_ratio(ref, lst)} |"
        )
    small_kv = rows.get(("kvroute", "unified", 8, 128, 256))
    small_ref = rows.get(("reference", "unified", 8, 128, 256))
    if small_kv or small_ref:
        lines.append(
            f"| unified, 256 sessions (4x smaller cache) | "
            f"{us(small_kv['median']) if small_kv else 'n/a'} | "
            f"{us(small_ref['median']) if small_ref else 'n/a'} | "
            f"{fmt_ratio(small_ref, small_kv)} |"
        )
    kv = rows.get(("kvroute", "unified", 8, 128))
    if kv and ref:
        ratio = ref["median"] / kv["median"]
        verdict = "MET" if ratio >= ROUTE_RATIO_TARGET else "MISSED"
        lines += [
            "",
            f"Target route() p50 at 8 x 128 >= {ROUTE_RATIO_TARGET:.0f}x faster than the "
            f"reference: {ratio:.1f}x, **{verdict}**.",
        ]
    return lines


def block_hashes_section(benches: list[dict[str, Any]]) -> list[str]:
    rows = [b for b in benches if b.get("extra_info", {}).get("kind") == "block_hashes"]
    if not rows:
        return []
    rows.sort(key=lambda b: (b["extra_info"]["tokens"], b["stats"]["median"]))
    lines = [
        "### block_hashes",
        "",
        "| tokens | input | implementation | p50 (us) | min (us) | tokens / us |",
        "|---:|---|---|---:|---:|---:|",
    ]
    target = None
    for b in rows:
        e, s = b["extra_info"], b["stats"]
        lines.append(
            f"| {e['tokens']} | {e['input']} | {e['impl']} | {us(s['median'])} | "
            f"{us(s['min'])} | {e['tokens'] / (s['median'] * 1e6):.0f} |"
        )
        if e["impl"] == "kvroute" and e["tokens"] == 65_536 and e["input"] == "numpy int32":
            target = s["median"] * 1e6
    if target is not None:
        verdict = "MET" if target < BLOCK_HASHES_TARGET_US else "MISSED"
        lines += [
            "",
            f"Target 64k-token numpy array under {BLOCK_HASHES_TARGET_US:.0f} us (int32): "
            f"{target:.1f} us, **{verdict}**.",
        ]
    return lines


def criterion_section(root: Path) -> list[str]:
    found = {}
    for bench in sorted(root.glob("**/new/benchmark.json")):
        meta = json.loads(bench.read_text())
        est = json.loads((bench.parent / "estimates.json").read_text())
        found[meta["full_id"]] = est["median"]["point_estimate"]
    if not found:
        return []

    def t(ns: float) -> str:
        return f"{ns:.0f} ns" if ns < 10_000 else f"{ns / 1e3:.1f} us"

    lines = ["### Rust core (criterion, `cargo bench -p kvroute-bench`)", ""]
    shown = set()
    for group, title in [
        ("route/unified", "`Router::route`, unified, warm (route alone timed)"),
        ("walk", "`ClusterCache::walk`, warm"),
    ]:
        grid = {}
        for full_id, ns in found.items():
            parts = full_id.split("/")
            if "/".join(parts[:-2]) == group and parts[-2].endswith("keys"):
                grid[(int(parts[-2][:-4]), int(parts[-1]))] = ns
                shown.add(full_id)
        if not grid:
            continue
        keys = sorted({k for k, _ in grid})
        insts = sorted({i for _, i in grid})
        lines += [
            f"{title}, median, keys (rows) x instances (columns):",
            "",
            "| keys \\ instances | " + " | ".join(map(str, insts)) + " |",
            "|---:|" + "---:|" * len(insts),
        ]
        for k in keys:
            row = " | ".join(t(grid[(k, i)]) if (k, i) in grid else "n/a" for i in insts)
            lines.append(f"| {k} | {row} |")
        lines.append("")
    rest = [(f, ns) for f, ns in found.items() if f not in shown]
    if rest:
        lines += ["| benchmark | median |", "|---|---:|"]
        lines += [f"| `{f}` | {t(ns)} |" for f, ns in rest]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="store_true", help="run the Python benches first")
    ap.add_argument(
        "--json",
        type=Path,
        action="append",
        help=f"pytest-benchmark JSON file(s); several: medians over the runs "
        f"(default {DEFAULT_JSON.relative_to(ROOT)}, or the --repeat files)",
    )
    ap.add_argument("--repeat", type=int, default=1, help="with --run: number of runs")
    ap.add_argument("--criterion", type=Path, default=DEFAULT_CRITERION)
    ap.add_argument("--out", type=Path, help="write the markdown here instead of stdout")
    ap.add_argument(
        "--readme",
        type=Path,
        help=f"replace the text between {MARK_START!r} and {MARK_END!r} in this file",
    )
    ap.add_argument("paths", nargs="*", help="with --run: bench files (default: benches/)")
    ap.epilog = "Arguments after `--` go to pytest as they are."
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    pytest_args = argv[cut + 1 :]  # after `--`: passed to pytest as is (e.g. -k EXPR)
    if args.json is None:
        if args.repeat > 1:
            stem = DEFAULT_JSON.with_suffix("")
            args.json = [Path(f"{stem}-{i}.json") for i in range(1, args.repeat + 1)]
        else:
            args.json = [DEFAULT_JSON]
    if args.run:
        for path in args.json:
            run_pytest(path, [*(args.paths or [str(ROOT / "benches")]), *pytest_args])
    lines: list[str] = []
    paths = [p for p in args.json if p.exists()]
    if paths:
        benches, machines = load_python(paths)
        m = machines[0]
        cpu = m.get("cpu", {})
        loads = ", ".join(
            f"{x.get('loadavg_1_5_15_at_start', ['?'])[0]:.1f} -> "
            f"{x.get('loadavg_1_5_15_at_end', ['?'])[0]:.1f}"
            if "loadavg_1_5_15_at_start" in x
            else "?"
            for x in machines
        )
        lines += [
            f"Python {m.get('python_version', '?')}, {cpu.get('brand_raw', '?')}, "
            f"{cpu.get('count', '?')} cores; kvroute build: "
            f"{m.get('kvroute_build_profile', '?')}. {len(paths)} run(s)"
            + (" (each number: the median over the runs)" if len(paths) > 1 else "")
            + f"; 1-minute load average at start -> end of each run: {loads}.",
            "",
            *route_section(benches),
            "",
            *block_hashes_section(benches),
            "",
        ]
    lines += criterion_section(args.criterion)
    text = "\n".join(lines).rstrip() + "\n"
    if args.readme:
        doc = args.readme.read_text()
        head, rest = doc.split(MARK_START, 1)
        _, tail = rest.split(MARK_END, 1)
        args.readme.write_text(f"{head}{MARK_START}\n{text}{MARK_END}{tail}")
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
