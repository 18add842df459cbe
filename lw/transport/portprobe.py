"""Knocking on a silent peer's side-channel port: whether a process still holds it.

A process starved of CPU, stopped, or paused by its GC does not answer heartbeats, but its
kernel still completes a TCP handshake into the listen backlog; a dead process's host refuses
the connection, and a host gone or cut off does not answer. That tells a slow peer from a dead
one (:func:`lw.fsm.silence.silence_loses` decides). Non-blocking: a probe is started in one
heartbeat round and read in a later one; nothing here waits."""

from __future__ import annotations

import errno
import ipaddress
import select
import socket

from lw.fsm.silence import ALIVE, GONE, PENDING, UNKNOWN

__all__ = ["PortProbe"]


class _Knock:
    __slots__ = ("sock", "started")

    def __init__(self, sock: socket.socket, started: float) -> None:
        self.sock = sock
        self.started = started


class PortProbe:
    """Per peer address, one connection attempt at a time to its ``tcp://host:port``; what the
    last finished attempt showed is what :meth:`evidence` returns, and each call after a finished
    attempt starts the next (a process that dies while waited for is found at the next round)."""

    def __init__(self, answer_s: float) -> None:
        if not answer_s > 0:
            raise ValueError(f"a probe's answer time must be > 0 s, got {answer_s}")
        self.answer_s = answer_s  # no SYN-ACK within this: the host is gone or cut off
        self._knocks: dict[str, _Knock] = {}
        self._where: dict[str, tuple[str, int] | None] = {}
        self.probes = 0  # connection attempts started (for the loop's counters)

    def evidence(self, addr: str, now: float) -> str:
        """What is known of the process at ``addr``: ALIVE, GONE, PENDING (first probe under
        way) or UNKNOWN (not a tcp address: nothing to knock on)."""
        where = self._target(addr)
        if where is None:
            return UNKNOWN
        knock = self._knocks.get(addr)
        if knock is None:
            return self._start(addr, where, now) or PENDING
        shown = self._read(knock, now)
        if shown == PENDING:
            return PENDING
        del self._knocks[addr]
        knock.sock.close()
        # the answer holds for this round; the next round reads a fresh attempt
        self._start(addr, where, now)
        return shown

    def forget(self, addr: str) -> None:
        """Stop probing ``addr`` (it spoke, or was declared lost)."""
        knock = self._knocks.pop(addr, None)
        if knock is not None:
            knock.sock.close()

    def close(self) -> None:
        """Close every attempt under way."""
        for addr in list(self._knocks):
            self.forget(addr)

    def _start(self, addr: str, where: tuple[str, int], now: float) -> str | None:
        """Start an attempt; a verdict at once if the kernel gave one (refused on loopback)."""
        family = socket.AF_INET6 if ":" in where[0] else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        self.probes += 1
        err = sock.connect_ex(where)
        if err in (0, errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK, errno.EALREADY):
            self._knocks[addr] = _Knock(sock, now)
            return None
        sock.close()
        return GONE

    def _read(self, knock: _Knock, now: float) -> str:
        try:
            _, writable, _ = select.select([], [knock.sock], [], 0)
        except (OSError, ValueError):
            return GONE
        if writable:
            err = knock.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            return ALIVE if err == 0 else GONE
        return GONE if now - knock.started > self.answer_s else PENDING

    def _target(self, addr: str) -> tuple[str, int] | None:
        """(ip, port) of a ``tcp://`` address whose host is an IP literal or localhost; None
        for others (a name would need a resolver call, which may block the loop)."""
        if addr in self._where:
            return self._where[addr]
        where: tuple[str, int] | None = None
        if addr.startswith("tcp://"):
            host, _, port = addr[len("tcp://"):].rpartition(":")
            host = host.strip("[]")
            if host == "localhost":
                host = "127.0.0.1"
            try:
                ipaddress.ip_address(host)
                where = (host, int(port))
            except ValueError:
                where = None
        if len(self._where) > 4096:  # peers restart on new ports: keep the cache bounded
            self._where.clear()
        self._where[addr] = where
        return where
