"""A request failed by its KV transfer, as its client and the operator see it through the proxy and
the sidecar (fake P and D servers of test_proxy; no vLLM).

The fake D answers as vLLM does under ``kv_load_failure_policy`` "fail": a bare 500 "Internal
server error", or that error as a stream's event. Its one worker is a real side channel whose
status replies come from lw's own status code over a real timeline, holding what D's core records
when it fails a request (its ``fail`` event and reason). Prompt keywords steer the fake D:
``corrupt`` (a KV checksum mismatch), ``lostp`` (the prefill worker lost), ``late`` (the prefill
deadline), ``mute`` (the worker remembers nothing), ``deaf`` (its worker does not answer),
``aborted`` (only a local abort is remembered), ``role`` (a chat stream's role event first).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

import httpx  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, Response, StreamingResponse  # noqa: E402

from lw.contract.auth import signed_call  # noqa: E402
from lw.fsm.failures import Failure, FailureKind  # noqa: E402
from lw.fsm.messages import (  # noqa: E402
    PROTOCOL_VERSION,
    StatusQuery,
    StatusReply,
    TimelineEntry,
)
from lw.fsm.timeline import Timeline  # noqa: E402
from lw.ops.client import MAX_TIMELINE, Snapshot, query  # noqa: E402
from lw.ops.render import history  # noqa: E402
from lw.proxy.backend import Backend  # noqa: E402
from lw.proxy.explain import (  # noqa: E402
    TRANSFER_STATUS,
    error_code,
    explain,
    read,
    split_error_event,
)
from lw.proxy.limits import Limits  # noqa: E402
from lw.proxy.server import build_apps  # noqa: E402
from lw.proxy.sidecar import Sidecar, parse_allow  # noqa: E402
from lw.proxy.state import SubPrefill, Transfer  # noqa: E402
from lw.transport.sidechannel import SideChannel  # noqa: E402
from lw.transport.statusreply import status_reply  # noqa: E402
from lw.transport.wire import Sender, decode, encode  # noqa: E402
from tests.proxy.test_proxy import (  # noqa: E402
    KEY,
    ServerThread,
    World,
    closed_port_url,
    completion,
    d_params,
    fake_prefill,
    lw_detail,
)

REASONS = {
    "corrupt": Failure(FailureKind.CHECKSUM_MISMATCH,
                       "KV checksum mismatch from sender prefill rank 0: 3 of 96 block(s) "
                       "differ, first layer 0 block 5"),
    "lostp": Failure(FailureKind.PREFILL_LOST,
                     "prefill engine prefill lost: no message or heartbeat answer for 3.0s "
                     "(tcp://10.1.2.3:14600)"),
    "late": Failure(FailureKind.PREFILL_DEADLINE, "prefill deadline of 15s passed"),
    "aborted": Failure(FailureKind.ABORTED, "aborted locally: request FINISHED_ABORTED"),
}
VLLM_500 = {"error": {"message": "Internal server error", "type": "InternalServerError",
                      "param": None, "code": 500}}


class FakeWorker:
    """D's worker as ``lw status`` and the proxy reach it: a side channel answering status
    queries from a timeline (lw.transport.statusreply, as a real worker loop does)."""

    def __init__(self) -> None:
        self.side = SideChannel(cluster_key=KEY)
        self.me = Sender("decode", 0, 1, self.side.addr)
        self.timeline = Timeline()
        self.counters: dict[str, int] = {"failed": 0}
        self.lock = threading.Lock()
        self.asked: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    # what statusreply needs of an endpoint
    def status(self, now: float, req_id: str = "") -> list:
        return []

    def live_requests(self) -> list[str]:
        return []

    def fail(self, req_id: str, reason: Failure) -> None:
        """Record what D's core records when it fails a request (lw.fsm.decode): its kind and
        reason."""
        with self.lock:
            now = time.monotonic()
            self.timeline.record(now, req_id, "allocated", "", "PREFILL_REQUESTED")
            self.timeline.record(now, req_id, "claim", "PREFILL_REQUESTED", "RECEIVING")
            self.timeline.record(now, req_id, "fail", "RECEIVING", "FAILED", reason)
            self.timeline.record(now, f"other{req_id}", "fail", "RECEIVING", "FAILED",
                                 Failure(FailureKind.OTHER, "x"))
            self.counters["failed"] += 1

    def _serve(self) -> None:
        while not self._stop.is_set():
            inbound, _ = self.side.poll(20)
            for ib in inbound:
                if isinstance(ib.msg, StatusQuery):
                    with self.lock:
                        self.asked.append(ib.msg.req_id)
                        reply = status_reply(self, "decode", {}, time.monotonic(),
                                             ib.msg.req_id, ib.msg.timeline)
                    self.side.reply(ib, ib.msg.asker, reply)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.side.close()


def failing_decode(world: World, worker: FakeWorker) -> FastAPI:
    """A decode server whose requests' KV transfers fail: it asks for the prefill as lw's
    connector does (naming its worker), its worker records why, and it answers as vLLM."""
    app = FastAPI()
    port = int(worker.side.addr.rsplit(":", 1)[1])

    async def serve(request: Request) -> Response:
        body = json.loads(await request.body())
        params = body["kv_transfer_params"]
        tid = params["transfer_id"]
        prompt = str(body.get("prompt") or body.get("messages"))
        sub = f"{tid}@cmpl-{tid}-0"
        ids = [ord(c) for c in "hi"]
        named = closed_port_url().rsplit(":", 1)[1] if "deaf" in prompt else port
        msg = {"transfer_id": tid, "sub_transfer_id": sub, "prompt_token_ids": ids,
               "kv_transfer_params": d_params(ids, remote_port=int(named), remote_tp_size=1),
               "grant": params["metaserver_grant"]}
        content, headers = signed_call(KEY, msg)
        async with httpx.AsyncClient(timeout=5) as client:
            r = await client.post(params["metaserver"], content=content, headers=headers)
            assert r.status_code == 202, r.text
        # The metaserver answers 202 before it forwards the prefill; a real D fails a transfer
        # only after P has the request, so the fake waits for that (bounded) before failing.
        for _ in range(200):
            if world.has("p_request", tid=sub):
                break
            await asyncio.sleep(0.01)
        for word, reason in REASONS.items():
            if word in prompt:
                worker.fail(sub, reason)
        world.record("d_failed", "d0", tid)
        if not body.get("stream"):
            return JSONResponse(VLLM_500, 500)

        async def events() -> AsyncIterator[bytes]:
            if "role" in prompt:
                yield b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n'
                await asyncio.sleep(0.01)
            event = b"data: " + json.dumps(VLLM_500).encode() + b"\n\n"
            yield event[:9]  # split: the proxy judges the event once it is whole
            await asyncio.sleep(0.01)
            yield event[9:] + b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app.post("/v1/completions")(serve)
    app.post("/v1/chat/completions")(serve)
    app.get("/health")(lambda: {"ok": True})
    return app


@dataclass
class Setup:
    """A proxy (or sidecar) in front of fake P servers and one failing fake D."""

    url: str
    control: str
    world: World
    worker: FakeWorker
    p: list[str]

    def metrics(self) -> dict[str, Any]:
        return httpx.get(self.control + "/metrics-json", timeout=5).json()

    def post(self, prompt: str, stream: bool = False, headers: dict | None = None,
             chat: bool = False) -> httpx.Response:
        body = completion(prompt, stream=stream)
        api = "/v1/completions"
        if chat:
            api = "/v1/chat/completions"
            body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}],
                    "stream": stream}
        return httpx.post(self.url + api, json=body, headers=headers, timeout=10)


@contextlib.contextmanager
def setup(sidecar: bool = False, **limits: Any) -> Iterator[Setup]:
    """Fake P servers, the failing fake D and its worker, and a proxy (``sidecar``: llm-d's
    routing sidecar whose own --prefill is p0, p1 named by the requests' header)."""
    world = World(key=KEY)
    worker = FakeWorker()
    servers = [ServerThread(fake_prefill(f"p{i}", world)).start() for i in range(2)]
    try:
        d = ServerThread(failing_decode(world, worker)).start()
        servers.append(d)
        p = [s.url for s in servers[:2]]
        control = ServerThread(None)
        kw: dict[str, Any] = {"limits": Limits(**limits)} if limits else {}
        if sidecar:
            kw["sidecar"] = Sidecar([parse_allow(p[1].removeprefix("http://"))])
        apps = build_apps(p[:1], [d.url], metaserver_url=control.url + "/v1/metaserver",
                          cluster_key=KEY, timeout_s=10.0, decode_failovers=0,
                          start_mode="d-first", **kw)
        proxy = ServerThread(apps.public, also=(control, apps.control)).start()
        servers.append(proxy)
        yield Setup(proxy.url, control.url, world, worker, p)
    finally:
        world.release.set()
        for s in servers:
            s.stop()
        worker.close()


def error_of(r: httpx.Response, stream: bool, status: int) -> dict[str, Any]:
    """The client's error: the body, or a stream's last event (its head went out as 200)."""
    if not stream:
        assert r.status_code == status, r.text
        return dict(r.json()["error"])
    assert r.status_code == 200, r.text
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    last = json.loads(events[-1])
    assert "error" in last and last["error"]["code"] == status, r.text
    return dict(last["error"])


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_checksum_mismatch_is_a_502_naming_the_transfer_the_servers_and_the_reason(
        stream: bool) -> None:
    with setup() as s:
        r = s.post("corrupt", stream=stream)
        err = error_of(r, stream, 502)
        assert err["type"] == "BadGatewayError" and err["code"] == 502
        assert err["message"].startswith(
            "KV transfer from prefill server prefill#0 to decode server decode#0 failed: "
            "KV checksum mismatch from sender prefill rank 0: 3 of 96 block(s) differ"), err
        assert lw_detail(err) | {"request": ""} == {"stage": "kv_transfer", "server": "prefill#0",
                                                   "request": ""}
        assert "127.0.0.1" not in r.text and "Internal server error" not in err["message"]
        m = s.metrics()
        assert m["kv_transfer_failures"] == {"checksum_mismatch": 1}
        assert m["decode_errors_explained"] == 1 and m["decode_errors_unexplained"] == 0
        assert m["errors"] == 1 and m["in_flight"] == 0
        # the proxy asked by the transfer id its client sees; D is not avoided for P's fault
        assert s.worker.asked == [r.headers["x-request-id"]]
        assert m["decode"][0]["consecutive_failures"] == 0


@pytest.mark.parametrize(("word", "status", "kind", "words"), [
    ("lostp", 503, "prefill_lost", "prefill engine prefill lost: no message or heartbeat "
                                   "answer for 3.0s (a worker)"),
    ("late", 504, "prefill_deadline", "prefill deadline of 15s passed"),
])
def test_a_lost_prefill_worker_is_a_503_and_a_deadline_a_504(
        word: str, status: int, kind: str, words: str) -> None:
    with setup() as s:
        err = error_of(s.post(word), False, status)
        assert err["message"].startswith("KV transfer from prefill server prefill#0 to decode "
                                         f"server decode#0 failed: {words}"), err
        assert "tcp://" not in err["message"]  # a worker's address never reaches the client
        assert s.metrics()["kv_transfer_failures"] == {kind: 1}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("word", "unknown"), [
    ("mute", "cause unknown: the decode server's workers remember no failed transfer of this "
             "request"),
    ("deaf", "cause unknown: the decode server's workers did not answer within 0.3 s"),
])
def test_an_unexplained_failure_keeps_todays_answer_and_says_the_cause_is_unknown(
        stream: bool, word: str, unknown: str) -> None:
    with setup(why_timeout_s=0.3) as s:
        t0 = time.monotonic()
        err = error_of(s.post(word, stream=stream), stream, 502)
        assert time.monotonic() - t0 < 5
        assert err["message"].startswith("decode server decode#0 "), err
        assert "Internal server error" in err["message"] and unknown in err["message"], err
        assert lw_detail(err)["stage"] == "decode" and lw_detail(err)["server"] == "decode#0"
        m = s.metrics()
        assert m["decode_errors_unexplained"] == 1 and m["kv_transfer_failures"] == {}
        assert m["decode"][0]["consecutive_failures"] == 1  # D's own failure, as before


