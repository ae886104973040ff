"""What ``kvroute proxy`` finds out about its backends before it starts, so that its defaults
match them:

* the engines' KV block size, from ``vllm:cache_config_info`` in each one's ``/metrics`` (the
  router's keys are then the engines' blocks, and a prefix's hit is counted in the blocks the
  engine caches);
* the engines' KV capacity in tokens (``num_gpu_blocks`` x ``block_size``, the smallest
  engine's), for ``--max-in-flight-tokens cache``;
* the served model's folder, when this machine has it (:func:`model_folder`): the ``root``
  that ``/v1/models`` names (the path vLLM loaded, or a Hugging Face hub name), as a folder
  with a ``tokenizer.json``, or found in the local Hugging Face hub cache; text and chat are
  then keyed exactly, with the model's own tokenizer and chat template.

One call per backend and question, in parallel threads, each within ``PROBE_TIMEOUT_S``; a
backend that does not answer is left out. Stateless; any thread.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvroute.proxy.caches import kv_capacity

log = logging.getLogger("kvroute.proxy")

#: Seconds each backend has to answer.
PROBE_TIMEOUT_S = 5.0
#: The block size when no backend tells its own (the study's trace blocks).
FALLBACK_BLOCK_SIZE = 512


def _get(url: str, path: str) -> str | None:
    try:
        with urllib.request.urlopen(url.rstrip("/") + path, timeout=PROBE_TIMEOUT_S) as r:
            return str(r.read().decode("utf-8", "replace"))
    except (OSError, urllib.error.URLError, ValueError):
        return None


def _capacity(url: str) -> tuple[int, int] | None:
    text = _get(url, "/metrics")
    return None if text is None else kv_capacity(text)


def _block_size(url: str) -> int | None:
    found = _capacity(url)
    return None if found is None else found[1]


def kv_tokens(urls: list[str]) -> tuple[int | None, str]:
    """The smallest KV capacity in tokens the backends report (``vllm:cache_config_info``),
    or None; and why (for the log)."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(urls), 16))) as pool:
        told = [c[0] * c[1] for c in pool.map(_capacity, urls) if c is not None]
    if not told:
        return None, "no backend reported vllm:cache_config_info"
    return min(told), f"the smallest KV cache of {len(told)} of {len(urls)} backend(s)"


def _root(url: str) -> str | None:
    """The ``root`` (else ``id``) of the first model a backend's ``/v1/models`` lists."""
    text = _get(url, "/v1/models")
    try:
        card = json.loads(text or "")["data"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    root = card.get("root") or card.get("id") if isinstance(card, dict) else None
    return root if isinstance(root, str) and root else None


def hub_caches() -> list[Path]:
    """Where a Hugging Face hub cache may be, as ``huggingface_hub`` looks."""
    env = os.environ
    out = [Path(env[k]) for k in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE") if env.get(k)]
    home = Path(
        env.get("HF_HOME")
        or Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    )
    return [*out, home / "hub"]


def local_folder(root: str) -> Path | None:
    """``root`` as a model folder of this machine: itself, or a snapshot of the hub cache
    (the newest)."""
    folder = Path(root).expanduser()
    if (folder / "tokenizer.json").is_file():
        return folder
    if root.count("/") != 1 or root.startswith(("/", ".")):
        return None
    name = "models--" + root.replace("/", "--")
    for cache in hub_caches():
        snapshots = sorted(
            (cache / name / "snapshots").glob("*/tokenizer.json"),
            key=lambda p: p.stat().st_mtime,
        )
        if snapshots:
            return snapshots[-1].parent
    return None


def model_folder(urls: list[str]) -> tuple[str | None, str]:
    """The served model's folder on this machine, or None; and why (for the log)."""
    if not urls:
        return None, "no backend to ask"
    with ThreadPoolExecutor(max_workers=min(len(urls), 16)) as pool:
        roots = [r for r in pool.map(_root, urls) if r is not None]
    if not roots:
        return None, "no backend answered /v1/models"
    if len(set(roots)) > 1:
        log.warning("the backends serve different models (%s); using the first's", roots)
    folder = local_folder(roots[0])
    if folder is None:
        return None, f"no folder of {roots[0]!r} here (--model DIR to key text exactly)"
    return str(folder), f"the folder of {roots[0]!r}, which the backends serve"


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


__all__ = ["FALLBACK_BLOCK_SIZE", "block_size", "kv_tokens", "local_folder", "model_folder"]
