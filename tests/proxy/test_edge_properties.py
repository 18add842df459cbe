"""The proxy's public, sidecar and control ports under arbitrary input, over real HTTP, with a
decode server that parses bodies with vLLM's own request models (so it accepts exactly what
vLLM accepts, not what a stricter fake would): no client-written transfer field ever reaches it,
every refusal is a 4xx in vLLM's error shape, and nothing answers 5xx."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("fastapi")

from lw.vllm_adapter.serve import install_version_shim  # noqa: E402

install_version_shim()

import httpx  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, Response  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from pydantic import ValidationError  # noqa: E402
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: E402
from vllm.entrypoints.openai.completion.protocol import CompletionRequest  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402

from lw.contract.params import ContractError, decode_params_for_decoder  # noqa: E402
from lw.proxy.sidecar import Sidecar  # noqa: E402
from tests.proxy.test_proxy import KEY, ServerThread, cluster  # noqa: E402

VLLM_CRASH = "vLLM's own request parser raised"
"""(messages=1.0 raises TypeError inside vLLM 0.32's chat validator: a 500 from vLLM itself,
relayed as vLLM's answer; lw's own answers are never 5xx here.)"""
MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


class Seen:
    """What reached the decode server: transfer params that were not the proxy's."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = 0
        self.foreign: list[Any] = []


def vllm_like_decode(seen: Seen) -> FastAPI:
    """A decode server whose parser is vLLM's: a body vLLM refuses gets a 400, one it accepts
    is recorded (its transfer params checked against the proxy's signature) and answered."""
    app = FastAPI()

    async def serve(request: Request) -> Response:
        raw = await request.body()
        try:
            req = MODELS[request.url.path].model_validate_json(raw)
        except (ValidationError, VLLMValidationError, ValueError) as exc:  # vLLM answers 400
            return JSONResponse({"error": {"message": str(exc)[:300], "type": "BadRequestError",
                                           "param": None, "code": 400}}, 400)
        except Exception as exc:  # noqa: BLE001 - vLLM's own validators crash on some shapes
            return JSONResponse({"error": {"message": f"{VLLM_CRASH}: {exc!r}"[:300],
                                           "type": "InternalServerError", "param": None,
                                           "code": 500}}, 500)
        with seen.lock:
            seen.requests += 1
            for params in (req.kv_transfer_params, (req.vllm_xargs or {}).get(
                    "kv_transfer_params")):
                if params is None:
                    continue
                try:
                    decode_params_for_decoder(KEY, params)
                except ContractError:
                    seen.foreign.append(params)
        return JSONResponse({"id": "cmpl-x", "model": "tiny",
                             "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]})

    app.post("/v1/completions")(serve)
    app.post("/v1/chat/completions")(serve)
    app.get("/health")(lambda: {"ok": True})
    app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": "tiny"}]})
    return app


@pytest.fixture(scope="module", params=["proxy", "sidecar"])
def edge(request: pytest.FixtureRequest) -> Iterator[tuple[str, str, Seen]]:
    """(public URL, control URL, what D saw) for the proxy and for the sidecar (local mode)."""
    seen = Seen()
    d = ServerThread(vllm_like_decode(seen)).start()
    kw: dict[str, Any] = {}
    if request.param == "sidecar":
        kw["sidecar"] = Sidecar([], allow_any=False)
    try:
        with cluster(decode_urls=[d.url], **kw) as c:
            yield c.url, c.control, seen
    finally:
        d.stop()


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids,
                                                              max_size=3),
    max_leaves=8)
EVIL = st.fixed_dictionaries({"do_remote_prefill": st.just(True),
                              "metaserver": st.just("http://127.0.0.1:9/steal"),
                              "transfer_id": st.text(min_size=1, max_size=8)})
TRANSFER = EVIL | JSON
XARGS = st.dictionaries(st.sampled_from(["kv_transfer_params", "k"]), TRANSFER, max_size=2)
# bodies vLLM accepts, with the attacker's fields on every path (routed, relayed unroutable)
ATTACK = st.fixed_dictionaries(
    {"model": st.just("tiny"), "max_tokens": st.just(2),
     "kv_transfer_params": EVIL | st.none() | st.just({})},
    optional={"prompt": st.sampled_from(["hello", ["a", "b"], [1, 2]]),
              "messages": st.just([{"role": "user", "content": "hi"}]),
              "stream": st.sampled_from([None, False, True]),
              "n": st.sampled_from([1, 2]),
              "vllm_xargs": XARGS})
GENERIC = st.fixed_dictionaries(
    {"model": st.just("tiny") | JSON, "max_tokens": st.just(2) | JSON},
    optional={"prompt": st.just("hello") | JSON,
              "messages": st.just([{"role": "user", "content": "hi"}]) | JSON,
              "stream": st.sampled_from([None, False, "no", 0]),
              "n": st.just(1) | JSON,
              "kv_transfer_params": TRANSFER,
              "vllm_xargs": XARGS | JSON,
              "stream_options": JSON})
BODY = ATTACK | GENERIC


def assert_vllm_shape(r: httpx.Response) -> None:
    assert r.status_code < 500 or VLLM_CRASH in r.text, (r.status_code, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"}, err
        assert err["code"] == r.status_code and err["message"], err


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(sorted(MODELS)), body=BODY)
def test_no_client_transfer_field_reaches_the_decode_server(
        edge: tuple[str, str, Seen], path: str, body: dict[str, Any]) -> None:
    url, _control, seen = edge
    r = httpx.post(url + path, json=body, timeout=30)
    assert_vllm_shape(r)
    with seen.lock:
        assert seen.foreign == [], seen.foreign


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(sorted(MODELS)), raw=st.binary(max_size=200)
       | JSON.map(lambda v: json.dumps(v).encode()))
def test_any_bytes_get_a_4xx_in_vllms_shape_or_are_served(
        edge: tuple[str, str, Seen], path: str, raw: bytes) -> None:
    url, _control, seen = edge
    r = httpx.post(url + path, content=raw, timeout=30,
                   headers={"content-type": "application/json"})
    assert_vllm_shape(r)
    with seen.lock:
        assert seen.foreign == []


HEADER = st.text(max_size=80).filter(lambda v: v == v.strip() and "\r" not in v
                                     and "\n" not in v and "\x00" not in v)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(sig=HEADER, ts=HEADER, nonce=HEADER, raw=st.binary(max_size=100))
def test_the_control_port_refuses_any_unsigned_call_with_a_4xx(
        edge: tuple[str, str, Seen], sig: str, ts: str, nonce: str, raw: bytes) -> None:
    _url, control, _seen = edge
    headers = {"x-lw-signature": sig, "x-lw-timestamp": ts, "x-lw-nonce": nonce}
    try:
        r = httpx.post(control + "/v1/metaserver", content=raw, timeout=30,
                       headers={k: v.encode("utf-8").decode("latin-1")
                                for k, v in headers.items() if v})
    except (httpx.LocalProtocolError, UnicodeError):
        return  # a header httpx itself will not send
    assert r.status_code in (400, 401, 403, 404, 413), (r.status_code, r.text)
