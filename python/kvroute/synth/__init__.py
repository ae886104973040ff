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
the requests in timestamp order in chunks of about
:data:`~kvroute.synth.writer.CHUNK_KEYS` keys, computes each chunk's keys from the
scalars alone (a key's writer turn comes from a per-epoch lookup table) and appends the
chunk to the Parquet file as one row group. The keys themselves (8 bytes each, ~139M at
full scale) are never all in memory. Deterministic: the same arguments give a
byte-identical file.

The pieces: :mod:`~kvroute.synth.profiles` (parameters and targets),
:mod:`~kvroute.synth.sampling` and :mod:`~kvroute.synth.plan` (pass 1),
:mod:`~kvroute.synth.keys` and :mod:`~kvroute.synth.writer` (pass 2),
:mod:`~kvroute.synth.stats` (what was achieved).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from kvroute import args
from kvroute.errors import InvalidArgumentError, OutputExistsError
from kvroute.files import atomic_output, check_output
from kvroute.synth.plan import build_plan
from kvroute.synth.profiles import BLOCK_SIZE, KV_BYTES_PER_TOKEN, PROFILES, Profile, Target
from kvroute.synth.stats import SynthStats, plan_stats
from kvroute.synth.writer import progress_bar, write_trace

__all__ = [
    "BLOCK_SIZE",
    "KV_BYTES_PER_TOKEN",
    "PROFILES",
    "Profile",
    "SynthStats",
    "Target",
    "synthesize",
]


def synthesize(
    profile: str,
    path: str | Path,
    *,
    requests: int | None = None,
    seed: int = 42,
    progress: bool = False,
    force: bool = True,
    shards: int | None = None,
) -> SynthStats:
    """Write a synthetic trace of ``profile`` (a key of :data:`PROFILES`) to ``path``
    (canonical Parquet) and return what it achieved next to the profile's targets.

    ``requests`` scales the profile (sessions in proportion; default: the profile's own
    size). The same arguments always produce a byte-identical file, written atomically
    (:mod:`kvroute.files`; ``force=False`` refuses an existing one). ``shards``: ``path``
    is a folder, and the trace is written into it as ``part-00000.parquet``... of
    consecutive requests, straight from the generator (a folder with other shards is
    refused, or with ``force`` has them replaced)."""
    if args.text(profile, "profile") not in PROFILES:
        raise InvalidArgumentError(
            f"unknown synth profile {profile!r}; profiles: {', '.join(PROFILES)}"
        )
    p = PROFILES[profile]
    n_req = p.requests if requests is None else args.integer(requests, "requests", 1, 10**10)
    seed = args.integer(seed, "seed", 0, 2**63 - 1)
    args.flag(progress, "progress")
    args.flag(force, "force")
    if shards is not None:
        shards = args.integer(shards, "shards", 1, 100_000)
    started = time.perf_counter()
    out, files = _outputs(path, shards, force)
    bar = progress_bar(p.name) if progress else None
    try:
        if bar:
            bar.start()
            planning = bar.add_task("sessions, lengths, times", total=None)
        plan, per_prefix = build_plan(p, n_req, seed)
        if bar:
            bar.update(planning, total=1, completed=1)
        with contextlib.ExitStack() as stack:
            tmps = [stack.enter_context(atomic_output(f, force=force)) for f in files]
            write_trace(plan, tmps, n_req, bar)
    finally:
        if bar:
            bar.stop()
    stats = plan_stats(plan, per_prefix, n_req, out)
    stats.elapsed_s = time.perf_counter() - started
    stats.file_bytes = sum(f.stat().st_size for f in files)
    return stats


def _outputs(path: str | Path, shards: int | None, force: bool) -> tuple[Path, list[Path]]:
    """The output and its files; a sharded trace's stale shards go only with ``force``."""
    if shards is None:
        out = check_output(path, force=force)
        return out, [out]
    text = args.text(str(path) if isinstance(path, Path) else path, "path")
    if not text:
        raise InvalidArgumentError("path is empty")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise OutputExistsError(f"{path} exists and is not a folder")
    files = [path / f"part-{i:05d}.parquet" for i in range(shards)]
    old = sorted(path.glob("part-*.parquet")) if path.is_dir() else []
    if old and not force:
        raise OutputExistsError(f"{path} already holds shards ({old[0].name}, ...); pass force")
    for f in old:
        if f not in files:
            f.unlink()
    return path, files
