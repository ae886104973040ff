"""Engine profiles: the engine model's cost parameters fitted to measured grid points, and
the JSON file that carries them (``kvroute calibrate`` writes it; ``kvroute simulate
--engine-profile`` and ``kvroute engine --engine-profile`` load it).

A measured point is one of five kinds (``docs/simulator.md`` "Calibration"):

* ``prefill``: the time to first token of a lone request on an idle engine, ``prefill_tokens``
  new tokens after ``cached_tokens`` cached ones, in chunks of ``max_num_batched_tokens``
  (admitting it costs every one of its prompt tokens, cached or not, and the request);
* ``decode``: the gap between two tokens of ``batch`` sequences decoding together, each
  reading ``context`` tokens;
* ``mixed``: that gap for the step that also prefills a request of ``prefill_tokens`` (the
  interference of a prefill on running decodes);
* ``arrival``: what one request of ``prefill_tokens`` new tokens after ``cached_tokens``
  cached ones, with one output token, adds to the time of a running decode batch, all its
  steps together (its prefill chunks and its admission: what a request costs the requests
  already running, wherever its handling takes the engine's time);
* ``busy``: the same requests' own mean time to first token beside that batch: on average
  half a decode step before the step it can join, its steps (each also decoding the batch),
  its admission, ``request_overhead_s``, and ``busy_handling_s``, the later start of a
  request that arrives while a step is in progress; and, per request, when the step that
  made its first token started and the step before it (``joins``).

Each is a linear function of the cost terms (:data:`COST_TERMS`). The first eight are fitted
to the other kinds by a non-negative least squares on relative errors, solved exactly by
trying every subset of the terms (2^8 small solves). ``busy_handling_s`` is then read off
the busy points' requests: in the engine model a request that arrives at ``t`` joins the
first step that starts at or after ``t + busy_handling_s``, so each request bounds it
between the starts of its step and of the step before (less ``request_overhead_s``, the
delay of the readings); the fit is the value nearest to all those intervals (least total
distance, the middle of the best stretch; at least 0). Requests evenly spread over the step
in progress make the intervals cross near the true value, whatever the step's length.
O(points) per prediction; the fit O(256 · points + requests²); plain data, thread-safe.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvroute import _core
from kvroute.errors import InvalidArgumentError

FORMAT = "kvroute-engine-profile"
VERSION = 1
#: The step-cost terms the fit finds, in feature order (``docs/simulator.md`` "Cost model").
COST_TERMS = (
    "step_overhead_s",
    "prefill_s_per_token",
    "prefill_s_per_pair",
    "decode_s_per_seq",
    "decode_s_per_ctx_token",
    "admit_s_per_token",
    "admit_s_per_request",
    "request_overhead_s",
    "busy_handling_s",
)
#: The terms the least squares finds (the last, ``busy_handling_s``, is fitted after them).
STEP_TERMS = COST_TERMS[:-1]
KINDS = ("prefill", "decode", "mixed", "arrival", "busy")


@dataclass(frozen=True)
class Point:
    """One grid point and what was measured there (seconds; see the module doc)."""

    kind: str
    seconds: float
    prefill_tokens: int = 0
    cached_tokens: int = 0
    batch: int = 0
    context: float = 0.0
    samples: int = 1
    #: A busy point's requests: seconds from each one's arrival to the start of the step that
    #: made its first token, and to the start of the step before it (both as the readings
    #: show them, ``request_overhead_s`` late).
    joins: tuple[tuple[float, float], ...] = ()


def _chunks(new: int, cached: int, budget: int) -> Iterable[tuple[int, int]]:
    """``(start, length)`` of each prefill chunk."""
    start, end = cached, cached + new
    while start < end:
        length = min(budget, end - start)
        yield start, length
        start += length


def features(point: Point, budget: int) -> np.ndarray:
    """The point's coefficients of :data:`COST_TERMS`."""
    if point.kind not in KINDS:
        raise InvalidArgumentError(
            f"point kind must be one of {', '.join(KINDS)}, got {point.kind!r}"
        )
    x = np.zeros(len(COST_TERMS))
    if point.kind != "decode":  # a request arrives
        for start, length in _chunks(point.prefill_tokens, point.cached_tokens, budget):
            x[0] += 1
            x[1] += length
            x[2] += length * (start + length / 2)
        # Admitted in its first step: every prompt token, cached or not, and the request.
        x[5] = point.cached_tokens + point.prefill_tokens
        x[6] = 1.0
    if point.kind == "prefill":
        x[7] = 1.0
    elif point.kind == "arrival":
        x[0] = 0.0  # each of its steps also decodes the batch: no step of its own
    elif point.kind == "busy":
        # Half a decode step's wait on average, then its own steps, each decoding the batch.
        steps = x[0] + 0.5
        x[0] = steps
        x[3] = steps * point.batch
        x[4] = steps * point.batch * point.context
        x[7] = x[8] = 1.0
    else:  # decode, mixed: one step, whatever it holds
        x[0] = 1.0
        x[3] = point.batch
        x[4] = point.batch * point.context
    return x


def predict(params: Mapping[str, float], point: Point, budget: int) -> float:
    """Seconds the cost model gives for ``point``."""
    return float(features(point, budget) @ np.array([params[t] for t in COST_TERMS]))


