"""What the proxy saw of each recent transfer, with wall-clock times (``GET /lw/timeline``).

Milestones: ``received`` (client request in), ``d_sent`` (forwarded to D), ``meta_posted`` (D's
metaserver call, per sub-transfer), ``p_sent`` / ``p_done`` (the prefill request to P and its
answer), ``first_token`` (the first body bytes from D relayed to the client) and ``end``. With
lw's own lifecycle events (``lw status``) they say where a request's time goes
(:mod:`lw.ops.phases`). Bounded: the oldest transfers are forgotten.
"""

from __future__ import annotations

import time
from collections import OrderedDict


class ProxyTimeline:
    """Milestones of the newest ``capacity`` transfers and sub-transfers (first time wins)."""

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._capacity = capacity
        self._events: OrderedDict[str, dict[str, float]] = OrderedDict()

    def mark(self, transfer_id: str, event: str, t: float | None = None) -> None:
        """Record ``event`` for a transfer (or sub-transfer) unless it is already recorded."""
        ev = self._events.get(transfer_id)
        if ev is None:
            ev = self._events[transfer_id] = {}
            while len(self._events) > self._capacity:
                self._events.popitem(last=False)
        ev.setdefault(event, time.time() if t is None else t)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """A copy: transfer id -> event -> wall time."""
        return {k: dict(v) for k, v in self._events.items()}