def test_a_local_abort_is_quoted_but_is_not_called_a_transfer_failure() -> None:
    with setup() as s:
        err = error_of(s.post("aborted"), False, 502)
        assert err["message"].startswith("decode server decode#0 returned HTTP 500"), err
        assert err["message"].split(" [lw proxy")[0].endswith(
            "its workers say: aborted locally: request FINISHED_ABORTED"), err
        assert s.metrics()["kv_transfer_failures"] == {}


def test_a_chat_stream_past_its_role_event_gets_the_explained_error_in_band() -> None:
    with setup() as s:
        r = s.post("corrupt role", stream=True, chat=True)
        assert '"role": "assistant"' in r.text  # relayed before D's error
        err = error_of(r, True, 502)
        assert "KV checksum mismatch" in err["message"] and "data: [DONE]" not in r.text


def test_no_budget_to_ask_means_an_unknown_cause_at_once() -> None:
    with setup(why_per_s=0) as s:
        err = error_of(s.post("corrupt"), False, 502)
        assert "cause unknown: the proxy is set to never ask" in err["message"]
        assert s.worker.asked == []


def test_questions_beyond_the_rate_bound_are_not_asked() -> None:
    with setup(why_per_s=1) as s:
        first = error_of(s.post("corrupt"), False, 502)
        second = error_of(s.post("corrupt"), False, 502)
        assert "KV checksum mismatch" in first["message"]
        assert "more failures than the proxy asks about (1 a second)" in second["message"]
        assert len(s.worker.asked) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_through_the_sidecar_the_error_names_the_prefill_server_its_header_named(
        stream: bool) -> None:
    with setup(sidecar=True) as s:
        named = s.p[1].removeprefix("http://")
        r = s.post("corrupt", stream=stream, headers={"x-prefiller-host-port": named})
        err = error_of(r, stream, 502)
        assert s.world.servers("p_request") == ["p1"]
        assert err["message"].startswith(
            f"KV transfer from prefill server {s.p[1]} to decode server decode#0 failed: KV "
            "checksum mismatch"), err  # the named server as the client wrote it
        assert lw_detail(err)["server"] == s.p[1]
        assert s.metrics()["kv_transfer_failures"] == {"checksum_mismatch": 1}


