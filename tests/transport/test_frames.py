"""The side channel's frame checks without sockets (lw.transport.frames.FrameSeal): each way a
frame set is refused, at its boundary, next to the honest frame that passes. Written to kill the
survivors of ``tools/mutation.py --scope security``; the live-socket attacks are in
tests/runtime/test_sidechannel_hostile.py."""

from __future__ import annotations

import struct
import time

import pytest

from lw.transport.frames import (
    MAX_FRAMES,
    FrameSeal,
    Opened,
    Refusal,
    frame_mac,
    header_frame,
    parse_cluster_key,
)
from lw.transport.wire import MAX_MESSAGE_BYTES

KEY = b"cluster-key-of-the-victim-000000"
ME = "tcp://10.0.0.1:5000"
OTHER = "tcp://10.0.0.2:5000"
HEADER = struct.Struct("!2sBBIQQQH")


def seal(key: bytes | None = KEY, addr: str = ME, window: float | None = 30.0,
         cache: int = 100) -> FrameSeal:
    """A channel's seal at ``addr``."""
    return FrameSeal(key, addr, window, cache)


def signed(payload: bytes = b"p", dest: str = ME, ts_ns: int | None = None,
           key: bytes = KEY, msg_id: int = 1) -> list[bytes]:
    """Frames a key holder makes for ``dest``."""
    header = header_frame(1, 7, msg_id, 0, time.time_ns() if ts_ns is None else ts_ns,
                          dest.encode())
    return [header, payload, frame_mac(key, header, payload)]


def refused(result: Opened | Refusal) -> str:
    """The counter a refusal is counted in ("" when the frames passed)."""
    return result.counter if isinstance(result, Refusal) else ""


def test_a_sealed_message_opens_at_its_destination_with_its_ids() -> None:
    a, b = seal(addr=OTHER), seal()
    msg_id, frames = a.seal(b"hello", 41, ME.encode())
    second, _ = a.seal(b"again", 0, ME.encode())
    assert (msg_id, second) == (1, 2) and len(frames) == 3
    assert b.open(frames) == Opened(1, 41, b"hello")
    plain_id, plain = seal(key=None).seal(b"x", 0, ME.encode())
    assert len(plain) == 2 and seal(key=None).open(plain) == Opened(plain_id, 0, b"x")


def test_a_frame_readdressed_to_another_worker_is_forged() -> None:
    """The MAC covers the destination: a frame signed for OTHER, its header rewritten to name
    this worker, fails the MAC (it is not merely misdirected)."""
    header, payload, mac = signed(dest=OTHER)
    fields = HEADER.unpack_from(header)
    readdressed = HEADER.pack(*fields[:-1], len(ME)) + ME.encode()
    assert refused(seal().open([readdressed, payload, mac])) == "forged"
    assert refused(seal().open([header, payload, mac])) == "misdirected"


def test_a_keyed_channel_refuses_a_message_without_or_with_a_wrong_mac() -> None:
    header = header_frame(0, 7, 1, 0, time.time_ns(), ME.encode())
    assert refused(seal().open([header, b"p"])) == "unauthenticated"
    assert seal(key=None).open([header, b"p"]) == Opened(1, 0, b"p")
    good = signed()
    assert refused(seal().open([good[0], good[1], good[2][:-1]])) == "forged"
    assert refused(seal().open([good[0], b"q", good[2]])) == "forged"
    assert refused(seal().open(signed(key=b"another-cluster-key-00000000000"))) == "forged"
    assert refused(seal().open([good[0], good[1], good[2] + b"\0"])) == "forged"


def test_framing_is_checked_before_anything_else() -> None:
    good = signed()
    assert refused(seal().open([*good, b""])) == "too_many_frames"
    assert refused(seal().open(good[:1])) == "malformed"
    assert refused(seal().open([])) == "malformed"
    assert refused(seal().open([good[0][:HEADER.size - 1], b"p", good[2]])) == "malformed"
    assert refused(seal().open([b"XX" + good[0][2:], b"p", good[2]])) == "malformed"
    other_version = good[0][:2] + bytes([good[0][2] + 1]) + good[0][3:]
    assert refused(seal().open([other_version, b"p", good[2]])) == "malformed"
    assert refused(seal().open([good[0] + b"x", b"p", good[2]])) == "malformed"  # dest length
    assert refused(seal().open([good[0], b"p"])) == "malformed"  # MAC flag, no MAC
    unflagged = header_frame(0, 7, 1, 0, time.time_ns(), ME.encode())
    assert refused(seal(key=None).open([unflagged, b"p", b"m" * 32])) == "malformed"
    assert MAX_FRAMES == 3


