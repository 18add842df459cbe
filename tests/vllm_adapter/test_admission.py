"""The admission guard P's and D's vLLM servers mount: bad or unsigned transfer parameters get
vLLM's 400 naming the field before the engine sees them; everything else passes untouched."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("starlette")

from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from lw.contract.params import (  # noqa: E402
    CONTRACT_VERSION,
    decoder_params,
    prefill_params,
    prompt_digest,
    sign_params,
)
from lw.vllm_adapter.admission import TransferParamsGuard  # noqa: E402

KEY = "admission-test-key-0123456789abcdef"


def client(monkeypatch: pytest.MonkeyPatch, key: str | None = KEY) -> tuple[TestClient, list]:
    seen: list[Any] = []

    async def engine(request: Request) -> JSONResponse:
        seen.append(json.loads(await request.body()))
        return JSONResponse({"ok": True})

    if key:
        monkeypatch.setenv("LW_CLUSTER_KEY", key)
    else:
        monkeypatch.delenv("LW_CLUSTER_KEY", raising=False)
    app = Starlette(routes=[Route("/v1/completions", engine, methods=["POST"])])
    app.add_middleware(TransferParamsGuard)
    return TestClient(app), seen


def test_plain_and_signed_requests_pass_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    c, seen = client(monkeypatch)
    plain = {"prompt": "héllo", "max_tokens": 2}
    assert c.post("/v1/completions", json=plain).status_code == 200
    d = {"prompt": "p", "kv_transfer_params": sign_params(KEY.encode(), "decode", decoder_params(
        "http://10.0.0.1:1/v1/metaserver", "t", "g" * 32))}
    kv = {"remote_engine_id": "d", "remote_host": "h", "remote_port": 1,
          "remote_block_ids": [0], "remote_tp_size": 1, "lw_geometry": "g",
          "lw_params_version": CONTRACT_VERSION, "lw_prompt_digest": prompt_digest([1])}
    p = {"prompt": [1], "kv_transfer_params": sign_params(KEY.encode(), "prefill",
                                                          prefill_params(kv, "t@r"))}
    for body in (d, p):
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
    assert seen == [plain, d, p]


EVIL = {"do_remote_prefill": True, "transfer_id": "evil-1",
        "metaserver": "http://127.0.0.1:9/steal", "metaserver_grant": "g" * 32}


@pytest.mark.parametrize("body,field", [
    ({"vllm_xargs": {"kv_transfer_params": "x"}}, "vllm_xargs.kv_transfer_params"),
    ({"vllm_xargs": {"kv_transfer_params": ["x"]}}, "vllm_xargs.kv_transfer_params"),
    ({"kv_transfer_params": "x"}, "kv_transfer_params"),
    ({"kv_transfer_params": EVIL}, "kv_transfer_params"),  # the SSRF, unsigned
    ({"kv_transfer_params": {**EVIL, "lw_contract": CONTRACT_VERSION, "lw_sig": "0" * 64}},
     "kv_transfer_params.lw_sig"),
    ({"kv_transfer_params": {"do_remote_decode": True, "remote_host": "10.6.6.6"}},
     "kv_transfer_params"),
    ({"kv_transfer\\u005fparams": EVIL}, "kv_transfer_params"),  # spelled with an escape
])
def test_bad_or_unsigned_transfer_params_get_vllms_400_naming_the_field(
        monkeypatch: pytest.MonkeyPatch, body: dict[str, Any], field: str) -> None:
    c, seen = client(monkeypatch)
    raw = json.dumps({"prompt": "p", **body}).replace("\\\\u005f", "\\u005f")
    r = c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith(field) and err["type"] == "BadRequestError", err
    assert err["code"] == 400 and err["message"]
    assert seen == []


def test_without_a_key_shapes_are_still_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    c, seen = client(monkeypatch, key=None)
    r = c.post("/v1/completions", json={"prompt": "p", "vllm_xargs": {"kv_transfer_params": 1}})
    assert r.status_code == 400 and seen == []


def test_without_a_key_the_guard_says_it_checks_shapes_only(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    c, _ = client(monkeypatch, key=None)
    with caplog.at_level("WARNING", logger="lw.vllm_adapter.admission"):
        c.post("/v1/completions", json={"prompt": "p"})  # the middleware is built on first use
    assert "LW_CLUSTER_KEY is not set" in caplog.text and "shape" in caplog.text


@pytest.mark.parametrize("bad", ["short", "hex:zz"])
def test_a_bad_key_in_the_environment_is_named(monkeypatch: pytest.MonkeyPatch,
                                               bad: str) -> None:
    c, _ = client(monkeypatch, key=bad)
    with pytest.raises(ValueError, match="TransferParamsGuard: environment variable "
                                         "LW_CLUSTER_KEY"):
        c.post("/v1/completions", json={"prompt": "p"})


def test_not_json_is_left_to_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard has no opinion on what is not JSON: vLLM answers it (here: the fake)."""
    c, seen = client(monkeypatch)
    with pytest.raises(json.JSONDecodeError):
        c.post("/v1/completions", content=b'{"kv_transfer_params": ')
