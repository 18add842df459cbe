"""A lossy or slow link between P and D: userspace netem over two TUN devices.

This kernel has no ``sch_netem`` (and no tc ``gact`` or ``matchall``), so packet loss and delay
are made in userspace. :class:`Link` puts the decoder's network namespace behind two TUN devices
instead of a veth pair: one in this namespace (``10.77.N.1``), one in the decoder's
(``10.77.N.2``), point to point. A relay *process* (not a thread of the cluster, whose GIL would
then pace the packets) reads each IP packet from one TUN and writes it to the other, dropping it
with probability ``loss`` and delivering it ``delay`` seconds later. Only the two 10.77.N.x
addresses are ever configured; the relay never opens a socket, it only moves packets between the
two devices. The TUN devices are not persistent: they vanish with the relay's file descriptors,
so a killed relay leaves nothing behind. Needs root, iproute2 and ``/dev/net/tun``.

:func:`relay_main` is the relay process's entry point.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import heapq
import os
import random
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from lw.lab.synthetic import netns

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
PR_SET_PDEATHSIG = 1
# Ethernet's MTU, measured against larger ones: the relay moves one packet per read (TUN has no
# GSO without a virtio-net header) and still carries ~130 MB/s of one TCP stream at 1500 (430 at
# 9000), far above what a lossy or slow link lets through; and under 30 % loss TCP recovers by
# SACK only with many segments per window: one stream got 40 MB/s at 1500 but 3 MB/s at 9000,
# where nearly every loss waits for a retransmission timeout.
MTU = 1500
QUEUE_LIMIT = 20000  # packets held for delay per direction, like netem's ``limit`` (then dropped)
T = TypeVar("T")


def unavailable() -> str:
    """"" when namespaces and TUN devices can be made here, else why not."""
    why = netns.unavailable()
    if why:
        return why
    try:
        fd = os.open("/dev/net/tun", os.O_RDWR)
    except OSError as exc:
        return f"/dev/net/tun cannot be opened: {exc.strerror}"
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", b"lwprobe%d" % (os.getpid() % 10000),
                                               IFF_TUN | IFF_NO_PI))
    except OSError as exc:
        return f"TUNSETIFF failed: {exc.strerror}"
    finally:
        os.close(fd)  # not persistent: the probe device is gone with the descriptor
    return ""


@dataclass
class LinkStats:
    """What the relay did, per direction (``pd``: P to D, ``dp``: D to P)."""

    packets_pd: int = 0
    packets_dp: int = 0
    bytes_pd: int = 0
    bytes_dp: int = 0
    dropped_pd: int = 0
    dropped_dp: int = 0
    overflow: int = 0  # dropped because the delay queue was full
    foreign: int = 0  # not IPv4 between the two link addresses: never forwarded
    syns: int = 0  # TCP connection attempts (SYN without ACK, retransmissions included)
    busy_s: float = 0.0  # relay CPU time (user + system)

    def line(self) -> str:
        """One ``key=value`` line for the pipe back to the cluster."""
        return " ".join(f"{k}={v}" for k, v in self.__dict__.items())

    @classmethod
    def parse(cls, line: str) -> LinkStats:
        """The inverse of :meth:`line`."""
        kv = dict(part.split("=", 1) for part in line.split())
        return cls(**{k: (float(v) if k == "busy_s" else int(v)) for k, v in kv.items()
                      if k in cls.__dataclass_fields__})


class Link:
    """A namespace for the decoder behind two TUN devices and a relay that drops and delays.

    ``delay_pd_s`` delays packets from P to D, ``delay_dp_s`` from D to P; ``loss`` applies to
    each packet in each direction. :attr:`stats` holds the relay's counters after exit.
    """

    def __init__(self, loss: float = 0.0, delay_pd_s: float = 0.0, delay_dp_s: float = 0.0,
                 index: int | None = None, seed: int = 0, mtu: int = MTU) -> None:
        n = (os.getpid() % 200) + 20 if index is None else index
        self.name = f"lw-d-{os.getpid()}"
        # one name for both devices (each in its own namespace), as netns.Partition does
        self.host_if = self.ns_if = f"lwt{os.getpid() % 100000}"
        self.host_ip, self.ns_ip = f"10.77.{n}.1", f"10.77.{n}.2"
        self.loss, self.delay_pd_s, self.delay_dp_s = loss, delay_pd_s, delay_dp_s
        self.seed, self.mtu = seed, mtu
        self.stats = LinkStats()
        self.error = ""  # set by __exit__ when the relay had died before it was stopped
        self._relay: subprocess.Popen[str] | None = None
        self._made = False

    def __enter__(self) -> Link:
        why = unavailable()
        if why:
            raise OSError(f"TUN devices or network namespaces unavailable: {why}")
        try:
            netns.run_ip("netns", "add", self.name)
            self._made = True
            netns.run_ip("-n", self.name, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as exc:
            self.__exit__()
            raise OSError(f"could not make the namespace: {exc.stderr.strip()}") from exc
        self._relay = subprocess.Popen(
            # -c, not -m: running a module of an imported package makes runpy warn on stderr
            [sys.executable, "-c", "import sys; from lw.lab.synthetic.netem import relay_main; "
             "sys.exit(relay_main(sys.argv[1:]))", "--netns", self.name,
             "--host-if", self.host_if, "--ns-if", self.ns_if, "--host-ip", self.host_ip,
             "--ns-ip", self.ns_ip, "--loss", repr(self.loss), "--delay-pd", repr(self.delay_pd_s),
             "--delay-dp", repr(self.delay_dp_s), "--seed", str(self.seed), "--mtu", str(self.mtu)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self._relay.stdout is not None
        ready, _, _ = select.select([self._relay.stdout], [], [], 15.0)
        line = self._relay.stdout.readline() if ready else ""
        if line.strip() != "ready":
            err = ""
            if self._relay.poll() is not None and self._relay.stderr is not None:
                err = self._relay.stderr.read().strip()
            self.__exit__()
            raise OSError(f"the link relay did not start: {err or line.strip() or 'timeout'}")
        return self

    def __exit__(self, *exc: object) -> None:
        relay, self._relay = self._relay, None
        if relay is not None:
            died = relay.poll()
            if died is None:
                relay.terminate()  # the relay writes its counters, then exits
            try:
                out, err = relay.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                relay.kill()
                out, err = relay.communicate()
            if died:  # a dead relay is a cut link: the run's failures would not be the fault's
                self.error = f"the link relay died (exit {died}): {(err or '').strip()[-300:]}"
            for line in (out or "").splitlines():
                if line.startswith("packets_pd="):
                    self.stats = LinkStats.parse(line)
        # the devices went with the relay's descriptors; delete them anyway in case it hung
        netns.run_ip("link", "del", self.host_if, check=False)
        if self._made:
            netns.run_ip("-n", self.name, "link", "del", self.ns_if, check=False)
            netns.run_ip("netns", "del", self.name, check=False)
            self._made = False


# ----------------------------------------------------------------------------- the relay process
def _open_tun(name: str) -> int:
    """A TUN device ``name`` (IP packets, no packet-info header) in the calling thread's netns."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def in_netns(netns_name: str, make: Callable[[], T]) -> T:
    """``make()`` run by a thread inside namespace ``netns_name`` (setns on a network namespace
    moves only the calling thread, so this process stays where it is). Sockets and TUN devices
    made there stay in that namespace whoever uses them later."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            netns.enter(netns_name)
            try:
                result.append(make())
            finally:
                if ctypes.CDLL(None, use_errno=True).setns(home, netns.CLONE_NEWNET) != 0:
                    os._exit(4)  # pragma: no cover - a thread stuck in the wrong namespace
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            error.append(exc)
        finally:
            os.close(home)

    t = threading.Thread(target=run, name="lw-in-netns")
    t.start()
    t.join()
    if error:
        raise error[0]
    return result[0]


def relay(fd_p: int, fd_d: int, loss: float, delay_pd_s: float, delay_dp_s: float,
          rng: random.Random, stop: threading.Event, stats: LinkStats,
          pair: tuple[str, str]) -> None:
    """Move packets between the P-side TUN ``fd_p`` and the D-side ``fd_d`` until ``stop``.

    Only IPv4 packets between the two addresses of ``pair`` (P side, D side) pass. A packet is
    dropped with probability ``loss``; otherwise it is written at once, or after its
    direction's delay from a heap ordered by (due time, arrival), so a constant delay keeps
    each direction's order.
    """
    p_ip, d_ip = (socket.inet_aton(ip) for ip in pair)
    allowed = {fd_p: p_ip + d_ip, fd_d: d_ip + p_ip}  # bytes 12-20 of the IPv4 header: src, dst
    due: list[tuple[float, int, int, bytes]] = []
    held = {fd_p: 0, fd_d: 0}  # packets queued per destination
    seq = 0
    poller = select.poll()
    poller.register(fd_p, select.POLLIN)
    poller.register(fd_d, select.POLLIN)
    route = {fd_p: (fd_d, delay_pd_s, "pd"), fd_d: (fd_p, delay_dp_s, "dp")}
    while not stop.is_set():
        timeout_ms = 200
        if due:
            timeout_ms = max(0, min(200, int((due[0][0] - time.monotonic()) * 1000 + 0.999)))
        try:
            ready = poller.poll(timeout_ms)
        except InterruptedError:
            continue
        for fd, _ in ready:
            out, delay, way = route[fd]
            for _ in range(256):  # a bounded burst, so the other direction is served too
                try:
                    pkt = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if len(pkt) < 20 or pkt[0] >> 4 != 4 or pkt[12:20] != allowed[fd]:
                    stats.foreign += 1
                    continue
                flags_at = (pkt[0] & 0x0F) * 4 + 13  # TCP flags, after the IPv4 header
                if pkt[9] == 6 and len(pkt) > flags_at and pkt[flags_at] & 0x12 == 0x02:
                    stats.syns += 1  # a connection attempt (for reading the logs, not the fault)
                if way == "pd":
                    stats.packets_pd += 1
                    stats.bytes_pd += len(pkt)
                else:
                    stats.packets_dp += 1
                    stats.bytes_dp += len(pkt)
                if loss and rng.random() < loss:
                    if way == "pd":
                        stats.dropped_pd += 1
                    else:
                        stats.dropped_dp += 1
                    continue
                if delay <= 0:
                    _write(out, pkt)
                elif held[out] >= QUEUE_LIMIT:
                    stats.overflow += 1
                else:
                    seq += 1
                    held[out] += 1
                    heapq.heappush(due, (time.monotonic() + delay, seq, out, pkt))
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, out, pkt = heapq.heappop(due)
            held[out] -= 1
            _write(out, pkt)


def _write(fd: int, pkt: bytes) -> None:
    try:
        os.write(fd, pkt)
    except OSError:
        pass  # a full or downed device drops the packet, as a wire would


def relay_main(argv: list[str]) -> int:
    """The relay process started by :class:`Link`: make and address both TUN devices, say
    ``ready``, relay until SIGTERM, then print the counters."""
    p = argparse.ArgumentParser(prog="lw link relay",
                                description="relay of the lossy/slow link (started by Link)")
    p.add_argument("--netns", required=True)
    p.add_argument("--host-if", required=True)
    p.add_argument("--ns-if", required=True)
    p.add_argument("--host-ip", required=True)
    p.add_argument("--ns-ip", required=True)
    p.add_argument("--loss", type=float, default=0.0)
    p.add_argument("--delay-pd", type=float, default=0.0)
    p.add_argument("--delay-dp", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mtu", type=int, default=MTU)
    a = p.parse_args(argv)
    for ip in (a.host_ip, a.ns_ip):  # the only addresses this relay will ever configure
        if not ip.startswith("10.77."):
            print(f"refusing address {ip}: only 10.77.N.x", file=sys.stderr)
            return 2
    if not a.netns.startswith("lw-d-"):
        print(f"refusing namespace {a.netns}: only the cluster's lw-d-*", file=sys.stderr)
        return 2
    # Never outlive the cluster: when the thread that started us dies (even by SIGKILL) we get
    # SIGTERM, stop, and remove the namespace ourselves; the TUN devices go with our fds.
    parent = os.getppid()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C in a terminal: the cluster ends us
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        return 3  # it died before the prctl
    fd_p = _open_tun(a.host_if)
    fd_d = in_netns(a.netns, lambda: _open_tun(a.ns_if))
    for ns, dev, me, peer in (([], a.host_if, a.host_ip, a.ns_ip),
                              (["-n", a.netns], a.ns_if, a.ns_ip, a.host_ip)):
        # no IPv6 link-local address: nothing but the two 10.77.N.x addresses on this link
        netns.run_ip(*ns, "link", "set", dev, "addrgenmode", "none")
        netns.run_ip(*ns, "addr", "add", me, "peer", f"{peer}/32", "dev", dev)
        netns.run_ip(*ns, "link", "set", dev, "mtu", str(a.mtu), "up")
    print("ready", flush=True)
    stats = LinkStats()
    relay(fd_p, fd_d, a.loss, a.delay_pd, a.delay_dp, random.Random(a.seed), stop, stats,
          (a.host_ip, a.ns_ip))
    t = os.times()
    stats.busy_s = round(t.user + t.system, 3)
    if os.getppid() != parent:  # orphaned: nobody is left to clean up after the cluster
        os.close(fd_p)
        os.close(fd_d)
        netns.run_ip("netns", "del", a.netns, check=False)
        return 3
    print(stats.line(), flush=True)
    return 0
