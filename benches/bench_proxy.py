"""Proxy overhead: the latency ``kvroute proxy`` adds and the throughput it keeps, against
connecting to the emulator directly, at 1, 64 and 256 concurrent streams, side by side in one
run (release build).

Setup: one ``kvroute engine --preset fast`` process (a near-instant engine, so the engine's
own time is small and steady), one ``kvroute proxy --policy unified`` process in front of it,
and closed-loop streaming clients (aiohttp, uvloop) in this process. Each request is a
streaming ``/v1/completions`` with a 512-token id prompt (its own session, prefix shared with
the client's earlier requests), ``max_tokens = 16`` and ``ignore_eos``. For each concurrency the
direct and proxied phases alternate, each after a short warm-up; latency is send to the end of
the stream, TTFT send to the first chunk. All three processes share the machine's cores, so at
high concurrency the proxy's CPU competes with the engine's and the clients'.

Run the full measurement (8 s phases) with ``.venv/bin/python benches/bench_proxy.py``; ``make
bench`` runs it with 3 s phases and puts the numbers in the benchmark's ``extra_info``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import numpy as np

from release_build import require_release

if TYPE_CHECKING:
    from kvroute.launch import Launched

ROOT = Path(__file__).resolve().parents[1]
CONCURRENCY = (1, 64, 256)
RATES = (250.0, 500.0, 1000.0)
PROMPT_TOKENS = 512
MAX_TOKENS = 16


def spawn(command: str, *args: str, source: str | None = None) -> Launched:
    """``kvroute COMMAND ARGS --port 0`` in a process of its own (from the Python tree
    ``source`` when given)."""
    from kvroute.launch import launch

    env = {"PYTHONWARNINGS": "ignore", **({"PYTHONPATH": source} if source else {})}
    return launch(command, *args, env=env, cwd=ROOT)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class AiohttpClient:
    """Streaming requests with aiohttp's client (the default harness)."""

    def __init__(self) -> None:
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def stream(self, url: str, data: bytes, session: str) -> tuple[bool, float | None]:
        """POST ``data``; whether the stream ended well, and when its first chunk came."""
        first, tail = None, b""
        headers = {"Content-Type": "application/json", "X-Session-Id": session}
        try:
            async with self.http.post(url + "/v1/completions", data=data, headers=headers) as r:
                async for chunk in r.content.iter_any():
                    if first is None:
                        first = time.perf_counter()
                    tail = chunk
                return r.status == 200 and tail.endswith(b"data: [DONE]\n\n"), first
        except aiohttp.ClientError:
            return False, first

    async def close(self) -> None:
        await self.http.close()


Client = AiohttpClient


async def _one(
    client: Client, url: str, cid: int, n: int, base: list[int], out: dict[str, list[float]]
) -> None:
    """One streaming request; its latency and TTFT (or an error) into ``out``."""
    prompt = base[: PROMPT_TOKENS - 64] + [256 + (n % 1000)] * 64
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    ok, first = await client.stream(url, json.dumps(body).encode(), str(cid))
    t1 = time.perf_counter()
    if ok and first is not None:
        out["latency"].append(t1 - t0)
        out["ttft"].append(first - t0)
        out["done"].append(t1)
    else:
        out["errors"].append(t1)


def _prompt_base(cid: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(cid).integers(256, 32000, PROMPT_TOKENS)]


async def _closed(
    http: Client, url: str, streams: int, until: float, out: dict[str, list[float]]
) -> None:
    async def client(cid: int) -> None:
        base, n = _prompt_base(cid), 0
        while time.perf_counter() < until:
            await _one(http, url, cid, n, base, out)
            n += 1

    await asyncio.gather(*(client(c) for c in range(streams)))


async def _open(
    http: Client, url: str, rate: float, until: float, out: dict[str, list[float]]
) -> None:
    """Requests at ``rate`` per second, evenly spaced, whatever the answers take."""
    bases = [_prompt_base(c) for c in range(64)]
    tasks = []
    start = time.perf_counter()
    n = 0
    while (at := start + n / rate) < until:
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        cid = n % 64
        tasks.append(asyncio.create_task(_one(http, url, cid, n, bases[cid], out)))
        n += 1
    await asyncio.gather(*tasks)


