"""How many bytes one sender keeps in flight to one peer: what that link moves in a fraction
of the transfer timeout. Each transfer's timeout runs from its first submitted entry, so with
more in flight than the link moves in that time a transfer times out behind bytes queued ahead
of it in the transport: a slow link read as a dead one (the fault table's slow-link row).
Optionally also no more than the link moves in ``span_s`` (a few milliseconds) while the link
has a backlog: what is in flight fills the link's queue, and P's first token, which crosses the
same link, waits behind it (issue 59)."""

from __future__ import annotations

__all__ = ["WINDOW_SPAN_AFTER_S", "WINDOW_SPAN_S", "ByteWindow"]

_SAMPLE_S = 0.05  # a rate sample spans at least this much busy time

WINDOW_SPAN_S = 0.010
"""A sender keeps in flight to a peer at most what its link moves in this long (and at least
twice a round trip) while that link has more than :data:`WINDOW_SPAN_AFTER_S` to carry: more
only queues in the link's buffers, and P's first token, on the same link, waited behind them
(docs/benchmarks.md)."""

WINDOW_SPAN_AFTER_S = 0.030
"""Below this backlog the span does not bind: a push that keeps pace with its link refills no
narrow window on the forward's core (P's prefill lengthened at kv/prefill 1.0 with it always
on), and its token finds little queued anyway."""

MAX_DRAIN_NAP_S = 0.02
"""Longest sleep :meth:`ByteWindow.nap` asks for while the link has much more in flight than
it drains in a nap."""


class ByteWindow:
    """Bytes in flight, and a limit that follows the link's measured rate (never below a
    floor; one entry may always go, however large)."""

    def __init__(self, timeout_s: float, *, initial: int = 8 << 20, floor: int = 1 << 20,
                 fraction: float = 0.25, span_s: float = 0.0, span_after_s: float = 0.0,
                 span_floor: int = 256 << 10) -> None:
        if (not timeout_s > 0 or not 0 < fraction <= 1 or floor < 1 or initial < floor
                or not span_s >= 0 or not span_after_s >= 0 or span_floor < 1):
            raise ValueError("ByteWindow needs timeout_s > 0, 0 < fraction <= 1, initial >= "
                             "floor >= 1, span_s >= 0, span_after_s >= 0 and span_floor >= 1")
        self.timeout_s = timeout_s
        self.fraction = fraction
        self.floor = floor
        # The span bound (0: none) holds only while the link has more than span_after_s of
        # bytes to carry (in flight and queued): a push that keeps pace with its link refills
        # no narrow window on the forward's core.
        self.span_s = span_s
        self.span_after_s = span_after_s
        self.span_floor = span_floor
        self.span_limit = 0  # bytes: the span bound at the measured rate (0: unmeasured)
        self.queued = 0  # bytes the sender holds for this link, not yet submitted
        self.limit = initial  # bytes: until the link's rate is measured
        self.inflight = 0
        self.rate = 0.0  # bytes per second the link moved while busy (moving average)
        self.rtt = 0.0  # an idle link's first entry: submitted -> landed (low watermark)
        self._since = 0.0  # start of the current sample (0: nothing in flight)
        self._moved = 0
        self._lone: float | None = None  # when an entry went to an idle link

    def room(self, nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` may be submitted now."""
        if self.inflight == 0:
            return True
        limit = self.limit
        if self.span_limit and self.inflight + self.queued > self.rate * self.span_after_s:
            limit = min(limit, self.span_limit)
        return self.inflight + nbytes <= limit

    def sent(self, nbytes: int, now: float) -> None:
        """An entry went to the transport (out of :attr:`queued`)."""
        if self.inflight == 0:
            self._since, self._moved = now, 0  # the link was idle: a sample starts now
            self._lone = now
        self.inflight += nbytes
        self.queued = max(0, self.queued - nbytes)

    def resolved(self, nbytes: int, now: float) -> None:
        """Entries of ``nbytes`` in all left flight, having landed."""
        self.inflight = max(0, self.inflight - nbytes)
        self._moved += nbytes
        if self._lone is not None:
            took, self._lone = now - self._lone, None
            # a low watermark that may rise again (a route that got longer), 25 % per sample
            self.rtt = took if not self.rtt else min(took, self.rtt * 1.25)
        dt = now - self._since
        if dt >= _SAMPLE_S:
            r = self._moved / dt
            self.rate = r if not self.rate else 0.7 * self.rate + 0.3 * r
            self.limit = max(self.floor, int(self.rate * self.timeout_s * self.fraction))
            if self.span_s:
                # Never under twice what the link holds in a round trip: a window below it
                # would idle the link between landings, and the rate measured then would
                # shrink the window again (a 200 ms route read as a crawl).
                span = max(self.span_s, 2 * self.rtt)
                self.span_limit = max(self.span_floor, int(self.rate * span))
            self._since, self._moved = now, 0

    def backlog_s(self) -> float:
        """Seconds the link needs to drain what is in flight (0 while its rate is unknown)."""
        return self.inflight / self.rate if self.rate > 0 else 0.0

    def queue_s(self) -> float:
        """Seconds the link needs to carry what is in flight and :attr:`queued` (0 while its
        rate is unknown): what the inbox batches layer events on."""
        return (self.inflight + self.queued) / self.rate if self.rate > 0 else 0.0

    def nap(self, nap: float) -> float:
        """A sender's next sleep: ``nap``, or up to a quarter of :meth:`backlog_s` (at most
        MAX_DRAIN_NAP_S) when that is longer. On a link-bound push, entries resolve
        milliseconds apart for the whole prefill, and a 2 ms poll woke the Mooncake sender ~560
        times per 1,024-token prompt on the core the forward runs on, each wake-up a preemption
        of the forward (benchmarks/push_cpu.py counts both); a later poll delays only the
        report of entries that are not the last, and the last is polled finely again as the
        bytes in flight shrink."""
        return max(nap, min(self.backlog_s() / 4, MAX_DRAIN_NAP_S))

    def dropped(self, nbytes: int) -> None:
        """Entries of ``nbytes`` left flight without landing (timed out: not a rate sample)."""
        self.inflight = max(0, self.inflight - nbytes)
        self._lone = None
