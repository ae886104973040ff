"""``kvroute proxy``, ``kvroute engine`` and ``kvroute replay``: the live path.

Thin wrappers over :mod:`kvroute.proxy`, :mod:`kvroute.emulator` and :mod:`kvroute.replay`;
see ``docs/proxy.md`` and ``docs/replay.md``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

import kvroute
from kvroute.cli.common import FINITE, BadInput, Finite, output_option
from kvroute.errors import KvrouteError
from kvroute.proxy.config import DEFAULT_POLICY

F = TypeVar("F", bound=Callable[..., Any])


def _pairs(values: tuple[str, ...], what: str) -> dict[str, Any]:
    """``KEY=VALUE`` options, values read as JSON when they parse (numbers, null, ...)."""
    out: dict[str, Any] = {}
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint=what)
        try:
            out[key.replace("-", "_")] = json.loads(raw)
        except ValueError:
            out[key.replace("-", "_")] = raw
    return out


def _ready(what: str) -> Any:
    def say(url: str) -> None:
        click.echo(f"kvroute {what} listening on {url}", err=True)

    return say


def token_cap(value: str | None, urls: list[str], who: str) -> int | None:
    """``--max-in-flight-tokens`` as a number of tokens (at least 1): ``cache`` is the
    smallest KV capacity the backends report (logged); an error when none reports one."""
    if value is None:
        return None
    if value != "cache":
        if not value.isdigit() or int(value) < 1:
            raise click.BadParameter(
                f"{value!r} is neither a number of tokens >= 1 nor 'cache'",
                param_hint="--max-in-flight-tokens",
            )
        return int(value)
    from kvroute.proxy.discover import kv_tokens

    tokens, why = kv_tokens(urls)
    if tokens is None:
        raise click.UsageError(f"--max-in-flight-tokens cache: {why}; give a number of tokens")
    click.echo(
        f"kvroute {who}: at most {tokens} prompt tokens in flight per engine ({why})", err=True
    )
    return tokens


def admission_options(f: F) -> F:
    """``--max-in-flight``, ``--max-in-flight-tokens``, ``--queue-size``,
    ``--queue-patience``, ``--queue-hold`` and ``--queue-hold-yield`` (``docs/proxy.md``,
    "Admission"), for the proxy and for the commands that run one."""
    options = [
        click.option(
            "--max-in-flight",
            default=None,
            type=click.IntRange(min=1),
            help="Leave out an engine with this many requests in flight while another has "
            "fewer [default: off].",
        ),
        click.option(
            "--max-in-flight-tokens",
            default=None,
            metavar="TOKENS|cache",
            help="Leave out an engine with this many prompt tokens in flight; with --queue-size, "
            "a request waits until its tokens fit beside those in flight and held there. "
            "'cache': the engines' KV capacity (vllm:cache_config_info) [default: off].",
        ),
        click.option(
            "--queue-size",
            default=None,
            type=click.IntRange(min=0),
            help="Admission: while the engine a request's policy prefers is over a limit "
            "(--max-in-flight, --max-in-flight-tokens, --overload-*), up to this many "
            "requests wait at the router, routed when it has room [default: off: all engines "
            "take part].",
        ),
        click.option(
            "--queue-patience",
            default=0.5,
            show_default=True,
            type=Finite(min=0),
            help="Seconds a queued request waits for the engine its policy prefers before the "
            "first in the queue takes any engine with room.",
        ),
        click.option(
            "--queue-hold",
            default=0.0,
            show_default=True,
            type=Finite(min=0),
            help="Seconds an engine keeps a room (under --max-in-flight, and the request's "
            "tokens under --max-in-flight-tokens) for a session's next "
            "request after one ends there, so the sessions being served keep their engines.",
        ),
        click.option(
            "--queue-hold-yield",
            default=5.0,
            show_default=True,
            type=Finite(min=0),
            help="No room is held while a request has waited this many seconds.",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


@click.command("proxy")
@click.option("--backend", "backends", multiple=True, help="Engine base URL (repeat).")
@click.option(
    "--policy",
    type=click.Choice(kvroute.policies()),
    default=DEFAULT_POLICY,
    show_default=True,
    help="Routing policy (unified_dynamo and dynamo_cost: with overlap_weight=8 unless "
    "--router-option says).",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--block-size",
    default=None,
    type=click.IntRange(min=1),
    help="Tokens per routing key [default: the engines' KV block size, from their "
    "vllm:cache_config_info; 512 when none says].",
)
@click.option(
    "--router-option",
    "router_opts",
    multiple=True,
    metavar="KEY=VALUE",
    help="Router keyword (cache_capacity_blocks, overload_factor, ...).",
)
@click.option(
    "--tokenizer",
    default="auto",
    show_default=True,
    help="Keys for text prompts: auto (the served model's folder when this machine has it, "
    "else approx), approx, backend, or a model folder or its tokenizer.json (as --model).",
)
@click.option(
    "--model",
    "model_dir",
    default=None,
    type=click.Path(exists=True, file_okay=False, path_type=str),
    help="The served model's folder (tokenizer.json, chat template): text and chat prompts "
    "are keyed as vLLM tokenizes them, in Rust.",
)
@click.option(
    "--engine-profile",
    default=None,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Engine profile from kvroute calibrate: the step costs --policy ttft predicts with "
    "(without one, the proxy fits them to the first tokens it relays).",
)
@click.option(
    "--ttft-slo",
    default=None,
    type=Finite(min=0, min_open=True),
    help="--policy ttft: seconds to first token to aim for; the engine with the most cache "
    "reuse among those predicted to meet it [default: none: the least predicted time].",
)
@click.option("--session-header", default="X-Session-Id", show_default=True)
@click.option(
    "--session-field",
    default="session_id",
    show_default=True,
    help="Body field naming the session when the header is absent ('' for none).",
)
@click.option("--max-body-bytes", default=32 << 20, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--request-timeout",
    default=600.0,
    show_default=True,
    type=FINITE,
    help="Seconds to wait for a backend's next bytes.",
)
@click.option("--connect-timeout", default=3.0, show_default=True, type=FINITE)
@click.option("--max-concurrency", default=4096, show_default=True, type=click.IntRange(min=1))
@click.option("--retries", default=2, show_default=True, type=click.IntRange(min=0))
@click.option("--health-interval", default=2.0, show_default=True, type=FINITE)
@click.option(
    "--load-interval",
    default=2.0,
    show_default=True,
    type=Finite(min=0, min_open=True),
    help="Seconds between reads of each engine's own load (its /metrics).",
)
@click.option(
    "--load-source",
    default="engine",
    show_default=True,
    type=click.Choice(["engine", "router"]),
    help="What the policies' load terms read: the router's own counts plus the requests each "
    "engine reports beyond them (engine), or its own counts only (router).",
)
@click.option(
    "--overload-waiting",
    default=None,
    type=click.IntRange(min=1),
    help="Leave out an engine with this many requests waiting (reported, plus sent since) "
    "while another has fewer [default: off].",
)
@click.option(
    "--overload-kv-usage",
    default=None,
    type=Finite(0, 1),
    help="Leave out an engine whose KV-cache usage (0 to 1) reaches this while another's is "
    "under [default: off].",
)
@admission_options
@click.option(
    "--queue-timeout",
    default=30.0,
    show_default=True,
    type=Finite(min=0, min_open=True),
    help="Seconds a request waits in the queue at most (then 503 with Retry-After).",
)
@click.option(
    "--priority-header",
    default="X-Priority",
    show_default=True,
    help="Header with a request's priority in the queue (an integer, higher first).",
)
@click.option("--unhealthy-after", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--healthy-after", default=2, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--admin-token",
    envvar="KVROUTE_ADMIN_TOKEN",
    default=None,
    help="Bearer token of the admin API (env KVROUTE_ADMIN_TOKEN; none: API off).",
)
@click.option(
    "--decision-log",
    type=click.Path(dir_okay=False),
    default=None,
    help="Append one JSON line per routing decision to this file.",
)
@click.option(
    "--header-timeout",
    default=30.0,
    show_default=True,
    type=Finite(min=0, min_open=True),
    help="Seconds a client has to send a whole request head (also closes idle connections).",
)
@click.option(
    "--body-timeout",
    default=60.0,
    show_default=True,
    type=Finite(min=0, min_open=True),
    help="Seconds a client has to send a whole request body once its head is read.",
)
@click.option(
    "--max-connections",
    default=8192,
    show_default=True,
    type=click.IntRange(min=1),
    help="Client connections served at once; one beyond gets a 503.",
)
@click.option(
    "--kv-events",
    type=click.Choice(["auto", "off"]),
    default="auto",
    show_default=True,
    help="auto: route on the engines' KV-cache events wherever they publish them (needs "
    "--tokenizer backend or a tokenizer.json); off: on the router's estimate only.",
)
@click.option(
    "--kv-events-source",
    "kv_sources",
    multiple=True,
    metavar="URL=ENDPOINT[,REPLAY]",
    help="A backend's ZMQ endpoints (instead of its /kv_event_sources); repeat.",
)
@click.option("--no-uvloop", is_flag=True, help="Use asyncio's own event loop.")
def proxy(**kw: Any) -> None:
    """Serve an OpenAI-compatible, KV-cache-aware proxy in front of vLLM engines."""
    from kvroute.proxy import Proxy, ProxyConfig
    from kvroute.proxy.discover import block_size, model_folder
    from kvroute.sim.profile import load_profile

    tokenizer = kw["tokenizer"]
    if kw["model_dir"] is not None:
        if tokenizer != "auto":
            raise click.UsageError("--model and --tokenizer are alternatives: give one")
        tokenizer = kw["model_dir"]
    elif tokenizer == "auto":
        folder, why = model_folder(list(kw["backends"]))
        tokenizer = folder or "approx"
        click.echo(f"kvroute proxy: keys text with {tokenizer} ({why})", err=True)
    block = kw["block_size"]
    if block is None:
        block, why = block_size(list(kw["backends"]))
        click.echo(f"kvroute proxy: block size {block} ({why})", err=True)
    options = {"block_size": block, **_pairs(kw["router_opts"], "--router-option")}
    try:
        if kw["engine_profile"] is not None:
            options["engine_profile"] = load_profile(kw["engine_profile"])
        if kw["ttft_slo"] is not None:
            options["ttft_slo_s"] = kw["ttft_slo"]
        config = ProxyConfig(
            backends=list(kw["backends"]),
            policy=kw["policy"],
            router_options=options,
            tokenizer=tokenizer,
            session_header=kw["session_header"],
            session_field=kw["session_field"] or None,
            max_body_bytes=kw["max_body_bytes"],
            request_timeout_s=kw["request_timeout"],
            connect_timeout_s=kw["connect_timeout"],
            max_concurrency=kw["max_concurrency"],
            retries=kw["retries"],
            health_interval_s=kw["health_interval"],
            load_interval_s=kw["load_interval"],
            load_source=kw["load_source"],
            overload_waiting=kw["overload_waiting"],
            overload_kv_usage=kw["overload_kv_usage"],
            max_in_flight=kw["max_in_flight"],
            max_in_flight_tokens=token_cap(kw["max_in_flight_tokens"], kw["backends"], "proxy"),
            queue_size=kw["queue_size"],
            queue_timeout_s=kw["queue_timeout"],
            queue_patience_s=kw["queue_patience"],
            queue_hold_s=kw["queue_hold"],
            queue_hold_yield_s=kw["queue_hold_yield"],
            priority_header=kw["priority_header"],
            unhealthy_after=kw["unhealthy_after"],
            healthy_after=kw["healthy_after"],
            admin_token=kw["admin_token"] or None,
            decision_log=kw["decision_log"],
            header_read_timeout_s=kw["header_timeout"],
            body_read_timeout_s=kw["body_timeout"],
            max_connections=kw["max_connections"],
            kv_events=kw["kv_events"],
            kv_event_sources=_sources(kw["kv_sources"]),
        )
        _log_to_stderr("proxy")
        app = Proxy(config)
    except (KvrouteError, TypeError) as exc:
        raise BadInput(str(exc)) from exc
    chosen = {k: v for k, v in config.policy_options().items() if k != "block_size"}
    if "engine_profile" in chosen:
        chosen["engine_profile"] = kw["engine_profile"]
    said = ", ".join(f"{k}={v}" for k, v in chosen.items())
    click.echo(f"kvroute proxy: policy {config.policy}" + (f" ({said})" if said else ""), err=True)
    click.echo(
        f"kvroute proxy: load from the {config.load_source}"
        + (" (own counts plus the engines' reports)" if config.load_source == "engine" else "")
        + f", engines read every {config.load_interval_s:g} s",
        err=True,
    )
    _serve(app, kw, "proxy")


def _log_to_stderr(what: str) -> None:
    """Show the library's log from INFO up on stderr, as ``kvroute <what>: ...`` lines."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"kvroute {what}: %(message)s"))
    logger = logging.getLogger("kvroute")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _sources(pairs: tuple[str, ...]) -> dict[str, list[str]]:
    """``URL=ENDPOINT[,REPLAY]`` options as ``{url: [endpoint, replay]}``."""
    out = {}
    for pair in pairs:
        url, sep, endpoints = pair.partition("=")
        if not sep or not endpoints:
            raise click.BadParameter(
                f"{pair!r} is not URL=ENDPOINT[,REPLAY]", param_hint="--kv-events-source"
            )
        out[url] = endpoints.split(",")
    return out


