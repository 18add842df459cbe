"""What the proxy reads from a client (lw.proxy.intake), through the proxy's apps in process
(raw ASGI, no server): the answer to a client that left mid-body and what it counts, the place a
finished body read gives back, a refusal's message. Written to kill the survivors of
``tools/mutation.py --scope security``; the same with real servers and sockets is in
tests/proxy/test_proxy_intake.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

pytest.importorskip("fastapi")

from lw.contract.auth import signed_call  # noqa: E402
from lw.proxy.limits import Limits  # noqa: E402
from lw.proxy.server import ProxyApps, build_apps  # noqa: E402
from tests.proxy.test_proxy import KEY  # noqa: E402

Sent = list[dict[str, Any]]


def apps(limits: Limits | None = None) -> ProxyApps:
    """A keyed proxy over servers nobody calls (every request here ends at intake)."""
    return build_apps(["http://p:1"], ["http://d:1"], metaserver_url="http://c/v1/metaserver",
                      cluster_key=KEY, start_mode="d-first", limits=limits)


async def drive(app: Callable[..., Awaitable[None]], path: str, chunks: list[bytes],
                gone: bool, headers: dict[str, str] | None = None,
                hold: asyncio.Event | None = None, stalled: asyncio.Event | None = None
                ) -> Sent:
    """POST ``chunks`` to ``app`` as one ASGI request; then the client leaves (``gone``) or the
    body ends; with ``hold``, the body stalls after its first chunk until it is set (setting
    ``stalled`` when it does). What the app sent back."""
    todo = list(chunks)
    sent: Sent = []

    async def receive() -> dict[str, Any]:
        if hold is not None and len(todo) < len(chunks):
            if stalled is not None:
                stalled.set()
            await hold.wait()
        if todo:
            chunk = todo.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(todo) or gone}
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "client": ("10.1.2.3", 4567),
             "server": ("proxy", 80),
             "headers": [(b"host", b"proxy"), (b"content-type", b"application/json"),
                         *((k.encode(), v.encode()) for k, v in (headers or {}).items())]}
    await app(scope, receive, send)
    return sent


def start(sent: Sent) -> tuple[int, dict[bytes, bytes]]:
    """The status and headers of the answer in ``sent``."""
    first = next(m for m in sent if m["type"] == "http.response.start")
    return first["status"], dict(first["headers"])


@pytest.mark.parametrize(("port", "path"), [("public", "/v1/completions"),
                                            ("control", "/v1/metaserver")])
def test_a_client_gone_mid_body_gets_a_bare_400_that_closes_and_counts_once(
        port: str, path: str) -> None:
    """A body abandoned mid-way is answered 400 with no body and ``connection: close``,
    counted as abandoned only (not as a bad request, nothing logged as a refusal)."""
    async def go() -> None:
        a = apps()
        try:
            # a control call is signed (an unsigned one is refused before its body is read)
            _, signed = signed_call(KEY, {"transfer_id": "t"})
            sent = await drive(getattr(a, port), path, [b'{"prompt": "'], gone=True,
                               headers=signed if port == "control" else None)
        finally:
            await a.state.aclose()
        status, headers = start(sent)
        assert status == 400 and headers[b"connection"] == b"close", sent
        assert b"".join(m.get("body", b"") for m in sent[1:]) == b""
        assert a.state.counters["bodies_abandoned"] == 1
        assert a.state.counters["bad_requests"] == 0

    asyncio.run(go())


def test_a_finished_body_read_gives_back_exactly_its_one_place() -> None:
    """With room for one body read at a time, three bodies read (and refused as not JSON) one
    after another leave exactly that one place: a body that stalls then holds it, and the
    next is refused 503 while it does."""
    async def go() -> None:
        a = apps(Limits(max_body_reads=1))
        try:
            for _ in range(3):
                status, _ = start(await drive(a.public, "/v1/completions", [b"{"],
                                              gone=False))
                assert status == 400
            hold, stalled = asyncio.Event(), asyncio.Event()
            held = asyncio.create_task(drive(a.public, "/v1/completions", [b"{", b"["],
                                             gone=False, hold=hold, stalled=stalled))
            await stalled.wait()
            status, _ = start(await drive(a.public, "/v1/completions", [b"{"], gone=False))
            assert status == 503 and a.state.counters["bodies_refused_busy"] == 1
            assert a.state.counters["bad_requests"] == 3
            hold.set()
            await held
        finally:
            await a.state.aclose()

    asyncio.run(go())


def test_json_the_proxy_cannot_encode_again_is_refused_with_its_message_alone() -> None:
    """A body holding NaN is a 400 whose message is exactly the refusal's text (not the tuple
    of the exception's arguments) with ``param`` naming the place."""
    async def go() -> None:
        a = apps()
        try:
            sent = await drive(a.public, "/v1/completions", [b'{"a": [1, NaN]}'], gone=False)
        finally:
            await a.state.aclose()
        status, _ = start(sent)
        error = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]
        assert status == 400 and error["param"] == "a[1]", error
        assert error["message"] == (
            "request body is not valid JSON at a[1]: nan is not a finite number (NaN, Infinity "
            "and numbers beyond 1.8e308 are not allowed) [lw proxy: stage=proxy]")
        assert a.state.counters["bad_requests"] == 1

    asyncio.run(go())
