"""Hostile peers against a live, keyed side channel: raw ZMQ frames sent with pyzmq on loopback to
the real receiving class. Every attack is refused, counted under its name, never delivered, and
the channel still delivers an honest message afterwards. Bounded: a few hundred messages, every
wait a poll for a condition with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lw.transport.frames import frame_mac as _mac
from lw.transport.frames import header_frame as _header
from lw.transport.sidechannel import (
    _REFUSALS,
    MAX_FRAME_BYTES,
    MAX_FRAMES,
    Inbound,
    SideChannel,
)
from lw.transport.wire import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, MetaRequest, Sender, encode

KEY = b"cluster-key-of-the-victim-000000"
WRONG_KEY = b"some-other-cluster-key-000000000"
DEADLINE_S = 10.0  # generous: a loaded machine can take seconds to connect

Factory = Callable[..., SideChannel]


def meta(rid: str) -> MetaRequest:
    return MetaRequest(PROTOCOL_VERSION, rid, Sender("P", 0, 1, "tcp://127.0.0.1:1"), True, (1,))


@dataclass
class Live:
    """A victim worker, an honest peer and a third worker sharing its key, an attacker's DEALER."""

    victim: SideChannel
    honest: SideChannel
    other: SideChannel
    attacker: zmq.Socket
    honest_sent: int = 0

    def refused(self) -> int:
        """Every refusal the victim counted so far."""
        return sum(self.victim.counters[k] for k in _REFUSALS)

    def signed(self, payload: bytes, *, dest: str | None = None, key: bytes = KEY,
               ts_ns: int | None = None, version_byte: int | None = None) -> list[bytes]:
        """Frames of ``payload`` as a key holder signs them for ``dest`` (the victim)."""
        header = _header(1, 7, 1, 0, time.time_ns() if ts_ns is None else ts_ns,
                         (dest or self.victim.addr).encode())
        if version_byte is not None:
            header = header[:2] + bytes([version_byte]) + header[3:]
        return [header, payload, _mac(key, header, payload)]

    def expect_refused(self, counter: str, before: int, n: int = 1) -> None:
        """Poll until the victim counted ``n`` more refusals, all under ``counter``; none
        delivered."""
        start = self.refused()
        got: list[Inbound] = []
        deadline = time.monotonic() + DEADLINE_S
        while self.refused() < start + n and time.monotonic() < deadline:
            got += self.victim.poll(20)[0]
        assert got == []
        assert self.victim.counters[counter] == before + n, dict(self.victim.counters)
        assert self.refused() == start + n

    def still_serves(self) -> None:
        """An honest message sent now is delivered (and nothing else is)."""
        self.honest_sent += 1
        rid = f"honest-{self.honest_sent}"
        assert self.honest.send(self.victim.addr, meta(rid)) > 0
        got: list[Inbound] = []
        deadline = time.monotonic() + DEADLINE_S
        while not got and time.monotonic() < deadline:
            got += self.victim.poll(20)[0]
        assert [ib.msg.req_id for ib in got] == [rid]


@pytest.fixture
def live(channels: Factory) -> Iterator[Live]:
    ctx = zmq.Context()
    victim = channels(cluster_key=KEY)
    attacker = ctx.socket(zmq.DEALER)
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.connect(victim.addr)
    lv = Live(victim, channels(cluster_key=KEY), channels(cluster_key=KEY), attacker)
    lv.still_serves()  # connected and serving before the attacks start
    yield lv
    attacker.close(0)
    ctx.term()


def _send(lv: Live, counter: str, frames: list[bytes], n: int = 1) -> None:
    before = lv.victim.counters[counter]
    lv.attacker.send_multipart(frames)
    lv.expect_refused(counter, before, n)
    lv.still_serves()


def test_unsigned(live: Live) -> None:
    header = _header(0, 7, 1, 0, time.time_ns(), live.victim.addr.encode())
    _send(live, "unauthenticated", [header, encode(meta("x"))])
    # flagged as signed, MAC frame missing: refused as inconsistent before any MAC is computed
    _send(live, "malformed", live.signed(encode(meta("x")))[:2])


def test_wrong_key(live: Live) -> None:
    _send(live, "forged", live.signed(encode(meta("x")), key=WRONG_KEY))


