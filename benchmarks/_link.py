"""A shaped network link for benchmarks: a network namespace behind a veth pair.

``Link.create()`` makes a network namespace (``ip netns``) and a veth pair with one end in it:
the root side gets ``10.78.K.1/24``, the namespace side ``10.78.K.2/24`` (K is the first /24 of
10.78 not yet on an interface here). A server started with ``link.wrap(argv)`` runs in the
namespace and is reached at ``link.ns_addr``; it reaches the root namespace at
``link.root_addr``. ``link.set_rate(bits_per_s)`` caps the root -> namespace direction (the
root side's egress) with tbf: ``tc qdisc replace dev <veth> root tbf rate R burst <R x 5 ms>
latency 200ms`` (netem is not needed); ``None`` removes the cap. ``link.goodput()`` measures
TCP goodput root -> namespace with Python sockets.

The namespace and the veth pair go away on ``close()``, at the end of a ``with`` block (also on
an exception), at interpreter exit (``atexit``) and on SIGTERM/SIGHUP (turned into
``SystemExit`` so that ``finally`` blocks run). Namespaces left by a run that was killed with
SIGKILL are removed by the next ``Link.create()`` (their name carries the owner's pid).

Needs root and iproute2 (``ip``, ``tc``); :func:`missing_requirements` says what is missing.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from lw.lab.synthetic.netns import enter

__all__ = ["Link", "missing_requirements", "close_all"]

SUBNET = "10.78"  # the /16 the links' /24s come from
NS_PREFIX = "lwlink"
BURST_S = 0.005  # tbf bucket: 5 ms at the rate
MIN_BURST = 16 * 1024  # bytes; a bucket below one packet would drop everything
LATENCY = "200ms"  # tbf queue: at most this long a wait before a drop

_live: dict[str, Link] = {}
_lock = threading.Lock()
_counter = itertools.count()
_hooks_installed = False

T = TypeVar("T")


def missing_requirements() -> str:
    """Why this process cannot make links ("" when it can): root and ``ip``/``tc`` needed."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and tc qdiscs)"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"needs {' and '.join(missing)} (Debian: apt-get install iproute2)"
    return ""


