"""Side channel: delivery, correlation, authentication, destination binding, replay, garbage,
the bounds on what a peer can make it hold, rate-limited warnings, reconnects."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq

from lw.transport.frames import frame_mac as _mac
from lw.transport.frames import header_frame as _header
from lw.transport.sidechannel import (
    MAX_FRAME_BYTES,
    MAX_FRAMES,
    PRE_AUTH_BYTES_PER_CONNECTION,
    RECV_HWM,
    FaultInjection,
    Inbound,
    SideChannel,
    parse_cluster_key,
)
from lw.transport.wire import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    MetaReply,
    MetaRequest,
    Sender,
    encode,
)

KEY = b"k" * 32
Factory = Callable[..., SideChannel]


def meta(rid: str = "r1", addr: str = "tcp://127.0.0.1:1") -> MetaRequest:
    return MetaRequest(PROTOCOL_VERSION, rid, Sender("P", 0, 1, addr), True, (1,))


def recv(ch: SideChannel, n: int = 1, timeout: float = 3.0) -> list[Inbound]:
    """Poll until ``n`` messages arrived or ``timeout`` passed."""
    out: list[Inbound] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        got, _ = ch.poll(20)
        out += got
    return out


def settle(ch: SideChannel, seconds: float = 0.3) -> list[Inbound]:
    """Poll for a while and return whatever arrived (to prove that nothing does)."""
    out: list[Inbound] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got, _ = ch.poll(20)
        out += got
    return out


def raw_dealer(ctx: zmq.Context, addr: str) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr)
    return s


@pytest.fixture
def ctx() -> zmq.Context:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_binds_loopback_by_default_and_refuses_unadvertised_wildcard(channels: Factory) -> None:
    ch = channels()
    assert ch.addr.startswith("tcp://127.0.0.1:") and ch.port > 0
    with pytest.raises(ValueError, match="advertise_host"):
        SideChannel(bind_host="0.0.0.0")


def test_roundtrip_and_reply_correlation(channels: Factory) -> None:
    a, b = channels(), channels()
    mid = a.send(b.addr, meta(addr=a.addr), expect_reply=True)
    assert mid > 0
    [ib] = recv(b)
    assert ib.msg == meta(addr=a.addr) and ib.msg_id == mid and ib.route is not None
    reply = MetaReply(PROTOCOL_VERSION, "r1", "unknown", Sender("D", 0, 1, b.addr))
    assert b.reply(ib, a.addr, reply) > 0
    [back] = recv(a)
    assert back.msg == reply
    assert back.reply_to == mid and back.peer == b.addr and back.route is None
    assert back.rtt_s is not None and 0 <= back.rtt_s < 3
    assert a.counters["replies_matched"] == 1
    assert b.counters["replies_sent"] == 1 and b.counters["dealers_opened"] == 0
    # a reply to something never asked is delivered (the core decides) but counted
    b.reply(ib, a.addr, reply)
    assert len(recv(a)) == 1 and a.counters["replies_unmatched"] == 1


def test_reply_falls_back_to_listener_when_route_is_gone(channels: Factory) -> None:
    a, b = channels(), channels()
    a.send(b.addr, meta(addr=a.addr))
    [ib] = recv(b)
    a.forget_peer(b.addr)  # the asking DEALER is gone
    time.sleep(0.1)
    reply = MetaReply(PROTOCOL_VERSION, "r1", "unknown", Sender("D", 0, 1, b.addr))
    b.reply(ib, a.addr, reply)
    [back] = recv(a)
    assert back.msg == reply and back.route is not None  # came in through a's ROUTER
    assert b.counters["route_fallbacks"] == 1


def test_keyed_channels_talk_and_keyless_sender_is_dropped(channels: Factory) -> None:
    keyed_a, keyed_b = channels(cluster_key=KEY), channels(cluster_key=KEY)
    keyless, plain = channels(), channels()
    keyed_a.send(keyed_b.addr, meta())
    assert len(recv(keyed_b)) == 1
    keyless.send(keyed_b.addr, meta())
    assert settle(keyed_b) == []
    assert keyed_b.counters["unauthenticated"] == 1
    # a keyless receiver accepts signed frames (it cannot check them)
    keyed_a.send(plain.addr, meta())
    assert len(recv(plain)) == 1


def capture(ctx: zmq.Context, sender: SideChannel, msg: MetaRequest) -> tuple[int, list[bytes]]:
    """Frames ``sender`` sent for a listener on a fresh port, caught there: (port, frames)."""
    sniff = ctx.socket(zmq.ROUTER)
    sniff.setsockopt(zmq.LINGER, 0)
    port = sniff.bind_to_random_port("tcp://127.0.0.1")
    sender.send(f"tcp://127.0.0.1:{port}", msg)
    assert sniff.poll(5000)
    _ident, *frames = sniff.recv_multipart()
    sniff.close(0)
    sender.forget_peer(f"tcp://127.0.0.1:{port}")  # no reconnects to whoever binds it next
    return port, frames


def test_wrong_key_and_tampered_frames_are_counted_as_forged(channels: Factory,
                                                             ctx: zmq.Context) -> None:
    b = channels(cluster_key=KEY)
    other = channels(cluster_key=b"x" * 32)
    other.send(b.addr, meta())
    assert settle(b) == [] and b.counters["forged"] == 1
    # capture a genuine frame, then tamper with its payload but keep the MAC
    a = channels(cluster_key=KEY)
    _port, [header, _payload, mac] = capture(ctx, a, meta("r1"))
    d = raw_dealer(ctx, b.addr)
    d.send_multipart([header, encode(meta("r2")), mac])
    assert settle(b) == [] and b.counters["forged"] == 2


def test_captured_frame_is_accepted_once_by_its_destination_only(channels: Factory,
                                                                 ctx: zmq.Context) -> None:
    a = channels(cluster_key=KEY)
    port, frames = capture(ctx, a, meta("r1"))  # on its way to the worker at that port
    b = channels(cluster_key=KEY)  # another worker: the MAC names the captured one's address
    d = raw_dealer(ctx, b.addr)
    d.send_multipart(frames)
    assert settle(b) == [] and b.counters["misdirected"] == 1
    assert b.counters["forged"] == 0  # signed with the right key, for someone else
    target = channels(cluster_key=KEY, port=port)  # the worker it was meant for
    t = raw_dealer(ctx, target.addr)
    t.send_multipart(frames)
    t.send_multipart(frames)  # the replay
    got = recv(target)
    assert [ib.msg.req_id for ib in got + settle(target)] == ["r1"]
    assert target.counters["replayed"] == 1


def test_replies_are_bound_to_the_askers_address(channels: Factory) -> None:
    a, b = channels(cluster_key=KEY), channels(cluster_key=KEY)
    a.send(b.addr, meta(addr=a.addr), expect_reply=True)
    [ib] = recv(b)
    reply = MetaReply(PROTOCOL_VERSION, "r1", "unknown", Sender("D", 0, 1, b.addr))
    assert b.reply(ib, "tcp://127.0.0.1:1", reply) > 0  # signed for a worker that is not a
    assert settle(a) == [] and a.counters["misdirected"] == 1
    assert b.reply(ib, a.addr, reply) > 0
    [back] = recv(a)
    assert back.msg == reply and a.counters["replies_matched"] == 1


def test_stale_timestamp_is_refused(channels: Factory, ctx: zmq.Context) -> None:
    b = channels(cluster_key=KEY, replay_window_s=5.0)
    payload = encode(meta())
    old = time.time_ns() - 60 * 10**9
    header = _header(1, 7, 1, 0, old, b.addr.encode())
    mac = _mac(KEY, header, payload)
    d = raw_dealer(ctx, b.addr)
    d.send_multipart([header, payload, mac])
    assert settle(b) == [] and b.counters["stale_frames"] == 1


def test_garbage_and_malformed_frames_are_counted_never_raised(channels: Factory,
                                                               ctx: zmq.Context) -> None:
    a, b = channels(), channels()
    a.send_bytes(b.addr, b"\xc1 definitely not msgpack")
    a.send_bytes(b.addr, encode(meta())[:10])
    d = raw_dealer(ctx, b.addr)
    d.send(b"one part only")
    d.send_multipart([b"short header", b"x"])
    d.send_multipart([b"XX" + b"\x00" * 30, encode(meta())])  # wrong magic
    d.send_multipart([b"a", b"b", b"c", b"d"])
    d.send_multipart([_header(0, 7, 1, 0, time.time_ns(), b.addr.encode())[:-1], b"x"])
    got: list[Inbound] = []
    deadline = time.monotonic() + 10  # a loaded machine can take seconds to connect
    while (b.counters["wire_errors"], b.counters["malformed"]) != (2, 4) \
            and time.monotonic() < deadline:
        got += b.poll(20)[0]
    assert got + settle(b, 0.3) == []
    assert b.counters["wire_errors"] == 2
    assert b.counters["malformed"] == 4  # one part, short header, wrong magic, cut destination
    assert b.counters["too_many_frames"] == 1
    a.send(b.addr, meta())  # still alive and well
    assert len(recv(b)) == 1


def test_size_limit(channels: Factory, ctx: zmq.Context) -> None:
    a, b = channels(), channels()
    assert a.send_bytes(b.addr, b"\x00" * (MAX_MESSAGE_BYTES + 1)) == 0
    assert a.counters["oversize_out"] == 1
    d = raw_dealer(ctx, b.addr)
    header = _header(0, 7, 1, 0, time.time_ns(), b.addr.encode())
    d.send_multipart([header, b"\x00" * (MAX_MESSAGE_BYTES + 1)])  # refused before parsing
    assert settle(b) == [] and b.counters["oversize"] == 1
    huge = raw_dealer(ctx, b.addr)
    huge.send_multipart([header, b"\x00" * (MAX_FRAME_BYTES + 1)])  # ZMQ drops the peer
    assert settle(b) == []
    a.send(b.addr, meta())
    assert len(recv(b)) == 1


def test_dealer_reconnects_to_a_restarted_listener(channels: Factory) -> None:
    a = channels()
    b = SideChannel()
    port = b.port
    a.send(b.addr, meta("before"))
    assert len(recv(b)) == 1
    b.close()
    a.send(f"tcp://127.0.0.1:{port}", meta("while-down"))  # queued or lost, never blocks
    b2 = channels(port=port)
    time.sleep(0.2)
    a.send(b2.addr, meta("after"))
    got = {ib.msg.req_id for ib in recv(b2, 2, timeout=5)}
    assert "after" in got


def test_send_never_blocks_when_the_peer_is_absent(channels: Factory) -> None:
    a = channels(hwm=10)
    t0 = time.monotonic()
    for _ in range(1000):
        a.send("tcp://127.0.0.1:9", meta())  # nothing listens on port 9
    assert time.monotonic() - t0 < 2.0
    assert a.counters["send_dropped"] > 0


def test_bad_destinations_and_peer_eviction(channels: Factory) -> None:
    a = channels(max_peers=2)
    assert a.send("not-a-url", meta()) == 0
    assert a.send("tcp://no such host:x", meta()) == 0
    assert a.counters["bad_dest"] == 2
    bs = [channels() for _ in range(3)]
    for b in bs:
        a.send(b.addr, meta())
    assert a.stats()["dealers"] == 2 and a.counters["dealers_evicted"] == 1


@pytest.mark.parametrize(
    ("faults", "expect"),
    [
        (FaultInjection(drop=1.0, seed=1), 0),
        (FaultInjection(duplicate=1.0, seed=1), 2),
        (FaultInjection(garbage=1.0, seed=1), 0),
    ],
)
def test_fault_injection(channels: Factory, faults: FaultInjection, expect: int) -> None:
    a, b = channels(faults=faults, cluster_key=KEY), channels(cluster_key=KEY)
    a.send(b.addr, meta())
    got = settle(b, 0.5)
    assert len(got) == expect
    if expect == 2:
        assert got[0].msg == got[1].msg and got[0].msg_id != got[1].msg_id
    if faults.garbage:
        assert b.counters["wire_errors"] == 1  # garbage is signed: it reaches the decoder


def test_poll_reports_ready_fds(channels: Factory) -> None:
    import os

    a = channels()
    r, w = os.pipe()
    try:
        os.write(w, b"x")
        got, ready = a.poll(1000, [r])
        assert got == [] and ready == {r}
        a.unregister_fd(r)
    finally:
        os.close(r)
        os.close(w)


def test_parse_cluster_key() -> None:
    assert parse_cluster_key(None) is None and parse_cluster_key("") is None
    assert parse_cluster_key("hex:" + "ab" * 16) == b"\xab" * 16
    assert parse_cluster_key("a" * 20) == b"a" * 20
    with pytest.raises(ValueError):
        parse_cluster_key("short")


def until(ch: SideChannel, done: Callable[[], bool], timeout: float = 10.0) -> list[Inbound]:
    """Poll ``ch`` until ``done()`` or ``timeout``; what arrived meanwhile (asserts ``done``)."""
    got: list[Inbound] = []
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        got += ch.poll(20)[0]
    assert done()
    return got


def test_messages_with_more_frames_than_the_protocol_sends_are_dropped(
        channels: Factory, ctx: zmq.Context) -> None:
    a, b = channels(cluster_key=KEY), channels(cluster_key=KEY)
    _mid, frames = a._frame(encode(meta()), 0, b.addr.encode())  # a genuine message for b
    assert len(frames) == MAX_FRAMES
    d = raw_dealer(ctx, b.addr)
    d.send_multipart([*frames, b"one more"])
    d.send_multipart([b""] * 100_000)  # several discard budgets: dropped over several polls
    d.send_multipart(frames)  # the genuine one, after both, still gets through
    got = until(b, lambda: b.counters["too_many_frames"] == 2 and b.counters["received"] == 1)
    assert [ib.msg for ib in got + settle(b, 0.2)] == [meta()]
    a.send(b.addr, meta("after"))
    assert [ib.msg.req_id for ib in recv(b)] == ["after"]


def test_pre_auth_bound_is_the_stated_product() -> None:
    assert MAX_FRAME_BYTES == 1_052_672 and MAX_FRAMES == 3 and RECV_HWM == 16
    assert PRE_AUTH_BYTES_PER_CONNECTION == (RECV_HWM + 2) * MAX_FRAMES * MAX_FRAME_BYTES
    assert PRE_AUTH_BYTES_PER_CONNECTION == 56_844_288


def _tcp_buffer_max() -> int:
    """The most bytes the kernel may buffer for one loopback connection, both ends together."""
    total = 0
    for name in ("tcp_rmem", "tcp_wmem"):
        try:
            total += int(Path(f"/proc/sys/net/ipv4/{name}").read_text().split()[2])
        except (OSError, IndexError, ValueError):
            total += 64 << 20
    return total


def test_receive_hwm_stops_a_sender_that_outruns_the_reader(channels: Factory,
                                                             ctx: zmq.Context) -> None:
    b = channels()  # keyless: the payloads reach the decoder and are counted there
    assert b._router.getsockopt(zmq.RCVHWM) == RECV_HWM
    payload = b"\x00" * MAX_MESSAGE_BYTES  # the largest payload, no valid message
    frames = [_header(0, 7, 1, 0, time.time_ns(), b.addr.encode()), payload]
    # queued at b's end, in ZMQ's decoder, prefetched, in the kernel, in the sender's queue
    bound = RECV_HWM + 2 + _tcp_buffer_max() // len(payload) + 2 + 1
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.SNDHWM, 1)
    d.connect(b.addr)
    sent = 0
    while sent < bound + 8 and d.poll(1000, zmq.POLLOUT):  # b does not read: it must stall
        d.send_multipart(frames, zmq.NOBLOCK)
        sent += 1
    assert 0 < sent <= bound, (sent, bound)
    # nothing was lost: once b reads, every message that was let in arrives (and is counted)
    until(b, lambda: b.counters["wire_errors"] == sent, timeout=30)
    a = channels()
    a.send(b.addr, meta())
    assert len(recv(b)) == 1


def test_a_flood_of_forged_frames_gives_two_lines_per_interval_and_kind_naming_the_count(
        channels: Factory, ctx: zmq.Context, caplog: pytest.LogCaptureFixture) -> None:
    b = channels(cluster_key=KEY, warn_interval_s=3600)
    d = raw_dealer(ctx, b.addr)
    header = _header(0, 7, 1, 0, time.time_ns(), b.addr.encode())
    signed = _header(1, 7, 1, 0, time.time_ns(), b.addr.encode())  # flags: a MAC follows
    payload = encode(meta())
    with caplog.at_level(logging.WARNING, logger="lw.transport.sidechannel"):
        for i in range(1000):
            d.send_multipart([header, payload])  # unsigned
            d.send_multipart([signed, payload, _mac(b"x" * 32, signed, payload)])  # forged
            if i % 100 == 99:
                b.poll(0)  # nobody's buffers fill up
        assert until(b, lambda: b.counters["unauthenticated"] == 1000
                     and b.counters["forged"] == 1000) == []
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 2, warnings  # one at once per kind
        assert {w.split(" [", 1)[1].split("]", 1)[0] for w in warnings} == {
            "unauthenticated", "forged"}
        assert all(w.startswith(f"side channel {b.addr} [") for w in warnings)
        assert "cluster key" in next(w for w in warnings if "[unauthenticated]" in w)
        later = b.refusals.clock() + 3600  # the interval is over: the next poll says the count
        b.refusals.clock = lambda: later
        b.poll(0)
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 4, warnings
        for kind in ("unauthenticated", "forged"):
            assert any(w.startswith(f"side channel {b.addr} [{kind}]: 999 more like it")
                       for w in warnings[2:]), warnings[2:]
        b.poll(0)
        assert len(caplog.records) == 4  # nothing new to report


def test_a_full_replay_cache_refuses_what_it_had_to_forget(channels: Factory,
                                                           ctx: zmq.Context) -> None:
    a, b = channels(cluster_key=KEY), channels(cluster_key=KEY, replay_cache_size=4)
    built = [a._frame(encode(meta(f"r{i}")), 0, b.addr.encode())[1] for i in range(6)]
    d = raw_dealer(ctx, b.addr)
    for frames in built:
        d.send_multipart(frames)
    got = until(b, lambda: b.counters["received"] == 6)
    assert [ib.msg.req_id for ib in got] == [f"r{i}" for i in range(6)]
    for frames in built[:2] + built[-1:]:  # two forgotten (still in the window), one remembered
        d.send_multipart(frames)
    assert until(b, lambda: b.counters["replay_floor"] == 2 and b.counters["replayed"] == 1) == []
    a.send(b.addr, meta("fresh"))  # newer than anything forgotten: accepted
    assert [ib.msg.req_id for ib in recv(b)] == ["fresh"]
