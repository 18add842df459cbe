"""The side channel of one worker: a ZMQ ROUTER that listens, one DEALER per peer it talks to.

Every message travels as one multipart ZMQ message ``[header, payload, mac?]``:

* ``header``: 34 bytes (magic ``b"LW"``, frame version, flags, a random per-channel epoch, a
  message id, the id of the message it answers (0 if none), the sender's wall clock (ns) and the
  length of the destination) followed by the destination: the address of the worker the sender
  meant (its advertised ``tcp://host:port``).
* ``payload``: one :mod:`lw.transport.wire` message (at most ``wire.MAX_MESSAGE_BYTES``).
* ``mac``: HMAC-SHA256 over header + payload, present when the sender has a cluster key.

A channel with a cluster key drops (and counts) every frame without a valid MAC, every frame
signed for another destination than its own address (a message captured on its way to worker A
is refused by worker B), every frame whose timestamp is outside ``replay_window_s`` and every
exact replay of a frame seen in that window: such frames never reach the caller. Oversized,
malformed, over-long and undecodable messages are dropped and counted too; refusals are logged at
most twice per ``warn_interval_s`` and kind (:mod:`lw.transport.ratelog`, ticked by each
:meth:`SideChannel.poll`); nothing a peer sends can raise out of :meth:`SideChannel.poll`.

Bounds on what a peer can make a channel hold before its MAC is checked: :data:`MAX_FRAME_BYTES`
per frame (ZMQ disconnects beyond it), :data:`MAX_FRAMES` per message and :data:`RECV_HWM`
messages per connection, so :data:`PRE_AUTH_BYTES_PER_CONNECTION` per connection. libzmq
reassembles a whole multipart message before the application sees any of it, and nothing in
ZMQ limits the number of frames in one message: :data:`MAX_FRAMES` bounds what this module
copies out of ZMQ, not what ZMQ buffered (only an authenticated transport such as CURVE, which
refuses a connection before its first message, would bound that).

Replies can travel back on the connection the request came in on (:meth:`SideChannel.reply`
through the ROUTER to the asking DEALER); the asker matches them by ``reply_to`` (request
correlation) and learns the round-trip time. No REQ sockets: a timed-out REQ socket is wedged,
a DEALER never is. Sends never block: a full queue drops the frame and counts it (the protocol
retries what matters).

A SideChannel is not thread-safe: one thread (a :class:`lw.transport.runtime.WorkerLoop`) owns it.
"""

from __future__ import annotations

import errno
import logging
import math
import random
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import zmq

from lw.transport.frames import (
    MAX_ADDR_BYTES,
    MAX_FRAMES,
    FrameSeal,
    Refusal,
    parse_cluster_key,
)
from lw.transport.links import Links
from lw.transport.ratelog import WARN_INTERVAL_S, RateLog
from lw.transport.wire import MAX_MESSAGE_BYTES, Message, WireError, decode, encode
from lw.transport.zmqsock import HOST_TIMEOUT_S, tune_socket

__all__ = [
    "MAX_ADDR_BYTES",
    "MAX_FRAMES",
    "MAX_FRAME_BYTES",
    "PRE_AUTH_BYTES_PER_CONNECTION",
    "RECV_HWM",
    "FaultInjection",
    "Inbound",
    "SideChannel",
    "parse_cluster_key",
]

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = MAX_MESSAGE_BYTES + 4096
"""ZMQ_MAXMSGSIZE, which libzmq applies per frame: a peer sending a longer frame is disconnected
before the frame is allocated. Between the wire limit and this the frame is received and counted
as ``oversize``. 1,052,672 bytes."""

RECV_HWM = 16
"""Receive high-water mark (ZMQ_RCVHWM), in messages per connection: beyond it ZMQ stops reading
the connection and the honest sender's own send queue holds the backlog."""

PRE_AUTH_BYTES_PER_CONNECTION = (RECV_HWM + 2) * MAX_FRAMES * MAX_FRAME_BYTES
"""What one connection can make a channel hold before a MAC is checked, for messages of at most
:data:`MAX_FRAMES` frames: RECV_HWM queued, one in ZMQ's decoder, one prefetched by the ROUTER.
18 x 3 x 1,052,672 = 56,844,288 bytes (54.2 MiB), plus the kernel's TCP buffers. Not bounded by
ZMQ: the number of connections (only the process's file limit) and the frames of one message
(see the module docstring)."""