def _run(*argv: str, check: bool = True) -> str:
    """Run an ``ip``/``tc`` command; RuntimeError with its stderr when it fails and ``check``."""
    r = subprocess.run(argv, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout


def in_netns(ns: str, fn: Callable[[], T]) -> T:
    """``fn()`` run in a fresh thread that entered network namespace ``ns`` (setns(2) changes
    only the calling thread's namespace); sockets it creates stay in ``ns``."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            enter(ns)
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            out["error"] = exc

    t = threading.Thread(target=body, name=f"netns-{ns}", daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]  # type: ignore[no-any-return]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete this module's namespaces whose owner process is gone (a SIGKILLed run)."""
    gone = []
    for line in _run("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{NS_PREFIX}-(\d+)-\d+", name)
        if m and not _pid_alive(int(m.group(1))):
            _run("ip", "netns", "del", name, check=False)
            gone.append(name)
    return gone


def _used_subnets() -> set[int]:
    """The K of every 10.78.K.x address on an interface of the root namespace."""
    used = set()
    for m in re.finditer(rf"inet {re.escape(SUBNET)}\.(\d+)\.", _run("ip", "-4", "-o", "addr")):
        used.add(int(m.group(1)))
    return used


def _install_hooks() -> None:
    """atexit + SIGTERM/SIGHUP -> SystemExit (so ``finally`` blocks stop servers and links)."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(close_all)
    if threading.current_thread() is not threading.main_thread():
        return

    def to_exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, to_exit)


def close_all() -> None:
    """Close every link this process still holds."""
    for link in list(_live.values()):
        link.close()


@dataclass
class Link:
    """One namespace and veth pair; the root -> namespace direction optionally capped."""

    ns: str  # network namespace name (``ip netns``)
    root_dev: str  # veth end in the root namespace (the shaped one)
    ns_dev: str  # veth end in the namespace
    root_addr: str  # address of root_dev, reachable from the namespace
    ns_addr: str  # address of ns_dev, reachable from the root namespace
    rate_bps: float | None = None  # current tbf rate, bit/s (None: uncapped)
    closed: bool = False

    @classmethod
    def create(cls, rate_bps: float | None = None) -> Link:
        """Make the namespace and veth pair (and cap it when ``rate_bps`` is given)."""
        why = missing_requirements()
        if why:
            raise RuntimeError(f"a shaped link {why}")
        _install_hooks()
        remove_stale()
        with _lock:
            n = next(_counter)
            used = _used_subnets() | {int(ipaddress.ip_address(link.root_addr).packed[2])
                                      for link in _live.values()}
            start = os.getpid() % 200 + 1
            k = next((k for k in (*range(start, 255), *range(1, start)) if k not in used), None)
            if k is None:
                raise RuntimeError(f"no free /24 left in {SUBNET}.0.0/16")
            tag = f"{os.getpid():x}{n}"
            link = cls(ns=f"{NS_PREFIX}-{os.getpid()}-{n}", root_dev=f"lwr{tag}"[:15],
                       ns_dev=f"lwn{tag}"[:15], root_addr=f"{SUBNET}.{k}.1",
                       ns_addr=f"{SUBNET}.{k}.2")
            _live[link.ns] = link
        try:
            _run("ip", "netns", "add", link.ns)
            _run("ip", "link", "add", link.root_dev, "type", "veth", "peer", "name", link.ns_dev)
            _run("ip", "link", "set", link.ns_dev, "netns", link.ns)
            _run("ip", "addr", "add", f"{link.root_addr}/24", "dev", link.root_dev)
            _run("ip", "link", "set", link.root_dev, "up")
            ns = ("ip", "netns", "exec", link.ns)
            _run(*ns, "ip", "addr", "add", f"{link.ns_addr}/24", "dev", link.ns_dev)
            _run(*ns, "ip", "link", "set", link.ns_dev, "up")
            _run(*ns, "ip", "link", "set", "lo", "up")  # vLLM's processes talk over loopback
            if rate_bps is not None:
                link.set_rate(rate_bps)
        except BaseException:
            link.close()
            raise
        return link

    # ---------------------------------------------------------------------------- shaping
    def set_rate(self, rate_bps: float | None) -> None:
        """Cap root -> namespace at ``rate_bps`` bit/s with tbf (replacing the cap); ``None``
        removes it."""
        if rate_bps is None:
            _run("tc", "qdisc", "del", "dev", self.root_dev, "root", check=False)
        else:
            rate = int(rate_bps)
            if rate < 8000:
                raise ValueError(f"rate {rate_bps} bit/s is below tbf's useful range")
            burst = max(int(rate / 8 * BURST_S), MIN_BURST)
            _run("tc", "qdisc", "replace", "dev", self.root_dev, "root", "tbf", "rate",
                 f"{rate}bit", "burst", str(burst), "latency", LATENCY)
        self.rate_bps = None if rate_bps is None else float(int(rate_bps))

    def qdisc(self) -> str:
        """``tc qdisc show`` of the shaped end (for reports)."""
        return _run("tc", "qdisc", "show", "dev", self.root_dev).strip()

    # ---------------------------------------------------------------------------- use
    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def free_in_ns(self, port: int) -> bool:
        """Whether TCP ``port`` can be bound inside the namespace right now."""

        def probe() -> bool:
            with socket.socket() as s:
                try:
                    s.bind(("0.0.0.0", port))
                except OSError:
                    return False
                return True

        return in_netns(self.ns, probe)

    def goodput(self, seconds: float = 1.0, chunk: int = 256 * 1024) -> float:
        """TCP goodput root -> namespace in bytes/s: one connection from the root namespace to a
        listener in the namespace, sending for ``seconds``; measured at the receiver from its
        first to its last byte (the first read, one tbf bucket at most, is not counted)."""
        srv = in_netns(self.ns, lambda: socket.create_server((self.ns_addr, 0)))
        port = srv.getsockname()[1]
        got: dict[str, Any] = {}

        def receive() -> None:
            try:
                srv.settimeout(10.0)
                conn, _ = srv.accept()
                with conn:
                    conn.settimeout(seconds + 30.0)
                    buf = bytearray(1 << 20)
                    total = first = 0
                    t_first = t_last = 0.0
                    while True:
                        k = conn.recv_into(buf)
                        if not k:
                            break
                        now = time.perf_counter()
                        if not first:
                            first, t_first = k, now
                        total += k
                        t_last = now
                    got.update(total=total, first=first, span=t_last - t_first)
            except OSError as exc:
                got["error"] = exc
            finally:
                srv.close()

        t = threading.Thread(target=receive, name="goodput-rx", daemon=True)
        t.start()
        payload = bytes(chunk)
        with socket.create_connection((self.ns_addr, port), timeout=10.0) as c:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                c.sendall(payload)
        t.join(seconds + 40.0)
        if "error" in got:
            raise RuntimeError(f"goodput measurement failed: {got['error']}")
        if got.get("span", 0.0) <= 0.0:
            raise RuntimeError("goodput measurement got no data")
        return (got["total"] - got["first"]) / got["span"]

    def pids(self) -> list[int]:
        """Processes running inside the namespace."""
        out = _run("ip", "netns", "pids", self.ns, check=False)
        return [int(p) for p in out.split() if p.isdigit()]

    # ---------------------------------------------------------------------------- teardown
    def close(self) -> None:
        """Kill what still runs in the namespace (only this link's servers run there), then
        delete the veth pair and the namespace. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        _run("ip", "link", "del", self.root_dev, check=False)  # takes its peer along
        _run("ip", "netns", "del", self.ns, check=False)
        _live.pop(self.ns, None)

    def exists(self) -> bool:
        """Whether the namespace or the root-side veth still exists."""
        names = [ln.split()[0] for ln in _run("ip", "netns", "list").splitlines() if ln.split()]
        dev = subprocess.run(["ip", "link", "show", self.root_dev], capture_output=True)
        return self.ns in names or dev.returncode == 0

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> str:
        """One line: addresses and cap."""
        cap = "uncapped" if self.rate_bps is None else f"tbf {self.rate_bps / 1e6:.1f} Mbit/s"
        return f"{self.root_addr} (root) -> {self.ns_addr} (netns {self.ns}), {cap}"