def _nnls_relative(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin over θ >= 0 of Σ ((a·θ - y) / y)², by every subset of the terms."""
    w = a / y[:, None]
    ones = np.ones(len(y))
    best, best_cost = np.zeros(a.shape[1]), float(ones @ ones)
    for size in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), size):
            sub = w[:, cols]
            theta, *_ = np.linalg.lstsq(sub, ones, rcond=None)
            if np.any(theta < 0):
                continue
            r = sub @ theta - ones
            cost = float(r @ r)
            if cost < best_cost - 1e-15:
                best_cost, best = cost, np.zeros(a.shape[1])
                best[list(cols)] = theta
    return best


def fit(points: Sequence[Point], budget: int) -> dict[str, float]:
    """The cost terms that best predict ``points`` (relative least squares, terms >= 0; see
    the module doc for ``busy_handling_s``)."""
    if any(not (math.isfinite(p.seconds) and p.seconds > 0) for p in points):
        raise InvalidArgumentError("every measured point must take a positive, finite time")
    steps = [p for p in points if p.kind != "busy"]
    if len(steps) < len(STEP_TERMS):
        raise InvalidArgumentError(
            f"a fit of {len(STEP_TERMS)} terms needs at least as many points besides the "
            f"busy ones, got {len(steps)}"
        )
    a = np.array([features(p, budget)[: len(STEP_TERMS)] for p in steps])
    y = np.array([p.seconds for p in steps])
    # Scale the columns to comparable sizes so that lstsq is well conditioned.
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    theta = _nnls_relative(a / scale, y) / scale
    terms = {t: float(v) for t, v in zip(STEP_TERMS, theta, strict=True)}
    late = terms["request_overhead_s"]
    bounds = [(before - late, join - late) for p in points for join, before in p.joins]
    terms["busy_handling_s"] = max(0.0, nearest(bounds)) if bounds else 0.0
    return terms


def nearest(intervals: Sequence[tuple[float, float]]) -> float:
    """The x with the least total distance to the ``(low, high)`` intervals (the middle of
    the stretch of such x)."""

    def cost(x: float) -> float:
        return sum(max(0.0, lo - x) + max(0.0, x - hi) for lo, hi in intervals)

    ends = sorted({e for pair in intervals for e in pair})
    costs = [cost(x) for x in ends]
    best = min(costs)
    tied = [x for x, c in zip(ends, costs, strict=True) if c <= best + 1e-12]
    return (tied[0] + tied[-1]) / 2


def residuals(
    params: Mapping[str, float], points: Sequence[Point], budget: int
) -> list[dict[str, Any]]:
    """Each point with its prediction and relative error (predicted / measured - 1)."""
    out = []
    for p in points:
        predicted = predict(params, p, budget)
        out.append(
            {
                **asdict(p),
                "predicted_seconds": predicted,
                "relative_error": predicted / p.seconds - 1.0,
            }
        )
    return out


def error_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """p50, p90 and max of the absolute relative errors, overall and per kind."""

    def summary(errors: list[float]) -> dict[str, float]:
        e = np.abs(np.array(errors))
        return {
            "points": len(e),
            "p50": float(np.quantile(e, 0.5)),
            "p90": float(np.quantile(e, 0.9)),
            "max": float(e.max()),
        }

    out: dict[str, Any] = {"all": summary([r["relative_error"] for r in rows])}
    for kind in KINDS:
        errors = [r["relative_error"] for r in rows if r["kind"] == kind]
        if errors:
            out[kind] = summary(errors)
    return out


def make_profile(
    points: Sequence[Point],
    *,
    engine: Mapping[str, Any],
    scheduler: Mapping[str, int],
    held_out: Sequence[Point] = (),
) -> dict[str, Any]:
    """The profile document: the fitted terms, the engine's settings, and the residuals of
    the fit points and of ``held_out`` points (measured, not fitted)."""
    budget = int(scheduler["max_num_batched_tokens"])
    terms = fit(points, budget)
    terms["step_overhead_s"] = max(terms["step_overhead_s"], 1e-6)  # a step takes time
    rows = residuals(terms, points, budget)
    params: dict[str, float] = {**terms, **{k: float(v) for k, v in scheduler.items()}}
    doc: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "engine": dict(engine),
        "params": params,
        "fit": {"error": error_summary(rows), "points": rows},
    }
    if held_out:
        held = residuals(terms, held_out, budget)
        doc["held_out"] = {"error": error_summary(held), "points": held}
    return doc


def load_profile(path: str | Path) -> dict[str, float]:
    """The engine parameters of a profile file, ready as ``engine=`` overrides of a preset.
    Errors name the file and the field."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InvalidArgumentError(
            f"{path}: cannot read the engine profile: {exc.strerror}"
        ) from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgumentError(f"{path}: not an engine profile (not JSON: {exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise InvalidArgumentError(
            f"{path}: not an engine profile (field format is not {FORMAT!r})"
        )
    if doc.get("version") != VERSION:
        raise InvalidArgumentError(
            f"{path}: field version: profile version {doc.get('version')!r}, this kvroute reads "
            f"{VERSION}"
        )
    params = doc.get("params")
    if not isinstance(params, dict) or not params:
        raise InvalidArgumentError(f"{path}: field params: expected an object of numbers")
    known = set(_core.engine_params())
    out: dict[str, float] = {}
    for name, value in params.items():
        if name not in known:
            raise InvalidArgumentError(
                f"{path}: field params.{name}: unknown engine parameter; known: "
                + ", ".join(sorted(known))
            )
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise InvalidArgumentError(
                f"{path}: field params.{name}: expected a finite number, got {value!r}"
            )
        out[name] = float(value)
    try:
        _core.engine_params(overrides=out)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{path}: field params: {exc}") from exc
    return out


__all__ = [
    "COST_TERMS",
    "FORMAT",
    "KINDS",
    "STEP_TERMS",
    "Point",
    "error_summary",
    "features",
    "fit",
    "load_profile",
    "make_profile",
    "nearest",
    "predict",
    "residuals",
]
