"""A receive-side fence: D cuts every inbound Mooncake TCP connection from one peer host.

A write that P's data plane reported failed can still land in D's memory tens of seconds later
(benchmarks/late_landing.py): Mooncake's TCP server reads each connection straight into the
destination address, and P's kernel keeps retransmitting what its socket buffer holds after
Mooncake gave up. :func:`fence_inbound` ends that from inside D's process, without privileges.

How a connection is cut (measured on Linux 6.18, loopback and a 30 %-loss link): ``connect()``
with an ``AF_UNSPEC`` address on a duplicate of the socket's descriptor runs the kernel's
``tcp_disconnect`` on the shared socket. Under the socket lock it sends a RST, purges the receive
and out-of-order queues, sets ``sk_err`` and moves the socket to CLOSE (unhashed: later segments
of that connection find no socket and are answered with RST). A ``recv`` copying into user
memory holds the same lock, so once the call returns no byte of that connection is left to be
read: the next ``recv`` fails (ECONNRESET), Mooncake's session ends and closes the descriptor.
The alternatives are not sound on their own: after ``shutdown(SHUT_RDWR)`` (with or without
``SO_LINGER`` 0) and after ``SOCK_DESTROY`` (``ss -K``, which also needs CAP_NET_ADMIN) the
bytes already queued (megabytes with autotuned buffers) stay readable and Mooncake copies them
into memory after the cut. The fence then waits until Mooncake has closed every cut descriptor,
so that a reader that received into a bounce buffer (CUDA builds copy from it afterwards) has
finished too; only then is it ``ok``.

Connections still in a listener's accept queue (or in SYN_RECV) when the fence starts have no
descriptor yet; they are found in ``/proc/self/net/tcp{,6}`` (this process's main-thread
namespace) and cut once Mooncake accepts them. New connections after the fence are left alone.

What it does not stop: a sender *engine* that still holds the failed writes. Measured with
benchmarks/late_landing.py (30 % loss): after the fence nothing landed for ~2 s, then P's
Mooncake opened new connections and kept delivering writes its data plane had reported failed
(30-62 block changes up to a minute later); with P's engine dropped before the fence, none did.
D cannot tell such a connection from one carrying a new write, so P must drop (or recreate) its
engine before D relies on the fence.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import socket
import struct
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass

__all__ = ["FenceResult", "TcpSocket", "fence_inbound", "listening_ports", "tcp_sockets"]

_libc = ctypes.CDLL(None, use_errno=True)
_UNSPEC = (ctypes.c_ubyte * 16)()  # a sockaddr whose sa_family is AF_UNSPEC (0)
_POLL_S = 0.002
# /proc/net/tcp states of a connection that may still carry a peer's bytes but has no
# descriptor yet: ESTABLISHED and CLOSE_WAIT (in an accept queue), SYN_RECV (a request).
_UNACCEPTED_STATES = frozenset({"01", "03", "08"})


@dataclass(frozen=True)
class TcpSocket:
    """One TCP socket open in this process: its descriptor, inode and addresses."""

    fd: int
    inode: int
    local_port: int
    remote_ip: str  # "" for a listener; IPv4-mapped IPv6 addresses are given as IPv4
    remote_port: int


@dataclass(frozen=True)
class FenceResult:
    """What :func:`fence_inbound` did: the sockets cut, whether their owner closed them, when."""

    cut: tuple[TcpSocket, ...]
    closed: bool  # every cut socket's descriptor was closed by its owner before the timeout
    elapsed_s: float
    errors: tuple[str, ...] = ()  # sockets that could not be cut, or stayed unaccepted

    @property
    def ok(self) -> bool:
        """True when no byte of the fenced connections can reach this process's memory."""
        return self.closed and not self.errors


