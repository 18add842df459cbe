"""A real network between P and D: the decoder in its own network namespace behind a veth pair.

:class:`Partition` creates a namespace and a veth pair (``10.77.N.1`` on this side, ``10.77.N.2``
inside, both ends of one name), and cuts or heals the link by setting the decoder's end down or
up: packets are dropped in the kernel, TCP connections stall and retransmit, a new connection
finds no neighbour, as between two hosts whose switch fails. Only those two addresses are ever
used. The decoder process enters the namespace with :func:`enter` before it opens a socket.
Needs root and ``ip`` (iproute2); :func:`unavailable` says why not when it cannot work.

Why the decoder's end: this side's end keeps its address and its route (only its carrier
drops), so P's packets to D die on the link. With this side's end down, the route went with it
and P's packets to ``10.77.N.2`` took the host's default route off the machine; the gateway's
"fragmentation needed" left a PMTU exception ``10.77.N.2 via <gateway> dev eth0 mtu 1400`` for
10 minutes (``ip route show cache``). UCX's TCP route check takes the longest prefix over every
route it dumped, exceptions included, once per process: every NIXL writer started in those 10
minutes refused D's address ("no route to 10.77.N.2"), the fault table's partition-long row
after the other partition rows on NIXL (0/40 done in about one run in three).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

CLONE_NEWNET = 0x40000000


def run_ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS`` (iproute2), its output captured; raises on failure when ``check``."""
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=10)


def unavailable() -> str:
    """"" when namespaces and veth pairs can be made here, else why not."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"lw-probe-{os.getpid()}"
    r = run_ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    run_ip("netns", "del", probe, check=False)
    return ""


class Partition:
    """A namespace for the decoder, a veth pair to it, and a switch to cut the link."""

    def __init__(self, index: int | None = None) -> None:
        n = (os.getpid() % 200) + 20 if index is None else index
        self.name = f"lw-d-{os.getpid()}"
        # both ends have one name (each in its own namespace): UCX lists devices by the names in
        # /sys/class/net, which shows this namespace's even to the decoder (see workers.ucx_env)
        self.host_if = self.ns_if = f"lwp{os.getpid() % 100000}"
        self.host_ip, self.ns_ip = f"10.77.{n}.1", f"10.77.{n}.2"
        self.cut = False
        self._made = False

    def __enter__(self) -> Partition:
        why = unavailable()
        if why:
            raise OSError(f"network namespaces unavailable: {why}")
        try:
            run_ip("netns", "add", self.name)
            self._made = True
            run_ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if,
                   "netns", self.name)
            # no IPv6 link-local addresses (nor their neighbour discovery): nothing but the two
            # 10.77.N.x addresses on this link
            run_ip("link", "set", self.host_if, "addrgenmode", "none")
            run_ip("-n", self.name, "link", "set", self.ns_if, "addrgenmode", "none")
            run_ip("addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
            run_ip("link", "set", self.host_if, "up")
            run_ip("-n", self.name, "addr", "add", f"{self.ns_ip}/24", "dev", self.ns_if)
            run_ip("-n", self.name, "link", "set", self.ns_if, "up")
            run_ip("-n", self.name, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as exc:
            self.__exit__()
            raise OSError(f"could not set up the partition network: {exc.stderr.strip()}") from exc
        return self

    def partition(self) -> None:
        """Cut the link: nothing passes between P and D until :meth:`heal` (the decoder's end
        goes down; this side keeps its route, so nothing leaves the host: module docstring)."""
        run_ip("-n", self.name, "link", "set", self.ns_if, "down")
        self.cut = True

    def heal(self) -> None:
        """Restore the link."""
        run_ip("-n", self.name, "link", "set", self.ns_if, "up")
        self.cut = False

    def __exit__(self, *exc: object) -> None:
        run_ip("link", "del", self.host_if, check=False)  # removes both ends
        if self._made:
            run_ip("netns", "del", self.name, check=False)
            self._made = False


def enter(name: str) -> None:
    """Move the calling thread (and the threads it starts later) into namespace ``name``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)
