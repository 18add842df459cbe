"""Signed control-plane calls: what the proxy's verifier accepts and refuses, and that D's
metaserver poster sends calls it accepts (a real HTTP round trip)."""

from __future__ import annotations

import http.server
import json
import logging
import threading
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lw.contract import auth as control_auth
from lw.contract.auth import NONCE, SIGNATURE, TIMESTAMP, CallVerifier, signed_call
from lw.vllm_adapter import config
from lw.vllm_adapter.config import ConfigError, LwConfig
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


def _forged(ts: str, nonce: str = "n0nce-0123456789") -> tuple[bytes, dict[str, str]]:
    """A call whose MAC is right (made with the key) over a timestamp or nonce of any form: what
    only the verifier's own parsing can refuse."""
    content = json.dumps(BODY).encode()
    return content, {TIMESTAMP: ts, NONCE: nonce,
                     SIGNATURE: control_auth._mac(KEY, ts, nonce, content)}


@pytest.mark.parametrize("header,value,needle", [
    (SIGNATURE, "\u00e9" * 64, "hex"),  # compare_digest raised TypeError on non-ASCII str
    (SIGNATURE, "\u0661" * 64, "hex"),
    (SIGNATURE, "A" * 64, "hex"),  # upper case is not what signers send
    (SIGNATURE, "0" * 63 + "\x00", "hex"),
    (SIGNATURE, "0" * 65, "64 characters"),
    (SIGNATURE, "00", "64 characters"),
    (TIMESTAMP, "1000.000\u00e9", "not a number"),
    (TIMESTAMP, "\u0661\u0660\u0660\u0660", "not a number"),  # float() reads Arabic digits
    (NONCE, "n\u00f6nce-0123456789", "[0-9A-Za-z_-]"),
    (NONCE, "nonce with spaces", "[0-9A-Za-z_-]"),
    (NONCE, "nonce/../0123", "[0-9A-Za-z_-]"),
    (NONCE, "nonce\n0123456", "[0-9A-Za-z_-]"),
    (NONCE, "n" * 65, "8..64"),
])
def test_a_hostile_header_is_a_reason_never_an_exception(header: str, value: str,
                                                         needle: str) -> None:
    content, headers = signed_call(KEY, BODY, now=1000.0)
    why = CallVerifier(KEY).check({**headers, header: value}, content, now=1000.0)
    assert needle in why


@pytest.mark.parametrize("ts", ["nan", "NaN", "inf", "-inf", "Infinity", "1e3", "1000.000e0",
                                "+1000.000", "-1000.000", " 1000.000", "1000.000 ", "1_000.000",
                                "0x3e8", "1000.", ".5", "1000.000\n", "1" * 23])
def test_a_correctly_signed_call_with_a_timestamp_that_is_no_plain_decimal_is_refused(
        ts: str) -> None:
    # "nan" passed before: every comparison with nan is False, so it was inside any window, and
    # its nonce (expiry nan) was never forgotten: a call valid forever.
    content, headers = _forged(ts)
    why = CallVerifier(KEY).check(headers, content, now=1000.0)
    assert "not a number" in why or "at most 22 characters" in why, why


@pytest.mark.parametrize("nonce", ["nonce with space", "n\u00f6nce-0123", "nonce=0123456",
                                   "nonce.0123456", "nonce\t0123456"])
def test_a_correctly_signed_call_with_a_nonce_outside_the_token_alphabet_is_refused(
        nonce: str) -> None:
    content, headers = _forged("1000.000", nonce)
    assert "[0-9A-Za-z_-]" in CallVerifier(KEY).check(headers, content, now=1000.0)
    content, headers = _forged("1000.000", "Nonce_-0123456789")  # the whole alphabet passes
    assert CallVerifier(KEY).check(headers, content, now=1000.0) == ""


