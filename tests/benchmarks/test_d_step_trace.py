"""benchmarks/d_step_trace.py: the milestones it reads from a step trace, and its shim's
wrapping of lw's modules in a process started with it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.d_step_trace import (
    D_PATH,
    FRONT,
    SHIM,
    TOKEN_PATH,
    milestones,
    read_events,
    report,
)

ROOT = Path(__file__).resolve().parents[2]

D_SCHED, D_WORKER, P_WORKER, PROXY, CLIENT, P_SCHED, D_API, P_API = 10, 20, 30, 40, 50, 60, 70, 80


def _front(i: int) -> list[tuple[float, int, str, str]]:
    """Request ``i``'s way to P's scheduler (ms, process, event, id), D first."""
    return [
        (0.0, CLIENT, "sent", str(i)), (2.0, PROXY, "p_received", "x"),
        (3.0, PROXY, "p_d_sent", "x"), (10.0, D_SCHED, "s_new", "r"),
        (12.0, D_SCHED, "s_alloc", "r"), (12.5, D_SCHED, "d_meta_call", ""),
        (13.0, PROXY, "p_meta_posted", "x@0"),
        (14.0, PROXY, "p_p_sent", "x@0"), (18.0, P_SCHED, "s_new", "p"),
    ]


def _request(t0: float, i: int, recv_logged_first: bool = False) -> list[str]:
    """One request's lines, times in ms after ``t0``; P's worker also ends steps and reports."""
    ms = [
        *_front(i),
        (19.0, D_WORKER, "w_bind", ""),  # D's idle step: not P's
        (20.0, P_WORKER, "w_bind", ""), (20.0, P_WORKER, "w_results", ""),
        (300.0, P_WORKER, "report_SendFinished", "t"),
        (300.1, PROXY, "p_p_done", "x@0"), (300.1, PROXY, "p_sched_p_done", "5000000/1000000"),
        (300.5, D_WORKER, "w_results", ""),  # an idle step of D's before the DONE
        (301.0 if recv_logged_first else 300.2, D_WORKER, "report_RecvDone", "t"),
        (300.9, D_WORKER, "w_results", ""), (300.9, D_WORKER, "w_recv", "r"),
        (301.5, D_SCHED, "s_update_recv", "r"), (303.0, D_SCHED, "s_sched", "r"),
        (305.0, D_WORKER, "w_bind", ""), (325.0, D_WORKER, "w_results", ""),
        (326.0, D_SCHED, "e_out", "r"), (326.5, D_API, "a_out", "r"),
        (327.0, D_API, "a_send", ""),
        (330.0, PROXY, "p_first_token", "x"),
        (330.0, PROXY, "p_sched_first_token", "6000000/13000000"),
        (331.0, CLIENT, "tok0", str(i)),
        (351.0, CLIENT, "tok1", str(i)), (371.0, CLIENT, "tok2", str(i)),
        (393.0, CLIENT, "tok3", str(i))]
    return [f"{t0 + t / 1e3:.6f} {pid} {name} {ident}" for t, pid, name, ident in ms]


def test_milestones_follow_d_processes_and_order() -> None:
    lines = _request(100.0, 0) + _request(101.0, 1, recv_logged_first=True)
    rows = milestones(read_events(reversed(lines)))  # sorted by time whatever the order
    assert len(rows) == 2
    for r, done in zip(rows, (300.2, 301.0), strict=True):
        steps = {label: round((r[b] - r[a]) * 1e3, 3) for label, a, b, _ in FRONT + D_PATH}
        assert steps["lw's proxy read the request -> POST to D left"] == 1.0
        assert steps["D allocated -> its metaserver thread calls"] == 0.5
        assert steps["the call (signed, HTTP) -> the proxy checked it"] == 0.5
        assert steps["proxy's POST to P -> P's scheduler has it"] == 4.0
        assert steps["P's scheduler has it -> P's first step starts"] == 2.0  # P's, not D's
        assert steps["P's first step starts -> D's last DONE"] == round(done - 20.0, 3)
        # the report's line may follow the worker's: still this request's report
        assert steps["last DONE -> D's worker reports it"] == round(300.9 - done, 3)
        assert steps["scheduled -> D's worker step starts"] == 2.0
        assert steps["step start -> its end (the forward)"] == 20.0  # not P's step end
        assert steps["step end -> D's engine core has the output"] == 1.0
        assert steps["-> D's API server sent the first bytes"] == 0.5
        assert steps["-> lw's proxy relays them"] == 3.0
        assert steps["lw's proxy -> first token at the client"] == 1.0
        assert round(r["proxy_wait"] * 1e3, 3) == 12.0  # 13 ms waited at the relay, 1 before
    text = report(rows)
    assert "over 10 ms in 2 of 2" in text
    assert "D: decode step (TPOT, tokens 1-3)" in text and "21.00" in text
    assert "2 requests" in text and "overlapped" not in text


def _token_from_p(t0: float, i: int) -> list[str]:
    """One request whose token 1 P sampled and D streamed as it arrived: D's worker took it,
    D's engine core and API server put it out, P's API server answered its own request too."""
    ms = [
        *_front(i),
        (19.0, D_WORKER, "w_bind", ""), (20.0, P_WORKER, "w_bind", ""),
        (55.0, P_WORKER, "w_results", ""),  # P's forward, then it samples token 1
        (55.5, P_WORKER, "w_sampled", ""),
        (56.0, D_WORKER, "w_results", ""),  # an idle step of D's
        (57.0, D_WORKER, "report_FirstTokenTaken", "t"),
        (57.5, P_SCHED, "e_out", "p"), (57.8, P_API, "a_out", "p"),  # P's own answer
        (58.0, D_SCHED, "e_out", "r"), (58.5, D_API, "a_out", "r"),
        (58.6, P_API, "a_send", ""), (59.0, D_API, "a_send", ""),
        (60.0, PROXY, "p_first_token", "x"), (61.0, CLIENT, "tok0", str(i)),
        (62.0, P_WORKER, "report_SendFinished", "t"), (63.0, D_WORKER, "report_RecvDone", "t"),
        (63.5, D_WORKER, "w_results", ""), (63.5, D_WORKER, "w_recv", "r"),
        (64.0, D_SCHED, "s_update_recv", "r"), (65.0, PROXY, "p_p_done", "x@0"),
        (71.0, CLIENT, "tok1", str(i)), (81.0, CLIENT, "tok2", str(i)),
        (91.0, CLIENT, "tok3", str(i))]
    return [f"{t0 + t / 1e3:.6f} {pid} {name} {ident}" for t, pid, name, ident in ms]


def test_token_1_from_p_follows_p_step_and_d_request_id() -> None:
    lines = _token_from_p(100.0, 0) + _request(101.0, 1)  # one of each path
    rows = milestones(read_events(lines))
    assert len(rows) == 2 and "ft" in rows[0] and "ft" not in rows[1]
    steps = {label: round((rows[0][b] - rows[0][a]) * 1e3, 3)
             for label, a, b, _ in FRONT + TOKEN_PATH}
    assert steps["P's first step starts -> its last step ends (token 1)"] == 35.0
    assert steps["P's step end -> its runner hands token 1 to lw"] == 0.5
    assert steps["-> D's worker took token 1"] == 1.5
    # D's engine core and API server, not P's (which answered its max_tokens 1 request)
    assert steps["D took it -> D's engine core has the output"] == 1.0
    assert steps["-> D's API server processed it"] == 0.5
    assert steps["-> D's API server sent the first bytes"] == 0.5
    assert steps["-> lw's proxy relays them"] == 1.0
    text = report(rows)
    assert "token 1 from P (1 requests)" in text and "token 1 from D after the KV (1" in text
    assert "P: token 1 sampled -> first token at the client" in text and "5.50" in text
    # P's answer came after the relay: no CPU wait is read across them
    assert "proxy_wait" not in rows[0]


def test_computing_ahead_p_rows_overlap_and_p_is_optional() -> None:
    # P's POST leaves with D's (2.5 ms), before D allocated and called the metaserver
    ahead = [x.replace("100.014000", "100.002500").replace(" p_p_sent ", " p_p_ahead_sent ")
             for x in _request(100.0, 0)]
    [row] = milestones(read_events(ahead))
    assert round((row["p_post"] - row["sent"]) * 1e3, 3) == 2.5
    text = report([row])
    assert "metaserver call -> the proxy's POST to P left" in text
    assert "overlapped (negative)" in text
    no_p = [x for x in _request(100.0, 0) if f" {P_SCHED} " not in x]
    [row] = milestones(read_events(no_p))  # D's path alone still counts
    assert "p_new" not in row and "P's scheduler has it -> P's first step starts" in report(
        [row])


def test_an_incomplete_request_is_left_out() -> None:
    lines = [x for x in _request(100.0, 0) if " p_first_token " not in x]
    assert milestones(read_events(lines)) == []
    assert report([]) == "no complete request in the trace"


def test_the_shim_wraps_lw_modules_as_they_are_imported(tmp_path: Path) -> None:
    pytest.importorskip("zmq")  # lw.transport.runtime's side channel
    trace = tmp_path / "trace"
    code = (
        "from lw.proxy.timeline import ProxyTimeline\n"
        "t = ProxyTimeline()\n"
        "t.mark('x', 'received'); t.mark('x', 'p_sent'); t.mark('x', 'first_token')\n"
        "from lw.transport.runtime import WorkerLoop\n"
        "print(hasattr(WorkerLoop.report, '__wrapped__'))\n")
    env = dict(os.environ, LW_STEPTRACE=str(trace),
               PYTHONPATH=os.pathsep.join([str(SHIM), str(ROOT)]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    events = [line.split()[2:] for line in trace.read_text().splitlines()]
    assert events[:3] == [["p_received", "x"], ["p_p_sent", "x"], ["p_first_token", "x"]]
    # at the relay, the proxy's thread's CPU time and time waiting for a CPU (ns)
    assert events[3][0] == "p_sched_first_token"
    assert all(n.isdigit() for n in events[3][1].split("/")) and len(events) == 4
    assert out.stdout.strip() == "True"
    # without LW_STEPTRACE the shim installs nothing
    env.pop("LW_STEPTRACE")
    trace.unlink()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    assert not trace.exists()
    assert out.stdout.strip() == "False"
