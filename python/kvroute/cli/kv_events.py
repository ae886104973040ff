"""``kvroute kv-events``: a live summary of an engine's KV-cache event stream."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import click
import zmq

from kvroute.cli.common import FINITE, Finite
from kvroute.kv_events import Source, Tally, event_sources


def _sources(target: str, topic: str, bind: bool) -> list[Source]:
    """``target`` as sources: an engine's URL (its ``/kv_event_sources``) or an endpoint."""
    if target.startswith(("http://", "https://")):
        url = target.rstrip("/") + "/kv_event_sources"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                answer = json.load(resp)
        except (OSError, ValueError) as exc:
            raise click.ClickException(f"{url}: {exc}") from exc
        found = event_sources(answer, target)
        if not found:
            raise click.ClickException(f"{target} publishes no KV events")
        return found
    return [Source(0, target, None, topic, bind)]


def _row(rank: int, now: dict[str, Any], before: dict[str, Any], dt: float) -> dict[str, Any]:
    rate = {k: (now[k] - before.get(k, 0)) / dt for k in ("batches", "stored", "removed")}
    return {"rank": rank, **{f"{k}_per_s": round(v, 1) for k, v in rate.items()}, **now}


@click.command("kv-events")
@click.argument("target")
@click.option("--topic", default="", help="Topic to subscribe to (default: every topic).")
@click.option("--bind", is_flag=True, help="Bind the endpoint (the engine connects to it).")
@click.option("--interval", default=1.0, show_default=True, type=Finite(min=0.05))
@click.option("--duration", default=None, type=FINITE, help="Stop after this many seconds.")
@click.option(
    "--batches",
    default=None,
    type=click.IntRange(min=1),
    help="Stop once this many batches have arrived (all ranks together), after a last summary.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON line per interval.")
def kv_events(
    target: str,
    topic: str,
    bind: bool,
    interval: float,
    duration: float | None,
    batches: int | None,
    as_json: bool,
) -> None:
    """Summarise the KV events at TARGET (an engine's URL or a ZMQ endpoint) live: per rank,
    batches and blocks stored/removed per second, gaps, restarts, last sequence number, lag."""
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    sources = _sources(target, topic, bind)
    ctx = zmq.Context()
    poller = zmq.Poller()
    for s in sources:
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, s.topic.encode())
        sock.bind(s.endpoint) if s.bind else sock.connect(s.endpoint)
        poller.register(sock, zmq.POLLIN)
    tally, start = Tally(), time.monotonic()
    before: dict[int, dict[str, Any]] = {}
    console = Console()

    def table(rows: list[dict[str, Any]]) -> Table:
        t = Table(title=f"KV events of {target}")
        cols = (
            "rank",
            "batches_per_s",
            "stored_per_s",
            "removed_per_s",
            "gaps",
            "missed",
            "restarts",
            "last_seq",
            "lag_s",
        )
        for c in cols:
            t.add_column(c, justify="right")
        for r in rows:
            t.add_row(*(f"{r[c]:.3f}" if c == "lag_s" else str(r[c]) for c in cols))
        return t

    try:
        with Live(table([]), console=console, auto_refresh=False, transient=as_json) as live:
            last = time.monotonic()
            while duration is None or time.monotonic() - start < duration:
                for sock, _ in poller.poll(int(interval * 1000 / 4)):
                    while True:
                        try:
                            tally.add(sock.recv_multipart(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                now = time.monotonic()
                got = sum(t.batches for t in tally.ranks.values())
                done = batches is not None and got >= batches
                if now - last < interval and not done:
                    continue
                rows = []
                for rank, t in sorted(tally.ranks.items()):
                    stats = vars(t).copy()
                    rows.append(_row(rank, stats, before.get(rank, {}), max(now - last, 1e-9)))
                    before[rank] = stats
                last = now
                if as_json:
                    click.echo(json.dumps({"ranks": rows, "bad_messages": tally.bad_messages}))
                else:
                    live.update(table(rows), refresh=True)
                if done:
                    break
    except KeyboardInterrupt:
        pass
    finally:
        ctx.destroy(linger=0)
