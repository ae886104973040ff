"""The proxy under faults: dead, killed, stalled, erroring and dying backends, health checks,
and clients that disconnect. Each ends with the router's counters back at zero."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import openai
import pytest

from kvroute.emulator import FaultConfig
from livekit import MODEL, Stack, http, spawn, sse_events, wait_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_connection_refused_is_retried_on_the_next_choice() -> None:
    with Stack(1, proxy={"policy": "load_only", "health_interval_s": 60}) as s:
        dead = f"http://127.0.0.1:{free_port()}"
        s.proxy.pool.add(dead)  # index 1, refuses connections
        s.proxy.pool.get(0).up = False
        s.proxy.pool._sync(s.proxy.pool.get(0))  # only the dead one is "up"
        s.proxy.pool.add(s.add_engine(speedup=50))  # index 2
        for i in range(5):
            status, headers, _ = http(
                "POST", s.url + "/v1/completions", {"prompt": [i], "max_tokens": 1}
            )
            assert status == 200 and headers["X-Kvroute-Instance"] == "2"
        assert not s.proxy.pool.get(1).up
        text = http("GET", s.url + "/metrics")[2].decode()
        assert 'kind="connect"' in text and "kvroute_proxy_retries_total" in text
        s.assert_counters_zero()


def test_a_backend_killed_mid_run() -> None:
    """Eight streams, half of them on an emulator in its own process that is killed once
    every stream has its first chunk (those on it need ~200 s more: they are cut mid-stream,
    the others end normally)."""
    victim = spawn("engine", "--speedup", "0.02")
    try:
        with Stack(1, speedup=2, proxy={"policy": "round_robin", "health_interval_s": 60}) as s:
            s.proxy.pool.add(victim.url)  # index 1: an emulator in its own process
            streaming = 0
            all_streaming = asyncio.Event()

            async def one(session: aiohttp.ClientSession, i: int) -> tuple[int, str | None]:
                nonlocal streaming
                body = {"prompt": [i] * 50, "max_tokens": 400, "ignore_eos": True, "stream": True}
                async with session.post(s.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    inst = int(resp.headers["X-Kvroute-Instance"])
                    raw = b""
                    while b"data: " not in raw:
                        chunk = await resp.content.readany()
                        assert chunk, "the stream ended before its first chunk"
                        raw += chunk
                    streaming += 1
                    if streaming == 8:
                        all_streaming.set()
                    events = sse_events(raw + await resp.content.read())
                errors = [
                    e["error"]["message"] for e in events if isinstance(e, dict) and "error" in e
                ]
                if not errors:
                    assert events[-1] == "[DONE]"
                return inst, (errors[0] if errors else None)

            async def run() -> list[tuple[int, str | None]]:
                async with aiohttp.ClientSession() as session:
                    tasks = [asyncio.create_task(one(session, i)) for i in range(8)]
                    await asyncio.wait_for(all_streaming.wait(), 60)
                    victim.proc.kill()
                    return await asyncio.gather(*tasks)

            results = asyncio.run(run())
            assert {inst for inst, _ in results} == {0, 1}
            for inst, error in results:
                assert (error is not None and "mid-stream" in error) if inst == 1 else error is None
            # Later requests never see the dead backend: refused connections are retried.
            for i in range(6):
                body = {"prompt": [i], "max_tokens": 1}
                status, headers, _ = http("POST", s.url + "/v1/completions", body)
                assert status == 200 and headers["X-Kvroute-Instance"] == "0"
            assert not s.proxy.pool.get(1).up
            s.assert_counters_zero()
    finally:
        victim.stop()


def test_a_stalled_backend_times_out_then_goes_down() -> None:
    """Requests to a backend that stalls (for an hour) time out after ``request_timeout_s``
    (5 s; the healthy backend answers in milliseconds) with 504s, and the backend is down
    after two of them."""
    config = {
        "policy": "round_robin",
        "request_timeout_s": 5.0,
        "unhealthy_after": 2,
        "health_interval_s": 60,
    }
    with Stack(2, proxy=config) as s:
        wait_until(lambda: s.proxy.pool.get(0).failures == 0 and s.proxy.pool.get(0).up)
        s.emulators[0].faults = FaultConfig(stall_rate=1.0, stall_s=3600)
        statuses = []
        for i in range(6):
            t0 = time.monotonic()
            status, _, raw = http(
                "POST", s.url + "/v1/completions", {"prompt": [i], "max_tokens": 1}, timeout=60
            )
            statuses.append(status)
            if status == 504:
                assert 4.9 < time.monotonic() - t0 < 40  # the timeout, not the stall's end
                assert json.loads(raw)["error"]["type"] == "gateway_timeout"
        assert statuses.count(504) == 2 and statuses.count(200) == 4
        assert not s.proxy.pool.get(0).up
        s.assert_counters_zero()


def test_dying_backend() -> None:
    with Stack(2, proxy={"policy": "load_only", "health_interval_s": 60}) as s:
        s.emulators[0].faults = FaultConfig(die_rate=1.0, die_after_tokens=2)
        with openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0) as client:
            stream = client.completions.create(
                model=MODEL,
                prompt=[1] * 10,
                max_tokens=6,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            got = []
            with pytest.raises(openai.APIError, match="mid-stream"):
                for chunk in stream:
                    got.append(chunk.choices[0].text)
            assert "".join(got).split() == ["the", "cache"]
            stream.close()
            # No byte reached the client yet: retried on the other backend.
            out = client.completions.create(model=MODEL, prompt=[2] * 10, max_tokens=3)
            assert out.choices[0].text
            s.emulators[0].faults = FaultConfig(die_rate=1.0, die_after_tokens=0)
            text = "".join(
                c.choices[0].text
                for c in client.completions.create(
                    model=MODEL,
                    prompt=[3] * 10,
                    max_tokens=3,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
            )
            assert len(text.split()) == 3
        s.assert_counters_zero()


def test_error_answers_are_retried_then_relayed() -> None:
    with Stack(2, proxy={"policy": "load_only", "health_interval_s": 60, "retries": 1}) as s:
        s.emulators[0].faults = FaultConfig(error_rate=1.0, error_status=500)
        status, headers, _ = http(
            "POST", s.url + "/v1/completions", {"prompt": [1], "max_tokens": 1}
        )
        assert status == 200 and headers["X-Kvroute-Instance"] == "1"
        s.emulators[1].faults = FaultConfig(error_rate=1.0, error_status=503)
        status, _, raw = http("POST", s.url + "/v1/completions", {"prompt": [2], "max_tokens": 1})
        assert status in (500, 503) and json.loads(raw)["error"]["message"] == "injected fault"
        s.assert_counters_zero()


def _raw_stream(url: str, body: dict[str, Any]) -> socket.socket:
    parts = urlsplit(url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def test_client_disconnect_mid_stream_cancels_upstream() -> None:
    with Stack(1, speedup=0.1) as s:
        body = {"prompt": [5] * 100, "max_tokens": 5000, "ignore_eos": True, "stream": True}
        with _raw_stream(s.url, body) as sock:
            got = b""
            while b"data:" not in got:
                chunk = sock.recv(65536)
                assert chunk, "the stream ended before its first chunk"
                got += chunk
            assert s.proxy.router.in_flight == 1
        s.assert_counters_zero(timeout=25)  # generation alone would take ~350 s
        text = http("GET", s.url + "/metrics")[2].decode()
        assert 'kind="client_disconnect"' in text


def test_client_disconnect_during_prefill_cancels_upstream() -> None:
    with Stack(1, speedup=0.1) as s:
        body = {"prompt": [6] * 60_000, "max_tokens": 10, "stream": True}
        with _raw_stream(s.url, body):
            wait_until(lambda: s.emulators[0].active == 1, what="the request to arrive")
            assert s.state()[0]["pending_prefill_tokens"] == 60_000
        s.assert_counters_zero(timeout=25)  # the prefill alone takes ~60 s


def test_health_checks_take_backends_down_and_up() -> None:
    # A check fails on the 503 of an unhealthy backend, not on a slow answer of a healthy one.
    config = {
        "health_interval_s": 0.05,
        "health_timeout_s": 10.0,
        "unhealthy_after": 2,
        "healthy_after": 2,
    }
    with Stack(2, proxy=config) as s:
        s.emulators[0].faults = FaultConfig(unhealthy=True)
        wait_until(lambda: not s.state()[0]["available"], what="backend 0 down")
        for i in range(4):
            _, headers, _ = http(
                "POST", s.url + "/v1/completions", {"prompt": [i], "max_tokens": 1}
            )
            assert headers["X-Kvroute-Instance"] == "1"
        s.emulators[1].faults = FaultConfig(unhealthy=True)
        wait_until(lambda: not s.state()[1]["available"], what="backend 1 down")
        status, _, raw = http("POST", s.url + "/v1/completions", {"prompt": [1], "max_tokens": 1})
        assert status == 503 and json.loads(raw)["error"]["code"] == 503
        s.emulators[0].faults = FaultConfig()
        wait_until(lambda: s.state()[0]["available"], what="backend 0 up again")
        assert http("POST", s.url + "/v1/completions", {"prompt": [1], "max_tokens": 1})[0] == 200
        s.assert_counters_zero()


def test_running_out_of_file_descriptors_is_logged_once_per_interval() -> None:
    """With no file descriptor left, every retry of accept fails: the relay logged each one
    (about 100 lines a second); now one line per interval, with a count."""
    import resource

    def few_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    args = ("--backend", "http://127.0.0.1:9")
    t0 = time.monotonic()
    proxy = spawn("proxy", *args, preexec=few_files, keep=None)
    parts = urlsplit(proxy.url)
    socks = []
    again = "more times since the last report"
    try:
        for _ in range(120):  # the kernel queues them; the proxy cannot take them all
            socks.append(socket.create_connection((parts.hostname, parts.port), timeout=30))
        # The second line: one interval (5 s) after the first, with the retries in between.
        wait_until(lambda: again in proxy.log(), 60, "the second report of failed accepts")
    finally:
        for sock in socks:
            sock.close()
        proxy.stop()
    elapsed = time.monotonic() - t0
    err = proxy.log()
    assert "Too many open files" in err
    prefix = "kvroute proxy: "
    lines = [line.removeprefix(prefix) for line in err.splitlines() if "accept" in line]
    # A first line, then one per interval with the count of the failures it stands for.
    assert lines[0].startswith("accept failed") and again not in lines[0], err[-2000:]
    assert all(line.startswith("accept failed") and again in line for line in lines[1:]), err
    assert 2 <= len(lines) <= 2 + elapsed / 5, err[-2000:]


def _metric_total(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def test_a_client_that_hangs_up_at_done_completed_its_request() -> None:
    """The ``openai`` client closes a stream as soon as it reads ``data: [DONE]``; vLLM writes
    the body's last chunk a moment later. Such a stream is complete: its usage is counted and
    no client disconnect is recorded."""
    with Stack(2, proxy={"policy": "round_robin"}) as s:
        for emulator in s.emulators:
            emulator.faults = FaultConfig(done_gap_s=0.05)
        seen = 0
        with openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0) as client:
            for i in range(30):
                chunks = client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"question {i} " * (i + 1)}],
                    max_tokens=3,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                usage = [c.usage for c in chunks if c.usage is not None]
                assert len(usage) == 1
                seen += usage[0].prompt_tokens
        s.assert_counters_zero()
        text = http("GET", s.url + "/metrics")[2].decode()
        assert _metric_total(text, "kvroute_proxy_prompt_tokens_total") == seen
        assert 'kind="client_disconnect"' not in text
