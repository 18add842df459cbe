"""Goodput of P's writes per decode host, measured over the time writes were in flight.

A busy period runs from the first write submitted to an idle host until none is in flight; its
goodput is the bytes it completed over its length. Periods are pooled (bytes and busy time
summed, the idle time between them left out) until they moved at least ``min_bytes``.

A busy period is longer than the link needs whenever the sender cannot run: every period pays a
write's fixed costs (the submission, the sender's status polls, the completion reaching the loop: a
few milliseconds on a host whose core also runs the forward), and writes queued behind a starved
sender look like a slow link. So the estimate is the *best* goodput the link showed recently, not
the latest: a sample whose periods moved ``trust_bytes`` each on average measures the link, and the
estimate is the highest such measurement of the last ``hold_s`` seconds (the newest one when none
is that recent), unless the two newest agree (within a quarter) on a slower link: then the link got
slower, and the faster ones are forgotten. A sample of smaller periods (fixed costs, or a shaper's
burst allowance letting a small write through at line rate) only bounds the link from below: it
raises an estimate that no measurement of the last ``hold_s`` seconds backs, and says nothing while
one does. A link that cannot keep up merges a push's writes into one long period, so a slow link is
measured whatever its writes; one that got slower is believed after two agreeing measurements (at
the latest once its faster ones are ``hold_s`` old: a push of one prompt is often one period, and a
row of the serving benchmark that followed a faster one had started most of its pushes a chunk late
on the faster link's figure), and one that got faster shows it in any period.

On the 2-core testbed (1,024-token prompts over an uncapped veth) periods of 4 MiB and more
showed 130-1,000 MB/s while P computed; the slowest of them made ``push_mode`` auto start a push
a chunk early, and a push that started at the last chunk ended 4 ms after its last layer.
"""

from __future__ import annotations

from collections import deque
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

    def __init__(self, min_bytes: int = 1 << 20, trust_bytes: int = 4 << 20,
                 hold_s: float = 5.0) -> None:
        if min_bytes < 1 or trust_bytes < 1 or hold_s < 0:
            raise ValueError(f"LinkMeter(min_bytes={min_bytes}, trust_bytes={trust_bytes}, "
                             f"hold_s={hold_s}): need min_bytes >= 1, trust_bytes >= 1 and "
                             "hold_s >= 0")
        self.min_bytes = min_bytes
        self.trust_bytes = trust_bytes
        self.hold_s = hold_s
        self._periods: dict[str, _Period] = {}
        self.goodput: dict[str, float] = {}  # replaced, never mutated: safe to read elsewhere
        # host -> recent measurements (when, bytes/s), newest last; bounded
        self._measured: dict[str, deque[tuple[float, float]]] = {}
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
        recent = self._measured.get(host)
        if measures:
            if recent is None:
                recent = self._measured[host] = deque(maxlen=256)
            recent.append((now, rate))
            while len(recent) > 1 and now - recent[0][0] >= self.hold_s:
                recent.popleft()
            if len(recent) > 2:
                a, b = recent[-2][1], recent[-1][1]
                hi = max(a, b)
                if hi <= 1.25 * min(a, b) and any(r > 1.25 * hi for _, r in recent):
                    # Two measurements in a row agree on a slower link: it got slower (a
                    # starved sender's periods scatter far more than a quarter).
                    for _ in range(len(recent) - 2):
                        recent.popleft()
            new = max(r for _, r in recent)
        elif (recent and now - recent[-1][0] < self.hold_s) or (old is not None and rate <= old):
            return  # small periods: no news about what the link can carry
        else:
            new = rate
        self.goodput = {**self.goodput, host: new}