def test_header_sizes_are_checked_before_any_work(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_mac(*args: Any) -> str:
        raise AssertionError("the MAC was computed over an oversized header")

    monkeypatch.setattr(control_auth, "_mac", no_mac)
    v = CallVerifier(KEY)
    content, headers = signed_call(None, BODY)
    ok = {SIGNATURE: "0" * 64, TIMESTAMP: "1000.000", NONCE: "n" * 16}
    for header, needle in ((SIGNATURE, "64 characters"), (TIMESTAMP, "at most 22"),
                           (NONCE, "8..64")):
        why = v.check({**ok, header: "9" * 1_000_000}, content, now=1000.0)
        assert needle in why
        assert len(why) < 300  # the refusal does not echo the header back
        assert needle in v.header_problem({**ok, header: "9" * 1_000_000})


@given(st.dictionaries(st.sampled_from([SIGNATURE, TIMESTAMP, NONCE, "other"]),
                       st.text(max_size=80)),
       st.binary(max_size=64))
def test_any_headers_give_a_refusal_never_an_exception(headers: dict[str, str],
                                                       content: bytes) -> None:
    why = CallVerifier(KEY).check(headers, content, now=1000.0)
    assert isinstance(why, str) and why  # no MAC is right without the key


def test_a_header_of_another_type_is_unsigned() -> None:
    content, headers = signed_call(KEY, BODY, now=1000.0)
    bad: dict[str, Any] = {**headers, SIGNATURE: headers[SIGNATURE].encode()}
    assert "unsigned" in CallVerifier(KEY).check(bad, content, now=1000.0)


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


# ---------------------------------------------------------------------------------------------
# The cluster key in the connector's config: never shown, and its absence said once, loudly


def _vllm_config(role: str, extra: dict[str, Any]) -> SimpleNamespace:
    ktc = SimpleNamespace(kv_role=role, engine_id=f"e-{role}", kv_port=14600,
                          kv_load_failure_policy="fail",
                          kv_connector_extra_config={"host": "127.0.0.1", **extra})
    par = SimpleNamespace(data_parallel_index=0, data_parallel_rank=0, data_parallel_size=1,
                          tensor_parallel_size=2, pipeline_parallel_size=1)
    return SimpleNamespace(kv_transfer_config=ktc, parallel_config=par)


@pytest.mark.parametrize("key", ["hex:" + KEY.hex(), "a text key of some length"])
def test_the_cluster_key_is_not_in_the_configs_repr(key: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LW_CLUSTER_KEY", raising=False)
    for cfg in (LwConfig.from_vllm(_vllm_config("kv_consumer", {"cluster_key": key})),
                LwConfig(role="kv_producer", engine_id="p", kv_port=1, tp_size=1, dp_size=1,
                         dp_rank=0, load_failure_policy="fail", cluster_key=key)):
        assert cfg.cluster_key == key  # still there for those who use it
        for text in (repr(cfg), str(cfg), f"{cfg}", f"{cfg!r}"):
            assert key not in text and KEY.hex() not in text and "cluster_key" not in text
            assert "engine_id=" in text  # the rest is still shown
    monkeypatch.setenv("LW_CLUSTER_KEY", key)  # the same from the environment
    cfg = LwConfig.from_vllm(_vllm_config("kv_producer", {}))
    assert cfg.cluster_key == key and key not in repr(cfg)


def test_a_cluster_key_of_the_wrong_type_is_not_echoed_in_the_error() -> None:
    secret = 1234567890123456789012345678901234567890
    with pytest.raises(ConfigError, match="cluster_key must be a string") as err:
        LwConfig.from_vllm(_vllm_config("kv_consumer", {"cluster_key": secret}))
    assert str(secret)[:12] not in str(err.value)


class _Records(logging.Handler):
    """Keeps every record it is given."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def connector_log(monkeypatch: pytest.MonkeyPatch) -> Any:
    """WARNING records of the connector's logger (a handler on it: vLLM, once imported, may stop
    its loggers propagating to the root), a fresh once-per-process memory, no key set."""
    monkeypatch.setattr(config, "_warned_unkeyed", set())
    monkeypatch.delenv("LW_CLUSTER_KEY", raising=False)
    logger, handler = logging.getLogger("vllm.lw.connector"), _Records()
    logger.addHandler(handler)
    monkeypatch.setattr(logger, "level", logging.WARNING)
    yield lambda: [r for r in handler.records if r.levelno == logging.WARNING]
    logger.removeHandler(handler)


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_an_engine_without_a_cluster_key_warns_once(role: str, connector_log: Any) -> None:
    cfg = LwConfig.from_vllm(_vllm_config(role, {}))
    assert cfg.cluster_key == ""  # behaviour unchanged: it runs, unauthenticated
    (record,) = connector_log()
    text = record.getMessage()
    assert "UNAUTHENTICATED" in text and "side channel" in text and "metaserver" in text
    assert "cluster_key" in text and "LW_CLUSTER_KEY" in text and cfg.engine_id in text
    assert "14600..14601" in text  # the ports it leaves open (TP 2)
    LwConfig.from_vllm(_vllm_config(role, {}))  # the scheduler's and a worker's connector
    assert len(connector_log()) == 1


def test_an_engine_with_a_cluster_key_does_not_warn(connector_log: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    LwConfig.from_vllm(_vllm_config("kv_consumer", {"cluster_key": "hex:" + KEY.hex()}))
    monkeypatch.setenv("LW_CLUSTER_KEY", "hex:" + KEY.hex())
    LwConfig.from_vllm(_vllm_config("kv_producer", {}))
    assert connector_log() == []
