"""Ray, for the work that outgrows one machine (``docs/distributed.md``): the executor
names, a clear error when the ``ray`` extra is missing, a connection to a cluster (the one
this process already joined, the address given, or a new local one), and task results as
they complete.

Nothing here defines work: :mod:`kvroute.sim.run` (sweeps and the rate search) and
:mod:`kvroute.sharded` (ceilings over sharded traces) define their tasks. Ray is imported
only when an executor asks for it, so ``import kvroute`` never needs it. Call from one
thread at a time (Ray's driver API is process-wide).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kvroute import args
from kvroute.errors import InvalidArgumentError, MissingExtraError

#: ``local``: this machine's cores (the Rust core's thread pool); ``ray``: tasks on a Ray
#: cluster.
EXECUTORS = ("local", "ray")
#: Seconds between the checks for signals while waiting for tasks.
POLL_S = 0.2


def check_executor(executor: str, ray_address: str | None = None) -> str:
    """``executor`` if it is one of :data:`EXECUTORS`; ``ray_address`` only with ``ray``."""
    args.text(executor, "executor", EXECUTORS)
    if ray_address is not None:
        args.text(ray_address, "ray_address")
        if executor != "ray":
            raise InvalidArgumentError("ray_address is only read with executor='ray'")
    return executor


def require_ray() -> Any:
    """The ``ray`` module, or an error naming the extra that installs it."""
    try:
        import ray
    except ImportError as exc:
        raise MissingExtraError(
            "executor='ray' needs Ray, which is not installed: pip install 'kvroute[ray]'"
        ) from exc
    return ray


@contextmanager
def connected(address: str | None = None) -> Iterator[Any]:
    """Yield ``ray`` connected to a cluster: the one this process already joined (left
    running afterwards), else ``address`` (``"auto"``, ``"ray://HOST:10001"``, ...), else a
    new local cluster on this machine's cores (shut down afterwards)."""
    ray = require_ray()
    if ray.is_initialized():
        yield ray
        return
    ray.init(address=address, include_dashboard=False, logging_level="WARNING")
    try:
        yield ray
    finally:
        ray.shutdown()


def completed(ray: Any, refs: Sequence[Any]) -> Iterator[tuple[int, Any]]:
    """``(index, value)`` of each task in ``refs`` as it completes. A task's error is raised
    as itself (a :class:`~kvroute.errors.KvrouteError` stays one, without Ray's wrapper);
    on an error or Ctrl-C the tasks still pending are cancelled. The wait comes back to
    Python every :data:`POLL_S` seconds, so that Ctrl-C and other signals are handled while
    tasks run (a wait without a timeout blocks them until a task ends)."""
    index = {ref: i for i, ref in enumerate(refs)}
    pending = list(refs)
    try:
        while pending:
            try:
                done, pending = ray.wait(pending, num_returns=1, timeout=POLL_S)
            except SystemError as exc:
                # A signal handler's exception (Ctrl-C, an alarm) raised inside Ray's wait
                # comes out wrapped; raise it as itself.
                if isinstance(exc.__cause__, BaseException):
                    raise exc.__cause__ from None
                raise
            for ref in done:
                try:
                    value = ray.get(ref)
                except ray.exceptions.RayTaskError as exc:
                    cause = getattr(exc, "cause", None)
                    if isinstance(cause, BaseException):
                        raise cause from None
                    raise
                yield index[ref], value
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)


__all__ = ["EXECUTORS", "check_executor", "completed", "connected", "require_ray"]
