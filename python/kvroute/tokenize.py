"""Tokenizers for text traces and text prompts: turn text into token ids, then block keys.

* :class:`BuiltinTokenizer` (the default, no download): splits text into GPT-2-style pieces
  (a word with its leading space, a number, a run of punctuation, whitespace) and maps each
  piece to ``crc32(piece)``. Equal text prefixes give equal token prefixes (except possibly
  the last piece), which is what prefix caching needs; counts are close to a BPE tokenizer's
  on English and code (a BPE token is often a whole word) but not equal: use it for keys and
  for approximate lengths, not for exact token counts.
* :class:`HuggingFaceTokenizer`: a ``tokenizer.json`` read with the ``tokenizers`` package
  (``pip install kvroute[hf]``): exact ids for that model.

Both are O(text length) and stateless after construction; safe to share between threads.
"""

from __future__ import annotations

import re
import zlib
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvroute.errors import InvalidArgumentError

_PIECES = re.compile(r" ?[^\W\d_]+| ?\d{1,3}| ?[^\s\w]+|\s+(?!\S)|\s+")


class Tokenizer(Protocol):
    """Anything that turns text into uint32 token ids."""

    name: str

    def encode(self, text: str) -> npt.NDArray[np.uint32]: ...


class BuiltinTokenizer:
    """Dependency-free approximate tokenizer (see the module doc)."""

    name = "builtin"

    def encode(self, text: str) -> npt.NDArray[np.uint32]:
        pieces = _PIECES.findall(text)
        return np.fromiter(
            (zlib.crc32(p.encode("utf-8")) for p in pieces), dtype=np.uint32, count=len(pieces)
        )


class HuggingFaceTokenizer:
    """A Hugging Face ``tokenizer.json``, via the ``tokenizers`` package."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise InvalidArgumentError(
                "a tokenizer.json needs the `tokenizers` package: pip install 'kvroute[hf]'"
            ) from exc
        if not Path(path).is_file():
            raise InvalidArgumentError(f"tokenizer file not found: {path}")
        self._tok: Any = _HFTokenizer.from_file(str(path))
        self.name = f"hf:{Path(path).name}"

    def encode(self, text: str) -> npt.NDArray[np.uint32]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.uint32)


def load_tokenizer(spec: str | Path | Tokenizer | None) -> Tokenizer:
    """``None`` or ``"builtin"``: the built-in tokenizer; a path: a ``tokenizer.json``;
    an object with ``encode``: used as it is."""
    if spec is None or spec == "builtin":
        return BuiltinTokenizer()
    if isinstance(spec, str | Path):
        return HuggingFaceTokenizer(spec)
    if not hasattr(spec, "encode"):
        raise InvalidArgumentError(
            f"tokenizer must be 'builtin', a path or have .encode, got {spec!r}"
        )
    return spec