def test_the_sidecars_own_prefill_server_is_named_by_its_label() -> None:
    with setup(sidecar=True) as s:
        err = error_of(s.post("late"), False, 504)
        assert err["type"] == "GatewayTimeoutError"
        assert err["message"].startswith("KV transfer from prefill server prefill#0 to decode "
                                         "server decode#0 failed: prefill deadline"), err


def test_lw_status_by_the_clients_request_id_says_why_it_failed() -> None:
    """The operator's view: ``lw status REQUEST`` with the id the client got (x-request-id)
    finds the sub-transfer D failed and names the failure and its kind."""
    with setup() as s:
        tid = s.post("corrupt").headers["x-request-id"]
        snap = query([s.worker.side.addr], KEY, req_id=tid, timeline=MAX_TIMELINE, timeout_s=10)
        text = history(snap, tid)
        assert ("failed on D decode rank 0 (checksum_mismatch): KV checksum mismatch from "
                "sender prefill rank 0") in text, text
        assert "claim" in text and "other" not in text


# ---------------------------------------------------------------------------------------------
# Pure parts


def test_error_events_are_found_whole_or_held() -> None:
    event = b'data: {"error": {"message": "x", "code": 500}}\n\n'
    assert split_error_event(b"data: a\n\n" + event + b"data: [DONE]\n\n") == (
        b"data: a\n\n", event, b"data: [DONE]\n\n")
    for cut in (3, 10, 20):  # the event's start is held, wherever the chunk ends
        assert split_error_event(b"data: a\n\n" + event[:cut]) == (
            b"data: a\n\n", None, event[:cut])
    assert split_error_event(b"data: a\n\ndata: {\"choices") == (
        b"data: a\n\ndata: {\"choices", None, b"")
    assert error_code(event) == 500
    assert error_code(b'data: {"error": {"message": "prefill never arrived"}}\n\n') is None
    assert error_code(b"data: {not json\n\n") is None
    assert error_code(b'data: {"error": {"code": true}}\n\n') is None


