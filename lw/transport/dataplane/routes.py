"""Why UCX may refuse a peer the kernel routes fine: a longer-prefix route to it on another
interface.

UCX's TCP transport takes an interface for a peer only if that interface's route to the peer
has the longest prefix of every IPv4 route it dumped, PMTU exceptions included, and it dumps
them once per process (``ucs/sys/netlink.c``). With ``UCX_NET_DEVICES`` pinned to the P/D link,
a ``/32`` to D through another interface (a PMTU exception left when D's traffic took the
default route while the link was down, or a host route) makes every endpoint to D fail with
"no route to" while the kernel itself still sends through the link. :func:`outranking_routes`
finds such routes, so a failed first contact can name them.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Route", "dump_routes", "outranking_routes", "parse_routes", "pinned_devices",
           "ucx_route_refusal"]

_NLMSG_DONE, _NLMSG_ERROR = 3, 2
_RTM_NEWROUTE, _RTM_GETROUTE = 24, 26
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_RTA_DST, _RTA_OIF, _RTA_GATEWAY = 1, 4, 5
_RTM_F_CLONED = 0x200
_HDR = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_RTMSG = struct.Struct("=BBBBBBBBI")  # family, dst/src len, tos, table, proto, scope, type, flags
_RTA = struct.Struct("=HH")


@dataclass(frozen=True)
class Route:
    """One IPv4 route of the kernel's dump: destination prefix, output interface index,
    gateway ("" when on-link), and whether it is a cached exception (``ip route show cache``)."""

    dst: ipaddress.IPv4Network
    oif: int
    gateway: str = ""
    cloned: bool = False


def _align(n: int) -> int:
    return (n + 3) & ~3


def parse_routes(data: bytes) -> tuple[list[Route], bool]:
    """The IPv4 routes in one netlink datagram, and whether it ended the dump. Malformed or
    truncated messages end the parse (ValueError for an error message from the kernel)."""
    routes: list[Route] = []
    off = 0
    while off + _HDR.size <= len(data):
        length, kind, _flags, _seq, _pid = _HDR.unpack_from(data, off)
        if length < _HDR.size or off + length > len(data):
            return routes, True
        if kind == _NLMSG_DONE:
            return routes, True
        if kind == _NLMSG_ERROR:
            (err,) = struct.unpack_from("=i", data, off + _HDR.size)
            raise ValueError(f"netlink route dump refused: errno {-err}")
        body = off + _HDR.size
        if kind == _RTM_NEWROUTE and length >= _HDR.size + _RTMSG.size:
            family, dst_len, _s, _t, _table, _p, _scope, _type, flags = _RTMSG.unpack_from(
                data, body)
            dst, oif, gateway = b"", -1, ""
            a = body + _RTMSG.size
            while a + _RTA.size <= off + length:
                rta_len, rta_type = _RTA.unpack_from(data, a)
                if rta_len < _RTA.size:
                    break
                value = data[a + _RTA.size:a + rta_len]
                if rta_type == _RTA_DST and len(value) == 4:
                    dst = value
                elif rta_type == _RTA_OIF and len(value) == 4:
                    (oif,) = struct.unpack("=i", value)
                elif rta_type == _RTA_GATEWAY and len(value) == 4:
                    gateway = socket.inet_ntoa(value)
                a += _align(rta_len)
            if family == socket.AF_INET and oif > 0 and (dst or dst_len == 0):
                net = ipaddress.IPv4Network((dst or bytes(4), dst_len), strict=False)
                routes.append(Route(net, oif, gateway, bool(flags & _RTM_F_CLONED)))
        off += _align(length)
    return routes, False


def dump_routes(timeout_s: float = 1.0) -> list[Route]:
    """Every IPv4 route of this thread's network namespace, every table, exceptions included
    (the dump UCX takes); OSError when netlink cannot be read."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as s:
        s.settimeout(timeout_s)
        s.bind((0, 0))
        req = _RTMSG.pack(socket.AF_INET, 0, 0, 0, 0, 0, 0, 0, 0)
        s.send(_HDR.pack(_HDR.size + len(req), _RTM_GETROUTE, _NLM_F_REQUEST | _NLM_F_DUMP,
                         1, 0) + req)
        routes: list[Route] = []
        done = False
        while not done:
            data = s.recv(1 << 16)
            if not data:
                raise OSError("netlink route dump ended without NLMSG_DONE")
            got, done = parse_routes(data)
            routes += got
        return routes


def outranking_routes(ip: str, device: str, routes: Iterable[Route] | None = None) -> list[str]:
    """Routes to ``ip`` on interfaces other than ``device`` whose prefix is longer than every
    route to ``ip`` through ``device`` (each described as ``ip route`` would), or all routes to
    ``ip`` when ``device`` has none: why UCX pinned to ``device`` refuses ``ip``. [] when
    nothing outranks it or the interface is unknown here."""
    return _outranking(ip, device, list(dump_routes() if routes is None else routes))[1]


def _outranking(ip: str, device: str, table: list[Route]) -> tuple[bool, list[str]]:
    """Whether ``device`` has a route to ``ip``, and the routes that outrank its best one
    (False and [] when ``ip`` or ``device`` is not one here)."""
    try:
        index = socket.if_nametoindex(device)
        addr = ipaddress.IPv4Address(ip)
    except (OSError, ValueError):
        return False, []
    ours = max((r.dst.prefixlen for r in table if r.oif == index and addr in r.dst), default=-1)
    out = []
    for r in table:
        if r.oif != index and addr in r.dst and r.dst.prefixlen > ours:
            try:
                name = socket.if_indextoname(r.oif)
            except OSError:
                name = f"ifindex {r.oif}"
            via = f" via {r.gateway}" if r.gateway else ""
            what = " (a PMTU exception: ip route show cache)" if r.cloned else ""
            out.append(f"{r.dst}{via} dev {name}{what}")
    return ours >= 0, out


def pinned_devices(value: str | None) -> list[str]:
    """The network interfaces a ``UCX_NET_DEVICES`` value pins ([] for unset or ``all``; an
    InfiniBand ``mlx5_0:1`` is not a network interface and is left out)."""
    if not value or value.strip() == "all":
        return []
    return [d.strip() for d in value.split(",") if d.strip() and ":" not in d]


def ucx_route_refusal(ip: str, ucx_net_devices: str | None) -> str:
    """A sentence naming the routes that make UCX, pinned to ``ucx_net_devices``, refuse
    ``ip`` ("" when none do, when nothing is pinned, or when the routes cannot be read)."""
    devices = pinned_devices(ucx_net_devices)
    if not devices:
        return ""
    try:
        table = dump_routes()
    except (OSError, ValueError):
        return ""
    parts = []
    for dev in devices:
        routed, found = _outranking(ip, dev, table)
        if not found:
            continue
        if routed:
            parts.append(f"{', '.join(found)} outrank{'s' if len(found) == 1 else ''} "
                         f"{dev}'s route to {ip}")
        else:
            parts.append(f"{dev} has no route to {ip} (the kernel's: {', '.join(found)})")
    if not parts:
        return ""
    return ("; ".join(parts) + ": UCX takes an interface only where its route has the longest "
            "prefix (ip route flush cache clears PMTU exceptions; then restart this engine, "
            "as UCX read the routes once)")
