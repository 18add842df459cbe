"""Signed control-plane calls: what the proxy's verifier accepts and refuses, and that D's
metaserver poster sends calls it accepts (a real HTTP round trip)."""

from __future__ import annotations

import http.server
import json
import threading
from typing import Any

import pytest

from lw.vllm_adapter.config import LwConfig
from lw.vllm_adapter.control_auth import NONCE, SIGNATURE, TIMESTAMP, CallVerifier, signed_call
from lw.vllm_adapter.metaserver_client import MetaserverPoster

KEY = b"control-auth-test-key-0123456789"
BODY = {"transfer_id": "t", "sub_transfer_id": "t@r", "prompt_token_ids": [1], "grant": "g"}


def test_a_signed_call_is_accepted_once() -> None:
    v = CallVerifier(KEY, window_s=30)
    content, headers = signed_call(KEY, BODY, now=1000.0)
    assert json.loads(content) == BODY
    assert v.check(headers, content, now=1001.0) == ""
    assert "replayed" in v.check(headers, content, now=1002.0)


@pytest.mark.parametrize("change,needle", [
    (lambda h, c: ({k: v for k, v in h.items() if k != SIGNATURE}, c), "unsigned"),
    (lambda h, c: ({}, c), "unsigned"),
    (lambda h, c: (h, c.replace(b'"g"', b'"h"')), "bad signature"),
    (lambda h, c: ({**h, TIMESTAMP: "999.000"}, c), "bad signature"),
    (lambda h, c: ({**h, NONCE: "f" * 32}, c), "bad signature"),
    (lambda h, c: ({**h, TIMESTAMP: "soon"}, c), "not a number"),
    (lambda h, c: ({**h, NONCE: "f"}, c), "8..64"),
])
def test_a_changed_call_is_refused(change: Any, needle: str) -> None:
    content, headers = signed_call(KEY, BODY, now=1000.0)
    headers, content = change(headers, content)
    assert needle in CallVerifier(KEY).check(headers, content, now=1000.0)


def test_another_key_and_the_clock_window() -> None:
    content, headers = signed_call(b"another-key-0123456789abcdef", BODY, now=1000.0)
    assert "bad signature" in CallVerifier(KEY).check(headers, content, now=1000.0)
    content, headers = signed_call(KEY, BODY, now=1000.0)
    assert "stale" in CallVerifier(KEY, window_s=30).check(headers, content, now=1031.0)
    assert "stale" in CallVerifier(KEY, window_s=30).check(headers, content, now=969.0)
    with pytest.raises(ValueError, match="window"):
        CallVerifier(KEY, window_s=0)


def test_spent_nonces_are_forgotten_after_the_window_and_bounded() -> None:
    v = CallVerifier(KEY, window_s=10, max_nonces=3)
    for i in range(3):
        content, headers = signed_call(KEY, BODY, now=100.0 + i)
        assert v.check(headers, content, now=100.0 + i) == ""
    content, headers = signed_call(KEY, BODY, now=103.0)
    assert "more than 3 calls" in v.check(headers, content, now=103.0)
    # Once the first calls' timestamps leave the window their nonces are dropped: room again,
    # and a copy of those calls is stale rather than unknown.
    assert v.check(headers, content, now=111.5) == ""
    assert len(v._seen) == 2


def test_no_key_accepts_anything() -> None:
    assert CallVerifier(None).check({}, b"whatever") == ""
    content, headers = signed_call(None, BODY)
    assert SIGNATURE not in headers and json.loads(content) == BODY


class _Recorder(http.server.BaseHTTPRequestHandler):
    calls: list[tuple[dict[str, str], bytes]] = []
    status = 202

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["content-length"]))
        type(self).calls.append(({k.lower(): v for k, v in self.headers.items()}, body))
        self.send_response(type(self).status)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize("status", [202, 503])
def test_d_poster_signs_every_attempt(status: int) -> None:
    _Recorder.calls, _Recorder.status = [], status
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cfg = LwConfig(role="kv_consumer", engine_id="d", kv_port=1, tp_size=1, dp_size=1,
                   dp_rank=0, load_failure_policy="fail", cluster_key="hex:" + KEY.hex(),
                   metaserver_attempts=2)
    poster = MetaserverPoster(cfg)
    try:
        poster.post("r", "t@r", f"http://127.0.0.1:{server.server_port}/v1/metaserver", BODY)
        deadline = threading.Event()
        for _ in range(100):
            if len(_Recorder.calls) == (1 if status == 202 else 2):
                break
            deadline.wait(0.05)
    finally:
        poster.close()
        server.shutdown()
    v = CallVerifier(KEY)
    assert len(_Recorder.calls) == (1 if status == 202 else 2)
    for headers, content in _Recorder.calls:  # a retry is a new call, not a replay
        assert json.loads(content) == BODY and v.check(headers, content) == ""
