"""Synthetic agentic traces shaped like the study's GLM-5.1 trace (``kvroute trace synth``).

:func:`synthesize` writes a trace in the canonical format (:mod:`kvroute.schema`: zstd
Parquet, block size 512 in the metadata) and returns the statistics it achieved next to
the study's numbers (:class:`SynthStats`). Two profiles (:data:`PROFILES`):

- ``agentic-glm``: the full GLM-5.1 agentic trace (2.11M requests, 1.31M sessions, ~2 h);
  ``requests=`` scales it (sessions in proportion), so small traces are quick.
- ``w600``: the study's w600 sample (1214 requests, 274 sessions, 53.3M input tokens,
  sessions starting in a 600 s window).

The model, its parameters and how close it gets are in ``docs/synth.md``. In short:

- **Sessions** have a heavy-tailed number of turns: stratified quantiles of a distribution
  that is 1 turn with probability ``f1`` (solved so the mean is requests/sessions),
  log-uniform from 2 to ``body_turns`` up to quantile ``body_q``, and Pareto beyond, with
  the exponent set so the largest of the reference session count is ``max_turns``.
- **Contexts** are append-only: turn t+1's input is turn t's input + turn t's output + new
  content (a tool result or a user message). A session compacts its context when it would
  pass its limit: the input drops to a summary ("floor") and every block after the system
  prefix is new. So turn t+1 keeps the keys of turn t's *full* blocks (or only the prefix
  after a compaction) and gets fresh keys from there on.
- **Keys** are a bijective 64-bit mix (splitmix64's finalizer, XOR-salted by the seed) of
  a packed ``(domain, session, turn that first wrote the block, position)`` or
  ``(domain, prefix id, position)``, so equal key at position i <=> equal prefix, and no
  two different prefixes collide. Cross-session sharing comes only from prefixes: a few
  global system prompts (Zipf popularity) and small "project" groups (2-7 sessions
  sharing a longer prefix).
- **Time**: session starts follow a mildly diurnal Poisson process; a turn starts one
  service time (prefill of its new tokens + decode) plus a think gap after the previous
  one; ``time_to_parent_chat`` is that gap (lognormal; tool results are quick, user
  messages slow).

Generation is two passes with bounded memory: pass 1 draws every per-request scalar
(~100 bytes a request) in session order and sorts the requests by timestamp; pass 2 walks
the requests in timestamp order in chunks of about :data:`CHUNK_KEYS` keys, computes each
chunk's keys from the scalars alone (a key's writer turn comes from a per-epoch lookup
table) and appends the chunk to the Parquet file as one row group. The keys themselves
(8 bytes each, ~139M at full scale) are never all in memory. Deterministic: the same
arguments give a byte-identical file.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
import zlib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq
from rich.table import Table

from kvroute.errors import InvalidArgumentError
from kvroute.schema import BLOCK_SIZE_KEY, trace_schema

__all__ = [
    "BLOCK_SIZE",
    "KV_BYTES_PER_TOKEN",
    "PROFILES",
    "Profile",
    "SynthStats",
    "Target",
    "synthesize",
]

BLOCK_SIZE = 512
#: The study's KV table: Qwen3-Coder-30B-A3B, 2 x 48 layers x 4 KV heads x 128 x 2 bytes.
KV_BYTES_PER_TOKEN = 98304
#: Target keys per Parquet row group (pass 2 chunk); bounds the generator's working set.
CHUNK_KEYS = 4_000_000
MAX_CHUNK_ROWS = 262_144
SYNTH_META_KEY = b"kvroute.synth"

_GIB = 2**30
_TOKENS_PER_GIB = _GIB / KV_BYTES_PER_TOKEN
# Packed key layout (then XOR-salted and mixed, both bijections of uint64):
#   session blocks: bit 63 = 0 | session (30 bits) | writer turn (17 bits) | position (16)
#   prefix blocks:  bit 63 = 1 | prefix id (47 bits)                        | position (16)
_POS_BITS = 16
_TURN_BITS = 17
_SESSION_BITS = 30
_MAX_TURNS = (1 << _TURN_BITS) - 1

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]
U64 = npt.NDArray[np.uint64]
B1 = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class Target:
    """One number the study reported (or the issue asked for), compared in :class:`SynthStats`."""

    key: str
    label: str
    value: float | None  # None: shown for information, no study number
    fmt: str
    scales: bool = False
    note: str = ""


@dataclass(frozen=True)
class Profile:
    """The parameters of one trace shape. Lengths are tokens, times seconds."""

    name: str
    summary: str
    requests: int
    sessions: int
    duration_s: float
    # True: every session lies inside [0, duration) (long ones are time-compressed);
    # False: sessions *start* inside the window and may run past it (a windowed sample).
    contain_sessions: bool
    # turns per session (see the module doc)
    body_q: float
    body_turns: float
    max_turns: float
    # per-session context: first turn truncated lognormal in [prefix + first_min, limit]
    first_median: float
    first_sigma: float
    first_min: int
    multi_first_scale: float  # first-turn median multiplier for multi-turn sessions
    limit_lo: int
    limit_hi: int
    big_limit_fraction: float
    big_limit_lo: int
    big_limit_hi: int
    floor_lo: float  # compaction floor as a fraction of the session's limit
    floor_hi: float
    # per-turn lengths (lognormal, clipped)
    output_median: float
    output_sigma: float
    output_max: int
    tool_fraction: float  # later turns that carry a tool result (else a user message)
    tool_median: float
    tool_sigma: float
    text_median: float
    text_sigma: float
    new_max: int
    # cross-session prefixes
    global_blocks: tuple[int, ...]
    global_zipf: float
    global_fraction: float
    project_fraction: float
    project_blocks_lo: int
    project_blocks_hi: int
    project_group_p: float  # group size = 2 + geometric(p) - 1, clipped to 7
    # timing
    ttft_base_s: float
    prefill_tok_s: float
    tpot_s: float
    think_tool_median_s: float
    think_tool_sigma: float
    think_text_median_s: float
    think_text_sigma: float
    diurnal_amplitude: float
    max_span_fraction: float
    targets: tuple[Target, ...] = field(default=())


_GLM_TARGETS = (
    Target("requests", "requests", 2_110_000, ",.0f", scales=True),
    Target("sessions", "sessions", 1_310_000, ",.0f", scales=True),
    Target("duration_s", "duration (s)", 7200, ",.0f", note="assumed (~2 h)"),
    Target("turns_p90", "turns/session p90", 1, ".0f"),
    Target("turns_p99", "turns/session p99", 18, ".0f"),
    Target("turns_max", "turns/session max", 3091, ",.0f", note="at 1.31M sessions"),
    Target("input_p50", "input tokens p50", 20_000, ",.0f", note="~ KV p50 / 98304 B"),
    Target("input_p90", "input tokens p90", 88_000, ",.0f"),
    Target("input_p99", "input tokens p99", 125_000, ",.0f"),
    Target("input_max", "input tokens max", 202_000, ",.0f"),
    Target("kv_p50_gib", "KV/request p50 (GiB)", 1.83, ".2f", note="(in+out) x 98304 B"),
    Target("kv_p90_gib", "KV/request p90 (GiB)", 8.04, ".2f"),
    Target("kv_p95_gib", "KV/request p95 (GiB)", 9.59, ".2f"),
    Target("kv_p99_gib", "KV/request p99 (GiB)", 11.49, ".2f"),
    Target("kv_max_gib", "KV/request max (GiB)", 18.5, ".2f"),
    Target("keys", "hash keys", 137_000_000, ",.0f", scales=True, note="the issue's estimate"),
    Target(
        "any_ceiling",
        "any-session APC ceiling",
        None,
        ".1%",
        note="not reported for the full trace",
    ),
    Target("intra_ceiling", "intra-session APC ceiling", None, ".1%"),
    Target("cross_gap_pp", "any - intra ceiling (pp)", 1.0, ".2f", note="must stay below"),
    Target("single_turn_fraction", "single-turn sessions", None, ".1%"),
    Target(
        "time_compressed_sessions",
        "time-compressed sessions",
        None,
        ",.0f",
        note="span > 98% of the window",
    ),
)

_W600_TARGETS = (
    Target("requests", "requests", 1214, ",.0f", scales=True),
    Target("sessions", "sessions", 274, ",.0f", scales=True),
    Target("duration_s", "duration (s)", None, ",.0f", note="sessions start in 600 s"),
    Target("turns_max", "turns/session max", None, ",.0f"),
    Target("input_tokens", "input tokens", 53_300_000, ",.0f", scales=True),
    Target("input_mean", "input tokens/request mean", 43_900, ",.0f"),
    Target("window_requests", "requests before 600 s", 807, ",.0f", scales=True),
    Target("single_turn_fraction", "single-turn sessions", 0.30, ".1%", note="sampler cap"),
    Target("beyond_turn8_fraction", "requests past turn 8", 0.37, ".1%", note="capped ablation"),
    Target("any_ceiling", "any-session APC ceiling", 0.803, ".1%"),
    Target("intra_ceiling", "intra-session APC ceiling", 0.796, ".1%"),
    Target("cross_gap_pp", "any - intra ceiling (pp)", 0.7, ".2f"),
    Target("shared_ceiling", "shared-prefix ceiling (>= 8 sess.)", 0.0010, ".2%"),
    Target("any_hit_requests", "any-session hit requests", 961, ",.0f", scales=True),
    Target("intra_hit_requests", "intra-session hit requests", 914, ",.0f", scales=True),
    Target("shared_hit_requests", "shared-prefix hit requests", 107, ",.0f", scales=True),
)

_AGENTIC_GLM = Profile(
    name="agentic-glm",
    summary="the study's full GLM-5.1 agentic trace (2.11M requests, 1.31M sessions, ~2 h)",
    requests=2_110_000,
    sessions=1_310_000,
    duration_s=7200.0,
    contain_sessions=True,
    body_q=0.99,
    body_turns=18.0,
    max_turns=3091.0,
    first_median=9_700.0,
    first_sigma=1.0,
    first_min=256,
    multi_first_scale=1.7,
    limit_lo=115_000,
    limit_hi=140_000,
    big_limit_fraction=0.05,
    big_limit_lo=150_000,
    big_limit_hi=202_069,
    floor_lo=0.15,
    floor_hi=0.40,
    output_median=300.0,
    output_sigma=1.0,
    output_max=32_768,
    tool_fraction=0.85,
    tool_median=2500.0,
    tool_sigma=1.3,
    text_median=300.0,
    text_sigma=1.2,
    new_max=65_536,
    global_blocks=(1, 1, 2, 2, 3, 3, 4, 4, 5, 6, 7, 8),
    global_zipf=1.0,
    global_fraction=0.10,
    project_fraction=0.02,
    project_blocks_lo=8,
    project_blocks_hi=48,
    project_group_p=0.5,
    ttft_base_s=0.3,
    prefill_tok_s=8000.0,
    tpot_s=0.025,
    think_tool_median_s=2.0,
    think_tool_sigma=1.0,
    think_text_median_s=20.0,
    think_text_sigma=1.0,
    diurnal_amplitude=0.25,
    max_span_fraction=0.98,
    targets=_GLM_TARGETS,
)

# The w600 sample: the same first-turn, growth, output and timing model; its own turn
# distribution (multi-turn heavy: the sampler capped single-turn sessions at 30%, and turns
# past the 8th are 37% of requests), a 600 s window that sessions start in (and may run
# past), slightly earlier compaction (to land on its 43.9k mean input) and more prefix
# sharing between sessions (its any - intra gap is 0.7 pp).
_W600 = replace(
    _AGENTIC_GLM,
    name="w600",
    summary="the study's w600 sample (1214 requests, 274 sessions, 53.3M input tokens)",
    requests=1214,
    sessions=274,
    duration_s=600.0,
    contain_sessions=False,
    body_q=0.88,
    body_turns=4.5,
    max_turns=220.0,
    limit_lo=100_000,
    limit_hi=131_072,
    floor_lo=0.08,
    floor_hi=0.30,
    global_fraction=0.15,
    project_fraction=0.15,
    diurnal_amplitude=0.0,
    targets=_W600_TARGETS,
)

PROFILES: dict[str, Profile] = {p.name: p for p in (_AGENTIC_GLM, _W600)}


# --------------------------------------------------------------------------------------
# statistics


@dataclass
class SynthStats:
    """What :func:`synthesize` achieved, with the profile's targets.

    Lengths are tokens; ``kv_*_gib`` is ``(input + output) * 98304 B`` per request (as
    ``kvroute trace stats`` computes it); percentiles are numpy's linear ones. The APC
    ceilings follow the project's semantics (timestamp order, ``hit_tokens =
    min(k * 512, input)``; ``shared`` counts nodes reached by >= 8 sessions) and are
    computed exactly from the generator's structure, without a key set.
    ``window_requests`` counts requests before ``duration_s`` of the profile;
    ``beyond_turn8_fraction`` the requests that ``cap_sessions(max_turns=8)`` drops."""

    profile: str
    path: str
    seed: int
    requests: int
    sessions: int
    duration_s: float
    window_requests: int
    input_tokens: int
    input_mean: float
    output_tokens: int
    keys: int
    turns_p50: float
    turns_p90: float
    turns_p99: float
    turns_max: int
    turns_mean: float
    single_turn_fraction: float
    beyond_turn8_fraction: float
    input_p50: float
    input_p90: float
    input_p95: float
    input_p99: float
    input_max: int
    output_p50: float
    output_mean: float
    kv_p50_gib: float
    kv_p90_gib: float
    kv_p95_gib: float
    kv_p99_gib: float
    kv_max_gib: float
    any_ceiling: float
    intra_ceiling: float
    cross_gap_pp: float
    shared_ceiling: float
    any_hit_requests: int
    intra_hit_requests: int
    shared_hit_requests: int
    compactions: int
    prefix_sessions_fraction: float
    time_compressed_sessions: int
    ttp_p50_s: float
    ttp_p90_s: float
    elapsed_s: float = 0.0
    file_bytes: int = 0
    targets: tuple[Target, ...] = field(default=(), repr=False)
    target_scale: float = field(default=1.0, repr=False)

    def comparison(self) -> list[tuple[str, str, str, str]]:
        """``(label, target, achieved, note)`` for every target of the profile."""
        rows = []
        for t in self.targets:
            want = self._target(t)
            note = t.note
            if t.key == "turns_max" and want is not None and self.target_scale != 1.0:
                note = "at 1.31M sessions; fewer sessions draw a smaller maximum"
            shown = "-" if want is None else format(want, t.fmt)
            rows.append((t.label, shown, format(getattr(self, t.key), t.fmt), note))
        return rows

    def _target(self, t: Target) -> float | None:
        if t.value is None or not t.scales:
            return t.value
        return float(round(t.value * self.target_scale))

    def table(self) -> Table:
        """A :class:`rich.table.Table` of achieved vs target."""
        table = Table(
            title=f"kvroute trace synth --profile {self.profile} --seed {self.seed}: "
            f"{self.requests:,} requests, {self.keys:,} keys, {self.elapsed_s:.1f} s"
        )
        table.add_column("metric", justify="left")
        table.add_column("target", justify="right")
        table.add_column("achieved", justify="right")
        table.add_column("note", justify="left", style="dim")
        for row in self.comparison():
            table.add_row(*row)
        return table

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every achieved statistic plus ``targets`` (scaled where they scale)."""
        out = asdict(self)
        out.pop("targets")
        out.pop("target_scale")
        out["targets"] = {t.key: self._target(t) for t in self.targets if t.value is not None}
        return out