def test_tampered_payload_and_destination(live: Live) -> None:
    header, _payload, mac = live.signed(encode(meta("x")))
    _send(live, "forged", [header, encode(meta("y")), mac])
    _send(live, "forged", [header, _payload, mac[:-1] + bytes([mac[-1] ^ 1])])
    # the MAC was made for another worker; rewriting the destination breaks it
    header, payload, mac = live.signed(encode(meta("x")), dest=live.other.addr)
    forged = _header(1, 7, 1, 0, time.time_ns(), live.victim.addr.encode())
    _send(live, "forged", [forged, payload, mac])


def test_oversized_frames(live: Live) -> None:
    # over the wire limit, under ZMQ's: received, refused before the MAC or the decoder
    _send(live, "oversize", live.signed(b"\x00" * (MAX_MESSAGE_BYTES + 1)))
    # over ZMQ_MAXMSGSIZE: ZMQ disconnects the attacker before allocating the frame; nothing
    # reaches the channel to count, and the channel goes on serving
    before = live.refused()
    live.attacker.send_multipart(live.signed(b"\x00" * (MAX_FRAME_BYTES + 1)))
    live.still_serves()
    assert live.refused() == before


def test_more_frames_than_the_bound(live: Live) -> None:
    frames = live.signed(encode(meta("x")))
    assert len(frames) == MAX_FRAMES
    _send(live, "too_many_frames", [*frames, b""])
    _send(live, "too_many_frames", [b"\x00" * 1024] * 1000)
    _send(live, "too_many_frames", [b""] * 50_000)  # more than one discard budget


def test_replayed_valid_message(live: Live) -> None:
    _mid, frames = live.honest._frame(encode(meta("once")), 0, live.victim.addr.encode())
    live.attacker.send_multipart(frames)  # as captured: the first copy is the genuine one
    got: list[Inbound] = []
    deadline = time.monotonic() + DEADLINE_S
    while not got and time.monotonic() < deadline:
        got += live.victim.poll(20)[0]
    assert [ib.msg.req_id for ib in got] == ["once"]
    _send(live, "replayed", frames)
    _send(live, "replayed", frames)


def test_valid_message_aimed_at_another_worker(live: Live) -> None:
    _mid, frames = live.honest._frame(encode(meta("for-other")), 0, live.other.addr.encode())
    _send(live, "misdirected", frames)
    assert live.victim.counters["forged"] == 0  # the right key, the wrong worker
    # the very same frames are good at the worker they were signed for
    ctx = zmq.Context()
    to_other = ctx.socket(zmq.DEALER)
    to_other.setsockopt(zmq.LINGER, 0)
    to_other.connect(live.other.addr)
    try:
        to_other.send_multipart(frames)
        got: list[Inbound] = []
        deadline = time.monotonic() + DEADLINE_S
        while not got and time.monotonic() < deadline:
            got += live.other.poll(20)[0]
        assert [ib.msg.req_id for ib in got] == ["for-other"]
    finally:
        ctx.destroy(linger=0)


def test_stale_and_future_timestamps_and_other_frame_versions(live: Live) -> None:
    now = time.time_ns()
    _send(live, "stale_frames", live.signed(encode(meta("x")), ts_ns=now - 3600 * 10**9))
    _send(live, "stale_frames", live.signed(encode(meta("x")), ts_ns=now + 3600 * 10**9))
    _send(live, "malformed", live.signed(encode(meta("x")), version_byte=1))


def test_signed_garbage_reaches_the_decoder_and_is_refused_there(live: Live) -> None:
    _mid, frames = live.honest._frame(b"\xc1 not msgpack", 0, live.victim.addr.encode())
    _send(live, "wire_errors", frames)


@pytest.mark.parametrize(
    ("frames", "counter"),
    [
        ([b""], "malformed"),
        ([b"", b""], "malformed"),
        ([b"", b"", b""], "malformed"),
        ([b""] * (MAX_FRAMES + 1), "too_many_frames"),
    ],
    ids=["one", "two", "three", "more"],
)
def test_empty_frames(live: Live, frames: list[bytes], counter: str) -> None:
    _send(live, counter, frames)


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # one victim for all
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=MAX_FRAMES + 2))
def test_random_bytes(live: Live, frames: list[bytes]) -> None:
    before = live.refused()
    live.attacker.send_multipart(frames)
    got: list[Inbound] = []
    deadline = time.monotonic() + DEADLINE_S
    while live.refused() == before and time.monotonic() < deadline:
        got += live.victim.poll(20)[0]
    assert got == [] and live.refused() == before + 1
    live.still_serves()
