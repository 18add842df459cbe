"""Whether the connection to each peer is up: what the kernel says of a silent peer's process.

A process starved of CPU, stopped, or paused by its GC does not answer heartbeats, but its
kernel keeps the TCP connection its side channel holds, acknowledges what is sent on it, and
answers keepalive probes; a dead process's host resets or refuses it, and a host gone or cut
off stops answering, which the kernel turns into a closed connection within the side channel's
``host_timeout_s`` (keepalive, TCP_MAXRT), with no reconnection after. ZMQ reports each change
on a monitor socket per DEALER; this keeps the last one, read as the evidence
:func:`lw.fsm.silence.silence_loses` weighs. No extra connection is made and no ZMTP heartbeat
runs: each was followed by libzmq 4.3.5 aborting the process (``Assertion failed: !_io_error``;
see :func:`lw.transport.zmqsock.tune_socket`)."""

from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from lw.fsm.silence import ALIVE, GONE, PENDING, UNKNOWN

__all__ = ["Links"]

_UP = zmq.EVENT_CONNECTED
_DOWN = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_CONNECT_RETRIED
_WATCHED = _UP | _DOWN


class _Link:
    __slots__ = ("up", "since")

    def __init__(self, now: float) -> None:
        self.up = False
        self.since = now  # when it last went up or down (created: connecting)


class Links:
    """The state of each DEALER's connection, from its monitor socket (registered in the side
    channel's poller, so changes are timed as they happen)."""

    def __init__(self, answer_s: float = 1.0) -> None:
        if not answer_s > 0:
            raise ValueError(f"a connection's answer time must be > 0 s, got {answer_s}")
        # down (or never up) this long: no process holds the port, or the host is unreachable
        self.answer_s = answer_s
        self._by_monitor: dict[zmq.Socket, _Link] = {}
        self._by_dest: dict[str, tuple[zmq.Socket, zmq.Socket]] = {}  # dest -> (dealer, monitor)

    def watch(self, dest: str, dealer: zmq.Socket) -> zmq.Socket:
        """Start following ``dealer``'s connection; the monitor socket to poll."""
        monitor = dealer.get_monitor_socket(_WATCHED)
        monitor.setsockopt(zmq.LINGER, 0)
        self._by_monitor[monitor] = _Link(time.monotonic())
        self._by_dest[dest] = (dealer, monitor)
        return monitor

    def monitor_of(self, dest: str) -> zmq.Socket | None:
        """The monitor socket following ``dest`` (to unregister it from a poller), or None."""
        pair = self._by_dest.get(dest)
        return None if pair is None else pair[1]

    def unwatch(self, dest: str) -> None:
        """Stop following ``dest`` (before its DEALER closes) and close its monitor."""
        pair = self._by_dest.pop(dest, None)
        if pair is None:
            return
        dealer, monitor = pair
        self._by_monitor.pop(monitor, None)
        try:
            dealer.disable_monitor()
        except zmq.ZMQError:
            pass
        monitor.close(0)

    def __contains__(self, sock: object) -> bool:
        return sock in self._by_monitor

    def drain(self, monitor: zmq.Socket) -> None:
        """Take every event queued on ``monitor``."""
        link = self._by_monitor.get(monitor)
        if link is None:
            return
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            try:
                event = parse_monitor_message(frames)["event"]
            except (ValueError, KeyError, TypeError):
                continue
            up = bool(event & _UP)
            if up != link.up:
                link.up = up
                link.since = time.monotonic()

    def evidence(self, dest: str) -> str:
        """What the connection to ``dest`` shows of its process: ALIVE (up), GONE (down or
        never up for ``answer_s``), PENDING (down more briefly), UNKNOWN (no connection)."""
        pair = self._by_dest.get(dest)
        if pair is None:
            return UNKNOWN
        self.drain(pair[1])
        link = self._by_monitor[pair[1]]
        if link.up:
            return ALIVE
        return GONE if time.monotonic() - link.since > self.answer_s else PENDING

    def watched(self) -> list[str]:
        """Every destination followed."""
        return list(self._by_dest)
