"""The benchmarks' check of the build they measure: kvroute's native extension must be a
release build, as users run it (the dev build that ``make build-dev`` and ``make lint``
install is optimised less and checks more). Imports kvroute; no other cost."""

from __future__ import annotations

import sys
import warnings


def not_release() -> str | None:
    """None for a release build of kvroute; else what it is, and what to run."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the warning a debug build gives on import
        import kvroute

    if kvroute.BUILD_PROFILE == "release":
        return None
    return (
        f"kvroute's native extension is a {kvroute.BUILD_PROFILE} build "
        f"({kvroute._core.__file__}): run `make build-release` before measuring"
    )


def require_release() -> None:
    """Exit (status 1, with the reason) unless kvroute is a release build."""
    why = not_release()
    if why is not None:
        sys.exit(why)
