"""Tests for lw.transport.dataplane.fence: D cuts inbound Mooncake connections from one peer.

Real sockets and real Mooncake engines: the slow-link test puts the receiver's engine in a
network namespace behind a 40 Mbit/s tbf cap (benchmarks/_link.py), so a 64 MiB write is still
crossing when the fence cuts it (a 30 %-loss netem link made the write's pace too erratic for a
test: from 60 MB to 16 KB in 4 s, by seed); the others use loopback.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from benchmarks._link import Link, in_netns, missing_requirements
from lw.transport.dataplane.fence import (
    _parse_hex_addr,
    fence_inbound,
    listening_ports,
    tcp_sockets,
)
from tests.transport.test_dataplane import HAVE_MOONCAKE, collect

needs_mooncake = pytest.mark.skipif(not HAVE_MOONCAKE, reason="mooncake not importable")


# The sender (P): a MooncakeDataPlane on argv[1] that writes to session argv[2] on command.
# stdin: "write <id> <dst addr> <bytes> <value> [<within_s>]" (the request's deadline, seconds
# from now); stdout: "ready", then "done <id> <ok> <why>".
_SENDER = r"""
import select, sys
import numpy as np
from lw.transport.dataplane import MooncakeDataPlane
dp = MooncakeDataPlane(sys.argv[1], 30.0)
src = np.zeros(int(sys.argv[3]), np.uint8)
dp.register_memory(src.ctypes.data, src.nbytes)
dp.connect(sys.argv[2])
print("ready", flush=True)
while True:
    ready, _, _ = select.select([sys.stdin, dp.fileno()], [], [])
    if sys.stdin in ready:
        cmd = sys.stdin.readline().split()
        if not cmd:
            break
        xid, dst, n, value = (int(x) for x in cmd[1:5])
        within = float(cmd[5]) if len(cmd) > 5 else float("inf")
        src[:n] = value
        dp.submit(xid, sys.argv[2], [(src.ctypes.data, dst, n)], within)
    for c in dp.poll():
        print("done", c.xfer_id, int(c.ok), c.reason.replace(chr(10), " "), flush=True)
