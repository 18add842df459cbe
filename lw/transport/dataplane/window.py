"""How many bytes one sender keeps in flight to one peer: what that link moves in a fraction
of the transfer timeout. Each transfer's timeout runs from its first submitted entry, so with
more in flight than the link moves in that time a transfer times out behind bytes queued ahead
of it in the transport: a slow link read as a dead one (the fault table's slow-link row)."""

from __future__ import annotations

__all__ = ["ByteWindow"]

_SAMPLE_S = 0.05  # a rate sample spans at least this much busy time

MAX_DRAIN_NAP_S = 0.02
"""Longest sleep :meth:`ByteWindow.nap` asks for while the link has much more in flight than
it drains in a nap."""


class ByteWindow:
    """Bytes in flight, and a limit that follows the link's measured rate (never below a
    floor; one entry may always go, however large)."""

    def __init__(self, timeout_s: float, *, initial: int = 8 << 20, floor: int = 1 << 20,
                 fraction: float = 0.25) -> None:
        if not timeout_s > 0 or not 0 < fraction <= 1 or floor < 1 or initial < floor:
            raise ValueError("ByteWindow needs timeout_s > 0, 0 < fraction <= 1 and "
                             "initial >= floor >= 1")
        self.timeout_s = timeout_s
        self.fraction = fraction
        self.floor = floor
        self.limit = initial  # bytes: until the link's rate is measured
        self.inflight = 0
        self.rate = 0.0  # bytes per second the link moved while busy (moving average)
        self._since = 0.0  # start of the current sample (0: nothing in flight)
        self._moved = 0

    def room(self, nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` may be submitted now."""
        return self.inflight == 0 or self.inflight + nbytes <= self.limit

    def sent(self, nbytes: int, now: float) -> None:
        """An entry went to the transport."""
        if self.inflight == 0:
            self._since, self._moved = now, 0  # the link was idle: a sample starts now
        self.inflight += nbytes

    def resolved(self, nbytes: int, now: float) -> None:
        """Entries of ``nbytes`` in all left flight, having landed."""
        self.inflight = max(0, self.inflight - nbytes)
        self._moved += nbytes
        dt = now - self._since
        if dt >= _SAMPLE_S:
            r = self._moved / dt
            self.rate = r if not self.rate else 0.7 * self.rate + 0.3 * r
            self.limit = max(self.floor, int(self.rate * self.timeout_s * self.fraction))
            self._since, self._moved = now, 0

    def backlog_s(self) -> float:
        """Seconds the link needs to drain what is in flight (0 while its rate is unknown)."""
        return self.inflight / self.rate if self.rate > 0 else 0.0

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
