"""The admission guard (lw.vllm_adapter.admission) driven as plain ASGI, at its edges: the body
bound, what is parsed and what is passed on unread, and the refusal's shape. Written to kill the
survivors of ``tools/mutation.py --scope security``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from lw.contract.params import CONTRACT_VERSION, decoder_params, sign_params
from lw.vllm_adapter import admission
from lw.vllm_adapter.admission import (
    MAX_BODY_BYTES,
    TransferParamsGuard,
    transfer_params_problem,
)

KEY = "admission-test-key-0123456789abcdef"
UNSIGNED = {**decoder_params("http://127.0.0.1:9/steal", "t", "g" * 32),
            "lw_contract": CONTRACT_VERSION}


class Engine:
    """The app behind the guard: records what reached it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes, list[dict[str, Any]]]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        msgs = [await receive()]
        while msgs[-1].get("more_body"):
            msgs.append(await receive())
        if scope.get("type") == "http" and msgs[-1]["type"] == "http.request":
            msgs.append(await receive())  # what follows the body: the client's disconnect
        body = b"".join(m.get("body", b"") for m in msgs)
        self.calls.append((scope.get("method", ""), body, msgs))
        if scope.get("type") == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})


def call(monkeypatch: pytest.MonkeyPatch, chunks: list[bytes], *, method: str = "POST",
         length: int | None = None, kind: str = "http", key: str | None = KEY,
         end: str = "http.disconnect") -> tuple[int, dict[str, Any] | None, Engine]:
    """Send one request through a fresh guard: (status, error object or None, the engine)."""
    if key:
        monkeypatch.setenv("LW_CLUSTER_KEY", key)
    else:
        monkeypatch.delenv("LW_CLUSTER_KEY", raising=False)
    engine = Engine()
    guard = TransferParamsGuard(engine)
    todo = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
            for i, c in enumerate(chunks)]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return todo.pop(0) if todo else {"type": end}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    headers = [] if length is None else [(b"content-length", str(length).encode())]
    asyncio.run(guard({"type": kind, "method": method, "headers": headers}, receive, send))
    status = next((m["status"] for m in sent if m["type"] == "http.response.start"), 0)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    error = json.loads(body)["error"] if status in (400, 413) else None
    return status, error, engine


def params_body(params: Any, **extra: Any) -> bytes:
    return json.dumps({"prompt": "p", "kv_transfer_params": params, **extra}).encode()


def test_unsigned_params_are_a_400_naming_the_signature(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    status, err, engine = call(monkeypatch, [params_body(UNSIGNED)])
    assert status == 400 and engine.calls == []
    assert err == {"message": err["message"], "type": "BadRequestError",
                   "param": "kv_transfer_params.lw_sig", "code": 400}
    signed = sign_params(KEY.encode(), "decode", UNSIGNED)
    status, _, engine = call(monkeypatch, [params_body(signed)])
    assert status == 200 and engine.calls[0][1] == params_body(signed)


def test_a_body_split_in_chunks_is_checked_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = params_body(UNSIGNED)
    status, _, engine = call(monkeypatch, [raw[:10], raw[10:20], raw[20:]])
    assert status == 400 and engine.calls == []


def test_a_declared_length_over_the_bound_is_a_413_unread(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    status, err, engine = call(monkeypatch, [b"{}"], length=MAX_BODY_BYTES + 1)
    assert status == 413 and engine.calls == [] and MAX_BODY_BYTES == 64 << 20
    assert err is not None and err["type"] == "RequestEntityTooLargeError"
    assert err["code"] == 413 and err["param"] is None and str(MAX_BODY_BYTES) in err["message"]
    status, _, engine = call(monkeypatch, [b"{}"], length=MAX_BODY_BYTES)  # at the bound: read
    assert status == 200 and engine.calls[0][1] == b"{}"


def test_a_stream_over_the_bound_is_a_413(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "MAX_BODY_BYTES", 10)  # the bound is read at each call
    status, err, engine = call(monkeypatch, [b"12345", b"67890", b"x"])
    assert status == 413 and engine.calls == [] and err is not None
    assert "larger than 10 bytes" in err["message"] and err["code"] == 413
    assert err["type"] == "RequestEntityTooLargeError"
    status, _, engine = call(monkeypatch, [b"12345", b"67890"])  # exactly the bound: passed on
    assert status == 200 and engine.calls[0][1] == b"1234567890"


def test_only_http_posts_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = params_body(UNSIGNED)
    status, _, engine = call(monkeypatch, [raw], method="GET")
    assert status == 200 and engine.calls[0][1] == raw
    status, _, engine = call(monkeypatch, [raw], kind="websocket")
    assert status == 0 and len(engine.calls) == 1


def test_a_client_gone_mid_body_is_handed_on_with_its_disconnect(
        monkeypatch: pytest.MonkeyPatch) -> None:
    raw = params_body(UNSIGNED)
    engine = Engine()
    monkeypatch.setenv("LW_CLUSTER_KEY", KEY)
    guard = TransferParamsGuard(engine)
    todo = [{"type": "http.request", "body": raw[:5], "more_body": True},
            {"type": "http.disconnect"}]

    async def receive() -> dict[str, Any]:
        return todo.pop(0)

    async def send(msg: dict[str, Any]) -> None:
        pass

    asyncio.run(guard({"type": "http", "method": "POST", "headers": []}, receive, send))
    [(_, body, msgs)] = engine.calls
    assert body == raw[:5] and msgs[-1] == {"type": "http.disconnect"}


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32-be", "utf-8-sig"])
def test_bodies_in_other_encodings_are_parsed(monkeypatch: pytest.MonkeyPatch, encoding: str
                                              ) -> None:
    raw = json.dumps({"prompt": "p", "kv_transfer_params": UNSIGNED}).encode(encoding)
    status, err, _ = call(monkeypatch, [raw])
    assert status == 400 and err is not None and err["param"] == "kv_transfer_params.lw_sig"


def test_plain_bodies_pass_unparsed_and_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw in (b'{"prompt": "p"}', b"not json", b'{"prompt": "\\u0070"}', b""):
        status, _, engine = call(monkeypatch, [raw])
        assert status == 200 and engine.calls[0][1] == raw


def test_what_the_check_refuses_and_passes() -> None:
    key = KEY.encode()
    assert transfer_params_problem([1], key) is None
    assert transfer_params_problem({"prompt": "p"}, key) is None
    assert transfer_params_problem({"kv_transfer_params": None}, key) is None
    assert transfer_params_problem({"vllm_xargs": {"other": 1}}, key) is None
    assert transfer_params_problem({"vllm_xargs": "x", "kv_transfer_params": None}, key) is None
    bad = transfer_params_problem({"vllm_xargs": {"kv_transfer_params": {}}}, key)
    assert bad is not None and bad.field == "vllm_xargs.kv_transfer_params"
    bad = transfer_params_problem({"kv_transfer_params": [1]}, key)
    assert bad is not None and bad.field == "kv_transfer_params" and "list" in str(bad)
    plain = {"kv_transfer_params": {"do_remote_prefill": False, "do_remote_decode": False}}
    assert transfer_params_problem(plain, key) is None
    p = {"do_remote_decode": True, "transfer_id": "t", "lw_contract": CONTRACT_VERSION}
    bad = transfer_params_problem({"kv_transfer_params": p}, key)
    assert bad is not None and bad.field == "kv_transfer_params.lw_sig"
    ahead = {**p, "lw_ahead_url": "http://h:1/v1/ahead"}
    bad = transfer_params_problem({"kv_transfer_params": ahead}, key)
    assert bad is not None and bad.field == "kv_transfer_params.lw_sig"