def _norm_ip(ip: str) -> str:
    """``ip`` in canonical form, an IPv4-mapped IPv6 address as plain IPv4."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


def _socket_inodes() -> dict[int, int]:
    """inode -> descriptor of every socket open in this process."""
    out: dict[int, int] = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            target = os.readlink(f"/proc/self/fd/{name}")
            if target.startswith("socket:["):
                out[int(target[8:-1])] = int(name)
    return out


@contextlib.contextmanager
def _borrowed(fd: int, inode: int) -> Iterator[socket.socket | None]:
    """A private duplicate of ``fd`` as a socket object, None if ``fd`` no longer is ``inode``
    (closed and its number reused): acting on the duplicate can never hit another socket."""
    try:
        dup = os.dup(fd)
    except OSError:
        yield None
        return
    try:
        if os.fstat(dup).st_ino != inode:
            yield None
            return
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        yield None
        return
    try:
        yield sock
    finally:
        sock.close()  # closes only the duplicate; the owner's descriptor stays open


def tcp_sockets() -> list[TcpSocket]:
    """Every IPv4/IPv6 TCP socket of this process that is listening or connected.

    Asks each socket itself (not ``/proc/net``), so it works whichever network namespace the
    sockets were made in.
    """
    out: list[TcpSocket] = []
    for inode, fd in _socket_inodes().items():
        with _borrowed(fd, inode) as sock:
            if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_PROTOCOL) != socket.IPPROTO_TCP:
                    continue
                port = sock.getsockname()[1]
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    out.append(TcpSocket(fd, inode, port, "", 0))
                    continue
                peer = sock.getpeername()
            except OSError:
                continue  # not connected (or not any more)
            out.append(TcpSocket(fd, inode, port, _norm_ip(peer[0]), peer[1]))
    return out


def listening_ports() -> set[int]:
    """Local ports on which this process has a listening TCP socket.

    Taken before and after ``TransferEngine.initialize`` (TCP transport), the difference is
    Mooncake's two ports: its RPC port (``get_rpc_port()``) and the data port writes arrive on.
    """
    return {s.local_port for s in tcp_sockets() if not s.remote_ip}


def _unaccepted(peer: str | None, ports: Collection[int]) -> set[tuple[int, str, int]]:
    """(local port, remote ip, remote port) of matching connections without a descriptor."""
    out: set[tuple[int, str, int]] = set()
    for path in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) < 10 or cols[3] not in _UNACCEPTED_STATES or cols[9] != "0":
                continue
            (_, lport), (rip, rport) = (_parse_hex_addr(c) for c in cols[1:3])
            if lport in ports and (peer is None or rip == peer):
                out.add((lport, rip, rport))
    return out


def _parse_hex_addr(text: str) -> tuple[str, int]:
    """An ``ADDR:PORT`` of /proc/net/tcp (address in 32-bit host-order words) as (ip, port)."""
    hexaddr, hexport = text.split(":")
    raw = b"".join(struct.pack("=I", int(hexaddr[i:i + 8], 16))
                   for i in range(0, len(hexaddr), 8))
    return _norm_ip(socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6,
                                     raw)), int(hexport, 16)


def _disconnect(s: TcpSocket) -> str:
    """Run ``tcp_disconnect`` on ``s`` (see the module docstring); "" or why it failed."""
    with _borrowed(s.fd, s.inode) as sock:
        if sock is None:
            return ""  # already closed by its owner: nothing can be read from it any more
        if _libc.connect(sock.fileno(), _UNSPEC, ctypes.sizeof(_UNSPEC)) != 0:
            err = ctypes.get_errno()
            return f"fd {s.fd} from {s.remote_ip}:{s.remote_port}: {os.strerror(err)}"
    return ""


def fence_inbound(peer_ip: str | None, local_ports: Collection[int],
                  timeout_s: float) -> FenceResult:
    """Cut this process's TCP connections on ``local_ports`` from ``peer_ip`` (None: from any
    host) and wait up to ``timeout_s`` until their owner has closed every one of them."""
    started = time.monotonic()
    deadline = started + timeout_s
    peer = None if peer_ip is None else _norm_ip(peer_ip)
    ports = frozenset(local_ports)
    pending = _unaccepted(peer, ports) if ports else set()
    cut: list[TcpSocket] = []
    errors: list[str] = []
    seen: set[int] = set()
    first = True
    while True:
        if first or pending:  # rescan only to catch pre-fence connections being accepted
            # read before the descriptors: one accepted in between is then found among them
            unaccepted = _unaccepted(peer, ports) if pending else set()
            for s in tcp_sockets():
                key = (s.local_port, s.remote_ip, s.remote_port)
                if (s.inode in seen or not s.remote_ip or s.local_port not in ports
                        or (peer is not None and s.remote_ip != peer)
                        or not (first or key in pending)):
                    continue
                seen.add(s.inode)
                pending.discard(key)
                why = _disconnect(s)
                cut.append(s)
                if why:
                    errors.append(why)
            pending &= unaccepted  # gone without being accepted: no reader got its bytes
            first = False
        still_open = seen & _socket_inodes().keys()
        if (not still_open and not pending) or time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
    errors += [f"{rip}:{rport} to local port {lport} not accepted within {timeout_s:g}s"
               for lport, rip, rport in sorted(pending)]
    return FenceResult(tuple(cut), not still_open and not pending,
                       time.monotonic() - started, tuple(errors))
