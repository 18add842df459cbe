"""The port probe tells a process that holds its port (alive, however slow) from one that is
gone, without waiting; and the core's verdict on a silence reads what it shows."""

from __future__ import annotations

import select
import socket

import pytest

from lw.fsm.silence import ALIVE, GONE, PENDING, UNKNOWN, Silence, fixed_budget_loses, silence_loses
from lw.transport.portprobe import PortProbe


def _listening() -> tuple[socket.socket, str]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)  # never accept(): a process that does not run still has its kernel answer
    return srv, f"tcp://127.0.0.1:{srv.getsockname()[1]}"


def _settle(probe: PortProbe, addr: str) -> str:
    for i in range(200):
        shown = probe.evidence(addr, i * 0.001)
        if shown != PENDING:
            return shown
        select.select([], [], [], 0.005)
    return PENDING


def test_a_port_held_by_a_process_that_does_not_run_shows_it_alive() -> None:
    srv, addr = _listening()
    probe = PortProbe(answer_s=5.0)
    try:
        assert _settle(probe, addr) == ALIVE
        assert _settle(probe, addr) == ALIVE  # every answer starts the next attempt
        assert probe.probes >= 2
    finally:
        probe.close()
        srv.close()


def test_a_port_nobody_holds_shows_the_process_gone() -> None:
    srv, addr = _listening()
    srv.close()  # the process died: its port is closed
    probe = PortProbe(answer_s=5.0)
    assert _settle(probe, addr) == GONE
    probe.close()


def test_an_attempt_without_answer_in_time_shows_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    srv, addr = _listening()
    probe = PortProbe(answer_s=1.0)
    # a host gone or cut off never answers the SYN: the attempt stays unwritable
    monkeypatch.setattr(select, "select", lambda r, w, x, t: ([], [], []))
    try:
        assert probe.evidence(addr, 0.0) == PENDING
        assert probe.evidence(addr, 0.5) == PENDING
        assert probe.evidence(addr, 1.5) == GONE
    finally:
        probe.close()
        srv.close()


@pytest.mark.parametrize("addr", ["ipc:///tmp/x", "inproc://y", "tcp://some-host:5555"])
def test_addresses_it_cannot_knock_on_without_blocking_are_unknown(addr: str) -> None:
    assert PortProbe(answer_s=1.0).evidence(addr, 0.0) == UNKNOWN


def test_a_bad_answer_time_is_refused() -> None:
    with pytest.raises(ValueError, match="answer time"):
        PortProbe(answer_s=0)


@pytest.mark.parametrize(("quiet", "process", "lw_loses", "fixed_loses"), [
    (1.0, GONE, False, False),  # within the budget: waited for, whatever shows
    (3.0, ALIVE, False, True),  # slow, not dead: kept (a fixed budget loses it)
    (3.0, PENDING, False, True),  # the probe's answer is waited for
    (3.0, GONE, True, True),
    (3.0, UNKNOWN, True, True),  # nothing to go on: the budget decides, as before
    (31.0, ALIVE, True, True),  # past the cap: a wedged process is found too
])
def test_the_verdict_on_a_silence(quiet: float, process: str, lw_loses: bool,
                                  fixed_loses: bool) -> None:
    s = Silence(quiet, budget_s=1.5, cap_s=30.0, process=process)
    assert silence_loses(s) is lw_loses
    assert fixed_budget_loses(s) is fixed_loses


def test_unknown_evidence_is_refused() -> None:
    with pytest.raises(ValueError, match="process evidence"):
        Silence(1.0, 1.0, 2.0, "maybe")
