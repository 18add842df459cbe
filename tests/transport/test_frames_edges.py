"""The side channel's frame checks (lw.transport.frames.FrameSeal) exactly at their edges: a
header of exactly its fixed size and one byte short, a timestamp exactly a window old or ahead
and one nanosecond beyond, a full replay cache with a zero window after the wall clock stepped
back, and a destination of exactly MAX_ADDR_BYTES. Written to kill the survivors of
``tools/mutation.py --scope security``."""

from __future__ import annotations

import time

import pytest

from lw.transport.frames import MAX_ADDR_BYTES, FrameSeal, Opened, frame_mac, header_frame
from lw.transport.sidechannel import SideChannel
from tests.transport.test_frames import HEADER, KEY, ME, refused, seal, signed

NOW = 10**18
WINDOW_NS = 2 * 10**9


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The wall clock the seal reads (time.time_ns), set by the test."""
    now = [NOW]
    monkeypatch.setattr(time, "time_ns", lambda: now[0])
    return now


def test_a_header_of_exactly_the_fixed_size_opens_and_one_byte_less_is_malformed() -> None:
    """A header naming an empty destination is exactly the fixed part: it is well framed (an
    unkeyed channel opens it, a keyed one finds it misdirected); one byte short is malformed."""
    header = header_frame(0, 7, 3, 2, time.time_ns(), b"")
    assert len(header) == HEADER.size
    assert seal(key=None).open([header, b"p"]) == Opened(3, 2, b"p")
    keyed = header_frame(1, 7, 3, 2, time.time_ns(), b"")
    assert refused(seal().open([keyed, b"p", frame_mac(KEY, keyed, b"p")])) == "misdirected"
    short = seal(key=None).open([header[:-1], b"p"])
    assert refused(short) == "malformed" and short.why == f"a header of {HEADER.size - 1} bytes"


def test_a_frame_exactly_a_window_old_or_ahead_passes_and_a_nanosecond_more_is_stale(
        clock: list[int]) -> None:
    """The freshness bound is inclusive: |now - stamp| == window passes, window + 1 ns not."""
    def opened(ts_ns: int, msg_id: int) -> str:
        return refused(seal(window=WINDOW_NS / 1e9).open(signed(ts_ns=ts_ns, msg_id=msg_id)))

    assert opened(NOW - WINDOW_NS, 1) == "" == opened(NOW + WINDOW_NS, 2)
    assert opened(NOW - WINDOW_NS - 1, 3) == "stale_frames" == opened(NOW + WINDOW_NS + 1, 4)


def test_a_zero_window_full_cache_refuses_a_replay_of_what_it_forgot(clock: list[int]) -> None:
    """With replay_window_s 0 (only frames stamped now pass) and room for one MAC: after the
    wall clock steps back, a new frame pushes out a live entry, and the frame it forgot is
    refused (replay_floor) once the clock is back, not replayed; newer ones still pass."""
    s = FrameSeal(KEY, ME, 0.0, 1)
    first = signed(ts_ns=NOW, msg_id=1)
    assert refused(s.open(first)) == ""
    clock[0] = NOW - 5  # the wall clock steps back (NTP)
    assert refused(s.open(signed(ts_ns=NOW - 5, msg_id=2))) == ""  # forgets the first
    clock[0] = NOW
    assert refused(s.open(first)) == "replay_floor"
    assert refused(s.open(signed(ts_ns=NOW, msg_id=3))) == "replay_floor"  # stamped alike
    clock[0] = NOW + 1
    assert refused(s.open(signed(ts_ns=NOW + 1, msg_id=4))) == ""


def test_a_destination_of_max_addr_bytes_is_sent_to_and_one_byte_more_is_a_bad_dest() -> None:
    """MAX_ADDR_BYTES (1,024) is the longest address a channel will connect to and name in a
    header: one that long gets a connection, one byte longer is counted as bad_dest."""
    ch = SideChannel()
    try:
        at_bound = "inproc://" + "a" * (1024 - len("inproc://"))
        ch.send_bytes(at_bound, b"p")  # nobody listens: dropped or queued, never bad_dest
        assert ch.counters["bad_dest"] == 0
        assert ch.send_bytes(at_bound + "a", b"p") == 0 and ch.counters["bad_dest"] == 1
        assert MAX_ADDR_BYTES == len(at_bound.encode())
    finally:
        ch.close()