async def phase(
    url: str,
    seconds: float,
    warmup: float,
    streams: int = 0,
    rate: float = 0.0,
) -> dict[str, Any]:
    """Closed-loop ``streams`` or open-loop ``rate`` for ``warmup + seconds``; the stats of
    the measured part."""
    http = AiohttpClient()
    try:

        async def run(until: float, into: dict[str, list[float]]) -> None:
            if streams:
                await _closed(http, url, streams, until, into)
            else:
                await _open(http, url, rate, until, into)

        sink: dict[str, list[float]] = {"latency": [], "ttft": [], "errors": [], "done": []}
        await run(time.perf_counter() + warmup, sink)
        warm = len(sink["latency"]) + len(sink["errors"])
        out: dict[str, list[float]] = {"latency": [], "ttft": [], "errors": [], "done": []}
        t0 = time.perf_counter()
        await run(t0 + seconds, out)
        elapsed = max(max(out["done"], default=t0), t0 + seconds) - t0
    finally:
        await http.close()
    lat = np.array(out["latency"]) * 1e3
    ttft = np.array(out["ttft"]) * 1e3
    return {
        "requests": len(lat),
        "all_requests": warm + len(lat) + len(out["errors"]),
        "errors": len(out["errors"]),
        "rps": len(lat) / elapsed,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
    }


def compare(
    seconds: float = 8.0,
    warmup: float = 1.0,
    rounds: int = 2,
    rates: tuple[float, ...] = RATES,
    concurrency: tuple[int, ...] = CONCURRENCY,
    baseline: str | None = None,
) -> list[dict[str, Any]]:
    """Direct and proxied phases, alternating, at each concurrency (closed loop) and each
    rate (open loop); one row per load. ``baseline``: the Python tree of another kvroute
    whose proxy runs beside this one, in its own phases (``baseline_*`` columns)."""
    from kvroute.proxy.serving import new_event_loop

    engine = spawn("engine", "--preset", "fast")
    engine_url = engine.url
    proxies = {"proxy": spawn("proxy", "--backend", engine_url, "--policy", "unified")}
    if baseline is not None:
        proxies["baseline"] = spawn(
            "proxy", "--backend", engine_url, "--policy", "unified", source=baseline
        )
    loads = [{"streams": c} for c in concurrency] + [{"rate": r} for r in rates]
    rows = []
    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            for load in loads:
                got: dict[str, list[dict[str, Any]]] = {m: [] for m in ("direct", *proxies)}
                cpu = dict.fromkeys(proxies, 0.0)
                for n in range(rounds):
                    per = seconds / rounds
                    got["direct"].append(runner.run(phase(engine_url, per, warmup, **load)))
                    # the proxies take turns at going first, so neither always follows the other
                    order = list(proxies.items())[:: -1 if n % 2 else 1]
                    for mode, server in order:
                        before = cpu_seconds(server.proc.pid)
                        got[mode].append(runner.run(phase(server.url, per, warmup, **load)))
                        cpu[mode] += cpu_seconds(server.proc.pid) - before
                row: dict[str, Any] = {
                    "load": f"{load['streams']} streams"
                    if "streams" in load
                    else f"{load['rate']:.0f} req/s offered",
                    "streams": load.get("streams"),
                }
                for mode, phases in got.items():
                    row[f"{mode}_rps"] = sum(p["rps"] for p in phases) / len(phases)
                    row[f"{mode}_errors"] = sum(p["errors"] for p in phases)
                    row[f"{mode}_requests"] = sum(p["requests"] for p in phases)
                    for key in ("p50_ms", "p99_ms", "ttft_p50_ms"):
                        row[f"{mode}_{key}"] = float(np.median([p[key] for p in phases]))
                for mode in proxies:
                    pre = "" if mode == "proxy" else f"{mode}_"
                    for q in ("p50", "p99"):
                        added = row[f"{mode}_{q}_ms"] - row[f"direct_{q}_ms"]
                        row[f"{pre}added_{q}_ms"] = added
                    served = sum(p["all_requests"] for p in got[mode])
                    row[f"{mode}_cpu_us_per_request"] = cpu[mode] / max(served, 1) * 1e6
                rows.append(row)
    finally:
        for server in (*proxies.values(), engine):
            server.stop()
    return rows


def table(rows: list[dict[str, Any]], mode: str = "proxy") -> str:
    """The results of ``mode`` (``proxy`` or ``baseline``) as a Markdown table."""
    pre = "" if mode == "proxy" else f"{mode}_"
    head = (
        "| load | direct req/s | proxy req/s | direct p50 / p99 (ms) | proxy p50 / p99 (ms) "
        "| added p50 / p99 (ms) | proxy CPU / req (µs) | errors |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r['load']} | {r['direct_rps']:.0f} | {r[f'{mode}_rps']:.0f} "
        f"| {r['direct_p50_ms']:.2f} / {r['direct_p99_ms']:.2f} "
        f"| {r[f'{mode}_p50_ms']:.2f} / {r[f'{mode}_p99_ms']:.2f} "
        f"| {r[f'{pre}added_p50_ms']:+.2f} / {r[f'{pre}added_p99_ms']:+.2f} "
        f"| {r[f'{mode}_cpu_us_per_request']:.0f} | {r['direct_errors'] + r[f'{mode}_errors']} |"
        for r in rows
    ]
    return head + "\n".join(lines)


