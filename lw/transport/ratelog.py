"""The one rate-limited log of what lw refuses or warns about again and again (the core's and the
side channel's refusals, the proxy's, the scheduler's): a flood must not flood the log.

Per kind (a key its owner chooses from a bounded set: a message type, a counter's name), the first
line after a quiet interval goes out at once; the rest are counted, and once the interval is over
one line says how many were left out and shows the last of them. So a flood gives at most two
lines per interval and kind, the second naming the count. Each line names its owner, its kind and,
where known, the request and the peer. Time comes from an injectable clock (or is passed in); the
end-of-interval line is written by :meth:`RateLog.tick`, which the owner's loop calls every turn
(the worker's loop, the side channel's poll, the scheduler's step), or by a ``timer`` the log arms
when it starts counting (the proxy's asyncio loop: :func:`call_later`). One thread per log.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["MAX_KINDS", "WARN_INTERVAL_S", "RateLog", "Received", "call_later", "peer_of"]

WARN_INTERVAL_S = 10.0
"""The default interval: at most two lines per kind within it."""

MAX_KINDS = 64
"""Kinds one log keeps apart; beyond them (a bug: kinds come from bounded sets) the rest share
the kind ``other``."""


_SLACK_S = 0.001  # added to a timer's delay: a timer that fires a little early ticks in vain


def _short(text: str, n: int = 200) -> str:
    """``text`` cut to ``n`` characters: peers choose request ids, addresses and reasons."""
    return text if len(text) <= n else text[: n - 1] + "\u2026"


class Received(Protocol):
    """What :func:`peer_of` reads of a side channel's ``Inbound`` (imported neither way)."""

    @property
    def msg(self) -> object: ...

    @property
    def peer(self) -> str | None: ...


def peer_of(ib: Received | None) -> str | None:
    """The peer of an inbound message: the connection it came on, else the sender it names."""
    if ib is None:
        return None
    origin = getattr(ib.msg, "sender", None) or getattr(ib.msg, "responder", None)
    return ib.peer or (origin.addr if origin is not None else None)


def call_later(delay: float, fn: Callable[[], None]) -> None:
    """A timer on the running asyncio loop (the proxy's); with none, the next line's note
    writes what is due."""
    try:
        asyncio.get_running_loop().call_later(delay, fn)
    except RuntimeError:
        pass


@dataclass
class _Kind:
    """One kind's interval: until when its lines are counted, how many, and the last one."""

    until: float
    since: float  # when its last line went out
    count: int = 0
    last: tuple[str, tuple[object, ...], str | None, str | None] = ("", (), None, None)


class RateLog:
    """Lines of one owner at most twice per interval and kind: the first at once, then one with
    the count of those left out (:meth:`tick`, at the interval's end)."""

    def __init__(self, log: logging.Logger, owner: str, interval_s: float = WARN_INTERVAL_S, *,
                 clock: Callable[[], float] = time.monotonic,
                 timer: Callable[[float, Callable[[], None]], None] | None = None,
                 level: int = logging.WARNING) -> None:
        """``owner`` starts each line; ``clock`` gives the time when a call passes none;
        ``timer(delay, tick)``, if given, is called when a kind starts counting."""
        if not (math.isfinite(interval_s) and interval_s >= 0):
            raise ValueError(f"interval_s must be >= 0 and finite, got {interval_s}")
        self.clock = clock
        self._log = log
        self._owner = owner
        self._interval = interval_s
        self._timer = timer
        self._level = level
        self._kinds: dict[str, _Kind] = {}
        self._due = math.inf  # the earliest end of an interval with lines counted
        self._armed = math.inf  # when the timer armed last is due (inf: none armed)
        self.suppressed = 0  # lines counted rather than written, in all

    def note(self, kind: str, msg: str, *args: object, req_id: str | None = None,
             peer: str | None = None, now: float | None = None) -> None:
        """One line ``msg % args`` of ``kind`` (about request ``req_id``, from ``peer``): written
        now if its kind was quiet for an interval, else counted."""
        now = self.clock() if now is None else now
        if now >= self._due:
            self.tick(now)
        k = self._kinds.get(kind)
        if k is None and len(self._kinds) >= MAX_KINDS:
            self._forget(now)
            if len(self._kinds) >= MAX_KINDS:
                kind = "other"
                k = self._kinds.get(kind)
        line = (msg, args, req_id, peer)
        if k is not None and now < k.until:
            k.count += 1
            k.last = line
            self.suppressed += 1
            if k.count == 1:  # the interval's end has something to say
                self._due = min(self._due, k.until)
                self._arm(k.until, now)
            return
        self._kinds[kind] = _Kind(now + self._interval, now)
        self._write("%s [%s]: %s", kind, line)

    def tick(self, now: float | None = None) -> None:
        """Write one line per kind whose interval is over with lines counted (every loop turn)."""
        now = self.clock() if now is None else now
        if now < self._due:
            return
        self._due = math.inf
        for kind, k in self._kinds.items():
            if k.count and now >= k.until:
                self._summary(kind, k, now)
            if k.count:
                self._due = min(self._due, k.until)

    def flush(self, now: float | None = None) -> None:
        """Write every kind's counted lines now, whether or not its interval is over (at close)."""
        now = self.clock() if now is None else now
        for kind, k in self._kinds.items():
            if k.count:
                self._summary(kind, k, now)
        self._due = math.inf

    def _arm(self, due: float, now: float) -> None:
        """Have the timer (if any) tick at ``due``, unless one armed before is due sooner and
        has not passed (a timer that could not be armed, with no loop running, is not awaited)."""
        if self._timer is not None and (due < self._armed or self._armed <= now):
            self._armed = due
            self._timer(max(due - now, 0.0) + _SLACK_S, lambda: self._fired(due))

    def _fired(self, due: float) -> None:
        """The timer armed for ``due`` went off: tick, and arm it again if lines wait still."""
        now = self.clock()
        if due == self._armed:
            self._armed = math.inf
        self.tick(now)
        if self._due < math.inf:
            self._arm(self._due, now)

    def _summary(self, kind: str, k: _Kind, now: float) -> None:
        """The line for ``k``'s counted lines; its next interval starts now."""
        n, span = k.count, now - k.since
        k.count, k.since, k.until = 0, now, now + self._interval
        self._write(f"%s [%s]: {n} more like it in the last {span:.3g}s, not written one by one "
                    f"(at most one line per {self._interval:g}s per kind), the last one: %s",
                    kind, k.last)

    def _forget(self, now: float) -> None:
        """Drop the kinds quiet for an interval (their next line goes out at once anyway)."""
        for kind in [kd for kd, k in self._kinds.items() if not k.count and now >= k.until]:
            del self._kinds[kind]

    def _write(self, fmt: str, kind: str,
               line: tuple[str, tuple[object, ...], str | None, str | None]) -> None:
        """Log ``fmt`` with the owner, the kind and the line (with its request and peer)."""
        msg, args, req_id, peer = line
        text = msg % args if args else msg
        about = [f"request {_short(req_id)!r}"] if req_id is not None else []
        about += [f"from {_short(peer)!r}"] if peer else []
        if about:
            text = f"{_short(text, 600)} ({', '.join(about)})"
        self._log.log(self._level, fmt, self._owner, kind, _short(text, 800))