def test_a_payload_over_the_message_limit_is_oversize() -> None:
    at_limit = b"x" * MAX_MESSAGE_BYTES
    assert seal().open(signed(at_limit)) == Opened(1, 0, at_limit)
    assert refused(seal().open(signed(at_limit + b"x"))) == "oversize"


def test_a_frame_outside_the_window_is_stale_and_inside_it_passes() -> None:
    now = time.time_ns()
    assert refused(seal(window=5.0).open(signed(ts_ns=now - 6 * 10**9))) == "stale_frames"
    assert refused(seal(window=5.0).open(signed(ts_ns=now + 6 * 10**9))) == "stale_frames"
    assert refused(seal(window=5.0).open(signed(ts_ns=now - 4 * 10**9))) == ""
    assert refused(seal(window=None).open(signed(ts_ns=1))) == ""  # no window: no freshness


def test_a_replay_is_refused_and_a_new_message_is_not() -> None:
    s = seal()
    frames = signed()
    assert refused(s.open(frames)) == ""
    assert refused(s.open(frames)) == "replayed"
    assert refused(s.open(signed(msg_id=2))) == ""
    assert refused(seal(window=None).open(frames)) == "" == refused(seal(window=None).open(
        frames))  # without a window nothing is remembered (nor refused as a replay)


def test_a_full_replay_cache_refuses_what_it_forgot_but_not_newer_frames(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [10**18]
    monkeypatch.setattr(time, "time_ns", lambda: clock[0])
    s = seal(window=10.0, cache=2)
    first = signed(ts_ns=clock[0] - 3, msg_id=1)
    assert refused(s.open(first)) == ""
    assert refused(s.open(signed(ts_ns=clock[0] - 2, msg_id=2))) == ""
    assert refused(s.open(signed(ts_ns=clock[0] - 1, msg_id=3))) == ""  # forgets the first
    assert refused(s.open(first)) == "replay_floor"
    assert refused(s.open(signed(ts_ns=clock[0] - 3, msg_id=4))) == "replay_floor"
    assert refused(s.open(signed(ts_ns=clock[0] - 2, msg_id=5))) == ""  # newer than the floor
    # once every remembered frame expired, the cache empties from the front and lets new in
    clock[0] += 11 * 10**9
    assert refused(s.open(signed(ts_ns=clock[0], msg_id=6))) == ""
    assert len(s._seen) == 1


def test_an_expired_entry_is_pruned_without_raising_the_floor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [10**18]
    monkeypatch.setattr(time, "time_ns", lambda: clock[0])
    s = seal(window=10.0, cache=5)
    assert refused(s.open(signed(ts_ns=clock[0], msg_id=1))) == ""
    clock[0] += 10 * 10**9 + 1  # the first frame's expiry passed: pruned, not a floor
    assert refused(s.open(signed(ts_ns=clock[0], msg_id=2))) == ""
    assert list(s._seen.values()) == [clock[0] + 10 * 10**9] and s._floor_ns == 0
    assert refused(s.open(signed(ts_ns=clock[0] - 9 * 10**9, msg_id=3))) == ""


@pytest.mark.parametrize(("value", "key"), [
    (None, None), ("", None), (b"", None), (b"k" * 16, b"k" * 16),
    ("hex:" + "ab" * 16, b"\xab" * 16), ("sixteen-chars-ok", b"sixteen-chars-ok")])
def test_cluster_keys_are_read_from_config(value: str | bytes | None, key: bytes | None
                                           ) -> None:
    assert parse_cluster_key(value) == key


@pytest.mark.parametrize("value", ["fifteen-chars-n", b"k" * 15, "hex:" + "ab" * 15])
def test_a_key_shorter_than_16_bytes_is_refused(value: str | bytes) -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        parse_cluster_key(value)


def test_an_entry_expiring_this_very_nanosecond_is_pruned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [10**18]
    monkeypatch.setattr(time, "time_ns", lambda: clock[0])
    s = seal(window=10.0, cache=5)
    assert refused(s.open(signed(ts_ns=clock[0], msg_id=1))) == ""
    clock[0] += 10 * 10**9  # the first frame's expiry is now: no longer needed
    assert refused(s.open(signed(ts_ns=clock[0], msg_id=2))) == ""
    assert len(s._seen) == 1 and s._floor_ns == 0


def test_the_header_says_frame_version_2_and_a_seal_draws_a_32_bit_epoch() -> None:
    """The frame version is a wire fact (2: the header names its destination); a channel's
    epoch is 32 random bits (a restarted peer is told apart from its old self)."""
    assert HEADER.unpack_from(signed()[0])[1] == 2
    assert any(seal()._epoch >= 1 << 24 for _ in range(8))
