"""The peers benchmark's harness (``benches/peers``, ``make bench-peers``) on a short
workload: SMG and vllm-router install from PyPI and start, as do kvroute's arms, in front of
two real vLLM engines; every request of every arm is answered and the table is produced.
The benchmark's targets live in ``benches/README.md``, not here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches" / "peers"))


def _agent_traces() -> Path:
    import workloads

    return workloads.AGENT_TRACES


@pytest.mark.skipif(not _agent_traces().exists(), reason="shared agent traces not present")
def test_every_router_answers_a_short_workload(tmp_path: Path) -> None:
    import run

    arms = list(run.DEFAULT_ARMS)
    # One agent session of each trace folder, three turns each, as text completions.
    runs, ceilings, facts = run.run(["agentic-text"], ["light"], arms, 1, tmp_path, 1, 3)
    assert [r.arm for r in runs] == arms
    requests = facts["requests"]["agentic-text"]
    assert requests == 6
    for r in runs:
        assert r.requests == requests and r.errors == 0, (r.arm, r.error_samples)
        assert sum(r.per_engine) == requests, r
        assert 0.0 <= r.hit_rate <= 1.0 and r.cpu_ms_per_req > 0
    assert 0 < ceilings["agentic-text"]["any_session"] <= 1
    table = run.markdown(runs, ceilings)
    assert all(f"| {arm} |" in table for arm in arms)
