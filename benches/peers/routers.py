"""The routers of the peers benchmark, each in a process of its own in front of the same
engines: kvroute's proxy, SMG (``pip install smg``) and vllm-router (``pip install
vllm-router``) from PyPI, installed in a cached virtual environment of their own
(:func:`peers_venv`, pinned versions), and the CPU time each spends.

An :class:`Arm` is one router in one configuration: how to start it (its command line for
the engines' URLs, KV-event endpoints and tokenizer), its documented best settings per
workload kind, and whether it takes the session header. O(1) per call; the processes are
owned by the caller (``Router`` is a context manager that stops its process group).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from release_build import require_release as require_release

#: The peers as installed from PyPI (the versions the results name).
PEER_PACKAGES = ("smg==1.13.0", "vllm-router==0.1.17")
REPO = Path(__file__).resolve().parents[2]
#: The header that names a request's session (what every router here is told to read).
SESSION_HEADER = "x-session-id"


@dataclass(frozen=True)
class Fleet:
    """What a router is put in front of: the engines' URLs, each one's KV-event endpoint
    (``tcp://host:port``) and replay endpoint, their KV block size, and the model's folder
    (``tokenizer.json``, ``tokenizer_config.json``)."""

    urls: tuple[str, ...]
    events: tuple[str, ...]
    replays: tuple[str, ...]
    block_size: int
    model_dir: Path
    model: str
    #: An engine profile of these engines (``kvroute calibrate``), for the arms that need one.
    profile: Path | None = None


#: An arm's command line after the router's executable, for a fleet, its port and a port for
#: its own metrics server (the peers bind one, 29000 by default).
Argv = Callable[[Fleet, int, int], list[str]]


@dataclass(frozen=True)
class Arm:
    """One router in one configuration (see the module doc)."""

    name: str
    kind: str  # "kvroute", "smg" or "vllm-router"
    argv: Argv
    #: Whether the benchmark sends this arm the session header (the router reads it).
    sessions: bool = True
    #: Router processes started alike, each request sent to the next in turn (replicas behind
    #: a load balancer that knows nothing of sessions).
    replicas: int = 1
    #: Whether the arm reads the engines' profile (``Fleet.profile``).
    needs_profile: bool = False


#: Admission's options in the arms: a queue; a queue with holds of a second; a cap in prompt
#: tokens sized to the engines' KV cache.
QUEUE = ("--queue-size", "1024")
HOLDS = (*QUEUE, "--queue-hold", "1")
TOKEN_CAP = ("--max-in-flight-tokens", "cache")


def _kvroute(*extra: str) -> Argv:
    def argv(fleet: Fleet, port: int, _metrics: int) -> list[str]:
        backends = [a for url in fleet.urls for a in ("--backend", url)]
        return ["proxy", *backends, "--port", str(port), *extra]

    return argv


def _kvroute_ttft(*extra: str) -> Argv:
    """``--policy ttft`` with the fleet's engine profile."""

    def argv(fleet: Fleet, port: int, metrics: int) -> list[str]:
        if fleet.profile is None:
            raise RuntimeError("the ttft arms need the engines' profile")
        profile = ["--policy", "ttft", "--engine-profile", str(fleet.profile)]
        return _kvroute(*profile, *extra)(fleet, port, metrics)

    return argv


def _smg(*extra: str) -> Argv:
    def argv(fleet: Fleet, port: int, metrics: int) -> list[str]:
        return [
            "launch", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
            "--worker-urls", *fleet.urls, *extra,
        ]  # fmt: skip

    return argv


def _vllm_router(*extra: str, events: bool = False) -> Argv:
    def argv(fleet: Fleet, port: int, metrics: int) -> list[str]:
        out = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *fleet.urls]
        out += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics)]
        if events:
            for url, pub, replay in zip(fleet.urls, fleet.events, fleet.replays, strict=True):
                out += ["--kv-event-source", f"{url}={pub}"]
                out += ["--kv-event-replay-source", f"{url}={replay}"]
            out += ["--kv-event-block-size", str(fleet.block_size)]
            out += ["--kv-event-model", fleet.model]
        return out + list(extra)

    return argv