dp.close()
"""


def _wait_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The sender's next stdout line (AssertionError after ``timeout`` seconds)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no line from the sender within {timeout}s"
    return proc.stdout.readline().strip()


@pytest.fixture
def receiver() -> Iterator[tuple[object, set[int]]]:
    """A Mooncake receiver on loopback and the listening ports its engine opened."""
    from lw.transport.dataplane import MooncakeDataPlane

    before = listening_ports()
    plane = MooncakeDataPlane("127.0.0.1", 10.0)
    ports = listening_ports() - before
    try:
        yield plane, ports
    finally:
        plane.close()


def test_parse_proc_net_addresses() -> None:
    assert _parse_hex_addr("0100007F:3C30") == ("127.0.0.1", 15408)
    assert _parse_hex_addr("0000000000000000FFFF00000100007F:3D97") == ("127.0.0.1", 15767)
    assert _parse_hex_addr("00000000000000000000000001000000:0050") == ("::1", 80)


@needs_mooncake
def test_mooncake_opens_two_listeners_rpc_and_data(receiver: tuple) -> None:
    plane, ports = receiver
    assert plane.engine.get_rpc_port() in ports and len(ports) == 2  # RPC port + TCP data port


@needs_mooncake
def test_fence_without_a_matching_socket_returns_ok_at_once(receiver: tuple) -> None:
    _, ports = receiver
    for peer in ("10.255.0.9", None):
        r = fence_inbound(peer, ports, 5.0)
        assert r.ok and r.closed and r.cut == () and r.errors == ()
        assert r.elapsed_s < 1.0


@needs_mooncake
def test_fence_spares_other_ports_to_the_same_peer(receiver: tuple) -> None:
    from lw.transport.dataplane import MooncakeDataPlane

    plane, ports = receiver
    dst = np.zeros(1 << 20, np.uint8)
    plane.register_memory(dst.ctypes.data, dst.nbytes)
    sender = MooncakeDataPlane("127.0.0.1", 10.0)
    src = np.full(1 << 20, 5, np.uint8)
    sender.register_memory(src.ctypes.data, src.nbytes)
    # A side channel to the same peer IP in the same process, on a port Mooncake does not own.
    lsn = socket.create_server(("127.0.0.1", 0))
    side_out = socket.create_connection(lsn.getsockname())
    side_in, _ = lsn.accept()
    try:
        sender.submit(1, plane.session, [(src.ctypes.data, dst.ctypes.data, src.nbytes)])
        assert collect(sender, 1)[0].ok
        inbound = [s for s in tcp_sockets() if s.local_port in ports and s.remote_ip]
        assert inbound, "the write left no inbound Mooncake connection to fence"
        r = fence_inbound("127.0.0.1", ports, 5.0)
        assert r.ok, r
        assert {s.inode for s in r.cut} == {s.inode for s in inbound}
        assert all(s.local_port in ports for s in r.cut)
        side_out.sendall(b"ping")
        assert side_in.recv(4) == b"ping"
        side_in.sendall(b"pong")
        assert side_out.recv(4) == b"pong"
        # Mooncake's sender finds its cached connection reset (a fast failure) and lw's data
        # plane resends the write once, on a new connection: the write after a fence lands.
        dst[:] = 0
        sender.submit(2, plane.session, [(src.ctypes.data, dst.ctypes.data, src.nbytes)])
        [c] = collect(sender, 1)
        assert c.ok, c.reason
        assert (dst == 5).all()
    finally:
        sender.close()
        for s in (side_out, side_in, lsn):
            s.close()


@needs_mooncake
def test_a_write_after_a_fence_lands_though_every_lane_was_cut(receiver: tuple) -> None:
    """Mooncake keeps one cached connection per lane (4): a fence resets them all, and a
    multi-entry write meets them one after another; lw resends until it has new ones."""
    from lw.transport.dataplane import MooncakeDataPlane

    plane, ports = receiver
    n, size = 16, 64 << 10
    dst = np.zeros(n * size, np.uint8)
    plane.register_memory(dst.ctypes.data, dst.nbytes)
    sender = MooncakeDataPlane("127.0.0.1", 10.0)
    src = np.full(n * size, 7, np.uint8)
    sender.register_memory(src.ctypes.data, src.nbytes)
    # Every other chunk: entries that cannot be merged, spread over the lanes.
    entries = [(src.ctypes.data + i * size, dst.ctypes.data + i * size, size // 2)
               for i in range(n)]
    try:
        for tid in range(1, 4):
            sender.submit(tid, plane.session, entries)
        assert all(c.ok for c in collect(sender, 3))
        inbound = [s for s in tcp_sockets() if s.local_port in ports and s.remote_ip]
        assert len(inbound) > 2, inbound  # several lanes plus the handshake's
        assert fence_inbound("127.0.0.1", ports, 5.0).ok
        dst[:] = 0
        for tid in range(4, 7):
            sender.submit(tid, plane.session, entries)
        done = collect(sender, 3)
        assert all(c.ok for c in done), [c.reason for c in done]
        assert all((dst[i * size:i * size + size // 2] == 7).all() for i in range(n))
    finally:
        sender.close()


def test_a_cut_connection_loses_its_queued_bytes() -> None:
    lsn = socket.create_server(("127.0.0.1", 0))
    port = lsn.getsockname()[1]
    out = socket.create_connection(("127.0.0.1", port))
    conn, _ = lsn.accept()
    try:
        out.sendall(b"x" * 100_000)  # queued at the receiver, not read yet
        time.sleep(0.05)
        r = fence_inbound("127.0.0.1", {port}, 0.2)
        # This test is the owner and keeps the descriptor open: cut, but not closed, not ok.
        assert len(r.cut) == 1 and not r.closed and not r.ok
        with pytest.raises(ConnectionResetError):
            conn.recv(1 << 20)  # purged: not one of the queued bytes is left to read
        with pytest.raises(OSError):
            for _ in range(50):
                out.sendall(b"y" * 1000)
                time.sleep(0.01)
    finally:
        for s in (out, conn, lsn):
            s.close()


def test_a_connection_still_in_the_accept_queue_is_cut_once_accepted() -> None:
    lsn = socket.create_server(("127.0.0.1", 0))
    port = lsn.getsockname()[1]
    out = socket.create_connection(("127.0.0.1", port))
    out.sendall(b"x" * 1000)
    time.sleep(0.05)
    got: list[object] = []

    def owner() -> None:
        """Accept late, read until the connection fails, close: what Mooncake's server does."""
        time.sleep(0.3)
        conn, _ = lsn.accept()
        try:
            while conn.recv(65536):
                pass
            got.append("eof")
        except OSError as exc:
            got.append(exc)
        conn.close()

    t = threading.Thread(target=owner)
    t.start()
    try:
        r = fence_inbound("127.0.0.1", {port}, 5.0)
        t.join(5)
        assert r.ok and len(r.cut) == 1 and r.elapsed_s >= 0.25, r
        # A recv asleep in the kernel when the cut came fails with EPIPE, a later one ECONNRESET
        assert isinstance(got[0], (BrokenPipeError, ConnectionResetError)), got
    finally:
        t.join(5)
        out.close()
        lsn.close()