def _serve(app: Any, kw: dict[str, Any], what: str) -> None:
    """Serve until SIGINT/SIGTERM; a port that cannot be bound is a clear error."""
    from kvroute.proxy.serving import serve_forever

    try:
        serve_forever(
            app, kw["host"], kw["port"], use_uvloop=not kw["no_uvloop"], on_ready=_ready(what)
        )
    except OSError as exc:
        raise click.ClickException(
            f"cannot listen on {kw['host']}:{kw['port']}: {exc.strerror or exc}"
        ) from exc


@click.command("engine")
@click.option(
    "--preset",
    default="h20-qwen3-coder-30b-a3b",
    show_default=True,
    help="Engine preset: the simulator's (h20-qwen3-coder-30b-a3b, h200-...) or 'fast'.",
)
@click.option(
    "--engine",
    "engine_kind",
    type=click.Choice(["sim", "simple"]),
    default="sim",
    show_default=True,
    help="The simulator's engine model, or the small Python one.",
)
@click.option("--speedup", default=1.0, show_default=True, type=Finite(min=0.0, min_open=True))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8100, show_default=True, type=click.IntRange(0, 65535))
@click.option("--model", default=None, help="Model name to serve (default: the preset's model).")
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a timing parameter of the preset.",
)
@click.option(
    "--engine-profile",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Timing and KV parameters from `kvroute calibrate` (--set wins); prompts are "
    "hashed in the profile's KV blocks.",
)
@click.option(
    "--no-prompt-tokens-details",
    is_flag=True,
    help="Leave cached_tokens out of usage (vLLM without the flag).",
)
@click.option(
    "--kv-events",
    is_flag=True,
    help="Publish the engine's KV-cache events as vLLM does (ZMQ on --host, ports chosen "
    "freely; GET /kv_event_sources names them).",
)
@click.option(
    "--no-kv-replay", is_flag=True, help="With --kv-events: no replay socket for missed batches."
)
@click.option("--error-rate", default=0.0, type=Finite(0, 1))
@click.option("--error-status", default=500, type=click.IntRange(400, 599))
@click.option("--stall-rate", default=0.0, type=Finite(0, 1))
@click.option("--stall-seconds", default=30.0, type=FINITE)
@click.option("--die-rate", default=0.0, type=Finite(0, 1))
@click.option("--die-after-tokens", default=1, type=click.IntRange(min=0))
@click.option("--fault-seed", default=0, type=int)
@click.option("--no-uvloop", is_flag=True, help="Use asyncio's own event loop.")
def engine(**kw: Any) -> None:
    """Serve an OpenAI-compatible emulator of one vLLM engine (no GPU)."""
    from kvroute.emulator import EmulatorConfig, FaultConfig, emulator_app
    from kvroute.emulator.server import DEFAULT_MODEL

    try:
        faults = FaultConfig(
            error_rate=kw["error_rate"],
            error_status=kw["error_status"],
            stall_rate=kw["stall_rate"],
            stall_s=kw["stall_seconds"],
            die_rate=kw["die_rate"],
            die_after_tokens=kw["die_after_tokens"],
            seed=kw["fault_seed"],
        )
        config = EmulatorConfig(
            model=kw["model"] or DEFAULT_MODEL,
            preset=kw["preset"],
            overrides=_engine_overrides(kw["engine_profile"], kw["overrides"]),
            speedup=kw["speedup"],
            prompt_tokens_details=not kw["no_prompt_tokens_details"],
            faults=faults,
            engine=kw["engine_kind"],
            kv_events=kw["kv_events"],
            kv_events_replay=not kw["no_kv_replay"],
            kv_events_host=kw["host"],
        )
        app = emulator_app(config)
    except (ValueError, TypeError) as exc:
        raise BadInput(str(exc)) from exc
    _serve(app, kw, "engine")


