"""Goodput of P's writes per decode host, measured over the time writes were in flight.

A busy period runs from the first write submitted to an idle host until none is in flight; its
goodput is the bytes it completed over its length. Periods are pooled (bytes and busy time
summed, the idle time between them left out) until they moved at least ``min_bytes``, so that
many small writes measure the link together rather than one write's latency. A sample slower than
the estimate replaces it at once; a faster one moves it by ``alpha`` of the difference. The
asymmetry follows the costs: believing a link faster than it is leaves a prompt's transfer
behind its compute (a tail of up to the whole wire time), believing it slower only starts a
push a chunk early (some of P's CPU).
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
    pooled_bytes: int = 0  # ended periods not yet enough for a sample
    pooled_s: float = 0.0


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
        self.samples = 0  # samples folded into the estimate (tests wait on it)

    def submitted(self, host: str, now: float) -> None:
        """A write to ``host`` was handed to the data plane."""
        p = self._periods.get(host)
        if p is None:
            p = self._periods[host] = _Period()
        if p.inflight == 0:  # a busy period starts (the last one's bytes went to the pool)
            p.start = now
        p.inflight += 1

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
        p.nbytes = 0
        if p.pooled_bytes < self.min_bytes or p.pooled_s <= 0:
            return
        rate = p.pooled_bytes / p.pooled_s
        p.pooled_bytes, p.pooled_s = 0, 0.0
        old = self.goodput.get(host)
        new = rate if old is None or rate < old else old + self.alpha * (rate - old)
        self.goodput = {**self.goodput, host: new}
        self.samples += 1