def _transfer() -> Transfer:
    d = Backend("decode#0", "decode")
    return Transfer("t1", "/v1/completions", {}, False, {}, "", d,
                    prefills={"t1@r1": SubPrefill("t1@r1", Backend("prefill#0", "prefill"))})


def _state() -> Any:
    return SimpleNamespace(counters=Counter(), transfer_failures={})


def test_the_kind_decides_not_the_words() -> None:
    """Every reason text rewritten (to words of another kind, or none): the proxy's status code,
    stage and count, and ``lw status``'s kind, follow the kind D's core set."""
    snap = Snapshot()
    decoys = ["", "aborted locally: request FINISHED_ABORTED", "prefill deadline",
              "KV checksum mismatch", "something new"]
    want = {FailureKind.CHECKSUM_MISMATCH: 502, FailureKind.BAD_DONE: 502,
            FailureKind.PREFILL_FAILED: 502, FailureKind.PREFILL_LOST: 503,
            FailureKind.METASERVER: 503, FailureKind.PREFILL_DEADLINE: 504}
    assert TRANSFER_STATUS == want
    for kind in FailureKind:
        for words in decoys[1:]:
            entry = TimelineEntry(1.0, ["t1@r1"], "fail", "RECEIVING", "FAILED", words, kind)
            reply = StatusReply(PROTOCOL_VERSION, Sender("decode", 0, 1, "tcp://d"), "decode",
                                1.0, 1.0, [], [entry])
            snap.replies = [decode(encode(reply))]
            why = read(snap, _transfer(), 1.0)
            assert (why.kind, why.reason) == (kind, words)
            state = _state()
            failure = explain(state, _transfer(), why, "decode server d returned HTTP 500")
            if kind in want:
                assert (failure.status, failure.stage, failure.log_kind) == (
                    want[kind], "kv_transfer", f"kv_transfer_{kind.value}")
                assert state.transfer_failures == {kind.value: 1}
            else:  # quoted, not called a transfer failure
                assert (failure.status, failure.stage) == (502, "decode")
                assert state.transfer_failures == {}
            assert f"failed on D decode rank 0 ({kind.value}): {words}" in history(snap, "t1")
    # a D that remembers a local abort and a transfer failure of one request: the transfer's
    # kind is told, whichever words came first
    entries = [TimelineEntry(1.0, ["t1@r1"], "fail", "RECEIVING", "FAILED", "KV checksum mismatch",
                             FailureKind.ABORTED),
               TimelineEntry(2.0, ["t1@r1"], "fail", "FAILED", "FAILED", "aborted locally",
                             FailureKind.PREFILL_LOST)]
    snap.replies = [StatusReply(PROTOCOL_VERSION, Sender("decode", 0, 1, "tcp://d"), "decode",
                                1.0, 1.0, [], entries)]
    assert read(snap, _transfer(), 1.0).kind is FailureKind.PREFILL_LOST