# Frames of an over-long message discarded per drain (about 1 us each): the loop thread goes on
# serving its timers and other sockets while a flood is thrown away.
_DISCARD_BUDGET = 16384
_SCHEMES = ("tcp://", "ipc://", "inproc://")
# Counters of inbound refusals: each one is a kind of the channel's rate-limited log.
_REFUSALS = ("oversize", "malformed", "too_many_frames", "unauthenticated", "forged",
             "misdirected", "stale_frames", "replay_floor", "replayed", "wire_errors")


@dataclass(frozen=True)
class FaultInjection:
    """Test-only faults applied to outgoing frames (probabilities per frame, seeded)."""

    drop: float = 0.0  # the frame is not sent
    duplicate: float = 0.0  # the message is sent twice (as two frames with distinct ids)
    garbage: float = 0.0  # the payload is replaced by bytes that are no valid message
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("drop", "duplicate", "garbage"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"FaultInjection.{name} must be in [0, 1], got {p}")

    @property
    def active(self) -> bool:
        """True when any fault has a non-zero probability."""
        return self.drop > 0 or self.duplicate > 0 or self.garbage > 0


@dataclass(frozen=True, slots=True)
class Inbound:
    """One accepted message and where it came from (for replies and correlation)."""

    msg: Message
    msg_id: int
    reply_to: int
    route: bytes | None  # ROUTER identity of the asking DEALER; None when it came on our DEALER
    peer: str | None  # the dest address of our DEALER it came back on (None: via the ROUTER)
    rtt_s: float | None  # round trip when it answered a message we sent with expect_reply


_COUNTERS = (
    "sent",
    "replies_sent",
    "received",
    "send_dropped",  # queue full (peer slow or frozen): dropped, the protocol retries
    "send_errors",
    "bad_dest",
    "encode_errors",
    "oversize_out",
    "oversize",
    "malformed",
    "too_many_frames",  # more than MAX_FRAMES frames in one message
    "unauthenticated",  # keyed channel got a frame without a MAC
    "forged",  # MAC present but wrong
    "misdirected",  # MAC right, but signed for another worker's address
    "stale_frames",  # timestamp outside the replay window
    "replay_floor",  # timestamp not after one the full replay cache had to forget
    "replayed",
    "wire_errors",
    "replies_matched",
    "replies_unmatched",
    "route_fallbacks",
    "dealers_opened",
    "dealers_evicted",
    "injected_drops",
    "injected_duplicates",
    "injected_garbage",
)