# --------------------------------------------------------------------------------------
# pass 1: per-request scalars


@dataclass
class _Plan:
    profile: Profile
    seed: int
    # per session (internal index)
    sid: I64  # public session id: rank of the session's start time
    turns: I64
    prefix_id: I64  # -1: none
    prefix_blocks: I64
    time_factor: F64
    # per request, session order
    sess: I64
    turn: I64
    inp: I64
    out: I64
    ts: F64
    ttp: F64
    is_tool: B1
    hit_intra: I64
    inh_keys: I64  # leading blocks whose keys come from earlier turns (same epoch)
    tab_start: I64  # this row's epoch's offset into `table`
    new_epoch: B1
    table: npt.NDArray[np.int32]  # writer turn by (epoch, position - prefix)
    order: I64  # session-order row of the request with request_id i


def _lognormal(rng: np.random.Generator, median: float, sigma: float, n: int) -> F64:
    return median * np.exp(sigma * rng.standard_normal(n))


def _trunc_lognormal(rng: np.random.Generator, median: F64, sigma: float, lo: I64, hi: I64) -> I64:
    """Lognormal draws resampled until inside [lo, hi] (clipped after 64 rounds)."""
    x = median * np.exp(sigma * rng.standard_normal(len(median)))
    bad = (x < lo) | (x > hi)
    for _ in range(64):
        nbad = int(bad.sum())
        if nbad == 0:
            break
        x[bad] = median[bad] * np.exp(sigma * rng.standard_normal(nbad))
        bad = (x < lo) | (x > hi)
    return np.clip(np.round(x), lo, hi).astype(np.int64)


