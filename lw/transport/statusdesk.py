"""A worker loop's answers to ``lw status`` (a part of :class:`lw.transport.runtime.WorkerLoop`),
kept within a budget: diagnostics never starve the protocol nor queue unbounded memory.

A full answer to ``StatusQuery(timeline=100000)`` costs the loop thread tens of milliseconds and
about 1 MiB of send queue; ZMQ queues up to 10,000 replies per connection for an asker that never
reads. So answers may take only a share of the loop's time (a bucket of loop seconds, charged
with what each answer took: what costs the loop is time, and a narrow question is cheap), a query
over that budget gets a short refusal, and one connection gets a few answers in its life, after
which its queries are dropped: ``lw status`` asks once per connection, and an asker that never
reads then holds at most ``per_route`` replies of at most 1 MiB each. The loop answers the status
queries of a turn after its protocol messages, completions and timers.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable
from typing import TYPE_CHECKING, Protocol

from lw.transport.statusreply import refusal_reply
from lw.transport.wire import Sender, StatusQuery, StatusReply

if TYPE_CHECKING:
    from lw.transport.sidechannel import Inbound, SideChannel

__all__ = ["ANSWER", "DROP", "REFUSE", "StatusGate", "StatusLoop", "answer"]

ANSWER, REFUSE, DROP = "answer", "refuse", "drop"
ROUTES = 4096  # connections whose answers are remembered (least recently asking forgotten first)
_MAX_RETRY_S = 3600.0


class StatusLoop(Protocol):
    """What answering needs of its :class:`~lw.transport.runtime.WorkerLoop` (not imported:
    it imports this module)."""

    status_gate: StatusGate
    counters: dict[str, int | float]
    side: SideChannel
    role: str  # "prefill" or "decode"

    @property
    def me(self) -> Sender:
        """This worker's identity."""

    def now(self) -> float:
        """The loop's clock."""

    def status_reply(self, req_id: str = "", timeline: int = 0) -> StatusReply:
        """This worker's answer to a status query."""

    def core_error(self, what: str, exc: Exception, ib: Inbound | None = None) -> None:
        """The core raised on ``what``: counted and logged."""


class StatusGate:
    """Decides each status query: answer it, refuse it with a short answer, or drop it.

    Answers may use ``share`` of the loop thread's time on average and ``burst_s`` at once;
    each connection (route) gets at most ``per_route`` answers or refusals."""

    def __init__(self, share: float, burst_s: float, per_route: int, routes: int = ROUTES
                 ) -> None:
        self._share = share
        self._burst = burst_s
        self._per_route = per_route
        self._max_routes = routes
        self._level = burst_s  # loop seconds answers may still take now; below 0: a debt
        self._at: float | None = None  # when the level was last refilled
        self._routes: OrderedDict[Hashable, int] = OrderedDict()  # route -> answers given

    def admit(self, route: Hashable, now: float) -> str:
        """ANSWER, REFUSE (over the time budget) or DROP (the route had its share)."""
        given = self._routes.pop(route, 0)
        self._routes[route] = min(given + 1, self._per_route)  # newest last
        if len(self._routes) > self._max_routes:
            self._routes.popitem(last=False)
        if given >= self._per_route:
            return DROP
        if self._at is not None and now > self._at:
            self._level = min(self._burst, self._level + (now - self._at) * self._share)
        self._at = now if self._at is None else max(self._at, now)
        return ANSWER if self._level > 0 else REFUSE

    def charge(self, seconds: float) -> None:
        """An answer took ``seconds`` of the loop thread."""
        self._level -= seconds

    def retry_in(self) -> float:
        """Seconds until the budget answers again (at most an hour)."""
        if self._level > 0:
            return 0.0
        if self._share <= 0:
            return _MAX_RETRY_S
        return min(_MAX_RETRY_S, -self._level / self._share)


def answer(loop: StatusLoop, queries: list[Inbound]) -> None:
    """Answer, refuse or drop each status query of a turn, in order, under ``loop``'s gate."""
    gate = loop.status_gate
    c = loop.counters
    for ib in queries:
        c["status_queries"] += 1
        q = ib.msg
        assert isinstance(q, StatusQuery)
        # the asker's connection; for a query that came back on our own DEALER, that peer
        route = ib.route if ib.route is not None else (ib.peer or q.asker)
        now = loop.now()
        verdict = gate.admit(route, now)
        if verdict == DROP:
            c["status_dropped"] += 1  # nothing queued for a connection that had its share
            continue
        if verdict == REFUSE:
            c["status_refused"] += 1
            loop.side.reply(ib, q.asker, refusal_reply(loop.me, loop.role, now, gate.retry_in()))
            continue
        started = time.perf_counter()
        try:
            reply = loop.status_reply(q.req_id, q.timeline)
        except Exception as exc:
            loop.core_error("status", exc)
        else:
            loop.side.reply(ib, q.asker, reply)
        gate.charge(time.perf_counter() - started)
