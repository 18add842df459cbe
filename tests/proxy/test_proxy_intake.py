"""The proxy's intake refusals: JSON in any encoding screened on the relay, types vLLM would
coerce (``n``, ``stream``), JSON the proxy cannot encode again, the bound on bodies read at once,
clients that leave mid-body; and the relay of requests not routable D first."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

import httpx  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, Response, StreamingResponse  # noqa: E402

from lw.proxy.intake import BadJson, decode_json  # noqa: E402
from lw.proxy.limits import Limits  # noqa: E402
from lw.proxy.sidecar import Sidecar  # noqa: E402
from lw.proxy.state import BadField, validate_request  # noqa: E402
from lw.vllm_adapter.admission import TransferParamsGuard  # noqa: E402
from tests.proxy.test_proxy import ServerThread, cluster, completion, wait_for  # noqa: E402

EVIL = {"do_remote_prefill": True, "metaserver": "http://127.0.0.1:9/steal", "transfer_id": "x"}


class FakeD:
    """A decode server that records what reached it; its stream waits for ``go``."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bytes]] = []
        self.events: list[str] = []
        self.go = threading.Event()
        self.app = FastAPI()
        self.app.add_api_route("/v1/responses", self.raw, methods=["POST", "PUT"])
        self.app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        self.app.add_api_route("/v1/models", self.models, methods=["GET"])

    async def raw(self, request: Request) -> Response:
        self.seen.append((request.url.path, await request.body()))
        return JSONResponse({"ok": True})

    async def models(self) -> Response:
        return JSONResponse({"data": [{"id": "tiny"}]})

    async def completions(self, request: Request) -> Response:
        raw = await request.body()
        self.seen.append((request.url.path, raw))
        if not json.loads(raw).get("stream"):
            return JSONResponse({"choices": [{"text": "alone"}]})

        async def events() -> AsyncIterator[bytes]:
            try:
                yield b'data: {"choices":[{"text":"first"}]}\n\n'
                while not self.go.is_set():
                    await asyncio.sleep(0.01)
                yield b"data: [DONE]\n\n"
                self.events.append("finished")
            except (asyncio.CancelledError, GeneratorExit):
                self.events.append("aborted")
                raise

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture
def fake_d() -> Iterator[tuple[FakeD, ServerThread]]:
    d = FakeD()
    server = ServerThread(d.app).start()
    try:
        yield d, server
    finally:
        d.go.set()
        server.stop()


# -- 1. the sidecar's relay screens JSON in any encoding and content type -------------------

BODY = {"model": "tiny", "input": "hi", "kv_transfer_params": EVIL}
PLAIN = json.dumps(BODY).encode()


@pytest.mark.parametrize(("content", "content_type"), [
    (b"\xef\xbb\xbf" + PLAIN, "application/JSON"),
    (json.dumps(BODY).encode("utf-16-be"), "Application/Json"),
    (json.dumps(BODY).encode("utf-16"), "application/json; charset=utf-16"),
    (json.dumps(BODY).encode("utf-32-le"), None),
    (b"\xef\xbb\xbf" + PLAIN, "text/plain"),
])
def test_the_relay_screens_json_whatever_its_encoding_and_content_type(
        fake_d: tuple[FakeD, ServerThread], content: bytes, content_type: str | None) -> None:
    d, server = fake_d
    with cluster(decode_urls=[server.url], sidecar=Sidecar([], allow_any=False)) as c:
        headers = {"content-type": content_type} if content_type else {}
        r = httpx.post(c.url + "/v1/responses", content=content, headers=headers, timeout=10)
        assert r.status_code == 200, r.text
        [(_, got)] = d.seen
        assert json.loads(got) == {"model": "tiny", "input": "hi"}
        assert c.metrics()["client_transfer_params_dropped"] == 1