def _tail_alpha(p: Profile) -> float:
    """Pareto exponent so that the largest of ``p.sessions`` stratified draws is ``max_turns``."""
    top = 0.5 / p.sessions
    return math.log((1.0 - p.body_q) / top) / math.log(p.max_turns / p.body_turns)


def _turn_quantile(u: F64, f1: float, p: Profile, alpha: float) -> I64:
    n = np.ones(len(u))
    body = (u >= f1) & (u < p.body_q)
    n[body] = 2.0 * ((p.body_turns + 1.0) / 2.0) ** ((u[body] - f1) / (p.body_q - f1))
    tail = u >= p.body_q
    n[tail] = p.body_turns * ((1.0 - u[tail]) / (1.0 - p.body_q)) ** (-1.0 / alpha)
    return np.minimum(np.floor(n + 1e-6), _MAX_TURNS).astype(np.int64)


def _turn_counts(p: Profile, n_req: int, n_sess: int, rng: np.random.Generator) -> I64:
    """Stratified quantiles (so percentiles land on target at any scale), with ``f1`` solved
    for the mean, shuffled, then nudged by +-1 turns to sum to exactly ``n_req``."""
    u = (np.arange(n_sess) + 0.5) / n_sess
    alpha = _tail_alpha(p)
    lo, hi = 0.0, p.body_q - 1e-9
    if int(_turn_quantile(u, lo, p, alpha).sum()) <= n_req:
        f1 = lo
    elif int(_turn_quantile(u, hi, p, alpha).sum()) >= n_req:
        f1 = hi
    else:
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if int(_turn_quantile(u, mid, p, alpha).sum()) > n_req:
                lo = mid
            else:
                hi = mid
        f1 = hi
    n = rng.permutation(_turn_quantile(u, f1, p, alpha))
    diff = n_req - int(n.sum())
    while diff != 0:
        cand = np.flatnonzero(n >= 2)
        if len(cand) == 0:
            cand = np.arange(n_sess)
        k = min(abs(diff), len(cand))
        pick = rng.choice(cand, size=k, replace=False)
        n[pick] += 1 if diff > 0 else -1
        diff -= k if diff > 0 else -k
    return n


