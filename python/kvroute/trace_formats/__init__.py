"""Per-format converters into the canonical trace table (see ``docs/trace-format.md``).

Each ``from_*`` function reads one file format with Arrow (JSONL via :mod:`kvroute.jsonl`,
CSV via polars), then builds the canonical columns with vectorized numpy/Arrow code:
O(rows + keys), except Mooncake session inference (a Python loop over requests and their
keys, opt-in) and text tokenization (O(text)). Stateless.

One module per format family: :mod:`~kvroute.trace_formats.mooncake`,
:mod:`~kvroute.trace_formats.sessions` (Bailian and agentic JSONL),
:mod:`~kvroute.trace_formats.text`, :mod:`~kvroute.trace_formats.lengths_csv`; what they
share (detection, key-column helpers, :func:`canonical`) is in
:mod:`~kvroute.trace_formats.common`.
"""

from kvroute.trace_formats.common import FORMATS, KEYS_I64, canonical, detect_jsonl_format
from kvroute.trace_formats.lengths_csv import CSV_COLUMNS, from_csv
from kvroute.trace_formats.mooncake import (
    MIN_SESSION_PREFIX_BLOCKS,
    from_mooncake,
    infer_prefix_sessions,
)
from kvroute.trace_formats.sessions import from_agentic, from_bailian
from kvroute.trace_formats.text import from_text

__all__ = [
    "CSV_COLUMNS",
    "FORMATS",
    "KEYS_I64",
    "MIN_SESSION_PREFIX_BLOCKS",
    "canonical",
    "detect_jsonl_format",
    "from_agentic",
    "from_bailian",
    "from_csv",
    "from_mooncake",
    "from_text",
    "infer_prefix_sessions",
]
