"""The proxy's bounds (lw.proxy.limits) at their edges, without a server: the defaults the threat
model states, each bad setting refused, and a body read up to its bound and no further. Written
to kill the survivors of ``tools/mutation.py --scope security``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import pytest
from starlette.requests import Request

from lw.proxy.limits import (
    BODY_READ_BUDGET,
    BodyAbandoned,
    BodyTooLarge,
    BodyTooSlow,
    Limits,
    read_body,
)


def test_the_defaults_are_the_threat_models() -> None:
    """docs/deployment.md ("Threat model") states these numbers."""
    got = Limits()
    assert (got.max_body_bytes, got.max_control_body_bytes) == (8 << 20, 8 << 20)
    assert (got.max_control_reads, got.max_prefill_answer_bytes) == (32, 1 << 20)
    assert (got.prefill_total_s, got.health_cache_s, got.body_read_s) == (600.0, 1.0, 60.0)
    assert (got.max_concurrent_requests, got.max_connections) == (4096, 8192)
    assert (got.why_timeout_s, got.why_in_flight, got.why_per_s) == (0.5, 4, 20.0)
    assert (got.ahead_wait_s, got.max_body_reads, BODY_READ_BUDGET) == (2.0, None, 1 << 30)
    assert got.body_reads == 128


@pytest.mark.parametrize("bad", [
    {"ahead_wait_s": 0.0}, {"max_body_bytes": 0}, {"max_control_body_bytes": 0},
    {"max_prefill_answer_bytes": 0}, {"max_concurrent_requests": 0}, {"max_control_reads": 0},
    {"prefill_total_s": 0.0}, {"health_cache_s": -0.1}, {"body_read_s": 0.0},
    {"max_body_reads": 0}, {"max_connections": 0}, {"why_timeout_s": -1.0},
    {"why_in_flight": -1}, {"why_per_s": -1.0},
])
def test_each_bound_below_its_least_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):  # the message names it
        Limits(**bad)


def test_each_bound_at_its_least_is_accepted() -> None:
    Limits(ahead_wait_s=0.001, max_body_bytes=1, max_control_body_bytes=1,
           max_prefill_answer_bytes=1, max_concurrent_requests=1, max_control_reads=1,
           prefill_total_s=0.001, health_cache_s=0.0, body_read_s=0.001, max_body_reads=1,
           max_connections=1, why_timeout_s=0.0, why_in_flight=0, why_per_s=0.0)


def test_the_derived_body_reads_bound() -> None:
    assert Limits(max_body_bytes=BODY_READ_BUDGET // 3).body_reads == 3
    assert Limits(max_body_bytes=BODY_READ_BUDGET + 1).body_reads == 1
    assert Limits(max_concurrent_requests=5, max_body_bytes=1).body_reads == 5


def request(chunks: Iterable[bytes], length: str | None = None, gone: bool = False,
            stall: bool = False) -> Request:
    """A request whose body arrives in ``chunks``; then the client leaves (``gone``) or sends
    nothing more (``stall``)."""
    todo = list(chunks)

    async def receive() -> dict[str, Any]:
        if todo:
            chunk = todo.pop(0)
            return {"type": "http.request", "body": chunk,
                    "more_body": bool(todo) or gone or stall}
        if stall:
            await asyncio.sleep(10)
        return {"type": "http.disconnect"}

    headers = [] if length is None else [(b"content-length", length.encode())]
    return Request({"type": "http", "method": "POST", "headers": headers}, receive)


def read(req: Request, limit: int, within_s: float = 5.0) -> bytes:
    return asyncio.run(read_body(req, limit, within_s))


def test_a_body_up_to_its_bound_is_read_whole() -> None:
    assert read(request([b"abc", b"de"], "5"), 5) == b"abcde"
    assert read(request([b"abc", b"de"]), 5) == b"abcde"
    assert read(request([b"abcde"], "x"), 5) == b"abcde"  # an unreadable length: the stream


def test_a_declared_length_over_the_bound_is_refused_before_reading() -> None:
    with pytest.raises(BodyTooLarge, match="declares 6 bytes; the limit is 5") as err:
        read(request([b"abc"], "6"), 5)
    assert err.value.limit == 5


def test_a_stream_over_the_bound_is_cut_when_it_passes_it() -> None:
    with pytest.raises(BodyTooLarge, match="is larger; the limit is 5"):
        read(request([b"abc", b"def"], "2"), 5)  # a declared length that lies


def test_a_client_leaving_mid_body_is_abandoned_with_its_size() -> None:
    with pytest.raises(BodyAbandoned) as err:
        read(request([b"abc", b"d"], gone=True), 10)
    assert err.value.size == 4


def test_a_body_that_stalls_is_too_slow() -> None:
    with pytest.raises(BodyTooSlow, match="within 0.05 s"):
        read(request([b"abc"], stall=True), 10, within_s=0.05)


def test_a_control_body_read_frees_its_place() -> None:
    """With room for one body read at a time, calls one after another are each read (and
    refused for their signature), never turned away as if the earlier reads still held it."""
    pytest.importorskip("uvicorn")
    import httpx

    from tests.proxy.test_proxy import cluster

    forged = {"x-lw-signature": "0" * 64, "x-lw-timestamp": "1.0", "x-lw-nonce": "abcdefgh"}
    with cluster(limits=Limits(max_control_reads=1)) as c:
        for _ in range(3):
            r = httpx.post(c.control + "/v1/metaserver", content=b"{}", headers=forged,
                           timeout=10)
            assert r.status_code == 401, r.text