@needs_mooncake
@pytest.mark.slow
@pytest.mark.skipif(bool(missing_requirements()), reason=f"link: {missing_requirements()}")
def test_fence_stops_a_write_crossing_a_slow_link_and_the_next_write_lands() -> None:
    from lw.transport.dataplane import MooncakeDataPlane

    size = 64 << 20  # 13 s at the link's 40 Mbit/s: the fence comes about 1 s in
    with Link.create(40e6) as link:
        # D in the namespace (its engine's threads and sockets made there), P in this one
        before = listening_ports()
        plane = in_netns(link.ns, lambda: MooncakeDataPlane(link.ns_addr, 30.0))
        ports = listening_ports() - before
        dst = np.zeros(size, np.uint8)
        plane.register_memory(dst.ctypes.data, dst.nbytes)
        tx = subprocess.Popen([sys.executable, "-c", _SENDER, link.root_addr, plane.session,
                               str(size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "MC_LOG_LEVEL": "ERROR"})
        assert tx.stdin is not None
        try:
            assert _wait_line(tx, 15.0) == "ready"
            # As in the protocol, the request's deadline has passed when D fences (D fences at
            # the end of its lease, which outlasts P's deadline): P resends nothing after it.
            tx.stdin.write(f"write 1 {dst.ctypes.data} {size} 7 0.5\n")
            tx.stdin.flush()
            deadline = time.monotonic() + 15.0
            while np.count_nonzero(dst[::4096]) < 1024:  # 4 MiB landed
                assert time.monotonic() < deadline, "the write did not start"
                time.sleep(0.01)
            r = fence_inbound(link.root_addr, ports, 5.0)
            assert r.ok and r.cut, r
            assert all(s.remote_ip == link.root_addr and s.local_port in ports for s in r.cut)
            snapshot = dst.copy()
            assert (snapshot != 7).any(), "the write finished before the fence: nothing cut"
            time.sleep(1.5)  # P's socket buffer and the tbf queue held megabytes
            assert np.array_equal(dst, snapshot), "bytes landed after the fence returned ok"
            line = _wait_line(tx, 30.0).split(maxsplit=3)
            assert line[:3] == ["done", "1", "0"], line  # the cut write failed at P
            # A new connection after the fence is not fenced: the next write lands.
            tx.stdin.write(f"write 2 {dst.ctypes.data} {1 << 20} 9\n")
            tx.stdin.flush()
            line = _wait_line(tx, 30.0).split(maxsplit=3)
            assert line[:3] == ["done", "2", "1"], line
            assert (dst[:1 << 20] == 9).all()
        finally:
            tx.stdin.close()
            try:
                tx.wait(15)
            except subprocess.TimeoutExpired:
                tx.kill()
            plane.close()
