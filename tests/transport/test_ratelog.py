"""The one rate-limited log (lw.transport.ratelog): a burst gives one line at once and one with
its count at the interval's end, per kind; lines name the owner, the kind, the request and the
peer; time is injected (or comes from the owner's clock), the end-of-interval line from a tick or
a timer on the owner's asyncio loop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest

from lw.transport.ratelog import MAX_KINDS, RateLog, call_later, peer_of
from lw.transport.sidechannel import Inbound
from lw.transport.wire import PROTOCOL_VERSION, AbortAck, Sender


class Lines(logging.Handler):
    """Keeps each record's message."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def lines() -> list[str]:
    logger = logging.getLogger("lw.test.ratelog")
    handler = Lines()
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler.lines
    logger.removeHandler(handler)


def rate_log(now: list[float], interval_s: float = 10.0, **kw: object) -> RateLog:
    return RateLog(logging.getLogger("lw.test.ratelog"), "owner", interval_s,
                   clock=lambda: now[0], **kw)


def test_a_burst_is_one_line_at_once_and_one_with_its_count_at_the_interval_end(
        lines: list[str]) -> None:
    now = [100.0]
    rl = rate_log(now)
    for i in range(1000):
        rl.note("forged", "refused call %d", i)
    assert lines == ["owner [forged]: refused call 0"]
    assert rl.suppressed == 999
    now[0] += 9.9
    rl.tick()
    assert len(lines) == 1  # the interval is not over
    now[0] += 0.1
    rl.tick()
    assert len(lines) == 2
    assert lines[1].startswith("owner [forged]: 999 more like it in the last 10s")
    assert lines[1].endswith("the last one: refused call 999")
    rl.tick()
    assert len(lines) == 2  # nothing new counted: nothing to say


def test_a_flood_gives_at_most_two_lines_per_interval_per_kind(lines: list[str]) -> None:
    now = [0.0]
    rl = rate_log(now)
    for step in range(600):  # a minute of a flood of two kinds, one note of each per 0.1 s
        now[0] = step / 10
        rl.note("a", "a %d", step)
        rl.note("b", "b %d", step)
        rl.tick()
    a = [x for x in lines if x.startswith("owner [a]")]
    assert len(a) == 6 and len(lines) == 12  # t=0 at once, then one per 10 s with the count
    assert "99 more like it" in a[1] and all("100 more like it" in x for x in a[2:])


def test_a_kind_quiet_for_an_interval_logs_at_once_again(lines: list[str]) -> None:
    now = [0.0]
    rl = rate_log(now)
    rl.note("k", "one")
    now[0] = 3.0
    rl.note("k", "two")  # counted
    now[0] = 10.0
    rl.note("k", "three")  # the interval is over: 'two' is reported first, 'three' counted
    assert lines[1].startswith("owner [k]: 1 more like it") and lines[1].endswith("two")
    assert len(lines) == 2
    now[0] = 20.0
    rl.tick()
    assert lines[2].endswith("three")
    now[0] = 30.0
    rl.tick()  # the interval after is quiet
    rl.note("k", "four")
    assert lines[3] == "owner [k]: four"


def test_kinds_are_limited_apart(lines: list[str]) -> None:
    now = [0.0]
    rl = rate_log(now)
    for kind in ("x", "y", "x", "y", "z"):
        rl.note(kind, kind)
    assert lines == ["owner [x]: x", "owner [y]: y", "owner [z]: z"]
    now[0] = 10.0
    rl.tick()
    assert sorted(lines[3:]) == ["owner [x]: 1 more like it in the last 10s, not written one by "
                                 "one (at most one line per 10s per kind), the last one: x",
                                 "owner [y]: 1 more like it in the last 10s, not written one by "
                                 "one (at most one line per 10s per kind), the last one: y"]


