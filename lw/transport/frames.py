"""The side channel's frame format and its authentication, apart from the sockets that carry it.

A message is ``[header, payload, mac?]`` (see :mod:`lw.transport.sidechannel`). :class:`FrameSeal`
makes the frames of one channel's outgoing messages and checks incoming ones: framing, the MAC,
the destination the MAC was made for, freshness and exact replays. It does no I/O and decodes no
payload: what passes is handed back as bytes, what fails as a :class:`Refusal` the channel counts.
"""

from __future__ import annotations

import hmac
import os
import struct
import time
from typing import NamedTuple

from lw.transport.wire import MAX_MESSAGE_BYTES

__all__ = [
    "MAX_ADDR_BYTES",
    "MAX_FRAMES",
    "FrameSeal",
    "Opened",
    "Refusal",
    "frame_mac",
    "header_frame",
    "parse_cluster_key",
]

MAX_FRAMES = 3
"""Frames in one message (header, payload, MAC; the ROUTER's routing id aside). A message with
more is dropped and counted as ``too_many_frames``; at most this many of its frames are copied
out of ZMQ, the rest are discarded a bounded number per poll."""

MAX_ADDR_BYTES = 1024
"""Longest destination address a message may name (and this module will connect to)."""

_MAGIC = b"LW"
_FRAME_VERSION = 2  # 2: the header names its destination, which the MAC covers
_FLAG_MAC = 0x01
# magic, frame version, flags, epoch, msg_id, reply_to, timestamp (ns since the epoch), dest length;
# the destination's bytes follow
_HEADER = struct.Struct("!2sBBIQQQH")
_MAC_LEN = 32


def header_frame(flags: int, epoch: int, msg_id: int, reply_to: int, ts_ns: int,
                 dest: bytes) -> bytes:
    """The header frame of a message to ``dest`` (tests build hostile frames with it)."""
    return _HEADER.pack(_MAGIC, _FRAME_VERSION, flags, epoch, msg_id, reply_to, ts_ns,
                        len(dest)) + dest


def frame_mac(key: bytes, header: bytes, payload: bytes) -> bytes:
    """The MAC of one message: it covers the header, and so the destination named in it."""
    return hmac.digest(key, header + payload, "sha256")


def parse_cluster_key(value: str | bytes | None) -> bytes | None:
    """A cluster key from config: bytes as is, ``hex:...`` decoded, other text UTF-8 encoded."""
    if value is None or value == "" or value == b"":
        return None
    if isinstance(value, bytes):
        key = value
    elif value.startswith("hex:"):
        key = bytes.fromhex(value[4:])
    else:
        key = value.encode()
    if len(key) < 16:
        raise ValueError(f"cluster key must be at least 16 bytes, got {len(key)}")
    return key


class Refusal(NamedTuple):
    """Why a frame set was dropped: the counter it is counted in, and a line for the log."""

    counter: str
    why: str


class Opened(NamedTuple):
    """A frame set that passed every check: its ids and its still encoded payload."""

    msg_id: int
    reply_to: int
    payload: bytes


