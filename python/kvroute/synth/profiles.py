"""The trace shapes :func:`kvroute.synth.synthesize` draws from: the fixed constants (block
size, KV bytes per token, the packed key layout's field widths), :class:`Profile` (every
parameter of a shape), :class:`Target` (a study number to compare against), the two
profiles in :data:`PROFILES`, and the numpy array aliases the generator's modules share.
Data only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

BLOCK_SIZE = 512
#: The study's KV table: Qwen3-Coder-30B-A3B, 2 x 48 layers x 4 KV heads x 128 x 2 bytes.
KV_BYTES_PER_TOKEN = 98304

# Packed key layout (then XOR-salted and mixed, both bijections of uint64; see keys.py):
#   session blocks: bit 63 = 0 | session (30 bits) | writer turn (17 bits) | position (16)
#   prefix blocks:  bit 63 = 1 | prefix id (47 bits)                        | position (16)
# The widths bound a plan's sessions and turns per session.
POS_BITS = 16
TURN_BITS = 17
SESSION_BITS = 30
MAX_TURNS = (1 << TURN_BITS) - 1

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
