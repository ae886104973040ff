"""What ``kvroute proxy`` finds out about its backends before it starts, so that its defaults
match them: the engines' KV block size, from ``vllm:cache_config_info`` in each one's
``/metrics`` (the router's keys are then the engines' blocks, and a prefix's hit is counted
in the blocks the engine caches).

One ``GET /metrics`` per backend, in parallel threads, each within ``PROBE_TIMEOUT_S``; a
backend that does not answer is left out. Stateless; any thread.
"""

from __future__ import annotations

import logging
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from kvroute.proxy.caches import kv_capacity

log = logging.getLogger("kvroute.proxy")

#: Seconds each backend has to answer.
PROBE_TIMEOUT_S = 5.0
#: The block size when no backend tells its own (the study's trace blocks).
FALLBACK_BLOCK_SIZE = 512


def _block_size(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=PROBE_TIMEOUT_S) as r:
            text = r.read().decode("utf-8", "replace")
    except (OSError, urllib.error.URLError, ValueError):
        return None
    found = kv_capacity(text)
    return None if found is None else found[1]


def block_size(urls: list[str]) -> tuple[int, str]:
    """The block size to route with, and why (for the log): the engines' own when they say
    it (the most common one, with a warning when they differ), else
    :data:`FALLBACK_BLOCK_SIZE`."""
    if not urls:
        return FALLBACK_BLOCK_SIZE, "no backend to ask"
    with ThreadPoolExecutor(max_workers=min(len(urls), 16)) as pool:
        sizes = dict(zip(urls, pool.map(_block_size, urls), strict=True))
    told = Counter(s for s in sizes.values() if s is not None)
    if not told:
        return FALLBACK_BLOCK_SIZE, (
            f"no backend reported vllm:cache_config_info; {FALLBACK_BLOCK_SIZE} "
            "(set --block-size to the engines' block size)"
        )
    size, count = told.most_common(1)[0]
    if len(told) > 1:
        log.warning(
            "the backends' block sizes differ (%s); routing with %d",
            ", ".join(f"{u}: {s}" for u, s in sizes.items()),
            size,
        )
    return size, f"vllm:cache_config_info of {count} of {len(urls)} backend(s)"


__all__ = ["FALLBACK_BLOCK_SIZE", "block_size"]
