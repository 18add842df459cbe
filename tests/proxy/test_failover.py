"""Decode failover in the proxy (fakes of test_proxy, no vLLM): a decode server that refuses the
connection or fails (5xx) before a byte of its answer reached the client is replaced by another
one, with a fresh transfer (the old one's prefills are cancelled and its late metaserver calls
unknown); once a byte went out the client gets the error in-band; a failed server is avoided
for a while; the number of moves is bounded."""

from __future__ import annotations

import httpx
import pytest

from tests.proxy.test_proxy import (
    TOKENS,
    cluster,
    completion,
    lw_detail,
    request_error,
    sse_text,
)


def _text(r: httpx.Response, stream: bool) -> str:
    return sse_text(r.text) if stream else r.json()["choices"][0]["text"]


def _post(url: str, prompt: str, **extra: object) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=completion(prompt, **extra), timeout=10)


@pytest.mark.parametrize("stream", [False, True])
def test_an_unreachable_decode_server_is_replaced_then_avoided(
        stream: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # a backoff longer than the test, so that "avoided" does not depend on how fast the
    # machine serves the next three requests (test_backoff_* below times the backoff itself)
    monkeypatch.setattr("lw.proxy.backend.BACKOFF_S", (120.0, 120.0))
    with cluster(dead_decodes=1) as c:
        r = _post(c.url, "hello", stream=stream)
        assert r.status_code == 200, r.text
        assert _text(r, stream) == "".join(TOKENS)
        m = c.metrics()
        assert m["decode_failovers"] == 1 and m["in_flight"] == 0
        dead = m["decode"][0]
        assert dead["consecutive_failures"] == 1 and dead["in_flight"] == 0
        for _ in range(3):  # avoided while it backs off: no more failovers
            assert _post(c.url, "again", stream=stream).status_code == 200
        assert c.metrics()["decode_failovers"] == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_server_failing_before_its_answer_is_replaced(stream: bool) -> None:
    with cluster(n_decode=2) as c:
        r = _post(c.url, "d0down", stream=stream)
        assert r.status_code == 200, r.text
        assert _text(r, stream) == "".join(TOKENS)
        assert c.world.servers("d_failed") == ["d0"] and c.world.servers("d_done") == ["d1"]
        m = c.metrics()
        assert m["decode_failovers"] == 1 and m["in_flight"] == 0 and m["errors"] == 0
        assert [d["in_flight"] for d in m["decode"]] == [0, 0]


def test_the_moved_request_is_a_fresh_transfer_and_the_old_prefill_is_dropped() -> None:
    with cluster(n_decode=2) as c:
        r = _post(c.url, "d0postdown")
        assert r.status_code == 200, r.text
        old, new = c.world.tids("d_request")
        assert old != new
        assert c.world.meta_replies[old + "@0"][0][0] == 202  # d0 had its prefill started
        assert c.world.has("p_request", tid=new + "@0") and c.world.has("d_done", "d1", new)
        m = c.metrics()
        assert m["decode_failovers"] == 1 and m["in_flight"] == 0 and m["errors"] == 0


def test_a_stream_that_failed_after_its_first_token_reports_in_band() -> None:
    with cluster(n_decode=2) as c:
        r = _post(c.url, "d0middown", stream=True)
        assert r.status_code == 200
        err = request_error(r, stream=True)
        assert lw_detail(err)["stage"] == "decode"
        assert sse_text(r.text) == TOKENS[0]  # what the client had seen stays as it was
        assert c.metrics()["decode_failovers"] == 0


def test_failovers_are_bounded_and_the_error_names_every_server_tried() -> None:
    with cluster(n_decode=3, decode_failovers=1) as c:
        r = _post(c.url, "d0down d1down d2down")
        assert r.status_code == 502
        err = r.json()["error"]
        assert "tried 2 decode servers" in err["message"] and err["type"] == "BadGatewayError"
        assert len(c.world.servers("d_failed")) == 2 and c.metrics()["decode_failovers"] == 1


def test_a_client_error_of_d_is_not_retried_and_zero_failovers_keeps_one_try() -> None:
    with cluster(n_decode=2) as c:
        r = httpx.post(c.url + "/v1/completions", content=b"{not json",
                       headers={"content-type": "application/json"}, timeout=10)
        assert r.status_code == 400 and c.metrics()["decode_failovers"] == 0
    with cluster(n_decode=2, decode_failovers=0) as c:
        r = _post(c.url, "d0down")
        assert r.status_code == 502 and c.metrics()["decode_failovers"] == 0



def test_a_prefill_server_that_failed_is_avoided_by_the_next_requests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No prefill failover (the request whose P failed ends with its error), but new requests
    are routed to the P that answers."""
    monkeypatch.setattr("lw.proxy.backend.BACKOFF_S", (120.0, 120.0))  # see above
    with cluster(n_prefill=2) as c:
        r = _post(c.url, "fail here")  # the fake P fails it: 502 naming that P
        assert r.status_code == 502
        label = lw_detail(r.json()["error"])["server"]  # "prefill#i": no URL for the client
        bad = c.prefill_urls[int(label.removeprefix("prefill#"))]
        for i in range(4):
            assert _post(c.url, f"fine {i}").status_code == 200
        by_url = {p["url"]: p for p in c.metrics()["prefill"]}
        assert by_url[bad]["requests"] == 1 and by_url[bad]["consecutive_failures"] == 1


def test_backoff_grows_is_jittered_and_bounded() -> None:
    from lw.proxy.backend import BACKOFF_S, Backend

    b = Backend("http://d", "decode")
    waits = []
    for _ in range(2000):  # a server down for a long time: no overflow, never past the cap
        b.failed(100.0)
        waits.append(b.down_until - 100.0)
    lo, hi = BACKOFF_S
    assert 0.8 * lo <= waits[0] <= 1.2 * lo and waits[1] > waits[0] * 1.2
    assert max(waits) <= 1.2 * hi and not b.up(100.0) and b.up(100.0 + 1.2 * hi)
    b.answered()
    assert b.up(100.0) and b.fails == 0
