"""A D ``fail`` event's kind in a status reply (protocol 8): it keeps its bytes, it travels from
the core's timeline through a status reply, and a kind this side does not know, or an entry
longer than this side's, is a WireError naming where, never a kind read from words."""

from __future__ import annotations

import msgspec
import pytest

from lw.fsm.failures import Failure, FailureKind
from lw.fsm.messages import PROTOCOL_VERSION, Sender, StatusReply, TimelineEntry
from lw.fsm.timeline import Timeline
from lw.transport.statusreply import status_reply
from lw.transport.wire import WireError, decode, encode

D = Sender("D", 0, 1, "tcp://d0")
FAIL = TimelineEntry(1.0, ["r1"], "fail", "RECEIVING", "FAILED",
                     "prefill deadline of 5s passed", FailureKind.PREFILL_DEADLINE)
OTHER = TimelineEntry(1.5, ["r1"], "lease_expired", "FAILED", "FAILED", "")
REPLY = StatusReply(PROTOCOL_VERSION, D, "decode", 2.0, 3.0, [], [FAIL, OTHER])

# Captured from this commit: a peer of protocol 8 sends these bytes for REPLY.
GOLDEN = (
    b"\x8b\xa4kind\xaastatus_rep\xa7version\x08\xa6worker\x84\xa9engine_id\xa1D\xa4rank\x00"
    b"\xabincarnation\x01\xa4addr\xa8tcp://d0\xa4role\xa6decode\xa3now\xcb@\x00\x00\x00\x00"
    b"\x00\x00\x00\xa4wall\xcb@\x08\x00\x00\x00\x00\x00\x00\xa8requests\x90\xa8timeline\x92"
    b"\x97\xcb?\xf0\x00\x00\x00\x00\x00\x00\x91\xa2r1\xa4fail\xa9RECEIVING\xa6FAILED"
    b"\xbdprefill deadline of 5s passed\xb0prefill_deadline"
    b"\x97\xcb?\xf8\x00\x00\x00\x00\x00\x00\x91\xa2r1\xadlease_expired\xa6FAILED\xa6FAILED\xa0\xc0"
    b"\xa8counters\x80\xa9truncated\xc2\xabfirst_token\xc0")


def test_a_status_reply_with_a_failure_kind_keeps_its_bytes() -> None:
    assert encode(REPLY) == GOLDEN
    got = decode(GOLDEN)
    assert got == REPLY
    assert isinstance(got, StatusReply) and got.timeline[0].failure is FailureKind.PREFILL_DEADLINE
    assert got.timeline[1].failure is None


def _entry_with(kind: object) -> bytes:
    """GOLDEN with the fail event's kind replaced by ``kind`` (any msgpack value)."""
    raw = msgspec.msgpack.decode(GOLDEN)
    raw["timeline"][0][6] = kind
    return msgspec.msgpack.encode(raw)


@pytest.mark.parametrize("kind", ["compiler_bug", "", "Prefill_Deadline", 3, ["aborted"]])
def test_an_unknown_kind_is_refused_at_decode(kind: object) -> None:
    with pytest.raises(WireError, match=r"invalid message: .*timeline.*\[0\]\[6\]"):
        decode(_entry_with(kind))


def test_an_entry_longer_than_ours_is_refused() -> None:
    raw = msgspec.msgpack.decode(GOLDEN)
    raw["timeline"][0].append("more")
    with pytest.raises(WireError, match="at most length 7"):
        decode(msgspec.msgpack.encode(raw))


def test_every_kind_travels() -> None:
    for kind in FailureKind:
        assert decode(_entry_with(kind.value)).timeline[0].failure is kind  # type: ignore[union-attr]


class _Endpoint:
    def __init__(self) -> None:
        self.me = D
        self.timeline = Timeline(16)
        self.counters: dict[str, int] = {}

    def status(self, now: float, req_id: str = "") -> list:
        return []

    def live_requests(self) -> list[str]:
        return []


def test_the_cores_fail_event_becomes_words_and_kind() -> None:
    """The core's ``fail`` event holds a Failure; the reply sends its words as the detail (as
    before) and its kind beside them; every other event has none."""
    ep = _Endpoint()
    ep.timeline.record(1.0, "r1", "claim", "PREFILL_REQUESTED", "RECEIVING", "P P rank 0")
    ep.timeline.record(2.0, "r1", "fail", "RECEIVING", "FAILED",
                       Failure(FailureKind.CHECKSUM_MISMATCH, "words of no kind"))
    reply = decode(encode(status_reply(ep, "decode", {}, 3.0, "r1", 10)))
    assert isinstance(reply, StatusReply)
    assert [(e.event, e.detail, e.failure) for e in reply.timeline] == [
        ("claim", "P P rank 0", None),
        ("fail", "words of no kind", FailureKind.CHECKSUM_MISMATCH)]