class FrameSeal:
    """Seals one channel's outgoing messages and checks incoming ones (key, replay cache)."""

    def __init__(self, key: bytes | None, addr: str, replay_window_s: float | None,
                 replay_cache_size: int) -> None:
        """``addr``: the address this channel advertises, which an incoming MAC must name."""
        self.key = key
        self._addr = addr
        self._addr_b = addr.encode()
        self._window_ns = None if replay_window_s is None else int(replay_window_s * 1e9)
        self._replay_cap = replay_cache_size
        self._epoch = int.from_bytes(os.urandom(4), "big")
        self._next_id = 0
        self._seen: dict[bytes, int] = {}  # mac -> expiry (ns), insertion ordered
        self._floor_ns = 0  # frames stamped at or before this are refused (see _remember)

    def seal(self, payload: bytes, reply_to: int, dest: bytes) -> tuple[int, list[bytes]]:
        """A new message id and the frames of ``payload`` for the worker at ``dest``."""
        self._next_id += 1
        msg_id = self._next_id
        flags = _FLAG_MAC if self.key is not None else 0
        header = header_frame(flags, self._epoch, msg_id, reply_to, time.time_ns(), dest)
        if self.key is None:
            return msg_id, [header, payload]
        return msg_id, [header, payload, frame_mac(self.key, header, payload)]

    def open(self, frames: list[bytes]) -> Opened | Refusal:
        """Check one frame set (size, framing, MAC, destination, freshness, replay)."""
        n = len(frames)
        if n > MAX_FRAMES:  # only an inproc or test caller gets here: the channel stops them first
            return Refusal("too_many_frames", f"a message of {n} frames (at most {MAX_FRAMES})")
        if n < 2:
            return Refusal("malformed", f"a message of {n} frame(s)")
        header, payload = frames[0], frames[1]
        if len(payload) > MAX_MESSAGE_BYTES:
            return Refusal("oversize", f"a payload of {len(payload)} bytes")
        if len(header) < _HEADER.size:
            return Refusal("malformed", f"a header of {len(header)} bytes")
        magic, version, flags, _epoch, msg_id, reply_to, ts_ns, dest_len = _HEADER.unpack_from(
            header)
        if magic != _MAGIC:
            return Refusal("malformed", "not an lw frame")
        if version != _FRAME_VERSION:
            return Refusal("malformed", f"frame version {version} (this side speaks "
                                        f"{_FRAME_VERSION}: another lw version?)")
        if len(header) != _HEADER.size + dest_len or (n == 3) != bool(flags & _FLAG_MAC):
            return Refusal("malformed", "inconsistent header")
        if self.key is not None:
            why = self._authentic(self.key, frames, header, payload, ts_ns)
            if why is not None:
                return why
        return Opened(msg_id, reply_to, payload)

    def _authentic(self, key: bytes, frames: list[bytes], header: bytes, payload: bytes,
                   ts_ns: int) -> Refusal | None:
        """Why a keyed channel refuses this well-framed message (None: it accepts it)."""
        if len(frames) != 3:
            return Refusal("unauthenticated", "no MAC (a peer without the cluster key?)")
        mac = frames[2]
        if len(mac) != _MAC_LEN or not hmac.compare_digest(mac, frame_mac(key, header, payload)):
            return Refusal("forged", "a wrong MAC (another cluster key?)")
        dest = header[_HEADER.size:]
        if dest != self._addr_b:
            # Signed by a key holder, but for another worker: a replay aimed at us, or a
            # peer that knows us by another name (hostname vs IP) than we advertise.
            return Refusal("misdirected", f"signed for {dest[:100]!r}, this is {self._addr}")
        if self._window_ns is None:
            return None
        now_ns = time.time_ns()
        if abs(now_ns - ts_ns) > self._window_ns:
            return Refusal("stale_frames", f"a timestamp {(now_ns - ts_ns) / 1e9:.1f}s old "
                                           "(clocks out of sync?)")
        if ts_ns <= self._floor_ns:
            return Refusal("replay_floor", "a timestamp the full replay cache forgot")
        if mac in self._seen:
            return Refusal("replayed", "a replay")
        self._remember(mac, ts_ns + self._window_ns, now_ns)
        return None

    def _remember(self, mac: bytes, expiry_ns: int, now_ns: int) -> None:
        """Record an accepted MAC until its frame leaves the replay window."""
        seen = self._seen
        # Insertion order is roughly expiry order: prune expired entries from the front.
        while seen:
            first = next(iter(seen))
            first_expiry = seen[first]
            if first_expiry > now_ns and len(seen) < self._replay_cap:
                break
            if first_expiry > now_ns:
                # Full: forgetting a live entry would let its frame replay, so from now on
                # refuse every frame stamped no later than it (honest ones too, unless newer).
                self._floor_ns = max(self._floor_ns, first_expiry - (self._window_ns or 0))
            del seen[first]
        seen[mac] = expiry_ns
