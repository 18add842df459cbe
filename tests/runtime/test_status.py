"""``lw status`` against live worker loops: rows, histories, traces, silence, keys, alarms."""

from __future__ import annotations

import http.server
import json
import logging
import threading
import time
from typing import Any

import pytest

from lw.fsm import DecodeConfig, PrefillConfig
from lw.ops import cli
from lw.ops.client import expand_addrs, query
from lw.ops.render import chrome_trace, history, mermaid_timeline, table

from .loops import L, make_pair, wait_for

KEY = b"status-test-key-0123456789"


def test_status_lists_a_waiting_request_on_both_sides_then_nothing_after_the_run() -> None:
    pair = make_pair(p_key=KEY, d_key=KEY)
    try:
        pair.start("r1", (0, 1), (2, 3))
        wait_for(lambda: pair.p.endpoint.state_of("r1") == "META_READY")
        snap = query([pair.p.addr, pair.d.addr], KEY, timeout_s=30)  # returns at the answers
        assert not snap.silent
        p_rep, d_rep = snap.replies
        assert p_rep.role == "prefill" and d_rep.role == "decode"
        (prow,) = p_rep.requests
        assert prow.req_id == "r1" and prow.state == "META_READY"
        assert "forward pass" in prow.waiting_for and prow.layers_total == L
        (drow,) = d_rep.requests
        assert drow.state == "RECEIVING" and drow.peers == [pair.p.addr]
        assert 0 < drow.deadline_in_s <= 30  # make_pair's D prefill deadline
        text = table(snap)
        assert "r1" in text and "RECEIVING" in text and "0 of 4 layers written" in text

        pair.compute("r1", (0, 1))
        pair.wait_reports(1, 1)
        snap = query([pair.p.addr, pair.d.addr], KEY, req_id="r1", timeline=1000, timeout_s=30)
        assert all(not r.requests for r in snap.replies)
        hist = history(snap, "r1")
        assert "not live" in hist and "all_done" in hist and "ack" in hist
        diagram = mermaid_timeline(snap, "r1")
        assert diagram.startswith("sequenceDiagram") and "MetaRequest" in diagram
        assert "DoneSending" in diagram
        trace = json.loads(json.dumps(chrome_trace(snap)))
        spans = {(e["cat"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "X"}
        assert {("prefill", "AWAIT_DECODER_META"), ("prefill", "META_READY"),
                ("decode", "PREFILL_REQUESTED"), ("decode", "RECEIVING")} <= spans
        assert ("prefill", f"LAYER_{L - 1}_SENT") in spans
    finally:
        pair.stop()


def test_silent_workers_and_wrong_keys_are_named_not_waited_for() -> None:
    pair = make_pair(p_key=KEY, d_key=KEY)
    try:
        snap = query([pair.d.addr, "tcp://127.0.0.1:9"], b"another-key-0123456789",
                     timeout_s=0.5)
        assert not snap.replies
        assert set(snap.silent) == {pair.d.addr, "tcp://127.0.0.1:9"}
        assert "another cluster key" in snap.silent[pair.d.addr]
        assert "no status from tcp://127.0.0.1:9" in table(snap)
        assert pair.d.side.counters["forged"] >= 1  # refused by the worker, not answered
    finally:
        pair.stop()


def test_stuck_request_is_logged_once_with_its_status_line(
        caplog: pytest.LogCaptureFixture) -> None:
    pair = make_pair(dcfg=DecodeConfig(prefill_timeout_s=3.0, lease_s=10, stuck_fraction=0.1),
                     pcfg=PrefillConfig(request_timeout_s=4))
    pair.d.run(lambda lp: setattr(lp, "_stuck_check_s", 0.05) or setattr(
        lp, "_next_stuck_check", 0.0)).result(5)
    try:
        with caplog.at_level(logging.WARNING, logger="lw.runtime"):
            pair.d.call("add_request", "lonely", (1,), 1).result(5)  # P never hears of it
            wait_for(lambda: pair.d.counters["stuck_requests"] >= 1)
            lines = [r.getMessage() for r in caplog.records if "stuck" in r.getMessage()]
        assert len(lines) == 1
        assert "request lonely PREFILL_REQUESTED" in lines[0]
        assert "MetaRequest" in lines[0] and "deadline in" in lines[0]
        assert list(pair.d.stuck) == [lines[0].split("lw stuck request: ", 1)[1]]
    finally:
        pair.stop()


def test_cli_table_json_and_bad_addresses(capsys: pytest.CaptureFixture[str]) -> None:
    pair = make_pair()
    try:
        pair.d.call("add_request", "q1", (1,), 1).result(5)
        port = pair.d.addr.rsplit(":", 1)[1]
        assert cli.main(["--workers", f"127.0.0.1:{port}", "--width", "200",
                         "--timeout", "30"]) == 0
        out = capsys.readouterr().out
        assert "q1" in out and "PREFILL_REQUESTED" in out and "1 live request(s)" in out
        assert cli.main(["-w", pair.d.addr, "--json", "--timeout", "30"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["workers"][0]["requests"][0]["req_id"] == "q1"
    finally:
        pair.stop()
    with pytest.raises(SystemExit):
        cli.main(["--workers", "not an address"])
    assert expand_addrs(["h:5600-5602,tcp://x:1"]) == [
        "tcp://h:5600", "tcp://h:5601", "tcp://h:5602", "tcp://x:1"]


def test_phases_of_a_request_from_both_sides_and_the_proxy() -> None:
    from lw.ops.phases import format_phases, milestones, phase_means

    pair = make_pair()
    try:
        t_client = time.time()
        pair.start("x1@r1", (0, 1), (2, 3))
        wait_for(lambda: pair.p.endpoint.state_of("x1@r1") == "META_READY")
        pair.compute("x1@r1", (0, 1))
        pair.wait_reports(1, 1)
        snap = query([pair.p.addr, pair.d.addr], timeline=1000, timeout_s=30)
    finally:
        pair.stop()
    proxy = {"x1": {"received": t_client - 0.001, "first_token": time.time()}}
    ms = milestones(snap, proxy)
    times = ms["x1@r1"].times
    order = ["received", "allocated", "admitted", "first_computed", "last_computed",
             "last_written", "all_done", "first_token"]
    assert [times[k] for k in order] == sorted(times[k] for k in order)
    rows = {name: n for name, _mean, n in phase_means(ms)}
    assert rows["D allocated -> metaserver called"] == 0  # this test has no metaserver
    assert rows["metaserver -> prefill POSTed (proxy)"] == 0
    assert rows["prefill POSTed -> P admitted (push starts)"] == 0
    assert rows["transfer tail (last layer computed -> written)"] == 1
    assert "sum of the means" in format_phases(phase_means(ms))


class _FakeProxy(http.server.BaseHTTPRequestHandler):
    """A proxy's control port: ``GET /lw/workers`` answers ``answer`` (None: 404)."""

    answer: Any = None

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = json.dumps(type(self).answer).encode()
        found = self.path == "/lw/workers" and type(self).answer is not None
        self.send_response(200 if found else 404)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_cli_takes_the_workers_from_a_proxy(capsys: pytest.CaptureFixture[str]) -> None:
    """``--proxy URL``: the workers the proxy has seen; a proxy that cannot say is named."""
    pair = make_pair()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeProxy)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        pair.d.call("add_request", "q1", (1,), 1).result(5)
        _FakeProxy.answer = {"prefill": [pair.p.addr], "decode": [pair.d.addr]}
        assert cli.main(["--proxy", url, "--json", "--timeout", "30"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert [w["worker"]["addr"] for w in data["workers"]] == [pair.p.addr, pair.d.addr]
        assert data["workers"][1]["requests"][0]["req_id"] == "q1"
        for answer, why in (({"prefill": [], "decode": []}, "has seen no worker yet"),
                            (None, "HTTP 404 (the public port?")):
            _FakeProxy.answer = answer
            assert cli.main(["--proxy", url]) == 1
            assert why in capsys.readouterr().err
        assert cli.main(["--proxy", "http://127.0.0.1:9"]) == 1
        assert "/lw/workers" in capsys.readouterr().err
    finally:
        srv.shutdown()
        pair.stop()
    with pytest.raises(SystemExit):
        cli.main(["--proxy", url, "--workers", "h:1"])


def test_a_prefill_computed_ahead_has_its_ahead_milestones_under_d_s_id() -> None:
    """P admitted and computed it under the proxy's transfer id; the bind renamed it to D's
    sub-transfer id: the phase table joins both parts."""
    from lw.fsm.messages import PROTOCOL_VERSION, Sender, StatusReply, TimelineEntry
    from lw.ops.client import Snapshot
    from lw.ops.phases import milestones

    def entry(t: float, rid: str, event: str, detail: str = "") -> TimelineEntry:
        return TimelineEntry(t, [rid], event, "", "", detail)

    timeline = [entry(1.0, "t1", "admitted"), TimelineEntry(1.1, ["t1"], "layer_computed", "",
                                                            "", "0"),
                entry(1.2, "t1", "renamed", "t1@r1"), entry(1.3, "t1@r1", "layer_sent")]
    reply = StatusReply(PROTOCOL_VERSION, worker=Sender("P", 0, 1, "tcp://p:1"),
                        role="prefill", now=10.0, wall=110.0, timeline=timeline)
    ms = milestones(Snapshot([reply]))
    assert set(ms) == {"t1@r1"}
    assert ms["t1@r1"].times == {"admitted": 101.0, "first_computed": 101.1,
                                 "last_computed": 101.1, "last_written": 101.3}