def test_the_relay_refuses_broken_json_and_passes_other_bytes(
        fake_d: tuple[FakeD, ServerThread]) -> None:
    d, server = fake_d
    with cluster(decode_urls=[server.url], sidecar=Sidecar([], allow_any=False)) as c:
        r = httpx.post(c.url + "/v1/responses", content=b'{"input": ',
                       headers={"content-type": "application/JSON"}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "body.10"  # vLLM's
        r = httpx.put(c.url + "/v1/responses", content=b'{"t": NaN}', timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "t"
        form = b"a=1&kv_transfer_params=x"
        r = httpx.post(c.url + "/v1/responses", content=form,
                       headers={"content-type": "application/x-www-form-urlencoded"},
                       timeout=10)
        assert r.status_code == 200 and d.seen == [("/v1/responses", form)]


async def _guard(body: bytes) -> tuple[int | None, bool]:
    reached = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        reached.append(True)

    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    await TransferParamsGuard(inner)({"type": "http", "method": "POST", "headers": []},
                                     receive, send)
    return (sent[0]["status"] if sent else None), bool(reached)


@pytest.mark.parametrize("encoding", ["utf-16-be", "utf-16-le", "utf-16", "utf-32"])
def test_the_decode_guard_parses_utf16_and_utf32_bodies(encoding: str) -> None:
    bad = json.dumps({"prompt": "hi", "kv_transfer_params": "x"}).encode(encoding)
    assert asyncio.run(_guard(bad)) == (400, False)
    fine = json.dumps({"prompt": "hi"}).encode(encoding)
    assert asyncio.run(_guard(fine)) == (None, True)


# -- 2, 3. types vLLM would coerce are refused ---------------------------------------------

@pytest.mark.parametrize(("field", "value"), [
    ("n", "2"), ("n", " 2 "), ("n", "2.0"), ("n", 2.0), ("n", True),
    ("stream", 1), ("stream", "true"), ("stream", 0), ("stream", "no"),
])
def test_a_field_vllm_would_coerce_is_a_400_naming_it(field: str, value: Any) -> None:
    with pytest.raises(BadField) as exc:
        validate_request("/v1/completions", completion("hi", **{field: value}))
    assert exc.value.field == field
    with cluster() as c:
        for path, body in (("/v1/completions", completion("hi", **{field: value})),
                           ("/v1/chat/completions", {"model": "tiny", field: value,
                                                     "messages": [{"role": "user",
                                                                   "content": "hi"}]})):
            r = httpx.post(c.url + path, json=body, timeout=10)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == field and json.dumps(value) in err["message"], err
        assert not c.world.has("d_request") and not c.world.has("d_relayed")
        assert c.metrics()["bad_requests"] == 2


@pytest.mark.parametrize("prompt", [[1.0, 2.0], [1, "a"], [[1, 2], "a"], [True, 2], [[1.5]],
                                    [{"t": 1}]])
def test_a_prompt_list_vllm_would_coerce_or_refuse_is_a_400(prompt: list) -> None:
    """[1.0, 2.0] is one prompt of token ids to vLLM and two to a count of list items: the
    allowance of sub-transfers would not be vLLM's count."""
    with pytest.raises(BadField) as exc:
        validate_request("/v1/completions", completion(prompt))
    assert exc.value.field == "prompt" and "token ids" in str(exc.value)


@pytest.mark.parametrize("prompt", [[1, 2, 3], ["a", "b"], [[1, 2], [3]], "hi"])
def test_the_prompt_shapes_vllm_reads_as_they_are_pass(prompt: Any) -> None:
    assert validate_request("/v1/completions", completion(prompt))["prompt"] == prompt


# -- 3. the relay of what the proxy cannot route D first --------------------------------------

UNROUTABLE = {"model": "tiny", "prompt_embeds": "AAAA", "stream": True}  # no prompt


def test_an_unroutable_stream_is_streamed_bounded_and_ends_with_its_client(
        fake_d: tuple[FakeD, ServerThread]) -> None:
    d, server = fake_d
    with cluster(decode_urls=[server.url], limits=Limits(max_concurrent_requests=1)) as c:
        with httpx.stream("POST", c.url + "/v1/completions", json=UNROUTABLE,
                          timeout=10) as r:
            assert r.status_code == 200
            chunks = r.iter_raw()  # held: a dropped iterator closes the response
            assert b"first" in next(chunks) and d.events == []  # streamed before D finished
            # the relay is a request in flight: the bound (1) refuses the next
            busy = httpx.post(c.url + "/v1/completions", json=completion("hi"), timeout=10)
            assert busy.status_code == 503 and c.metrics()["overloaded"] == 1
        wait_for(lambda: d.events == ["aborted"])  # the client left: D's request ended
        d.go.set()
        wait_for(lambda: httpx.post(c.url + "/v1/completions", json={**UNROUTABLE, "stream":
                                                                      False},
                                    timeout=10).status_code == 200)
        assert c.metrics()["relayed_unroutable"] >= 2


# -- 4. JSON the proxy could not encode again ------------------------------------------------

@pytest.mark.parametrize(("raw", "param"), [
    (b'{"model":"tiny","prompt":"hi","temperature":1e400}', "temperature"),
    (b'{"model":"tiny","seed":-1e999}', "seed"),
    (b'{"model":"tiny","prompt":"hi","temperature":NaN}', "temperature"),
    (b'{"model":"tiny","prompt":"hi","max_tokens":Infinity}', "max_tokens"),
    (b'{"model":"tiny","prompt":["a","hi \\ud800"]}', "prompt[1]"),
    (b'{"model":"tiny","prompt":"hi","stream":null,"top_p":NaN}', "top_p"),
    (b'{"model":"tiny","user":"\\udfff"}', "user"),
    (b'{"prompt":"hi","temperature":-Infinity}', "temperature"),
    (b'{"model":"tiny","prompt":"hi","x":{"\\ud800":1}}', "x"),
])
def test_json_the_proxy_cannot_encode_again_is_a_400_naming_where(raw: bytes, param: str
                                                                   ) -> None:
    with cluster() as c:
        r = httpx.post(c.url + "/v1/completions", content=raw,
                       headers={"content-type": "application/json"}, timeout=10)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and f"at {param}:" in err["message"], err
        assert not c.world.has("d_request") and not c.world.has("d_relayed")


def test_decode_json_names_a_nested_place() -> None:
    with pytest.raises(BadJson) as exc:
        decode_json(b'{"messages":[{"role":"user","content":"\\ud83d"}]}')
    assert exc.value.path == "messages[0].content" and "surrogate" in str(exc.value)
    assert decode_json(b'{"big": 1e308, "pair": "\\ud83d\\ude00"}')["pair"] == "\U0001f600"


# -- 5. bodies being read at once ----------------------------------------------------------

def test_the_body_read_bound_has_a_default_from_the_other_bounds() -> None:
    assert Limits().body_reads == 128
    assert Limits(max_concurrent_requests=1).body_reads == 1
    assert Limits(max_body_bytes=4 << 30).body_reads == 1
    assert Limits(max_body_reads=7).body_reads == 7
    with pytest.raises(ValueError, match="max_body_reads"):
        Limits(max_body_reads=0)


def _partial_body(url: str, path: str = "/v1/completions") -> socket.socket:
    """A connection that declares a 1000-byte body and sends 9 bytes of it."""
    host, port = url.split("//")[1].split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
              "content-length: 1000\r\n\r\n{\"model\":".encode())
    return s


def test_bodies_read_at_once_are_bounded() -> None:
    with cluster(limits=Limits(max_body_reads=1)) as c:
        held = _partial_body(c.url)
        try:
            wait_for(lambda: httpx.post(c.url + "/v1/completions", json=completion("hi"),
                                        timeout=10).status_code == 503)
            m = c.metrics()
            assert m["bodies_refused_busy"] >= 1 and m["requests"] == 0
        finally:
            held.close()
        wait_for(lambda: httpx.post(c.url + "/v1/completions", json=completion("hi"),
                                    timeout=10).status_code == 200)


# -- 6. a client that leaves mid-body --------------------------------------------------------

class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("port", ["public", "control"])
def test_a_client_leaving_mid_body_is_counted_without_a_traceback(port: str) -> None:
    seen = _Records()
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(seen)
    try:
        with cluster(cluster_key=None, insecure_trusted_network=True) as c:
            url, path = ((c.url, "/v1/completions") if port == "public"
                         else (c.control, "/v1/metaserver"))
            _partial_body(url, path).close()
            wait_for(lambda: c.metrics()["bodies_abandoned"] == 1)
    finally:
        logger.removeHandler(seen)
    assert not [r for r in seen.records if r.exc_info], [r.getMessage() for r in seen.records]
