"""Warnings of what a worker's core refused (a part of :class:`lw.transport.runtime.WorkerLoop`):
at most one line per interval, naming the last refusal and counting those since the last line.

A ``ProtocolError`` from the core (an AbortAck for a request this worker never had, a DONE from a
sender D never accepted) is a peer's mistake or an attack: an operator must see it, with the
message, the request and the peer, but a flood of them must not flood the log (as the side
channel's frame refusals).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lw.transport.sidechannel import Inbound

__all__ = ["WARN_INTERVAL_S", "RefusalLog"]

WARN_INTERVAL_S = 10.0


def _short(text: str, n: int = 200) -> str:
    # peers choose request ids and addresses: bounded in a log line
    return text if len(text) <= n else text[: n - 1] + "\u2026"


class RefusalLog:
    """The core's refusals of one loop: the first after a quiet interval is logged at once, the
    rest are tallied (by what was refused) and logged as one line once the interval is over."""

    def __init__(self, log: logging.Logger, name: str, interval_s: float = WARN_INTERVAL_S
                 ) -> None:
        self._log = log
        self._name = name
        self._interval = interval_s
        self._warn_at = float("-inf")  # before this, refusals are only tallied
        self._tally: dict[str, int] = {}  # what was refused -> how often since the last line
        self._last = ""

    def note(self, what: str, req_id: str, ib: Inbound | None, why: str, now: float) -> None:
        """One refusal of ``what`` (a message type or an event) about ``req_id``, of the message
        ``ib`` (None: not a peer's); logged now if no line went out within the interval."""
        kind = what.split(" ", 1)[0]  # "timer <key>" counts as "timer": a bounded line
        self._tally[kind] = self._tally.get(kind, 0) + 1
        peer = ""
        if ib is not None:  # the connection it came back on, else the sender it names
            origin = getattr(ib.msg, "sender", None) or getattr(ib.msg, "responder", None)
            peer = ib.peer or (origin.addr if origin is not None else "")
        src = f" from {_short(peer)!r}" if peer else ""
        self._last = f"{what} about request {_short(req_id)!r}{src}: {_short(why, 400)}"
        if now >= self._warn_at:
            self.flush(now)

    def tick(self, now: float) -> None:
        """Log what was tallied once the interval is over (every loop turn)."""
        if self._tally and now >= self._warn_at:
            self.flush(now)

    def flush(self, now: float) -> None:
        """Log the refusals tallied since the last line, if any, now."""
        if not self._tally:
            return
        tally, self._tally = self._tally, {}
        self._warn_at = now + self._interval
        self._log.warning(
            "%s: the core refused %d message(s) or event(s) (%s), the last one: %s; at most one "
            "such warning per %gs", self._name, sum(tally.values()),
            ", ".join(f"{k} {v}" for k, v in sorted(tally.items())), self._last, self._interval)
