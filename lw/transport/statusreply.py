"""What a worker answers ``lw status``: its live requests, newest timeline entries and counters,
trimmed to fit one side-channel message."""

from __future__ import annotations

import time
from typing import Any

from lw.transport.wire import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    StatusReply,
    TimelineEntry,
    encode,
)

__all__ = ["status_reply"]


def status_reply(endpoint: Any, role: str, loop_counters: dict[str, int | float], now: float,
                 req_id: str = "", timeline: int = 0) -> StatusReply:
    """``endpoint``'s live requests (or one), its newest ``timeline`` entries and the counters of
    the core and its loop, halved (newest entries kept) until the reply fits a message."""
    wall = time.time()  # taken with ``now``: together they place timeline times
    rows = endpoint.status(now, req_id)
    entries: list = []
    if timeline:
        src = endpoint.timeline.of(req_id) if req_id else endpoint.timeline.last(timeline)
        entries = [TimelineEntry(t, [r] if isinstance(r, str) else list(r), ev, a, b,
                                 str(d)[:1024])
                   for t, r, ev, a, b, d in src[-timeline:]]
    counters = {f"loop.{k}": float(v) for k, v in loop_counters.items()}
    counters.update({f"core.{k}": float(v) for k, v in endpoint.counters.items()})
    truncated = False
    while True:
        reply = StatusReply(PROTOCOL_VERSION, endpoint.me, role, now, wall, rows, entries,
                            counters, truncated)
        if len(encode(reply)) <= MAX_MESSAGE_BYTES - 4096 or not (rows or entries):
            return reply
        truncated = True
        if len(entries) > len(rows):
            entries = entries[len(entries) // 2:]  # keep the newest
        else:
            rows = rows[: len(rows) // 2]
