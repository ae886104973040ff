"""The interference microbenchmark (the study's B2), against any OpenAI-compatible endpoints.

Per cell (variant x prefill size): a steady decode load of short prompts (``decode_rate``
requests/s, ``decode_prompt`` tokens, ``decode_tokens`` output tokens) on the *decode*
endpoint for ``duration_s``, and ``injections`` one-token prefills of ``size`` prompt tokens,
evenly spaced, on the same endpoint (``same``) or on the *prefill* endpoint
(``different``). Every prompt is made of fresh random token ids, drawn from ``seed`` and a
per-run random nonce, so no prefix cache helps, not even on an engine that ran the same cell
before (with the seed alone, a repeated run's injections were prefix-cache hits that skipped
their prefill and measured no interference).
A decode request *overlaps* when an injection's ``[send, finish]`` intersects its decode
window ``[first token, finish]`` (TPOT) or its TTFT window ``[send, first token]`` (TTFT);
``tpot_index`` = TPOT p90 of overlapping decodes / TPOT p90 of the others, ``ttft_index``
likewise for TTFT. Cells run one after another; one asyncio loop, one HTTP connection pool.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import numpy as np

from kvroute.replay import KEEPALIVE_S

SIZES = (2048, 8192, 16384, 32768, 65536)
VARIANTS = ("same", "different")


@dataclass
class BenchConfig:
    """What to run (see the module doc); ``prefill_url`` None: only the ``same`` variant."""

    decode_url: str
    prefill_url: str | None = None
    model: str | None = None
    sizes: tuple[int, ...] = SIZES
    variants: tuple[str, ...] = VARIANTS
    duration_s: float = 60.0
    decode_rate: float = 4.0
    decode_prompt: int = 256
    decode_tokens: int = 64
    injections: int = 4
    seed: int = 0
    vocab_size: int = 32000


@dataclass
class Cell:
    """One cell's counts and indices (None: a side had no requests)."""

    variant: str
    size: int
    n_overlap: int = 0
    n_clean: int = 0
    tpot_index: float | None = None
    ttft_index: float | None = None
    tpot_p90_overlap_ms: float | None = None
    tpot_p90_clean_ms: float | None = None
    ttft_p90_overlap_s: float | None = None
    ttft_p90_clean_s: float | None = None
    errors: int = 0
    injection_s: list[float] = field(default_factory=list)


def _url(u: str) -> str:
    u = u.rstrip("/")
    return u[:-3] if u.endswith("/v1") else u


async def _one(
    http: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int
) -> tuple[float, float | None, float, bool]:
    """(send, first token, finish, ok) on the monotonic clock."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    send, first, ok = time.monotonic(), None, False
    try:
        async with http.post(url + "/v1/completions", json=body) as resp:
            ok = resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data:") and line[5:].strip() not in (b"", b"[DONE]"):
                    obj = json.loads(line[5:])
                    if obj.get("choices") and first is None:
                        first = time.monotonic()
    except (aiohttp.ClientError, OSError, ValueError):
        ok = False
    return send, first, time.monotonic(), ok and first is not None


def _p90(x: list[float]) -> float | None:
    return float(np.percentile(x, 90)) if x else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


async def _cell(
    http: aiohttp.ClientSession,
    cfg: BenchConfig,
    model: str,
    variant: str,
    size: int,
    nonce: int,
) -> Cell:
    rng = np.random.default_rng([cfg.seed, size, VARIANTS.index(variant), nonce])

    def prompt(n: int) -> list[int]:
        return [int(t) for t in rng.integers(256, cfg.vocab_size, n)]

    dec_url = _url(cfg.decode_url)
    inj_url = dec_url if variant == "same" else _url(cfg.prefill_url or cfg.decode_url)
    t0 = time.monotonic()
    dec_at, inj_at, _ = schedule(cfg, variant)
    n_dec = len(dec_at)

    async def at(t: float, url: str, n: int, out: int) -> Timing:
        await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))
        return await _one(http, url, model, prompt(n), out)

    decodes = [at(t, dec_url, cfg.decode_prompt, cfg.decode_tokens) for t in dec_at]
    injects = [at(t, inj_url, size, 1) for t in inj_at]
    res = await asyncio.gather(*decodes, *injects)
    return cell_of(variant, size, res[:n_dec], res[n_dec:], cfg.decode_tokens)


Timing = tuple[float, float | None, float, bool]


def cell_of(
    variant: str, size: int, dec: Sequence[Timing], inj: Sequence[Timing], decode_tokens: int
) -> Cell:
    """A cell from its requests' ``(send, first token, finish, ok)``: the decodes' and the
    injections' (see the module doc for what overlaps)."""
    windows = [(s, f) for s, _, f, _ in inj]
    cell = Cell(variant, size, injection_s=[f - s for s, f in windows])
    tp: dict[bool, list[float]] = {True: [], False: []}
    tt: dict[bool, list[float]] = {True: [], False: []}
    for s, first, f, ok in dec:
        if not ok or first is None:
            cell.errors += 1
            continue
        over_d = any(ws <= f and we >= first for ws, we in windows)
        over_t = any(ws <= first and we >= s for ws, we in windows)
        if decode_tokens > 1:
            tp[over_d].append((f - first) / (decode_tokens - 1))
        tt[over_t].append(first - s)
    cell.n_overlap, cell.n_clean = len(tp[True]), len(tp[False])
    po, pc = _p90(tp[True]), _p90(tp[False])
    cell.tpot_index = _ratio(po, pc)
    cell.tpot_p90_overlap_ms = po * 1000 if po is not None else None
    cell.tpot_p90_clean_ms = pc * 1000 if pc is not None else None
    cell.ttft_p90_overlap_s, cell.ttft_p90_clean_s = _p90(tt[True]), _p90(tt[False])
    cell.ttft_index = _ratio(cell.ttft_p90_overlap_s, cell.ttft_p90_clean_s)
    return cell


