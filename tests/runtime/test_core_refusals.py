"""What the core refuses from the network is warned about: the message, the request and the
peer, at most two lines per interval and kind, the second with the count of those left out."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from lw.fsm import DecodeEndpoint
from lw.transport.loopconfig import LoopConfig
from lw.transport.runtime import WorkerLoop
from lw.transport.sidechannel import Inbound, SideChannel
from lw.transport.wire import PROTOCOL_VERSION, AbortAck, KVLayout, LayerLayout, Sender

ROGUE = "tcp://10.9.8.7:4242"


def refusal(i: int) -> Inbound:
    """An AbortAck about a request D never had: the core refuses it."""
    msg = AbortAck(PROTOCOL_VERSION, f"never-seen-{i}", Sender("X", 0, 1, ROGUE), True)
    return Inbound(msg, i + 1, 0, b"rogue", None, None)


def test_a_refused_message_is_warned_about_once_per_interval_with_a_count(
        channels: Callable[..., SideChannel], caplog: pytest.LogCaptureFixture) -> None:
    side = channels()
    now = [100.0]
    d = DecodeEndpoint(Sender("D", 0, 1, side.addr),
                       KVLayout("D", 1, "te", [LayerLayout(4096, 64, 64, 64)]))
    loop = WorkerLoop(d, side, None, LoopConfig(name="test-d", heartbeat_s=0,
                                                warn_interval_s=10.0), clock=lambda: now[0])
    try:
        with caplog.at_level(logging.WARNING, logger="lw.runtime"):
            loop._turn([refusal(0)], set())
            lines = [r.getMessage() for r in caplog.records]
            assert len(lines) == 1, lines
            assert lines[0].startswith("test-d [AbortAck]: the core refused AbortAck: ")
            assert f"(request 'never-seen-0', from '{ROGUE}')" in lines[0]

            loop._turn([refusal(i) for i in range(1, 6)], set())  # a burst, within the interval
            now[0] += 5.0
            loop._turn([], set())
            assert len(caplog.records) == 1  # tallied, not logged
            now[0] += 5.0
            loop._turn([], set())  # the interval is over: one line for the burst
            lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 2, lines
        assert lines[1].startswith("test-d [AbortAck]: 5 more like it in the last 10s")
        assert "'never-seen-5'" in lines[1] and ROGUE in lines[1]
        assert all(r.levelno == logging.WARNING for r in caplog.records)
        assert loop.counters["protocol_errors"] == 6
    finally:
        loop.stop()
