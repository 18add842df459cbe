"""Ask live lw workers what their requests are doing (the client side of ``lw status``).

A :class:`StatusQuery` goes to each worker over the same authenticated side channel the
protocol uses; each worker answers from its own loop thread with a :class:`StatusReply`. A worker
that does not answer in time (frozen, dead, wrong key, wrong address) is reported by address,
never waited for beyond the timeout.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from lw.fsm.messages import MAX_TIMELINE, PROTOCOL_VERSION, StatusQuery, StatusReply
from lw.transport.sidechannel import SideChannel, parse_cluster_key
from lw.transport.statusreply import REFUSED, RETRY_IN

__all__ = ["MAX_TIMELINE", "Snapshot", "expand_addrs", "query", "workers_from_proxy"]

_RANGE = re.compile(r"^(?P<scheme>tcp://)?(?P<host>[^:/]+|\[[^\]]+\]):(?P<lo>\d+)(-(?P<hi>\d+))?$")


@dataclass
class Snapshot:
    """What the workers said at one moment: their replies, and who did not answer (and why)."""

    replies: list[StatusReply] = field(default_factory=list)
    silent: dict[str, str] = field(default_factory=dict)  # address -> why there is no reply
    asked_at: float = 0.0  # wall clock

    def reply_of(self, addr: str) -> StatusReply | None:
        """The reply of the worker listening at ``addr``."""
        for r in self.replies:
            if r.worker.addr == addr:
                return r
        return None


def expand_addrs(specs: list[str]) -> list[str]:
    """Worker addresses from ``tcp://host:port``, ``host:port`` or ``host:lo-hi`` (a range),
    comma separated or repeated; ValueError naming a malformed entry."""
    out: list[str] = []
    for spec in specs:
        for part in filter(None, (p.strip() for p in spec.split(","))):
            m = _RANGE.match(part)
            if m is None:
                raise ValueError(f"bad worker address {part!r}: expected tcp://HOST:PORT or "
                                 "HOST:PORT or HOST:FIRST-LAST")
            lo = int(m["lo"])
            hi = int(m["hi"] or lo)
            if not 0 < lo <= hi < 65536 or hi - lo > 4096:
                raise ValueError(f"bad port range in {part!r}")
            out += [f"tcp://{m['host']}:{port}" for port in range(lo, hi + 1)]
    return list(dict.fromkeys(out))


def query(addrs: list[str], cluster_key: str | bytes | None = None, *, req_id: str = "",
          timeline: int = 0, timeout_s: float = 2.0, bind_host: str = "127.0.0.1") -> Snapshot:
    """Ask every worker at ``addrs`` for its live requests (``req_id``: only that one) and its
    newest ``timeline`` lifecycle events; wait at most ``timeout_s`` in total."""
    snap = Snapshot(asked_at=time.time())
    key = parse_cluster_key(cluster_key)
    with SideChannel(bind_host, 0, cluster_key=key) as side:
        pending: dict[int, str] = {}
        for addr in addrs:
            msg = StatusQuery(PROTOCOL_VERSION, side.addr, req_id, timeline)
            mid = side.send(addr, msg, expect_reply=True)
            if mid:
                pending[mid] = addr
            else:
                snap.silent[addr] = "could not send (bad address or queue full)"
        deadline = time.monotonic() + timeout_s
        while pending and (left := deadline - time.monotonic()) > 0:
            inbound, _ = side.poll(max(1, int(left * 1000)))
            for ib in inbound:
                addr = pending.pop(ib.reply_to, None)
                if addr is None or not isinstance(ib.msg, StatusReply):
                    continue
                if ib.msg.counters.get(REFUSED):
                    # the worker's budget for status answers is spent: it said so, and when
                    retry = ib.msg.counters.get(RETRY_IN, 0.0)
                    snap.silent[addr] = (f"refused: its budget for status answers is spent (a "
                                         f"flood of status queries?); ask again in {retry:.1f}s")
                else:
                    snap.replies.append(ib.msg)
        for addr in pending.values():
            why = f"no answer within {timeout_s:g}s (frozen, dead, not an lw worker"
            snap.silent[addr] = why + (", or another cluster key)" if key else
                                       ", or it needs a cluster key)")
    order = {a: i for i, a in enumerate(addrs)}
    snap.replies.sort(key=lambda r: order.get(r.worker.addr, len(order)))
    return snap


def workers_from_proxy(url: str, timeout_s: float = 2.0) -> list[str]:
    """The P and D workers an lw proxy has seen in its traffic (``GET /lw/workers`` on its control
    port); ValueError saying what went wrong (unreachable, not an lw proxy, nothing seen yet)."""
    endpoint = url.rstrip("/") + "/lw/workers"
    try:
        with urllib.request.urlopen(endpoint, timeout=timeout_s) as resp:
            body = json.loads(resp.read(1 << 20))
    except urllib.error.HTTPError as exc:
        hint = " (the public port? lw status needs the control port)" if exc.code == 404 else ""
        raise ValueError(f"{endpoint}: HTTP {exc.code}{hint}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ValueError(f"{endpoint}: {getattr(exc, 'reason', exc)}") from None
    if not isinstance(body, dict):
        raise ValueError(f"{endpoint}: not an lw proxy's answer")
    addrs = [a for role in ("prefill", "decode") for a in body.get(role) or []
             if isinstance(a, str)]
    if not addrs:
        raise ValueError(f"{endpoint}: the proxy has seen no worker yet (it learns them from "
                         "the requests it relays)")
    return expand_addrs(addrs)