def _prefixes(p: Profile, n_sess: int, rng: np.random.Generator) -> tuple[I64, I64, I64]:
    """Per session: prefix id (-1 none) and blocks; and the sessions per prefix id."""
    pid = np.full(n_sess, -1, dtype=np.int64)
    n_glob = len(p.global_blocks)
    w = 1.0 / (np.arange(n_glob) + 1.0) ** p.global_zipf
    r = rng.random(n_sess)
    glob = r < p.global_fraction
    pid[glob] = rng.choice(n_glob, size=int(glob.sum()), p=w / w.sum())
    proj = np.flatnonzero((r >= p.global_fraction) & (r < p.global_fraction + p.project_fraction))
    proj = rng.permutation(proj)
    sizes = np.minimum(rng.geometric(p.project_group_p, size=len(proj) + 1) + 1, 7)
    n_groups = int(np.searchsorted(np.cumsum(sizes), len(proj))) + 1 if len(proj) else 0
    sizes = sizes[:n_groups]
    pid[proj] = n_glob + np.repeat(np.arange(n_groups), sizes)[: len(proj)]
    group_blocks = rng.integers(p.project_blocks_lo, p.project_blocks_hi + 1, size=n_groups)
    blocks_of = np.concatenate([np.asarray(p.global_blocks, dtype=np.int64), group_blocks])
    blocks = np.where(pid >= 0, blocks_of[np.maximum(pid, 0)], 0).astype(np.int64)
    per_prefix = np.bincount(pid[pid >= 0], minlength=len(blocks_of)).astype(np.int64)
    return pid, blocks, per_prefix


