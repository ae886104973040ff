"""HTTP/1.1 framing for the proxy's data path: message heads, body readers, chunk encoding.

The proxy's hot path (:mod:`.front`, :mod:`.upstream`) speaks HTTP/1.1 on raw asyncio
transports, so a streamed token costs one read and one write, not a task switch and two
framework objects. This module holds the framing both sides share (RFC 9112):

* :func:`parse_request_head` / :func:`parse_response_head`: a head (start line and header
  fields, without the blank line) into its parts; malformed heads raise :class:`HttpError`
  with the status to answer (400, 431, 505);
* :func:`body_reader`: the reader a message's headers call for (``Content-Length``,
  ``chunked``, or up to the connection's end); :meth:`BodyReader.feed` takes bytes as they
  arrive and returns the body bytes in them and the bytes after the body;
* :func:`chunk`, :func:`response_head`, :data:`LAST_CHUNK`: what the proxy writes.

Header names keep their case (lookups ignore it); values are latin-1 strings, as on the
wire. Requests with both
``Content-Length`` and ``Transfer-Encoding``, conflicting lengths, or a transfer coding other
than ``chunked`` are refused (the request-smuggling cases).

O(bytes) per call; stateless apart from a reader's own position; not thread-safe.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from http import HTTPStatus

Headers = list[tuple[str, str]]

#: The longest head (start line and headers) accepted.
MAX_HEAD = 64 << 10
#: The longest chunk-size line (size, extensions) accepted.
MAX_CHUNK_LINE = 4096
LAST_CHUNK = b"0\r\n\r\n"
_REASONS = {s.value: s.phrase for s in HTTPStatus}

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_REQUEST_LINE = re.compile(r"([A-Z]+) (\S+) HTTP/(\d)\.(\d)")
_STATUS_LINE = re.compile(r"HTTP/1\.(\d) (\d{3})(?: (.*))?")
_CHUNK_SIZE = re.compile(rb"([0-9a-fA-F]{1,15})[ \t]*(?:;.*)?\Z", re.S)


class HttpError(Exception):
    """A message that cannot be read; ``status`` is the answer it gets (400, 413, 431, 505)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def without(headers: Headers, names: frozenset[str]) -> Headers:
    """``headers`` but those named in ``names`` (lower-case)."""
    return [(k, v) for k, v in headers if k.lower() not in names]


@dataclass(slots=True)
class Head:
    """A message head: its header fields in order, and by lower-case name."""

    headers: Headers
    fields: dict[str, list[str]]

    def get(self, name: str) -> str | None:
        """The first value of header ``name`` (lower-case), or None."""
        got = self.fields.get(name)
        return got[0] if got else None

    def tokens(self, name: str) -> set[str]:
        """The lower-case comma-separated tokens of header ``name`` (``Connection``)."""
        return {t.strip().lower() for v in self.fields.get(name, ()) for t in v.split(",")}


@dataclass(slots=True)
class RequestHead(Head):
    method: str
    target: str
    version: tuple[int, int]

    @property
    def keep_alive(self) -> bool:
        if self.version >= (1, 1):
            return "close" not in self.tokens("connection")
        return "keep-alive" in self.tokens("connection")

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]


@dataclass(slots=True)
class ResponseHead(Head):
    status: int
    http10: bool

    @property
    def keep_alive(self) -> bool:
        return not self.http10 and "close" not in self.tokens("connection")


def _fields(lines: list[str]) -> tuple[Headers, dict[str, list[str]]]:
    headers: Headers = []
    fields: dict[str, list[str]] = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.fullmatch(name):
            raise HttpError(400, f"malformed header line {line[:80]!r}")
        value = value.strip(" \t")
        headers.append((name, value))
        fields.setdefault(name.lower(), []).append(value)
    return headers, fields


def parse_request_head(head: bytes) -> RequestHead:
    """The request line and headers of ``head`` (no trailing blank line)."""
    lines = head.decode("latin-1").split("\r\n")
    m = _REQUEST_LINE.fullmatch(lines[0])
    if m is None:
        raise HttpError(400, f"malformed request line {lines[0][:80]!r}")
    version = (int(m[3]), int(m[4]))
    if version[0] != 1:
        raise HttpError(505, f"HTTP/{version[0]}.{version[1]} is not supported")
    return RequestHead(*_fields(lines[1:]), m[1], m[2], version)


