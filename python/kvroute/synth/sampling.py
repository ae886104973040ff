"""Pass 1's draws: lognormal lengths, turns per session (stratified quantiles with a
Pareto tail), cross-session prefixes (global Zipf prompts and project groups) and session
start times under a diurnal rate. Each is O(sessions) or O(requests) vectorized numpy.
"""

from __future__ import annotations

import math

import numpy as np

from kvroute.synth.profiles import F64, I64, MAX_TURNS, Profile


def lognormal(rng: np.random.Generator, median: float, sigma: float, n: int) -> F64:
    return median * np.exp(sigma * rng.standard_normal(n))


def trunc_lognormal(rng: np.random.Generator, median: F64, sigma: float, lo: I64, hi: I64) -> I64:
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
    return np.minimum(np.floor(n + 1e-6), MAX_TURNS).astype(np.int64)


def turn_counts(p: Profile, n_req: int, n_sess: int, rng: np.random.Generator) -> I64:
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


def prefixes(p: Profile, n_sess: int, rng: np.random.Generator) -> tuple[I64, I64, I64]:
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


def inverse_rate(p: Profile, u: F64, hi: F64) -> F64:
    """Times in [0, hi) from uniforms ``u`` under a mildly diurnal rate (the window starts at
    09:00, the rate is 1 + a*sin(2*pi*(hour - 9)/24))."""
    grid = np.linspace(0.0, p.duration_s, 4097)
    lam = 1.0 + p.diurnal_amplitude * np.sin(2.0 * np.pi * grid / 86_400.0)
    cum = np.concatenate([[0.0], np.cumsum(0.5 * (lam[1:] + lam[:-1]) * np.diff(grid))])
    target = u * np.interp(hi, grid, cum)
    out: F64 = np.interp(target, cum, grid)
    return np.minimum(out, np.nextafter(hi, 0.0))