def _engine_overrides(profile: Path | None, sets: tuple[str, ...]) -> dict[str, Any]:
    """The emulator's parameters: a calibrated profile's (hashing prompts in its KV blocks,
    as vLLM does), then ``--set``."""
    out: dict[str, Any] = {}
    if profile is not None:
        from kvroute.sim.profile import load_profile

        out = dict(load_profile(profile))
        if "kv_block_size" in out:
            out["block_size"] = out["kv_block_size"]
    return {**out, **_pairs(sets, "--set")}


@click.command("replay")
@click.argument("trace", type=click.Path(exists=True, path_type=Path))
@click.option("--url", required=True, help="Base URL of the proxy or engine.")
@click.option(
    "--mode",
    type=click.Choice(["tracets", "thinktime", "poisson"]),
    default="thinktime",
    show_default=True,
)
@click.option("--rate", type=FINITE, default=None, help="poisson: sessions per second.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--time-scale",
    default=1.0,
    show_default=True,
    type=Finite(min=0.0),
    help="Multiply trace times (timestamps, think times) by this.",
)
@click.option(
    "--max-requests",
    default=None,
    type=click.IntRange(min=1),
    help="Replay only the first N requests of the trace.",
)
@click.option("--model", default=None, help="Model name (default: the first of /v1/models).")
@output_option(
    "--output",
    "-o",
    default=Path("replay.parquet"),
    show_default=True,
    help="Records (Parquet; refused if it exists).",
)
@click.option("--format", "fmt", default=None, help="Trace format (default: detected).")
@click.option("--infer-sessions", is_flag=True, help="Mooncake: group requests into sessions.")
@click.option("--vocab-size", default=32000, show_default=True, type=click.IntRange(min=257))
@click.option("--request-timeout", default=3600.0, show_default=True, type=FINITE)
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None)
@click.option(
    "--reset-cache",
    is_flag=True,
    help="POST /reset_prefix_cache first (a proxy sends it to every backend): start cold.",
)
@click.option("--no-progress", is_flag=True)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def replay(trace: Path, **kw: Any) -> None:
    """Replay a trace's sessions against an OpenAI-compatible endpoint; write records."""
    from kvroute.metrics import summarize
    from kvroute.records import write_records
    from kvroute.replay import ReplayConfig
    from kvroute.replay import replay as run_replay
    from kvroute.trace import read_trace

    table = read_trace(trace, format=kw["fmt"], infer_sessions=kw["infer_sessions"])
    config = ReplayConfig(
        url=kw["url"],
        mode=kw["mode"],
        model=kw["model"],
        time_scale=kw["time_scale"],
        max_requests=kw["max_requests"],
        rate=kw["rate"],
        seed=kw["seed"],
        vocab_size=kw["vocab_size"],
        request_timeout_s=kw["request_timeout"],
        api_key=kw["api_key"],
        progress=not kw["no_progress"],
        reset_cache=kw["reset_cache"],
    )
    records = run_replay(table, config)
    write_records(records, kw["output"], force=kw["force"])
    summary = summarize(records)
    if kw["as_json"]:
        click.echo(json.dumps(summary, indent=2))
        return
    click.echo(f"records: {kw['output']} ({records.num_rows} requests)")
    for key in ("requests", "errors", "apc", "req_bal"):
        click.echo(f"{key}: {summary[key]}")
    for key in ("ttft", "tpot", "e2e"):
        p = summary[key]
        click.echo(
            f"{key} (s): "
            + ", ".join(f"{k}={v:.4f}" if v is not None else f"{k}=-" for k, v in p.items())
        )