class SideChannel:
    """ROUTER listener + one DEALER per peer, authenticated frames, bounded and non-blocking."""

    def __init__(
        self,
        bind_host: str = "127.0.0.1",
        port: int = 0,
        *,
        cluster_key: bytes | None = None,
        advertise_host: str | None = None,
        max_peers: int = 1024,
        replay_window_s: float | None = 60.0,
        replay_cache_size: int = 1 << 18,
        hwm: int = 10_000,
        recv_hwm: int = RECV_HWM,
        host_timeout_s: float = HOST_TIMEOUT_S,
        faults: FaultInjection | None = None,
        burst: int = 256,
        warn_interval_s: float = WARN_INTERVAL_S,
    ) -> None:
        """``hwm``: messages queued per peer for sending; ``recv_hwm``: per connection received;
        ``host_timeout_s``: how long a peer's host may leave a connection unanswered before it
        counts as down (0: the OS's defaults, minutes)."""
        if not (math.isfinite(host_timeout_s) and host_timeout_s >= 0):
            raise ValueError(f"host_timeout_s must be >= 0 and finite (0: the OS's defaults), "
                             f"got {host_timeout_s}")
        if cluster_key is not None and len(cluster_key) < 16:
            raise ValueError("cluster_key must be at least 16 bytes")
        if max_peers < 1:
            raise ValueError("max_peers must be >= 1")
        self._max_peers = max_peers
        self._hwm = hwm
        self._recv_hwm = recv_hwm
        self._host_timeout_s = host_timeout_s
        self._faults = faults if faults is not None and faults.active else None
        self._rng = random.Random(faults.seed if faults is not None else None)
        self._burst = burst
        self.counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._excess: dict[zmq.Socket, int] = {}  # socket -> frames dropped of an over-long msg
        self._pending: OrderedDict[int, tuple[str, float]] = OrderedDict()  # msg_id -> (dest, t)
        self._ctx = zmq.Context(io_threads=1)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._tune(self._router)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown route: error, not silence
        try:
            if port:
                self._router.bind(f"tcp://{bind_host}:{port}")
            else:
                self._router.bind(f"tcp://{bind_host}:*")
        except zmq.ZMQError:
            self._router.close(0)
            self._ctx.term()
            raise
        endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(endpoint.rsplit(":", 1)[1])
        host = advertise_host or bind_host
        if host in ("0.0.0.0", "*", "::"):
            raise ValueError(f"binding {bind_host} needs an advertise_host peers can reach")
        self.addr = f"tcp://{host}:{self.port}"
        self.refusals = RateLog(log, f"side channel {self.addr}", warn_interval_s)
        self._seal = FrameSeal(cluster_key, self.addr, replay_window_s, replay_cache_size)
        self._dealers: OrderedDict[str, zmq.Socket] = OrderedDict()  # LRU by dest
        # each DEALER's connection state, for telling a slow peer from a dead one
        self.links = Links(answer_s=1.0)
        self._dealer_dest: dict[zmq.Socket, str] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._fds: set[int] = set()
        self._closed = False

    # ----------------------------------------------------------------------------- sockets
    def _tune(self, sock: zmq.Socket) -> None:
        tune_socket(sock, self._hwm, self._recv_hwm, MAX_FRAME_BYTES, self._host_timeout_s)

    def _dealer(self, dest: str) -> zmq.Socket | None:
        sock = self._dealers.get(dest)
        if sock is not None:
            self._dealers.move_to_end(dest)
            return sock
        if not isinstance(dest, str) or not dest.startswith(_SCHEMES) or len(
                dest.encode(errors="replace")) > MAX_ADDR_BYTES:
            self.counters["bad_dest"] += 1
            return None
        sock = self._ctx.socket(zmq.DEALER)
        self._tune(sock)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        # followed before it connects: a connection made before its monitor is never reported
        monitor = self.links.watch(dest, sock)
        try:
            sock.connect(dest)
        except zmq.ZMQError:
            self.links.unwatch(dest)
            sock.close(0)
            self.counters["bad_dest"] += 1
            return None
        self._dealers[dest] = sock
        self._dealer_dest[sock] = dest
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)
        self.counters["dealers_opened"] += 1
        while len(self._dealers) > self._max_peers:
            old_dest, old = self._dealers.popitem(last=False)
            self._drop_dealer(old)
            self.counters["dealers_evicted"] += 1
            del old_dest
        return sock

    def _drop_dealer(self, sock: zmq.Socket) -> None:
        self._poller.unregister(sock)
        dest = self._dealer_dest.pop(sock, None)
        if dest is not None:
            self._unwatch(dest)
        self._excess.pop(sock, None)
        sock.close(0)

    def _unwatch(self, dest: str) -> None:
        monitor = self.links.monitor_of(dest)
        if monitor is not None:
            self._poller.unregister(monitor)
        self.links.unwatch(dest)

    def link_evidence(self, dest: str) -> str:
        """What our connection to ``dest`` shows of its process (lw.fsm.silence's evidence):
        ALIVE while it is up, GONE once down or never up for a while, else PENDING; UNKNOWN
        when we hold no connection to it."""
        return self.links.evidence(dest)

    def forget_peer(self, dest: str) -> None:
        """Close the DEALER to ``dest`` (queued frames are dropped); the next send reopens it."""
        sock = self._dealers.pop(dest, None)
        if sock is not None:
            self._drop_dealer(sock)

    # ----------------------------------------------------------------------------- sending
    def _frame(self, payload: bytes, reply_to: int, dest: bytes) -> tuple[int, list[bytes]]:
        """A new message id and the frames of ``payload`` for the worker at ``dest``."""
        return self._seal.seal(payload, reply_to, dest)

    def _dest(self, dest: str) -> bytes | None:
        """``dest`` as the bytes a MAC is bound to, or None (counted) when it cannot be one."""
        try:
            b = dest.encode()
        except (AttributeError, UnicodeError):
            b = b""
        if not b or len(b) > MAX_ADDR_BYTES:
            self.counters["bad_dest"] += 1
            return None
        return b

    def _inject(self, payload: bytes) -> list[bytes]:
        """Apply test faults: the payloads to actually send (0, 1 or 2 of them)."""
        f = self._faults
        assert f is not None
        rng = self._rng
        if f.drop and rng.random() < f.drop:
            self.counters["injected_drops"] += 1
            return []
        if f.garbage and rng.random() < f.garbage:
            self.counters["injected_garbage"] += 1
            if rng.random() < 0.5 and len(payload) > 1:
                return [payload[: rng.randrange(1, len(payload))]]  # truncated msgpack
            return [rng.randbytes(rng.randrange(1, 64))]
        if f.duplicate and rng.random() < f.duplicate:
            self.counters["injected_duplicates"] += 1
            return [payload, payload]
        return [payload]

    def send(self, dest: str, msg: Message, *, reply_to: int = 0,
             expect_reply: bool = False) -> int:
        """Queue ``msg`` for the worker listening at ``dest``; its id, or 0 when dropped."""
        try:
            payload = encode(msg)
        except (WireError, TypeError, ValueError):
            self.counters["encode_errors"] += 1
            return 0
        return self.send_bytes(dest, payload, reply_to=reply_to, expect_reply=expect_reply)

    def send_bytes(self, dest: str, payload: bytes, *, reply_to: int = 0,
                   expect_reply: bool = False) -> int:
        """Send an already encoded payload (tests use it to send garbage); id or 0."""
        if len(payload) > MAX_MESSAGE_BYTES:
            self.counters["oversize_out"] += 1
            return 0
        sock = self._dealer(dest)
        if sock is None:
            return 0
        dest_b = dest.encode()  # _dealer checked it
        payloads = [payload] if self._faults is None else self._inject(payload)
        last = 0
        for p in payloads:
            msg_id, frames = self._frame(p, reply_to, dest_b)
            if self._push(sock, frames):
                self.counters["sent"] += 1
                last = msg_id
        if last and expect_reply:
            self._pending[last] = (dest, time.monotonic())
            while len(self._pending) > 65536:
                self._pending.popitem(last=False)
        return last

    def _push(self, sock: zmq.Socket, frames: list[bytes]) -> bool:
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.counters["send_dropped"] += 1
        except zmq.ZMQError:
            self.counters["send_errors"] += 1
        return False

    def reply(self, to: Inbound, dest: str, msg: Message) -> int:
        """Answer ``to`` on the connection it came in on; falls back to a DEALER to ``dest``.

        ``dest`` is the asker's listening address: the reply is signed for it either way."""
        if to.route is None:
            return self.send(dest, msg, reply_to=to.msg_id)
        try:
            payload = encode(msg)
        except (WireError, TypeError, ValueError):
            self.counters["encode_errors"] += 1
            return 0
        dest_b = self._dest(dest)
        if dest_b is None:
            return 0
        payloads = [payload] if self._faults is None else self._inject(payload)
        last = 0
        for p in payloads:
            msg_id, frames = self._frame(p, to.msg_id, dest_b)
            try:
                self._router.send_multipart([to.route, *frames], flags=zmq.NOBLOCK)
                self.counters["replies_sent"] += 1
                last = msg_id
            except zmq.Again:
                self.counters["send_dropped"] += 1
            except zmq.ZMQError as exc:
                if exc.errno != errno.EHOSTUNREACH:
                    self.counters["send_errors"] += 1
                    continue
                # The asker's connection is gone (it reconnected or died): use its listener.
                self.counters["route_fallbacks"] += 1
                sock = self._dealer(dest)
                if sock is not None and self._push(sock, frames):
                    self.counters["sent"] += 1
                    last = msg_id
        return last

    # ----------------------------------------------------------------------------- receiving
    def poll(self, timeout_ms: int, fds: Iterable[int] = ()) -> tuple[list[Inbound], set[int]]:
        """Wait up to ``timeout_ms`` for messages or readable ``fds``; return both (no raise)."""
        for fd in fds:
            if fd not in self._fds:
                self._poller.register(fd, zmq.POLLIN)
                self._fds.add(fd)
        try:
            events = self._poller.poll(timeout_ms)
        except zmq.ZMQError as exc:
            if exc.errno == errno.EINTR:
                return [], set()
            raise
        inbound: list[Inbound] = []
        ready: set[int] = set()
        for sock, _ev in events:
            if isinstance(sock, int):
                ready.add(sock)
            elif sock is self._router:
                self._drain(sock, True, inbound)
            elif sock in self.links:
                self.links.drain(sock)
            else:
                self._drain(sock, False, inbound)
        self.refusals.tick()  # the refusals counted in an interval that is over
        return inbound, ready

    def unregister_fd(self, fd: int) -> None:
        """Stop polling an fd given to :meth:`poll` (before closing it)."""
        if fd in self._fds:
            self._poller.unregister(fd)
            self._fds.discard(fd)

    def _drain(self, sock: zmq.Socket, via_router: bool, out: list[Inbound]) -> None:
        limit = MAX_FRAMES + 1 if via_router else MAX_FRAMES  # the ROUTER prepends a routing id
        for _ in range(self._burst):
            try:
                parts = self._recv(sock, limit)
            except zmq.Again:
                return
            except zmq.ZMQError:
                self.counters["malformed"] += 1
                self.refusals.note("malformed", "refused a message: receive error",
                                   peer=None if via_router else self._dealer_dest.get(sock))
                return
            if parts is None:
                if sock in self._excess:
                    return  # discard budget spent: the rest of that message goes next poll
                continue
            if via_router:
                route, frames = parts[0], parts[1:]
                item = self._accept(frames, route, None)
            else:
                item = self._accept(parts, None, self._dealer_dest.get(sock))
            if item is not None:
                out.append(item)

    def _recv(self, sock: zmq.Socket, limit: int) -> list[bytes] | None:
        """The next message if it has at most ``limit`` frames; None after dropping (or starting
        to drop) a longer one. Raises zmq.Again when nothing is ready."""
        if sock in self._excess and not self._discard(sock):
            return None
        parts = [sock.recv(zmq.NOBLOCK)]
        while sock.getsockopt(zmq.RCVMORE):
            if len(parts) == limit:
                # Copy no more of it: ZMQ holds the whole message already, Python need not.
                self._excess[sock] = len(parts)
                self._discard(sock)
                return None
            parts.append(sock.recv(zmq.NOBLOCK))
        return parts

    def _discard(self, sock: zmq.Socket) -> bool:
        """Drop up to a budget of frames of an over-long message; True once its last is gone."""
        n = self._excess[sock]
        for _ in range(_DISCARD_BUDGET):
            if not sock.getsockopt(zmq.RCVMORE):
                del self._excess[sock]
                self.counters["too_many_frames"] += 1
                self.refusals.note("too_many_frames", "refused a message of %d frames (at most "
                                   "%d)", n, MAX_FRAMES, peer=self._dealer_dest.get(sock))
                return True
            sock.recv(zmq.NOBLOCK)
            n += 1
        self._excess[sock] = n
        return False

    def _accept(self, frames: list[bytes], route: bytes | None, peer: str | None
                ) -> Inbound | None:
        """Check one frame set (framing and authentication, then the wire); count and drop
        what fails."""
        opened = self._seal.open(frames)
        if isinstance(opened, Refusal):
            self.counters[opened.counter] += 1
            self.refusals.note(opened.counter, "refused a message: %s", opened.why, peer=peer)
            return None
        try:
            msg = decode(opened.payload)
        except WireError as exc:
            self.counters["wire_errors"] += 1  # repr: no newlines in the log
            self.refusals.note("wire_errors", "refused a message: %r", str(exc)[:200], peer=peer)
            return None
        self.counters["received"] += 1
        rtt = None
        reply_to = opened.reply_to
        if reply_to:
            sent = self._pending.pop(reply_to, None)
            if sent is not None:
                self.counters["replies_matched"] += 1
                rtt = time.monotonic() - sent[1]
            else:
                self.counters["replies_unmatched"] += 1
        return Inbound(msg, opened.msg_id, reply_to, route, peer, rtt)

    # ----------------------------------------------------------------------------- misc
    def stats(self) -> dict[str, int]:
        """Counters plus open DEALERs and pending correlations."""
        out = dict(self.counters)
        out["dealers"] = len(self._dealers)
        out["pending_replies"] = len(self._pending)
        return out

    @property
    def keyed(self) -> bool:
        """True when this channel signs and requires a cluster key."""
        return self._seal.key is not None

    def close(self) -> None:
        """Close every socket and the context (drops queued frames)."""
        if self._closed:
            return
        self._closed = True
        self.refusals.flush()  # what was counted and not yet written
        for fd in list(self._fds):
            self.unregister_fd(fd)
        for dest in self.links.watched():
            self._unwatch(dest)
        for sock in list(self._dealers.values()):
            sock.close(0)
        self._dealers.clear()
        self._dealer_dest.clear()
        self._router.close(0)
        self._ctx.term()

    def __enter__(self) -> SideChannel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
