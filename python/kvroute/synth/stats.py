"""What a synthesized trace achieved: :class:`SynthStats` (with the profile's targets,
as a comparison, a rich table or a dict) computed from the plan alone. The APC ceilings
come from the generator's structure, without a key set: O(requests).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from rich.table import Table

from kvroute.synth.plan import Plan
from kvroute.synth.profiles import BLOCK_SIZE, I64, KV_BYTES_PER_TOKEN, Target

_GIB = 2**30
_TOKENS_PER_GIB = _GIB / KV_BYTES_PER_TOKEN


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


def _pct(x: npt.NDArray[Any], q: float) -> float:
    return float(np.percentile(x, q)) if len(x) else 0.0


def plan_stats(plan: Plan, per_prefix: I64, n_req_target: int, path: Path) -> SynthStats:
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
