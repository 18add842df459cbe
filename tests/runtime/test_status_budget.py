"""``lw status`` answers within a budget: a flood is refused and counted, an asker that never
reads cannot make the worker queue more than a few replies, the protocol goes first."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from lw.fsm import DecodeEndpoint
from lw.ops.client import query
from lw.transport.loopconfig import LoopConfig
from lw.transport.runtime import WorkerLoop
from lw.transport.sidechannel import Inbound, SideChannel
from lw.transport.statusdesk import ANSWER, DROP, REFUSE, StatusGate
from lw.transport.statusreply import REFUSED, RETRY_IN
from lw.transport.wire import (
    PROTOCOL_VERSION,
    Heartbeat,
    KVLayout,
    LayerLayout,
    Sender,
    StatusQuery,
)

from .loops import wait_for

BIG = 100_000  # the most timeline entries a query may ask for


def decode_loop(side: SideChannel, entries: int = 0, **cfg: Any) -> WorkerLoop:
    """A D loop (not started) on ``side`` whose timeline holds ``entries`` events."""
    d = DecodeEndpoint(Sender("D", 0, 1, side.addr),
                       KVLayout("D", 1, "te", [LayerLayout(4096, 64, 64, 64)]))
    for i in range(entries):
        d.timeline.record(float(i), f"req-{i:06d}", "claim", "PREFILL_REQUESTED", "RECEIVING",
                          "P x rank 0 " * 8)
    return WorkerLoop(d, side, None, LoopConfig(name="test-d", heartbeat_s=0, **cfg))


def ask(asker: str, timeline: int = 0) -> StatusQuery:
    return StatusQuery(PROTOCOL_VERSION, asker, "", timeline)


def test_the_gate_answers_a_burst_then_refuses_until_the_share_refills() -> None:
    gate = StatusGate(share=0.1, burst_s=0.2, per_route=4)
    assert gate.admit("a", 0.0) == ANSWER
    gate.charge(0.15)
    assert gate.admit("b", 0.0) == ANSWER  # 0.05 s of the burst left
    gate.charge(0.15)  # 0.1 s in debt: 1 s of loop time at a 10 % share
    assert gate.admit("c", 0.5) == REFUSE and gate.retry_in() == pytest.approx(0.5)
    assert gate.admit("d", 1.01) == ANSWER
    gate.charge(10.0)  # one very long answer: the debt is paid back before the next
    assert gate.admit("e", 50.0) == REFUSE
    assert gate.admit("f", 102.0) == ANSWER
    assert StatusGate(share=0.0, burst_s=0.0, per_route=1).admit("x", 0.0) == REFUSE


def test_each_connection_gets_its_share_of_answers_then_is_dropped() -> None:
    gate = StatusGate(share=1.0, burst_s=1.0, per_route=2, routes=3)
    assert [gate.admit("r", 0.0) for _ in range(4)] == [ANSWER, ANSWER, DROP, DROP]
    assert gate.admit("s", 0.0) == ANSWER  # another connection: its own share
    for route in ("t", "u", "v"):  # "r" is the least recently asking: forgotten
        gate.admit(route, 0.0)
    assert gate.admit("r", 0.0) == ANSWER


def test_a_flood_of_status_queries_is_refused_with_a_short_answer_and_counted(
        channels: Callable[..., SideChannel]) -> None:
    # A budget used up by the first answer: every later query is refused, whatever the timing.
    loop = decode_loop(channels(), 2000, status_share=1e-9, status_burst_s=1e-9).start()
    try:
        first = query([loop.addr], timeline=BIG, timeout_s=30)
        (full,) = first.replies
        assert len(full.timeline) == 2000 and REFUSED not in full.counters
        for _ in range(5):  # lw status asks on a new connection each time
            snap = query([loop.addr], timeline=BIG, timeout_s=30)
            # lw status shows a refusal as a worker it has no status from, and says why
            assert snap.replies == [] and "refused" in snap.silent[loop.addr]
            assert "ask again in" in snap.silent[loop.addr]
        s = loop.stats()
        assert (s["loop.status_queries"], s["loop.status_refused"],
                s["loop.status_dropped"]) == (6, 5, 0)
    finally:
        loop.stop()


def test_an_asker_that_never_reads_gets_a_bounded_number_of_replies(
        channels: Callable[..., SideChannel]) -> None:
    loop = decode_loop(channels(), 4096).start()
    frozen = channels()  # sends on one connection, never polls: its replies are not read
    try:
        for _ in range(60):
            frozen.send(loop.addr, ask(frozen.addr, BIG))
        wait_for(lambda: loop.counters["status_queries"] == 60)
        sent = loop.side.counters["replies_sent"] + loop.side.counters["sent"]
        s = loop.stats()
        # at most status_per_route replies (each at most one 1 MiB message) for that connection
        assert sent == s["loop.status_queries"] - s["loop.status_dropped"] <= 4
        assert s["loop.status_dropped"] >= 56
        assert sent == s["side.replies_sent"]  # and none went elsewhere
    finally:
        loop.stop()


def test_a_heartbeat_is_answered_before_the_status_queries_of_its_turn(
        channels: Callable[..., SideChannel]) -> None:
    loop = decode_loop(channels(), 4096, status_share=1e-9, status_burst_s=1e-9)
    sent: list[str] = []
    loop.side.reply = lambda ib, dest, msg: sent.append(type(msg).__name__) or 1  # type: ignore
    peer = Sender("P", 0, 1, "tcp://127.0.0.1:9")
    flood = [Inbound(ask("tcp://127.0.0.1:8", BIG), i + 1, 0, b"flood%d" % i, None, None)
             for i in range(50)]
    beat = Inbound(Heartbeat(PROTOCOL_VERSION, peer), 99, 0, b"peer", None, None)
    try:
        loop._turn([*flood[:30], beat, *flood[30:]], set())  # one poll's worth, as it came
        assert sent[0] == "HeartbeatAck"
        assert sent[1:] == ["StatusReply"] * 50  # one answer, 49 refusals
        assert (loop.counters["status_queries"], loop.counters["status_refused"]) == (50, 49)
    finally:
        loop.stop()


@pytest.mark.parametrize(("kw", "error"), [
    ({"status_share": 1.5}, "LoopConfig.status_share must be at most 1"),
    ({"status_share": -0.1}, "LoopConfig.status_share must be >= 0"),
    ({"status_burst_s": float("nan")}, "LoopConfig.status_burst_s must be >= 0"),
    ({"status_per_route": 0}, "LoopConfig.status_per_route must be >= 1"),
    ({"warn_interval_s": -1}, "LoopConfig.warn_interval_s must be >= 0"),
])
def test_status_budget_settings_are_checked_on_creation(kw: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        LoopConfig(**kw)


def test_a_refusal_is_a_short_answer_that_says_when_to_ask_again() -> None:
    from lw.transport.statusreply import refusal_reply

    short = refusal_reply(Sender("D", 0, 1, "tcp://127.0.0.1:1"), "decode", 1.0, 2.5)
    assert short.counters == {REFUSED: 1.0, RETRY_IN: 2.5}
    assert short.truncated and not short.requests and not short.timeline
