"""Routes that make UCX refuse a peer: the netlink dump's parser, the longest-prefix rule, and
the kernel's own routes on a veth pair (root, iproute2)."""

from __future__ import annotations

import ipaddress
import os
import select
import socket
import struct
import subprocess
import time
from collections.abc import Iterator

import pytest

from lw.transport.dataplane import Completion
from lw.transport.dataplane.routes import (
    Route,
    dump_routes,
    outranking_routes,
    parse_routes,
    pinned_devices,
    ucx_route_refusal,
)


def _attr(kind: int, value: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(value), kind) + value
    return raw + bytes(-len(raw) % 4)


def _route(dst: str, dst_len: int, oif: int, gateway: str = "", cloned: bool = False) -> bytes:
    body = struct.pack("=BBBBBBBBI", socket.AF_INET, dst_len, 0, 0, 254, 2, 0, 1,
                       0x200 if cloned else 0)
    if dst_len:
        body += _attr(1, socket.inet_aton(dst))
    body += _attr(4, struct.pack("=i", oif))
    if gateway:
        body += _attr(5, socket.inet_aton(gateway))
    return struct.pack("=IHHII", 16 + len(body), 24, 2, 1, 0) + body


DONE = struct.pack("=IHHII", 20, 3, 2, 1, 0) + bytes(4)


def test_a_dump_datagram_parses_into_routes_and_says_when_the_dump_ended() -> None:
    data = (_route("0.0.0.0", 0, 4, "192.0.2.1") + _route("10.77.5.0", 24, 7)
            + _route("10.77.5.2", 32, 4, "192.0.2.1", cloned=True))
    routes, done = parse_routes(data)
    assert not done
    assert routes == [
        Route(ipaddress.IPv4Network("0.0.0.0/0"), 4, "192.0.2.1"),
        Route(ipaddress.IPv4Network("10.77.5.0/24"), 7),
        Route(ipaddress.IPv4Network("10.77.5.2/32"), 4, "192.0.2.1", cloned=True),
    ]
    assert parse_routes(_route("10.77.5.0", 24, 7) + DONE) == (
        [Route(ipaddress.IPv4Network("10.77.5.0/24"), 7)], True)


def test_malformed_datagrams_end_the_parse_and_a_kernel_error_is_raised() -> None:
    whole = _route("10.77.5.0", 24, 7)
    assert parse_routes(whole[:-3]) == ([], True)  # truncated: nothing half-read
    assert parse_routes(struct.pack("=IHHII", 8, 24, 0, 0, 0)) == ([], True)  # length < header
    error = struct.pack("=IHHII", 36, 2, 0, 1, 0) + struct.pack("=i", -1) + bytes(16)
    with pytest.raises(ValueError, match="errno 1"):
        parse_routes(error)


def test_a_longer_prefix_on_another_interface_outranks_the_pinned_one() -> None:
    lo = socket.if_nametoindex("lo")
    table = [Route(ipaddress.IPv4Network("10.77.5.0/24"), lo),
             Route(ipaddress.IPv4Network("10.77.5.2/32"), 999_999, "192.0.2.1", cloned=True),
             Route(ipaddress.IPv4Network("0.0.0.0/0"), 999_999, "192.0.2.1")]
    assert outranking_routes("10.77.5.2", "lo", table) == [
        "10.77.5.2/32 via 192.0.2.1 dev ifindex 999999 (a PMTU exception: ip route show cache)"]
    assert outranking_routes("10.77.5.3", "lo", table) == []  # the /24 is the longest
    assert outranking_routes("10.77.5.2", "no-such-if0", table) == []
    assert outranking_routes("not an address", "lo", table) == []


def test_only_named_network_interfaces_count_as_pinned() -> None:
    assert pinned_devices(None) == [] and pinned_devices("all") == [] and pinned_devices("") == []
    assert pinned_devices("eth0, lwp1,mlx5_0:1") == ["eth0", "lwp1"]
    assert ucx_route_refusal("10.77.5.2", None) == ""