def test_too_many_kinds_share_one(lines: list[str]) -> None:
    now = [0.0]
    rl = rate_log(now)
    for i in range(MAX_KINDS + 10):
        rl.note(f"k{i}", "line %d", i)
    assert len(lines) == MAX_KINDS + 1 and lines[-1] == f"owner [other]: line {MAX_KINDS}"
    now[0] = 10.0  # the kinds of the past interval are forgotten once a new one needs room
    rl.note("fresh", "again")
    assert lines[-1] == "owner [fresh]: again"


def test_lines_name_the_request_and_the_peer_cut_short(lines: list[str]) -> None:
    now = [0.0]
    rl = rate_log(now)
    rl.note("AbortAck", "the core refused %s: %s", "AbortAck", "no such request",
            req_id="r-1", peer="tcp://10.0.0.1:5")
    assert lines == ["owner [AbortAck]: the core refused AbortAck: no such request "
                     "(request 'r-1', from 'tcp://10.0.0.1:5')"]
    rl.note("AbortAck", "again", req_id="x" * 10_000, peer="p" * 10_000)
    now[0] = 10.0
    rl.tick()
    assert "(request 'xxx" in lines[1] and "from 'ppp" in lines[1] and len(lines[1]) < 1000


def test_the_peer_of_an_inbound_message() -> None:
    msg = AbortAck(PROTOCOL_VERSION, "r", Sender("X", 0, 1, "tcp://named:1"), True)
    assert peer_of(Inbound(msg, 1, 0, b"route", None, None)) == "tcp://named:1"
    assert peer_of(Inbound(msg, 1, 0, None, "tcp://conn:2", None)) == "tcp://conn:2"
    assert peer_of(None) is None


def test_flush_writes_what_was_counted_now(lines: list[str]) -> None:
    now = [0.0]
    rl = rate_log(now)
    rl.note("k", "a")
    rl.note("k", "b")
    now[0] = 2.0
    rl.flush()
    assert lines[-1].startswith("owner [k]: 1 more like it in the last 2s")
    rl.flush()
    assert len(lines) == 2


def test_a_timer_is_armed_once_per_interval_and_ticks(lines: list[str]) -> None:
    now = [0.0]
    armed: list[tuple[float, Callable[[], None]]] = []
    rl = rate_log(now, timer=lambda d, fn: armed.append((d, fn)))
    rl.note("k", "a")
    assert armed == []  # nothing counted: nothing to say at the interval's end
    now[0] = 4.0
    for _ in range(3):
        rl.note("k", "b")
        rl.note("j", "c")  # its own line at once
    assert len(armed) == 1 and armed[0][0] == pytest.approx(6.0, abs=0.01)
    now[0] = 9.99  # a timer that goes off early arms itself again for the rest
    armed.pop()[1]()
    assert len(lines) == 2 and len(armed) == 1 and armed[0][0] == pytest.approx(0.01, abs=0.01)
    now[0] = 10.0
    armed.pop()[1]()
    assert lines[-1].startswith("owner [k]: 3 more like it") and len(armed) == 1  # j: at 14
    now[0] = 14.0
    armed.pop()[1]()
    assert lines[-1].startswith("owner [j]: 2 more like it") and armed == []


def test_on_an_asyncio_loop_the_interval_end_needs_no_further_note(lines: list[str]) -> None:
    async def flood() -> None:
        rl = RateLog(logging.getLogger("lw.test.ratelog"), "proxy", 0.05, timer=call_later)
        for i in range(100):
            rl.note("k", "refused %d", i)
        assert len(lines) == 1
        await asyncio.sleep(0.2)

    asyncio.run(flood())
    assert len(lines) == 2 and lines[1].startswith("proxy [k]: 99 more like it")


def test_without_a_running_loop_the_next_note_writes_what_is_due(lines: list[str]) -> None:
    now = [0.0]
    rl = rate_log(now, timer=call_later)  # no loop runs: the timer is not armed
    rl.note("k", "a")
    rl.note("k", "b")
    now[0] = 10.0
    rl.note("j", "c")
    assert lines == ["owner [k]: a", lines[1], "owner [j]: c"] and lines[1].endswith("b")


def test_a_bad_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        rate_log([0.0], -1.0)
