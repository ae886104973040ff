"""Pass 1: every per-request scalar (lengths, compactions, times, the writer-turn table) in
session order, and the timestamp order of the requests. O(requests) time and memory
(~100 bytes a request) plus the writer-turn table; no keys.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvroute.errors import InvalidArgumentError
from kvroute.synth.profiles import B1, BLOCK_SIZE, F64, I64, SESSION_BITS, Profile
from kvroute.synth.sampling import inverse_rate, lognormal, prefixes, trunc_lognormal, turn_counts


@dataclass
class Plan:
    """Pass 1's output: per-session and per-request scalars, the writer-turn table and
    the timestamp order; everything pass 2 and the statistics need."""

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


def build_plan(p: Profile, n_req: int, seed: int) -> tuple[Plan, I64]:
    ss = np.random.SeedSequence([seed, zlib.crc32(p.name.encode())])
    g_turn, g_sess, g_pref, g_req, g_time = (np.random.default_rng(c) for c in ss.spawn(5))
    n_sess = max(1, min(n_req, round(n_req * p.sessions / p.requests)))
    if n_sess >= 1 << SESSION_BITS:
        raise InvalidArgumentError(f"requests={n_req} needs more than 2^30 sessions")

    turns = turn_counts(p, n_req, n_sess, g_turn)
    pid, pblocks, per_prefix = prefixes(p, n_sess, g_pref)

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
    c0 = trunc_lognormal(g_sess, median, p.first_sigma, min_ctx, limit)

    # per request, in session order
    first_row = np.concatenate([[0], np.cumsum(turns)[:-1]]).astype(np.int64)
    sess = np.repeat(np.arange(n_sess, dtype=np.int64), turns)
    row = np.arange(n_req, dtype=np.int64)
    turn = row - first_row[sess]
    later = turn > 0
    out = np.clip(
        np.round(lognormal(g_req, p.output_median, p.output_sigma, n_req)), 1, p.output_max
    ).astype(np.int64)
    is_tool = later & (g_req.random(n_req) < p.tool_fraction)
    tool_new = lognormal(g_req, p.tool_median, p.tool_sigma, n_req)
    text_new = lognormal(g_req, p.text_median, p.text_sigma, n_req)
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
        lognormal(g_time, p.think_tool_median_s, p.think_tool_sigma, n_req),
        lognormal(g_time, p.think_text_median_s, p.think_text_sigma, n_req),
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
        start = inverse_rate(p, u_start, p.duration_s - sess_span * factor)
    else:
        factor = np.ones(n_sess)
        start = inverse_rate(p, u_start, np.full(n_sess, p.duration_s))
    ts = start[sess] + offset * factor[sess]
    ttp = think * factor[sess]

    sid = np.empty(n_sess, dtype=np.int64)
    sid[np.lexsort((np.arange(n_sess), start))] = np.arange(n_sess)
    order = np.argsort(ts, kind="stable").astype(np.int64)
    plan = Plan(
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
