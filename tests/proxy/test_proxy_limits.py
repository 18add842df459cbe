"""The proxy's bounds (lw.proxy.limits), each tried by exceeding it: bodies on
both ports (refused before they are read), P's answer in size and time, requests in flight,
and the public /health under a flood (one shared probe, not one per call)."""

from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import httpx  # noqa: E402

from lw.proxy.limits import Limits  # noqa: E402
from tests.proxy.test_proxy import cluster, completion, wait_for  # noqa: E402


def raw_head(url: str, head: bytes, body: bytes = b"") -> bytes:
    """Send a request head (and the start of a body) on a raw socket; what comes back first.
    The proxy must answer without waiting for the rest of the body it was promised."""
    parts = urlsplit(url)
    got = b""
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as s:
        s.sendall(head + b"\r\n" + body)
        while chunk := s.recv(65536):  # the proxy closes after a refusal (connection: close)
            got += chunk
    return got


def test_a_body_declared_over_the_bound_is_refused_413_before_it_is_read() -> None:
    with cluster() as c:
        got = raw_head(c.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                              b"Content-Type: application/json\r\n"
                              b"Content-Length: 209715200\r\n", b'{"prompt": "')
        assert got.startswith(b"HTTP/1.1 413"), got[:200]
        assert b"limit is 8388608 bytes" in got and b"RequestEntityTooLarge" in got
        assert b"connection: close" in got.lower()
        assert c.metrics()["bodies_too_large"] == 1
        assert not c.world.has("d_request") and not c.world.has("d_relayed")


def test_a_streamed_body_is_cut_at_the_bound() -> None:
    """No Content-Length (chunked): read only until the bound is passed."""
    sent = []

    def chunks() -> object:
        for _ in range(64):
            sent.append(1)
            yield b" " * 65536

    with cluster(limits=Limits(max_body_bytes=256 << 10)) as c:
        try:
            r = httpx.post(c.url + "/v1/completions", content=chunks(), timeout=30,
                           headers={"content-type": "application/json"})
            assert r.status_code == 413, r.text
        except httpx.HTTPError:
            pass  # the proxy answered and closed while the client was still writing
        wait_for(lambda: c.metrics()["bodies_too_large"] == 1)
        assert not c.world.has("d_request") and not c.world.has("d_relayed")


def test_an_unsigned_control_call_is_refused_before_its_body_is_read() -> None:
    with cluster() as c:
        got = raw_head(c.control, b"POST /v1/metaserver HTTP/1.1\r\nHost: x\r\n"
                                  b"Content-Type: application/json\r\n"
                                  b"Content-Length: 52428800\r\n")
        assert got.startswith(b"HTTP/1.1 401"), got[:200]
        # signed-looking headers but a body over the control bound: 413, still unread
        got = raw_head(c.control, b"POST /v1/metaserver HTTP/1.1\r\nHost: x\r\n"
                                  b"x-lw-signature: " + b"0" * 64 + b"\r\n"
                                  b"x-lw-timestamp: 1.0\r\nx-lw-nonce: abcdefgh\r\n"
                                  b"Content-Length: 52428800\r\n")
        assert got.startswith(b"HTTP/1.1 413"), got[:200]


def test_control_bodies_read_at_once_are_bounded() -> None:
    """Each metaserver body is read before its MAC can be checked: callers with well-formed
    but wrong signature headers hold at most max_control_reads x max_control_body_bytes."""
    with cluster(limits=Limits(max_control_reads=2)) as c:
        parts = urlsplit(c.control)
        head = (b"POST /v1/metaserver HTTP/1.1\r\nHost: x\r\nx-lw-signature: " + b"0" * 64
                + b"\r\nx-lw-timestamp: 1.0\r\nx-lw-nonce: abcdefgh\r\n"
                b"Content-Length: 1000\r\n\r\n")
        slow = [socket.create_connection((parts.hostname, parts.port), timeout=30)
                for _ in range(2)]
        try:
            for s in slow:  # two callers that send a head and then drip nothing
                s.sendall(head + b"{")
            wait_for(lambda: httpx.get(c.control + "/metrics-json", timeout=5).json()[
                "metaserver_calls"] == 2)
            got = raw_head(c.control, head[:-2])
            assert got.startswith(b"HTTP/1.1 503"), got[:200]
        finally:
            for s in slow:
                s.close()


