"""kvroute's own servers (``kvroute proxy``, ``kvroute engine``) started as processes of
their own on a free port, for the side-by-side runs, benchmarks and tests.

:func:`launch` runs ``python -m kvroute COMMAND ARGS --port 0`` and returns once the server
logs the line the CLI prints when it listens (``kvroute proxy listening on URL``). A thread
reads the server's log for as long as it runs, so a chatty server never blocks on a full
pipe, and keeps its last lines: a server that exits or does not listen in time is an error
quoting them. :meth:`Launched.stop` sends SIGTERM, then SIGKILL after a grace period.

O(1) per log line; a :class:`Launched` is meant for the thread that launched it.
"""

from __future__ import annotations

import collections
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from kvroute.errors import KvrouteError

#: What the CLI logs when a server listens; the URL follows.
LISTENING = "listening on "
#: Log lines a launched server keeps for error messages.
TAIL_LINES = 20


class LaunchError(KvrouteError, RuntimeError):
    """A server did not start; the message quotes the end of its log."""


class Launched:
    """A running ``kvroute`` server: its process, its URL and the end of its log."""

    def __init__(
        self, command: str, proc: subprocess.Popen[str], keep: int | None = TAIL_LINES
    ) -> None:
        self.command, self.proc = command, proc
        self.url = ""
        self._tail: collections.deque[str] = collections.deque(maxlen=keep)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"kvroute-{command}-log")
        self._reader.daemon = True
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._tail.append(line)
            if not self.url:
                self._lines.put(line)
        self._lines.put(None)

    def _wait_listening(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                self.stop()
                raise LaunchError(f"kvroute {self.command} did not start:\n{self.log()}")
            if LISTENING in line:
                self.url = line.rsplit(" ", 1)[1].strip()
                return

    def log(self) -> str:
        """The last ``keep`` lines the server logged (read to the end once it stopped)."""
        return "".join(self._tail)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, SIGKILL after ``grace_s``; then the log reader ends and the pipe closes."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(grace_s)
        if self.proc.stderr is not None:
            self.proc.stderr.close()

    def __enter__(self) -> Launched:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def launch(
    command: str,
    *args: str,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    preexec: Callable[[], None] | None = None,
    timeout_s: float = 60.0,
    keep: int | None = TAIL_LINES,
) -> Launched:
    """``kvroute COMMAND ARGS --port 0`` in a process of its own (``env`` added to this
    process's environment; ``preexec`` runs in the child before kvroute starts), once it
    listens; its last ``keep`` log lines are kept (None: all)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvroute", command, *args, "--port", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        preexec_fn=preexec,
    )
    server = Launched(command, proc, keep)
    server._wait_listening(timeout_s)
    return server


__all__ = ["LISTENING", "LaunchError", "Launched", "launch"]
