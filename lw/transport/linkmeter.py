"""Goodput of P's writes per decode host, measured over the time writes were in flight.

A busy period runs from the first write submitted to an idle host until none is in flight; its
goodput is the bytes it completed over its length. Periods are pooled (bytes and busy time
summed, the idle time between them left out) until they moved at least ``min_bytes``, so that
many small writes measure the link together rather than one write's latency.

What a sample says depends on whether the link fell behind. In a *backlogged* period a write was
submitted while another was still in flight: the writes queued, so their goodput is what the
link (and P's side of it) can carry. In a period where every write ended before the next one came
the link kept pace, and the goodput is only a lower bound on what it could carry: a write's fixed
costs (the submission, the completion poll) dominate small writes. Such samples only raise an
estimate that no backlogged period has measured yet; once the link has been seen backlogged they
say nothing more. A backlogged sample slower than the estimate replaces it at once; a faster one
moves it by ``alpha`` of the difference. The asymmetry follows the costs: believing a link faster
than it is leaves a prompt's transfer behind its compute (a tail of up to the whole wire time),
believing it slower starts a push early (some of P's CPU), and taking small writes' latency for
the link's rate would start every push early.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LinkMeter", "host_of"]


def host_of(addr: str) -> str:
    """The host of a side-channel address such as ``tcp://10.0.0.2:5600`` (or ``[::1]:5600``)."""
    rest = addr.split("://", 1)[-1]
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    return host.strip("[]")


@dataclass
class _Period:
    inflight: int = 0
    start: float = 0.0
    nbytes: int = 0
    backlogged: bool = False  # a write was submitted while another was in flight
    pooled_bytes: int = 0  # ended periods not yet enough for a sample
    pooled_s: float = 0.0
    pooled_backlogged: bool = False


class LinkMeter:
    """Per host: writes in flight, the current busy period, the estimated goodput (bytes/s)."""

    def __init__(self, min_bytes: int = 1 << 20, alpha: float = 0.5) -> None:
        if min_bytes < 1 or not 0 < alpha <= 1:
            raise ValueError(f"LinkMeter(min_bytes={min_bytes}, alpha={alpha}): need "
                             "min_bytes >= 1 and 0 < alpha <= 1")
        self.min_bytes = min_bytes
        self.alpha = alpha
        self._periods: dict[str, _Period] = {}
        self.goodput: dict[str, float] = {}  # replaced, never mutated: safe to read elsewhere
        self._measured: set[str] = set()  # hosts whose estimate a backlogged period set
        self.samples = 0  # samples taken, whether or not they moved the estimate (tests wait)

    def submitted(self, host: str, now: float, writes: int = 1) -> None:
        """``writes`` writes to ``host`` were handed to the data plane together."""
        if writes < 1:
            raise ValueError(f"writes must be >= 1, got {writes}")
        p = self._periods.get(host)
        if p is None:
            p = self._periods[host] = _Period()
        if p.inflight == 0:  # a busy period starts (the last one's bytes went to the pool)
            p.start = now
        else:
            p.backlogged = True
        p.inflight += writes

    def completed(self, host: str, nbytes: int, now: float) -> None:
        """A write to ``host`` ended (``nbytes`` moved; 0 when it failed)."""
        p = self._periods.get(host)
        if p is None or p.inflight == 0:
            return  # submitted before the meter knew the host: not measurable
        p.inflight -= 1
        p.nbytes += max(0, nbytes)
        if p.inflight:
            return
        p.pooled_bytes += p.nbytes
        p.pooled_s += max(0.0, now - p.start)
        p.pooled_backlogged |= p.backlogged
        p.nbytes, p.backlogged = 0, False
        if p.pooled_bytes < self.min_bytes or p.pooled_s <= 0:
            return
        rate, backlogged = p.pooled_bytes / p.pooled_s, p.pooled_backlogged
        p.pooled_bytes, p.pooled_s, p.pooled_backlogged = 0, 0.0, False
        self.samples += 1
        old = self.goodput.get(host)
        if backlogged:
            if old is None or host not in self._measured or rate < old:
                new = rate
            else:
                new = old + self.alpha * (rate - old)
            self._measured.add(host)
        elif host in self._measured or (old is not None and rate <= old):
            return  # the link kept pace: no news about what it can carry
        else:
            new = rate
        self.goodput = {**self.goodput, host: new}
