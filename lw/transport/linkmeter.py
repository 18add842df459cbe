"""Goodput of P's writes per decode host, measured over the time writes were in flight.

A busy period runs from the first write submitted to an idle host until none is in flight; its
goodput is the bytes it completed over its length. Periods are pooled (bytes and busy time
summed, the idle time between them left out) until they moved at least ``min_bytes``.

What a sample says depends on how much its periods moved. Every period pays a write's fixed
costs once (the submission, the sender's status polls, the completion reaching the loop: a few
milliseconds on a host whose core also runs the forward), so a period of small writes shows those
costs rather than the link; and a shaped link lets a small write through at line rate from its
burst allowance. A sample whose periods moved ``trust_bytes`` each on average *measures* the link:
a slower one replaces the estimate at once, a faster one moves it by ``alpha`` of the difference.
A sample of smaller periods only bounds the link from below: it raises an estimate no measuring
sample has set in the last ``hold_s`` seconds, and says nothing while one has. A link that cannot
keep up merges a push's writes into one long period, so a slow link busy with pushes keeps being
measured whatever the size of its writes; one that got faster (congestion over, another route)
shows it in small periods once its last measurement is ``hold_s`` old.

The asymmetry follows the costs: believing a link faster than it is leaves a prompt's transfer
behind its compute (a tail of up to the whole wire time), believing it slower starts a push
early (some of P's CPU), and taking small writes' fixed costs for the link's rate would start
every push early (on the 2-core testbed, 1-2 MB periods of 200-300 MB/s against 4 MB ones of
400-1,000 MB/s over an uncapped veth).
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
    pooled_periods: int = 0


class LinkMeter:
    """Per host: writes in flight, the current busy period, the estimated goodput (bytes/s)."""

    def __init__(self, min_bytes: int = 1 << 20, alpha: float = 0.5,
                 trust_bytes: int = 4 << 20, hold_s: float = 5.0) -> None:
        if min_bytes < 1 or trust_bytes < 1 or not 0 < alpha <= 1 or hold_s < 0:
            raise ValueError(f"LinkMeter(min_bytes={min_bytes}, alpha={alpha}, trust_bytes="
                             f"{trust_bytes}, hold_s={hold_s}): need min_bytes >= 1, "
                             "trust_bytes >= 1, 0 < alpha <= 1 and hold_s >= 0")
        self.min_bytes = min_bytes
        self.trust_bytes = trust_bytes
        self.alpha = alpha
        self.hold_s = hold_s
        self._periods: dict[str, _Period] = {}
        self.goodput: dict[str, float] = {}  # replaced, never mutated: safe to read elsewhere
        self._measured: dict[str, float] = {}  # host -> when a measuring sample last came
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
        p.pooled_periods += 1
        p.nbytes = 0
        if p.pooled_bytes < self.min_bytes or p.pooled_s <= 0:
            return
        rate = p.pooled_bytes / p.pooled_s
        measures = p.pooled_bytes >= self.trust_bytes * p.pooled_periods
        p.pooled_bytes, p.pooled_s, p.pooled_periods = 0, 0.0, 0
        self.samples += 1
        old = self.goodput.get(host)
        held = now - self._measured.get(host, -float("inf")) < self.hold_s
        if measures:
            if old is None or not held or rate < old:
                new = rate
            else:
                new = old + self.alpha * (rate - old)
            self._measured[host] = now
        elif held or (old is not None and rate <= old):
            return  # small periods: no news about what the link can carry
        else:
            new = rate
        self.goodput = {**self.goodput, host: new}