def side_by_side(rows: list[dict[str, Any]]) -> str:
    """This proxy against the baseline's, row by row: throughput, p50 and p99 latency (and
    their ratios, this over the baseline), added latency and CPU per request."""
    head = (
        "| load | direct req/s | proxy / baseline req/s | proxy / baseline p50 (ms) | ratio "
        "| proxy / baseline p99 (ms) | ratio | added p50: proxy / baseline (ms) "
        "| CPU / req: proxy / baseline (µs) | errors |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for r in rows:
        errors = r["direct_errors"] + r["proxy_errors"] + r["baseline_errors"]
        lines.append(
            f"| {r['load']} | {r['direct_rps']:.0f} "
            f"| {r['proxy_rps']:.0f} / {r['baseline_rps']:.0f} "
            f"| {r['proxy_p50_ms']:.2f} / {r['baseline_p50_ms']:.2f} "
            f"| {r['proxy_p50_ms'] / r['baseline_p50_ms']:.3f} "
            f"| {r['proxy_p99_ms']:.2f} / {r['baseline_p99_ms']:.2f} "
            f"| {r['proxy_p99_ms'] / r['baseline_p99_ms']:.3f} "
            f"| {r['added_p50_ms']:+.2f} / {r['baseline_added_p50_ms']:+.2f} "
            f"| {r['proxy_cpu_us_per_request']:.0f} / {r['baseline_cpu_us_per_request']:.0f} "
            f"| {errors} |"
        )
    return head + "\n".join(lines)


async def breakdown(requests: int = 500) -> dict[str, float]:
    """CPU µs per request, one process and one loop: a stand-in engine answering a 1-chunk
    stream, reached directly, through a bare aiohttp relay, and through ``kvroute proxy``."""
    from aiohttp import web

    from kvroute.proxy import Proxy, ProxyConfig, start_app

    async def engine(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": " tok"}]}\n\ndata: [DONE]\n\n')
        await resp.write_eof()
        return resp

    async def healthy(_request: web.Request) -> web.Response:
        return web.Response()

    async with aiohttp.ClientSession() as upstream, aiohttp.ClientSession() as client:

        async def relay(request: web.Request) -> web.StreamResponse:
            raw = await request.read()
            async with upstream.post(engine_url + request.path, data=raw) as up:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp

        apps = []
        for handler in (engine, relay):
            app = web.Application()
            app.router.add_post("/v1/completions", handler)
            app.router.add_get("/health", healthy)
            apps.append(app)
        runner_e, engine_url = await start_app(apps[0])
        runner_r, relay_url = await start_app(apps[1])
        proxy = Proxy(ProxyConfig(backends=[engine_url]))
        proxy_url = await proxy.start("127.0.0.1", 0, 1.0)
        body = {"prompt": _prompt_base(0), "max_tokens": MAX_TOKENS, "stream": True}
        out = {}
        try:
            for name, url in (("direct", engine_url), ("relay", relay_url), ("kvroute", proxy_url)):
                for n in range(requests + 50):
                    if n == 50:
                        t0 = time.process_time()
                    async with client.post(url + "/v1/completions", json=body) as resp:
                        await resp.read()
                out[name] = (time.process_time() - t0) / requests * 1e6
        finally:
            await proxy.close()
            for r in (runner_r, runner_e):
                await r.cleanup()
    return out


def test_proxy_overhead(benchmark: Any) -> None:
    rows = benchmark.pedantic(compare, kwargs={"seconds": 3.0}, rounds=1, iterations=1)
    for r in rows:
        assert r["direct_errors"] == 0 and r["proxy_errors"] == 0
        for key in ("direct_rps", "proxy_rps", "added_p50_ms", "added_p99_ms"):
            benchmark.extra_info[f"{key}@{r['load']}"] = round(r[key], 3)
    print("\n" + table(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per mode")
    parser.add_argument(
        "--rounds", type=int, default=2, help="alternating rounds per load (medians over them)"
    )
    parser.add_argument("--allow-debug", action="store_true", help="measure a debug build too")
    parser.add_argument(
        "--baseline",
        help="the python/ directory of another kvroute checkout: its proxy is measured in the "
        "same run, in phases of its own",
    )
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    if not args.allow_debug:
        require_release()
    from kvroute.proxy.serving import new_event_loop

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        cpu = runner.run(breakdown())
    relay, ours = cpu["relay"] - cpu["direct"], cpu["kvroute"] - cpu["direct"]
    print(
        f"CPU per request, one loop: direct {cpu['direct']:.0f} µs, bare aiohttp relay "
        f"+{relay:.0f} µs, kvroute proxy +{ours:.0f} µs\n"
    )
    rows = compare(seconds=args.seconds, rounds=args.rounds, baseline=args.baseline)
    print(table(rows))
    if args.baseline:
        print(f"\nbaseline ({args.baseline}):\n\n" + table(rows, "baseline"))
        print("\nside by side:\n\n" + side_by_side(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