def parse_response_head(head: bytes) -> ResponseHead:
    """The status line and headers of a response ``head`` (no trailing blank line)."""
    lines = head.decode("latin-1").split("\r\n")
    m = _STATUS_LINE.fullmatch(lines[0])
    if m is None:
        raise HttpError(502, f"malformed status line {lines[0][:80]!r}")
    return ResponseHead(*_fields(lines[1:]), int(m[2]), m[1] == "0")


class BodyReader:
    """Reads one body off a byte stream (see :func:`body_reader`)."""

    done = False

    def feed(self, data: bytes) -> tuple[list[bytes], bytes]:
        """The body bytes in ``data`` and the bytes after the body (once ``done``)."""
        raise NotImplementedError

    def eof(self) -> None:
        """The stream ended; raises :class:`HttpError` when the body is not complete."""
        if not self.done:
            raise HttpError(502, "the connection closed inside a message body")


class _Length(BodyReader):
    def __init__(self, length: int) -> None:
        self.left = length
        self.done = length == 0

    def feed(self, data: bytes) -> tuple[list[bytes], bytes]:
        if self.done:
            return [], data
        take = data[: self.left]
        self.left -= len(take)
        self.done = self.left == 0
        return ([take] if take else []), data[len(take) :]


class NoBody(_Length):
    """The body of an answer to ``HEAD``: none."""

    def __init__(self) -> None:
        super().__init__(0)


class _UntilClose(BodyReader):
    def feed(self, data: bytes) -> tuple[list[bytes], bytes]:
        return ([data] if data else []), b""

    def eof(self) -> None:
        self.done = True


class _Chunked(BodyReader):
    """``Transfer-Encoding: chunked``: size lines, data, CRLFs, trailers (dropped)."""

    def __init__(self) -> None:
        self.buf = b""
        self.left = 0  # data bytes left in the current chunk
        self.crlf = False  # a CRLF ends the current chunk's data
        self.trailers = False

    def feed(self, data: bytes) -> tuple[list[bytes], bytes]:
        out: list[bytes] = []
        buf = self.buf + data if self.buf else data
        pos = 0
        while not self.done:
            if self.left:
                take = buf[pos : pos + self.left]
                if not take:
                    break
                out.append(take)
                self.left -= len(take)
                pos += len(take)
                continue
            end = buf.find(b"\r\n", pos)
            if end < 0:
                if len(buf) - pos > MAX_CHUNK_LINE:
                    raise HttpError(400, "chunk-size line too long")
                break
            if self.crlf:
                if end != pos:
                    raise HttpError(400, "chunk data longer than its size")
                self.crlf = False
            elif self.trailers:
                self.done = end == pos
            else:
                m = _CHUNK_SIZE.match(buf, pos, end)
                if m is None:
                    raise HttpError(400, f"malformed chunk size {buf[pos:end][:40]!r}")
                size = int(m[1], 16)
                stop = end + 2 + size
                if not size:
                    self.trailers = True
                elif buf[stop : stop + 2] == b"\r\n":  # the whole chunk is here
                    out.append(buf[end + 2 : stop])
                    pos = stop + 2
                    continue
                else:
                    self.left, self.crlf = size, True
            pos = end + 2
        self.buf = b"" if self.done else buf[pos:]
        return out, (buf[pos:] if self.done else b"")


def body_reader(head: Head) -> BodyReader:
    """The reader of the body a head announces (a request without framing has none)."""
    request = isinstance(head, RequestHead)
    if isinstance(head, ResponseHead) and (head.status < 200 or head.status in (204, 304)):
        return _Length(0)
    codings = head.fields.get("transfer-encoding", [])
    lengths = set(head.fields.get("content-length", ()))
    if codings:
        if lengths:
            raise HttpError(400, "both Content-Length and Transfer-Encoding")
        if ",".join(codings).replace(" ", "").lower() != "chunked":
            raise HttpError(501 if request else 502, f"transfer coding {codings!r}")
        return _Chunked()
    if lengths:
        if len(lengths) > 1 or not all(v.isdigit() for v in lengths):
            raise HttpError(400, f"bad Content-Length {sorted(lengths)!r}")
        return _Length(int(lengths.pop()))
    return _Length(0) if request else _UntilClose()


def chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def response_head(status: int, headers: Headers) -> bytes:
    """A status line and headers, with the blank line."""
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}"]
    lines.extend(f"{k}: {v}" for k, v in headers)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
