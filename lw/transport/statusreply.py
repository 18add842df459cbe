"""What a worker answers ``lw status``: its live requests, newest timeline entries and counters,
trimmed to fit one side-channel message."""

from __future__ import annotations

import time
from typing import Any

from lw.contract.transfer_ids import is_sub_transfer_of
from lw.fsm.failures import Failure
from lw.transport.wire import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    FirstTokenStatus,
    StatusReply,
    TimelineEntry,
    encode,
)

__all__ = ["REFUSED", "RETRY_IN", "of_transfer", "refusal_reply", "status_reply"]

# Counters of a refused query's short answer (see refusal_reply): ``lw status`` tells a
# refusal from a worker with nothing live by the first.
REFUSED = "status.refused"
RETRY_IN = "status.retry_in_s"


def of_transfer(ring: Any, req_id: str) -> list:
    """The entries of ``ring`` about ``req_id`` or, for a proxy's transfer id, about its
    sub-transfers (``<transfer id>@<request>``): batch milestones (tuples of ids) included."""
    if "@" in req_id:
        return [e for e in ring if e[1] == req_id or (type(e[1]) is tuple and req_id in e[1])]
    key = req_id[:16]  # every sub-transfer id starts so: a C-level test first (a full ring)

    def mine(r: str) -> bool:
        return r.startswith(key) and (r == req_id or is_sub_transfer_of(r, req_id))

    return [e for e in ring if (type(r := e[1]) is str and r.startswith(key) and mine(r))
            or (type(r) is tuple and any(map(mine, r)))]


def _rows(endpoint: Any, now: float, req_id: str) -> list:
    """The live rows asked for: every request, ``req_id``, or (a transfer id: what the proxy and
    its clients know) the live sub-transfers of it."""
    rows = endpoint.status(now, req_id)
    if rows or not req_id or "@" in req_id:
        return rows
    subs = [r for r in endpoint.live_requests() if is_sub_transfer_of(r, req_id)]
    return [row for r in subs[:64] for row in endpoint.status(now, r)]


def status_reply(endpoint: Any, role: str, loop_counters: dict[str, int | float], now: float,
                 req_id: str = "", timeline: int = 0,
                 first_token: FirstTokenStatus | None = None) -> StatusReply:
    """``endpoint``'s live requests (or one request or transfer: see :func:`of_transfer`), its
    newest ``timeline`` entries and the counters of the core and its loop, halved (newest
    entries kept) until the reply fits a message; ``first_token``: its engine's first-token
    mode and counts (a few hundred bytes), as its connector last relayed them."""
    wall = time.time()  # taken with ``now``: together they place timeline times
    rows = _rows(endpoint, now, req_id)
    entries: list = []
    if timeline:
        if req_id:
            # a transfer's failure is asked about once it ended, when only the ring remembers it
            src = of_transfer(endpoint.timeline, req_id)
        else:
            src = endpoint.timeline.last(timeline)
        # a D ``fail`` event's detail is a Failure: its words, and its kind beside them
        entries = [TimelineEntry(t, [r] if isinstance(r, str) else list(r), ev, a, b,
                                 str(d)[:1024], d.kind if type(d) is Failure else None)
                   for t, r, ev, a, b, d in src[-timeline:]]
    counters = {f"loop.{k}": float(v) for k, v in loop_counters.items()}
    counters.update({f"core.{k}": float(v) for k, v in endpoint.counters.items()})
    truncated = False
    while True:
        reply = StatusReply(PROTOCOL_VERSION, endpoint.me, role, now, wall, rows, entries,
                            counters, truncated, first_token)
        if len(encode(reply)) <= MAX_MESSAGE_BYTES - 4096 or not (rows or entries):
            return reply
        truncated = True
        if len(entries) > len(rows):
            entries = entries[len(entries) // 2:]  # keep the newest
        else:
            rows = rows[: len(rows) // 2]


def refusal_reply(me: Any, role: str, now: float, retry_in_s: float) -> StatusReply:
    """The short answer to a query the worker's status budget refused: no rows or entries,
    ``truncated``, and counters saying it was refused and when to ask again."""
    return StatusReply(PROTOCOL_VERSION, me, role, now, time.time(), [], [],
                       {REFUSED: 1.0, RETRY_IN: round(retry_in_s, 3)}, True)