def _inverse_rate(p: Profile, u: F64, hi: F64) -> F64:
    """Times in [0, hi) from uniforms ``u`` under a mildly diurnal rate (the window starts at
    09:00, the rate is 1 + a*sin(2*pi*(hour - 9)/24))."""
    grid = np.linspace(0.0, p.duration_s, 4097)
    lam = 1.0 + p.diurnal_amplitude * np.sin(2.0 * np.pi * grid / 86_400.0)
    cum = np.concatenate([[0.0], np.cumsum(0.5 * (lam[1:] + lam[:-1]) * np.diff(grid))])
    target = u * np.interp(hi, grid, cum)
    out: F64 = np.interp(target, cum, grid)
    return np.minimum(out, np.nextafter(hi, 0.0))


def _plan(p: Profile, n_req: int, seed: int) -> tuple[_Plan, I64]:
    ss = np.random.SeedSequence([seed, zlib.crc32(p.name.encode())])
    g_turn, g_sess, g_pref, g_req, g_time = (np.random.default_rng(c) for c in ss.spawn(5))
    n_sess = max(1, min(n_req, round(n_req * p.sessions / p.requests)))
    if n_sess >= 1 << _SESSION_BITS:
        raise InvalidArgumentError(f"requests={n_req} needs more than 2^30 sessions")

    turns = _turn_counts(p, n_req, n_sess, g_turn)
    pid, pblocks, per_prefix = _prefixes(p, n_sess, g_pref)

    # per-session context parameters
    big = g_sess.random(n_sess) < p.big_limit_fraction
    limit = np.where(
        big,
        g_sess.integers(p.big_limit_lo, p.big_limit_hi + 1, size=n_sess),
        g_sess.integers(p.limit_lo, p.limit_hi + 1, size=n_sess),
    ).astype(np.int64)
    min_ctx = pblocks * BLOCK_SIZE + p.first_min
    floor_ = np.maximum(
        (g_sess.uniform(p.floor_lo, p.floor_hi, size=n_sess) * limit).astype(np.int64), min_ctx
    )
    limit = np.maximum(limit, floor_ + 4 * BLOCK_SIZE)
    median = np.where(turns > 1, p.first_median * p.multi_first_scale, p.first_median)
    c0 = _trunc_lognormal(g_sess, median, p.first_sigma, min_ctx, limit)

    # per request, in session order
    first_row = np.concatenate([[0], np.cumsum(turns)[:-1]]).astype(np.int64)
    sess = np.repeat(np.arange(n_sess, dtype=np.int64), turns)
    row = np.arange(n_req, dtype=np.int64)
    turn = row - first_row[sess]
    later = turn > 0
    out = np.clip(
        np.round(_lognormal(g_req, p.output_median, p.output_sigma, n_req)), 1, p.output_max
    ).astype(np.int64)
    is_tool = later & (g_req.random(n_req) < p.tool_fraction)
    tool_new = _lognormal(g_req, p.tool_median, p.tool_sigma, n_req)
    text_new = _lognormal(g_req, p.text_median, p.text_sigma, n_req)
    new = np.clip(np.round(np.where(is_tool, tool_new, text_new)), 1, p.new_max).astype(np.int64)
    growth = np.zeros(n_req, dtype=np.int64)
    growth[1:] = out[:-1] + new[1:]
    growth[~later] = 0
    cs = np.cumsum(growth)
    raw = c0[sess] + cs - cs[first_row][sess]  # context without compaction
    lim, flo = limit[sess], floor_[sess]
    span = lim - flo
    epoch = np.where(raw > lim, -((lim - raw) // span), 0)  # ceil((raw - lim) / span)
    inp = raw - epoch * span

    prev = np.roll(row, 1)
    new_epoch = ~later | (epoch != epoch[prev])
    full = inp // BLOCK_SIZE
    pb = pblocks[sess]
    inh_keys = np.where(new_epoch, 0, full[prev])
    intra_blocks = np.where(~later, 0, np.where(new_epoch, pb, full[prev]))
    hit_intra = np.minimum(intra_blocks * BLOCK_SIZE, inp)

    # writer-turn table: per epoch, position (after the prefix) -> first turn whose full
    # blocks cover it; rows that end their epoch add nothing (nobody inherits from them)
    nxt = np.roll(row, -1)
    last_in_epoch = new_epoch[nxt] | (row == n_req - 1)
    d_full = np.where(last_in_epoch, 0, full - np.where(new_epoch, pb, full[prev]))
    table = np.repeat(turn.astype(np.int32), d_full)
    epoch_first = np.maximum.accumulate(np.where(new_epoch, row, 0))
    tab_start = (np.cumsum(d_full) - d_full)[epoch_first]

    # time: service of the previous turn + think gap
    service = p.ttft_base_s + (inp - hit_intra) / p.prefill_tok_s + out * p.tpot_s
    think = np.where(
        is_tool,
        _lognormal(g_time, p.think_tool_median_s, p.think_tool_sigma, n_req),
        _lognormal(g_time, p.think_text_median_s, p.think_text_sigma, n_req),
    )
    think = np.where(later, np.clip(think, 0.01, 3600.0), 0.0)
    gap = np.zeros(n_req)
    gap[1:] = service[:-1] + think[1:]
    gap[~later] = 0.0
    gcs = np.cumsum(gap)
    offset = gcs - gcs[first_row][sess]
    sess_span = offset[first_row + turns - 1]
    u_start = g_time.random(n_sess)
    if p.contain_sessions:
        max_span = p.max_span_fraction * p.duration_s
        factor = np.where(sess_span > max_span, max_span / np.maximum(sess_span, 1e-300), 1.0)
        start = _inverse_rate(p, u_start, p.duration_s - sess_span * factor)
    else:
        factor = np.ones(n_sess)
        start = _inverse_rate(p, u_start, np.full(n_sess, p.duration_s))
    ts = start[sess] + offset * factor[sess]
    ttp = think * factor[sess]

    sid = np.empty(n_sess, dtype=np.int64)
    sid[np.lexsort((np.arange(n_sess), start))] = np.arange(n_sess)
    order = np.argsort(ts, kind="stable").astype(np.int64)
    plan = _Plan(
        profile=p,
        seed=seed,
        sid=sid,
        turns=turns,
        prefix_id=pid,
        prefix_blocks=pblocks,
        time_factor=factor,
        sess=sess,
        turn=turn,
        inp=inp,
        out=out,
        ts=ts,
        ttp=ttp,
        is_tool=is_tool,
        hit_intra=hit_intra,
        inh_keys=inh_keys,
        tab_start=tab_start,
        new_epoch=new_epoch,
        table=table,
        order=order,
    )
    return plan, per_prefix


def _pct(x: npt.NDArray[Any], q: float) -> float:
    return float(np.percentile(x, q)) if len(x) else 0.0


def _stats(plan: _Plan, per_prefix: I64, n_req_target: int, path: Path) -> SynthStats:
    p = plan.profile
    n = len(plan.inp)
    inp, out, turn, sess = plan.inp, plan.out, plan.turn, plan.sess
    rank = np.empty(n, dtype=np.int64)
    rank[plan.order] = np.arange(n)
    # any-session: a turn 0 also hits its prefix when an earlier request used it
    pid = plan.prefix_id[sess]
    has = pid >= 0
    first_rank = np.full(max(len(per_prefix), 1), n, dtype=np.int64)
    np.minimum.at(first_rank, pid[has], rank[has])
    seen = has & (rank > first_rank[np.maximum(pid, 0)])
    pref_hit = np.minimum(plan.prefix_blocks[sess] * BLOCK_SIZE, inp)
    hit_any = np.where((turn == 0) & seen, pref_hit, plan.hit_intra)
    shared = seen & (per_prefix[np.maximum(pid, 0)] >= 8)
    total = int(inp.sum())
    kv = (inp + out) / _TOKENS_PER_GIB
    later_ttp = plan.ttp[turn > 0]
    any_c = float(hit_any.sum()) / total
    intra_c = float(plan.hit_intra.sum()) / total
    turns = plan.turns
    return SynthStats(
        profile=p.name,
        path=str(path),
        seed=plan.seed,
        requests=n,
        sessions=len(turns),
        duration_s=float(plan.ts.max()),
        window_requests=int((plan.ts < p.duration_s).sum()),
        input_tokens=total,
        input_mean=total / n,
        output_tokens=int(out.sum()),
        keys=int(((inp + BLOCK_SIZE - 1) // BLOCK_SIZE).sum()),
        turns_p50=_pct(turns, 50),
        turns_p90=_pct(turns, 90),
        turns_p99=_pct(turns, 99),
        turns_max=int(turns.max()),
        turns_mean=float(turns.mean()),
        single_turn_fraction=float((turns == 1).mean()),
        beyond_turn8_fraction=float((turn >= 8).mean()),
        input_p50=_pct(inp, 50),
        input_p90=_pct(inp, 90),
        input_p95=_pct(inp, 95),
        input_p99=_pct(inp, 99),
        input_max=int(inp.max()),
        output_p50=_pct(out, 50),
        output_mean=float(out.mean()),
        kv_p50_gib=_pct(kv, 50),
        kv_p90_gib=_pct(kv, 90),
        kv_p95_gib=_pct(kv, 95),
        kv_p99_gib=_pct(kv, 99),
        kv_max_gib=float(kv.max()),
        any_ceiling=any_c,
        intra_ceiling=intra_c,
        cross_gap_pp=100.0 * (any_c - intra_c),
        shared_ceiling=float(np.where(shared, pref_hit, 0).sum()) / total,
        any_hit_requests=int((hit_any > 0).sum()),
        intra_hit_requests=int((plan.hit_intra > 0).sum()),
        shared_hit_requests=int(shared.sum()),
        compactions=int((plan.new_epoch & (turn > 0)).sum()),
        prefix_sessions_fraction=float((plan.prefix_id >= 0).mean()),
        time_compressed_sessions=int((plan.time_factor < 1.0).sum()),
        ttp_p50_s=_pct(later_ttp, 50),
        ttp_p90_s=_pct(later_ttp, 90),
        targets=p.targets,
        target_scale=n_req_target / p.requests,
    )


# --------------------------------------------------------------------------------------
# pass 2: keys, streamed to Parquet in timestamp order


def _mix(x: U64) -> U64:
    """splitmix64's finalizer, in place: a bijection of uint64."""
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def _salt(seed: int) -> np.uint64:
    s = np.array([(seed ^ 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
    return np.uint64(_mix(s)[0])


def _chunk_keys(plan: _Plan, rows: I64, salt: np.uint64) -> tuple[I64, U64]:
    """Offsets (len(rows) + 1) and keys of ``rows`` (session-order indices)."""
    inp = plan.inp[rows]
    nk = (inp + BLOCK_SIZE - 1) // BLOCK_SIZE
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(nk, out=offsets[1:])
    rk = np.repeat(np.arange(len(rows), dtype=np.int64), nk)
    pos = np.arange(int(offsets[-1]), dtype=np.int64) - offsets[:-1][rk]
    sess = plan.sess[rows]
    pblocks = plan.prefix_blocks[sess][rk]
    inh = plan.inh_keys[rows][rk]
    writer = plan.turn[rows][rk]
    look = (pos >= pblocks) & (pos < inh)
    writer[look] = plan.table[plan.tab_start[rows][rk][look] + pos[look] - pblocks[look]]
    packed: U64 = plan.sid[sess][rk].astype(np.uint64) << np.uint64(_POS_BITS + _TURN_BITS)
    packed |= writer.astype(np.uint64) << np.uint64(_POS_BITS)
    packed |= pos.astype(np.uint64)
    pref = pos < pblocks
    pref_packed: U64 = plan.prefix_id[sess][rk][pref].astype(np.uint64) << np.uint64(_POS_BITS)
    pref_packed |= pos[pref].astype(np.uint64)
    pref_packed |= np.uint64(1 << 63)
    packed[pref] = pref_packed
    packed ^= salt
    return offsets, _mix(packed)


def _chunks(plan: _Plan) -> list[tuple[int, int]]:
    nk = (plan.inp[plan.order] + BLOCK_SIZE - 1) // BLOCK_SIZE
    cum = np.cumsum(nk)
    bounds = [0]
    n = len(nk)
    while bounds[-1] < n:
        a = bounds[-1]
        base = int(cum[a - 1]) if a else 0
        b = int(np.searchsorted(cum, base + CHUNK_KEYS, side="right"))
        bounds.append(min(max(b, a + 1), a + MAX_CHUNK_ROWS, n))
    return list(itertools.pairwise(bounds))


_TYPES = np.array(["text", "tool"])


def _progress_bar(name: str) -> Any:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn(f"synth {name}: " + "{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )


def _write(plan: _Plan, path: Path, n_req_arg: int, bar: Any) -> None:
    p = plan.profile
    schema = trace_schema(ttp=True, type_column=True, block_size=BLOCK_SIZE)
    meta = dict(schema.metadata or {})
    meta[SYNTH_META_KEY] = json.dumps(
        {
            "profile": p.name,
            "seed": plan.seed,
            "requests": n_req_arg,
            "sessions": len(plan.turns),
            "duration_s": p.duration_s,
            "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
        },
        sort_keys=True,
    ).encode()
    assert meta[BLOCK_SIZE_KEY] == str(BLOCK_SIZE).encode()
    schema = schema.with_metadata(meta)
    salt = _salt(plan.seed)
    task = bar.add_task("keys + Parquet (requests)", total=len(plan.inp)) if bar else None
    with pq.ParquetWriter(
        path,
        schema,
        compression="zstd",
        compression_level=3,
        # Keys are random 64-bit values, but a chunk repeats many of them (a session's
        # turns); large pages let zstd find the repeats (about -40% vs. dictionaries).
        use_dictionary=["session_id", "turn", "type"],
        data_page_size=8 << 20,
        write_statistics=["request_id", "timestamp", "session_id", "turn"],
    ) as writer:
        for a, b in _chunks(plan):
            rows = plan.order[a:b]
            offsets, keys = _chunk_keys(plan, rows, salt)
            turn = plan.turn[rows]
            batch = pa.Table.from_arrays(
                [
                    pa.array(np.arange(a, b, dtype=np.int64)),
                    pa.array(plan.ts[rows]),
                    pa.array(plan.sid[plan.sess[rows]]),
                    pa.array(turn.astype(np.int32)),
                    pa.array(plan.inp[rows]),
                    pa.array(plan.out[rows]),
                    pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(keys)),
                    pa.array(plan.ttp[rows], pa.float64(), mask=turn == 0),
                    pa.array(_TYPES[plan.is_tool[rows].astype(np.int64)], pa.string()),
                ],
                schema=schema,
            )
            writer.write_table(batch, row_group_size=b - a)
            if bar:
                bar.update(task, advance=b - a)


# --------------------------------------------------------------------------------------
# API


def synthesize(
    profile: str,
    path: str | Path,
    *,
    requests: int | None = None,
    seed: int = 42,
    progress: bool = False,
) -> SynthStats:
    """Write a synthetic trace of ``profile`` (a key of :data:`PROFILES`) to ``path``
    (canonical Parquet) and return what it achieved next to the profile's targets.

    ``requests`` scales the profile (sessions in proportion; default: the profile's own
    size). The same arguments always produce a byte-identical file."""
    if profile not in PROFILES:
        raise InvalidArgumentError(
            f"unknown synth profile {profile!r}; profiles: {', '.join(PROFILES)}"
        )
    p = PROFILES[profile]
    n_req = p.requests if requests is None else int(requests)
    if n_req < 1:
        raise InvalidArgumentError(f"requests must be >= 1, got {requests}")
    if not 0 <= seed < 2**63:
        raise InvalidArgumentError(f"seed must be in [0, 2^63), got {seed}")
    started = time.perf_counter()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed at the end: no half-written trace on failure.
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    bar = _progress_bar(p.name) if progress else None
    try:
        if bar:
            bar.start()
            planning = bar.add_task("sessions, lengths, times", total=None)
        plan, per_prefix = _plan(p, n_req, seed)
        if bar:
            bar.update(planning, total=1, completed=1)
        _write(plan, tmp, n_req, bar)
        os.replace(tmp, out)
    finally:
        if bar:
            bar.stop()
        tmp.unlink(missing_ok=True)
    stats = _stats(plan, per_prefix, n_req, out)
    stats.elapsed_s = time.perf_counter() - started
    stats.file_bytes = out.stat().st_size
    return stats