def test_the_kernel_dump_holds_loopback() -> None:
    lo = socket.if_nametoindex("lo")
    assert any(r.oif == lo and ipaddress.IPv4Address("127.0.0.1") in r.dst for r in dump_routes())


def _veth_missing() -> str:
    from lw.lab.synthetic.netns import unavailable

    return unavailable()


@pytest.fixture
def veth_pair() -> Iterator[tuple[str, str]]:
    """Two ends of a veth pair, both in this namespace: ``a`` holds 10.77.N.1/24 and ``b``
    holds 10.77.N.2/32, a local address whose /32 outranks ``a``'s /24 (nothing is sent)."""
    n = os.getpid() % 200 + 20
    a, b = f"lwra{os.getpid() % 10000}", f"lwrb{os.getpid() % 10000}"

    def ip(*args: str, check: bool = True) -> None:
        subprocess.run(["ip", *args], check=check, capture_output=True, timeout=10)

    try:
        ip("link", "add", a, "type", "veth", "peer", "name", b)
        for dev in (a, b):
            ip("link", "set", dev, "addrgenmode", "none")
        ip("addr", "add", f"10.77.{n}.1/24", "dev", a)
        ip("addr", "add", f"10.77.{n}.2/32", "dev", b)
        ip("link", "set", a, "up")
        ip("link", "set", b, "up")
        yield a, b
    finally:
        ip("link", "del", a, check=False)


@pytest.mark.skipif(bool(_veth_missing()), reason=f"no veth pairs: {_veth_missing()}")
def test_the_kernel_routes_of_a_veth_pair_name_what_outranks_the_pinned_end(
        veth_pair: tuple[str, str]) -> None:
    a, b = veth_pair
    n = os.getpid() % 200 + 20
    why = ucx_route_refusal(f"10.77.{n}.2", a)
    assert f"10.77.{n}.2/32 dev {b} outranks {a}'s route to 10.77.{n}.2" in why, why
    assert "ip route flush cache" in why
    assert ucx_route_refusal(f"10.77.{n}.3", a) == ""  # a's /24 is the longest there
    assert ucx_route_refusal(f"10.77.{n}.3", b).startswith(f"{b} has no route to 10.77.{n}.3")


def _nixl_missing() -> str:
    from lw.transport.dataplane.nixl import nixl_missing

    return nixl_missing()


@pytest.mark.skipif(bool(_veth_missing() or _nixl_missing()),
                    reason=f"no veth pairs or NIXL: {_veth_missing() or _nixl_missing()}")
def test_a_nixl_first_contact_refused_by_the_routes_names_them(
        veth_pair: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A listener that answers at D's address but yields no metadata, with UCX pinned to the
    end whose route is outranked: the failure names the outranking route, not a guess."""
    import numpy as np

    from lw.transport.dataplane.nixl import NixlDataPlane

    a, b = veth_pair
    d_ip = f"10.77.{os.getpid() % 200 + 20}.2"
    monkeypatch.setenv("UCX_TLS", "tcp")
    plane = NixlDataPlane("127.0.0.1", connect_timeout_s=0.3)
    src = np.zeros(1 << 16, dtype=np.uint8)
    try:
        plane.register_memory(src.ctypes.data, src.nbytes)
        monkeypatch.setenv("UCX_NET_DEVICES", a)
        with socket.create_server((d_ip, 0)) as mute:
            plane.submit("x", f"lw-nobody@{d_ip}:{mute.getsockname()[1]}",
                         [(src.ctypes.data, 1 << 20, 16)])
            got: list[Completion] = []
            deadline = time.monotonic() + 10.0
            while not got and time.monotonic() < deadline:
                select.select([plane.fileno()], [], [], 0.5)
                got += plane.poll()
        [c] = got
        assert not c.ok and not c.in_doubt, c
        assert "the listener answered, but UCX cannot reach" in c.reason, c.reason
        assert f"{d_ip}/32 dev {b} outranks {a}'s route" in c.reason, c.reason
    finally:
        plane.close()
