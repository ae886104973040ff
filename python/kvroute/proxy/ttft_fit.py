"""The ``ttft`` policy's step costs fitted while the proxy serves, from the first tokens the
relay measures (``docs/proxy.md``, "Predicting time to first token").

The time ``ttft`` predicts (``docs/semantics.md`` §3) is linear in its costs once the step
budget (``max_num_batched_tokens``) is fixed. Per sample (an engine's counters just before a
request was routed there, the request's uncached and total prompt tokens, the seconds from
the decision to its first byte), :func:`terms` gives the factor of each cost;
:func:`fit_costs` solves the non-negative least squares for each candidate budget and keeps
the budget with the smallest residual. Until :data:`MIN_SAMPLES` first tokens have come, the
router predicts with :data:`PRIOR`, under which ``ttft`` picks as ``leastwork`` (LPWL) does
(plus its delay term, where ``delay_weight`` > 0).

:class:`OnlineTtftCosts` takes the relay's samples every ``interval_s`` seconds, keeps the
newest ``window`` and refits. A fit is O(window) per budget, about a millisecond for 2,048
samples; it runs on the control plane's event loop. Not thread-safe: one event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from scipy.optimize import nnls

log = logging.getLogger("kvroute.proxy")

#: One sample, as ``Relay.take_first_tokens`` gives it: ``(pending_prefill_tokens,
#: num_requests, ongoing_decode_tokens, new_prefill, input_length, seconds)``.
Sample = tuple[int, int, int, int, int, float]

#: The costs in the order of :func:`terms`' columns (``admit_s_per_request`` is one constant
#: with ``request_overhead_s``, so it is fitted as that and left 0).
COSTS = (
    "step_overhead_s",
    "decode_s_per_seq",
    "decode_s_per_ctx_token",
    "prefill_s_per_token",
    "prefill_s_per_pair",
    "admit_s_per_token",
    "request_overhead_s",
    "busy_handling_s",
)
#: Step budgets tried: vLLM's defaults on CPU (2,048 on the CPU backend's ``serve``), and
#: the online-serving ones of GPUs.
BUDGETS = (2048, 4096, 8192, 16384)
#: First tokens before the first fit.
MIN_SAMPLES = 64
#: The least step cost a profile may have (a step takes time): a fitted 0 is raised to it.
MIN_STEP_S = 1e-6
#: The costs before a fit: a second per prefill token queued or new and the least step
#: cost (which grows with the work too), so the least predicted time is the least prefill
#: work (``leastwork``'s rule).
PRIOR: dict[str, float] = {
    **dict.fromkeys(COSTS, 0.0),
    "admit_s_per_request": 0.0,
    "prefill_s_per_token": 1.0,
    "step_overhead_s": MIN_STEP_S,
    "max_num_batched_tokens": float(BUDGETS[-1]),
}


def terms(samples: np.ndarray, budget: int) -> np.ndarray:
    """Each sample's factor of each cost (:data:`COSTS` order) at step budget ``budget``;
    ``samples`` has the columns of :data:`Sample` (the seconds are not read)."""
    pending, running, decode_ctx, new, length = (samples[:, i] for i in range(5))
    work = pending + new
    steps = np.maximum(1.0, np.ceil(work / budget))
    cached = length - new
    return np.column_stack(
        [
            steps,
            steps * running,
            steps * decode_ctx,
            work,
            new * (cached + new / 2.0),
            length,
            np.ones(len(samples)),
            (running > 0).astype(float),
        ]
    )


def fit_costs(
    samples: Sequence[Sample] | np.ndarray, budgets: Sequence[int] = BUDGETS
) -> tuple[dict[str, float], float]:
    """The costs (an engine profile's ``params``, as ``Router.set_ttft_costs`` takes them)
    that predict the samples' seconds best, and the root-mean-square error in seconds."""
    data = np.asarray(samples, dtype=float).reshape(-1, 6)
    if len(data) == 0:
        raise ValueError("no first tokens to fit the costs to")
    seconds = data[:, 5]
    best: tuple[float, int, np.ndarray] | None = None
    for budget in budgets:
        a = terms(data, budget)
        scale = np.abs(a).max(axis=0)
        scale[scale == 0] = 1.0
        x, _ = nnls(a / scale, seconds)
        x = x / scale
        rms = float(np.sqrt(np.mean((a @ x - seconds) ** 2)))
        if best is None or rms < best[0]:
            best = (rms, budget, x)
    assert best is not None
    rms, budget, x = best
    costs = {name: float(v) for name, v in zip(COSTS, x, strict=True)}
    costs["step_overhead_s"] = max(costs["step_overhead_s"], MIN_STEP_S)
    costs["admit_s_per_request"] = 0.0
    costs["max_num_batched_tokens"] = float(budget)
    return costs, rms


class OnlineTtftCosts:
    """Refit the router's ``ttft`` costs from the relay's first tokens (see the module doc).

    ``relay`` gives the running relay (None before it starts); ``router`` is the proxy's."""

    def __init__(
        self,
        relay: Callable[[], Any],
        router: Any,
        interval_s: float = 5.0,
        window: int = 2048,
    ) -> None:
        self.relay = relay
        self.router = router
        self.interval_s = interval_s
        self.samples: deque[Sample] = deque(maxlen=window)
        self.fits = 0
        self.rms_s: float | None = None
        router.set_ttft_costs(PRIOR)

    def refit(self) -> bool:
        """Take the relay's new samples and refit when there are enough; whether it did."""
        relay = self.relay()
        new = relay.take_first_tokens() if relay is not None else []
        self.samples.extend(new)
        if not new or len(self.samples) < MIN_SAMPLES:
            return False
        costs, self.rms_s = fit_costs(list(self.samples))
        self.router.set_ttft_costs(costs)
        self.fits += 1
        level = logging.INFO if self.fits == 1 else logging.DEBUG
        log.log(
            level,
            "ttft: costs fitted to %d first tokens (rms error %.1f ms): %s",
            len(self.samples),
            self.rms_s * 1e3,
            ", ".join(f"{k}={v:.4g}" for k, v in costs.items() if v),
        )
        return True

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.refit()
            except Exception:  # a bad fit keeps the costs before it
                log.exception("ttft: refitting the costs failed; the previous ones stay")