ARMS: dict[str, Arm] = {
    arm.name: arm
    for arm in (
        # kvroute with no flags but its backends: what a new user runs (it finds the model's
        # folder, the engines' block size and KV events by itself).
        Arm("kvroute-default", "kvroute", _kvroute()),
        # The same, with one of its policies named.
        Arm("kvroute-unified", "kvroute", _kvroute("--policy", "unified")),
        Arm("kvroute-sglang", "kvroute", _kvroute("--policy", "sglang_cache_aware")),
        Arm(
            "kvroute-unified-dynamo8",
            "kvroute",
            _kvroute("--policy", "unified_dynamo", "--router-option", "overlap_weight=8"),
        ),
        Arm(
            "kvroute-dynamo8",
            "kvroute",
            _kvroute("--policy", "dynamo_cost", "--router-option", "overlap_weight=8"),
        ),
        # The defaults before the proxy found anything by itself: approximate keys of text in
        # 512-token blocks, the estimate view, unified.
        Arm(
            "kvroute-old-default",
            "kvroute",
            _kvroute("--tokenizer", "approx", "--block-size", "512", "--policy", "unified"),
        ),
        Arm("smg-cache-aware", "smg", _smg("--policy", "cache_aware"), sessions=False),
        Arm(
            "smg-cache-aware-sticky",
            "smg",
            _smg(
                "--policy",
                "cache_aware",
                "--sticky-sessions",
                "--routing-key-headers",
                SESSION_HEADER,
            ),
        ),
        Arm(
            "vllm-router-kv-aware",
            "vllm-router",
            _vllm_router(
                "--policy", "kv_aware", "--kv-aware-session-affinity-ttl-secs", "600", events=True
            ),
        ),
        Arm("round-robin", "kvroute", _kvroute("--policy", "round_robin"), sessions=False),
        # vllm-router placing as round-robin does: with the same placement, what is left between
        # the two is each router's own cost (its relay, its CPU beside the engines).
        Arm(
            "vllm-router-rr", "vllm-router", _vllm_router("--policy", "round_robin"), sessions=False
        ),
        Arm("kvroute-shared", "kvroute", _kvroute("--router-option", "affinity=shared")),
        # The default with the prefill queued on each engine in Dynamo's cost, at face value.
        Arm("kvroute-queued1", "kvroute", _kvroute("--router-option", "queued_weight=1")),
        # The default, its policies reading only the router's own counts.
        Arm("kvroute-own-load", "kvroute", _kvroute("--load-source", "router")),
        # Admission: at most N requests in flight per engine, the rest wait at the router.
        *(
            Arm(f"kvroute-admit{n}", "kvroute", _kvroute("--max-in-flight", str(n), *QUEUE))
            for n in (2, 3, 4, 5, 6, 8)
        ),
        # ... with holds: an engine keeps a room for a session's next turn for a second.
        *(
            Arm(f"kvroute-hold{n}", "kvroute", _kvroute("--max-in-flight", str(n), *HOLDS))
            for n in (3, 4)
        ),
        Arm(
            "kvroute-hold4-yield2",
            "kvroute",
            _kvroute("--max-in-flight", "4", *HOLDS, "--queue-hold-yield", "2"),
        ),
        # ... a cap in prompt tokens instead, sized to the engines' KV cache: the sessions
        # served on an engine (in flight and held) are those whose prompts its cache holds.
        Arm("kvroute-tokens-queue", "kvroute", _kvroute(*TOKEN_CAP, *QUEUE)),
        Arm("kvroute-tokens", "kvroute", _kvroute(*TOKEN_CAP, *HOLDS)),
        *(
            Arm(
                f"kvroute-tokens-hold4{suffix}",
                "kvroute",
                _kvroute(*TOKEN_CAP, "--max-in-flight", "4", *HOLDS, *yield_args),
            )
            for suffix, yield_args in (
                ("", ()),
                ("-yield1", ("--queue-hold-yield", "1")),
                ("-yield2", ("--queue-hold-yield", "2")),
            )
        ),
        # Dynamo's own count of the blocks in flight: a block several requests share, once.
        Arm("kvroute-dedup", "kvroute", _kvroute("--router-option", "dedup_weight=1")),
        # Least predicted time to first token at the engines' calibrated costs; with a target
        # (seconds), the most cache reuse among the engines predicted to meet it.
        Arm("kvroute-ttft", "kvroute", _kvroute_ttft(), needs_profile=True),
        # The same without a profile: the costs fitted to the proxy's own first tokens.
        Arm("kvroute-ttft-online", "kvroute", _kvroute("--policy", "ttft")),
        # ... behind the token cap with holds (`kvroute-tokens`).
        Arm("kvroute-ttft-tokens", "kvroute", _kvroute("--policy", "ttft", *TOKEN_CAP, *HOLDS)),
        # ... without the delay a prefill adds to the requests running on the engine.
        Arm(
            "kvroute-ttft-online-nodelay",
            "kvroute",
            _kvroute("--policy", "ttft", "--router-option", "delay_weight=0"),
        ),
        Arm(
            "kvroute-ttft-online-slo0.25",
            "kvroute",
            _kvroute("--policy", "ttft", "--ttft-slo", "0.25"),
        ),
        *(
            Arm(
                f"kvroute-ttft-slo{t}",
                "kvroute",
                _kvroute_ttft("--ttft-slo", t),
                needs_profile=True,
            )
            for t in ("0.1", "0.25")
        ),
    )
}
# Two and three replicas of a router behind a per-request round robin: "<arm>-x2", "-x3".
for _name in (
    "kvroute-default",
    "kvroute-shared",
    "kvroute-own-load",
    "smg-cache-aware-sticky",
    "vllm-router-kv-aware",
):
    for _n in (2, 3):
        _xn = dataclasses.replace(ARMS[_name], name=f"{_name}-x{_n}", replicas=_n)
        ARMS[_xn.name] = _xn