def test_a_prefill_answer_over_its_bound_fails_the_prefill() -> None:
    """(The fake D decodes anyway: its P did answer, so the client's 200 is the fake's; what
    counts is that the proxy read no more than the bound and counted the prefill failed.)"""
    with cluster(limits=Limits(max_prefill_answer_bytes=16)) as c:
        httpx.post(c.url + "/v1/completions", json=completion("hello"), timeout=30)
        wait_for(lambda: c.metrics()["prefill_failures"] == 1)


def test_a_prefill_that_answers_slower_than_its_total_bound_is_a_504() -> None:
    """httpx's timeouts bound each read; a P dripping its answer would pass them all."""
    with cluster(limits=Limits(prefill_total_s=0.05)) as c:
        r = httpx.post(c.url + "/v1/completions", json=completion("slowfail"), timeout=30)
        assert r.status_code == 504, r.text
        assert "no whole answer within 0.05 s" in r.json()["error"]["message"]


def test_requests_beyond_the_concurrency_bound_get_503_at_once() -> None:
    with cluster(limits=Limits(max_concurrent_requests=1)) as c:
        box: list[httpx.Response] = []
        t = threading.Thread(target=lambda: box.append(httpx.post(
            c.url + "/v1/completions", json=completion("dhang"), timeout=60)))
        t.start()
        wait_for(lambda: c.world.has("d_request"))
        r = httpx.post(c.url + "/v1/completions", json=completion("hello"), timeout=30)
        assert r.status_code == 503 and "serving 1 requests" in r.text, r.text
        assert c.metrics()["overloaded"] == 1
        c.world.release.set()
        t.join(60)


def test_a_health_flood_probes_each_backend_once() -> None:
    with cluster(limits=Limits(health_cache_s=60.0)) as c:
        before = len(c.world.servers("health"))  # the harness's own readiness probes
        with ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(lambda _: httpx.get(c.url + "/health", timeout=30)
                                  .status_code, range(64)))
        assert codes == [200] * 64
        assert sorted(c.world.servers("health")[before:]) == ["d0", "p0"]  # one shared probe


def test_a_body_dripped_slower_than_its_bound_is_a_408() -> None:
    """A client that sends a head and then drips its body holds a connection and memory: the
    proxy answers 408 at ``body_read_s`` and closes."""
    with cluster(limits=Limits(body_read_s=0.5)) as c:
        got = raw_head(c.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                              b"Content-Type: application/json\r\nContent-Length: 100\r\n",
                       b'{"prompt": ')  # 11 of the 100 bytes promised, then nothing
        assert got.startswith(b"HTTP/1.1 408"), got[:200]
        assert c.metrics()["bodies_too_slow"] == 1


def test_a_flood_of_refused_bodies_logs_two_lines_per_kind_and_interval() -> None:
    """The proxy's refusals go through the one rate-limited log (lw.transport.ratelog): a flood
    gives one line at once and, once the 5 s are over, one naming how many were left out."""
    import asyncio
    import logging

    from lw.contract.auth import CallVerifier
    from lw.proxy.intake import refuse
    from lw.proxy.state import ProxyState
    from lw.transport.ratelog import RateLog

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("lw.proxy")
    keep = Keep()
    logger.addHandler(keep)

    async def flood() -> None:
        state = ProxyState(["http://p"], ["http://d"], timeout_s=1, connect_timeout_s=1,
                           health_timeout_s=1, metaserver_url="http://m",
                           verifier=CallVerifier(None))
        assert isinstance(state.refusals, RateLog)
        now = [0.0]
        state.refusals.clock = lambda: now[0]
        for i in range(1000):
            refuse(state, 400, f"bad body {i}", counter="client_transfer_params_refused")
        assert records == ["lw proxy [client_transfer_params_refused]: client request refused "
                           "(400): bad body 0"]
        now[0] = 5.0
        state.refusals.tick()
        assert len(records) == 2 and records[1].startswith(
            "lw proxy [client_transfer_params_refused]: 999 more like it in the last 5s")
        assert records[1].endswith("the last one: client request refused (400): bad body 999")
        assert state.counters["client_transfer_params_refused"] == 1000
        await state.aclose()

    try:
        asyncio.run(flood())
    finally:
        logger.removeHandler(keep)