def schedule(cfg: BenchConfig, variant: str) -> tuple[list[float], list[float], bool]:
    """The decodes' and the injections' send times (s from the cell's start), and whether
    the injections go to the decode endpoint."""
    n_dec = max(int(cfg.duration_s * cfg.decode_rate), 1)
    gap = cfg.duration_s / (cfg.injections + 1)
    decodes = [i / cfg.decode_rate for i in range(n_dec)]
    return decodes, [(k + 1) * gap for k in range(cfg.injections)], variant == "same"


def simulate_interference(
    cfg: BenchConfig, engine: Mapping[str, float], preset: str = "h20-qwen3-coder-30b-a3b"
) -> list[Cell]:
    """The cells of :func:`run_interference` as the simulator's engine model predicts them:
    the same schedule, on two ``kvroute.EngineModel`` engines of ``engine`` parameters (a
    profile's), each event ``request_overhead_s`` later as the client would see it."""
    variants = [v for v in cfg.variants if v == "same" or cfg.prefill_url]
    return [_simulated_cell(cfg, engine, preset, v, size) for v in variants for size in cfg.sizes]


def _simulated_cell(
    cfg: BenchConfig, engine: Mapping[str, float], preset: str, variant: str, size: int
) -> Cell:
    from kvroute import EngineModel
    from kvroute.sim.fidelity import drive

    engines = [EngineModel(preset, **engine), EngineModel(preset, **engine)]
    late = float(engines[0].params["request_overhead_s"])
    decodes, injects, same = schedule(cfg, variant)
    arrivals: list[tuple[float, int, int, int | str, int, int]] = [
        (t, 0, 0, f"d{i}", cfg.decode_prompt, cfg.decode_tokens) for i, t in enumerate(decodes)
    ]
    arrivals += [(t, 0 if same else 1, 1, f"i{k}", size, 1) for k, t in enumerate(injects)]
    times = drive(engines, arrivals, int(engines[0].params["block_size"]))

    def timing(rid: str) -> Timing:
        s, f, e = times[rid]
        return s, f + late, e + late, not np.isnan(e)

    dec = [timing(f"d{i}") for i in range(len(decodes))]
    inj = [timing(f"i{k}") for k in range(len(injects))]
    return cell_of(variant, size, dec, inj, cfg.decode_tokens)


async def _run(cfg: BenchConfig, on_cell: Any = None) -> list[Cell]:
    timeout = aiohttp.ClientTimeout(total=max(600.0, cfg.duration_s * 10))
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as http:
        model = cfg.model
        if model is None:
            async with http.get(_url(cfg.decode_url) + "/v1/models") as resp:
                model = str((await resp.json())["data"][0]["id"])
        cells, nonce = [], secrets.randbits(64)
        variants = [v for v in cfg.variants if v == "same" or cfg.prefill_url]
        for variant in variants:
            for size in cfg.sizes:
                cell = await _cell(http, cfg, model, variant, size, nonce)
                cells.append(cell)
                if on_cell is not None:
                    on_cell(cell)
        return cells


def run_interference(cfg: BenchConfig, on_cell: Any = None) -> list[Cell]:
    """Run every cell (blocks); ``on_cell(cell)`` is called as each one finishes."""
    return asyncio.run(_run(cfg, on_cell))


def to_dict(cfg: BenchConfig, cells: list[Cell]) -> dict[str, Any]:
    return {"config": asdict(cfg), "cells": [asdict(c) for c in cells]}


def plot(cells: list[Cell], path: Any) -> Any:
    """TPOT and TTFT index against prefill size, one line per variant (PNG)."""
    import matplotlib.pyplot as plt

    from kvroute.report.figures import _save

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, name in (
        (axes[0], "tpot_index", "TPOT p90 index"),
        (axes[1], "ttft_index", "TTFT p90 index"),
    ):
        for k, variant in enumerate(VARIANTS):
            pts = [
                (c.size, getattr(c, key))
                for c in cells
                if c.variant == variant and getattr(c, key) is not None
            ]
            if pts:
                ax.plot(
                    [p[0] / 1024 for p in pts],
                    [p[1] for p in pts],
                    marker="o",
                    color=f"C{k}",
                    label=f"{variant} endpoint",
                )
        ax.axhline(1.0, color="gray", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("injected prefill (thousand tokens)")
        ax.set_ylabel(f"{name} (overlapping / clean decodes)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    from pathlib import Path

    return _save(fig, Path(path))