def peers_venv(log: Callable[[str], None] = print) -> Path:
    """The cached virtual environment with SMG and vllm-router (installed on first use, about
    a minute); its ``bin`` folder."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    tag = "-".join(p.replace("==", "") for p in PEER_PACKAGES)
    root = cache / "kvroute" / f"peers-{tag}"
    stamp = root / ".complete"
    if not stamp.exists():
        log(f"installing {', '.join(PEER_PACKAGES)} into {root}")
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True)
        pip = [str(root / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, "--disable-pip-version-check", *PEER_PACKAGES], check=True)
        stamp.write_text("\n".join(PEER_PACKAGES) + "\n")
    return root / "bin"


def executable(kind: str, peers_bin: Path | None) -> list[str]:
    """The command that starts a router of ``kind``."""
    if kind == "kvroute":
        return [str(Path(sys.executable).parent / "kvroute")]
    if peers_bin is None:
        raise ValueError(f"{kind} needs the peers' environment (peers_venv())")
    return [str(peers_bin / ("smg" if kind == "smg" else "vllm-router"))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its live descendants (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            parents[int(entry.name)] = int(fields[1])
            times[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, p in parents.items():
            if p == parent and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(times.get(p, 0.0) for p in tree)


class Router:
    """A started router (see :func:`start`)."""

    def __init__(self, arm: Arm, process: subprocess.Popen[bytes], url: str, log: Path):
        self.arm, self.process, self.url, self.log = arm, process, url, log

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.process.pid)

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=15)

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start(
    arm: Arm,
    fleet: Fleet,
    ports: tuple[int, int],
    log_dir: Path,
    peers_bin: Path | None,
    ready: Callable[[str], bool],
    timeout_s: float = 120.0,
) -> Router:
    """Start ``arm`` on ``ports`` (its own, its metrics server's) in front of ``fleet`` and
    wait until ``ready(url)`` (a request through it answered); its log in ``log_dir``."""
    port, metrics = ports
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{arm.name}-{port}.log"
    argv = [*executable(arm.kind, peers_bin), *arm.argv(fleet, port, metrics)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "RUST_LOG": "warn"}
    with open(log, "ab") as out:
        out.write(("$ " + " ".join(argv) + "\n").encode())
        out.flush()
        process = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True,
        )  # fmt: skip
    router = Router(arm, process, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{arm.name} exited with {process.returncode}:\n{tail}")
        if _answers(router.url) and ready(router.url):
            return router
        if time.monotonic() > deadline:
            router.stop()
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{arm.name} not ready after {timeout_s:.0f} s:\n{tail}")
        time.sleep(0.5)


def _answers(url: str) -> bool:
    for path in ("/health", "/v1/models"):
        with contextlib.suppress(OSError), urllib.request.urlopen(url + path, timeout=5) as r:
            if r.status == 200:
                return True
    return False


def arms(names: Sequence[str]) -> list[Arm]:
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}; the arms are {', '.join(ARMS)}")
    return [ARMS[n] for n in names]
