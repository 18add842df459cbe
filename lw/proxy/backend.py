"""A prefill or decode server as the proxy knows it: its load, its failures and back-off, the
engines and workers it has shown, and whether prefills may go ahead to it."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

MAX_ENGINES = 64
"""Engine ids remembered per prefill server (one per DP rank behind its address)."""
MAX_WORKERS = 64
"""Worker side channels remembered per decode server and per transfer (DP x TP ranks)."""

BACKOFF_S = (1.0, 30.0)
"""A server that failed is avoided for 1 s, doubling per consecutive failure up to 30 s (each
±20 %, so that proxies do not come back in step): no retry storm on a dead server."""

# A prefill server whose ahead prefills were this many times in a row not usable for a reason
# of its own (it never fetched D's params, refused or dropped the ahead request, or tokenized
# another prompt) gets none for AHEAD_OFF_S, doubled each time it is switched off again before
# one was bound, up to AHEAD_OFF_MAX_S: each such miss cost a request up to the proxy's ahead
# wait, or P a prefill computed for nothing.
AHEAD_MISSES = 3
AHEAD_OFF_S = 60.0
AHEAD_OFF_MAX_S = 3600.0


@dataclass(eq=False)
class Backend:
    """A prefill or decode server and its counters."""

    url: str
    role: str
    in_flight: int = 0
    requests: int = 0
    errors: int = 0
    fails: int = 0  # consecutive connection-level failures
    down_until: float = 0.0  # (loop time) avoided until then
    # A prefill server's lw engine ids, each with its TP rank 0 side channel, as its prefill
    # responses name them: what a decode engine's core watches and avoids (prefill failover).
    engines: dict[str, str] = field(default_factory=dict)
    # A decode server's workers (side channels), as its metaserver calls name them: whom the
    # proxy asks why a request failed (lw.proxy.explain).
    workers: dict[str, None] = field(default_factory=dict)
    ahead_waiting: int = 0  # prefills sent here ahead of D's params, not bound yet
    ahead_misses: int = 0  # ahead prefills in a row not usable for a reason of this server's
    ahead_off_until: float = 0.0  # (loop time) none goes ahead here until then
    ahead_offs: int = 0  # times switched off since an ahead prefill here was last bound

    @property
    def load(self) -> int:
        """Requests this server holds: in flight, and (a prefill server) waiting ahead."""
        return self.in_flight + self.ahead_waiting

    def learn_workers(self, addrs: list[str]) -> None:
        """Remember side channels of this server's workers (well formed: decode_workers)."""
        for a in addrs:
            if len(self.workers) >= MAX_WORKERS:
                return
            self.workers[a] = None

    def learn_engine(self, engine_id: Any, workers: Any) -> None:
        """Remember an engine id and rank-0 worker a prefill response of this server named."""
        if (isinstance(engine_id, str) and 0 < len(engine_id) <= 256 and isinstance(workers, list)
                and workers and isinstance(workers[0], str) and len(self.engines) < MAX_ENGINES):
            self.engines[engine_id] = workers[0]

    def identity(self) -> tuple[str, str] | None:
        """(engine id, rank-0 side channel) when this server has shown exactly one engine;
        None when unknown or ambiguous (several DP engines behind one address)."""
        return next(iter(self.engines.items())) if len(self.engines) == 1 else None

    def failed(self, now: float) -> None:
        """The server did not answer (connection refused or dropped, 5xx): avoid it a while."""
        self.fails += 1
        lo, hi = BACKOFF_S
        wait = min(hi, lo * 2 ** min(self.fails - 1, 16))  # the exponent capped: no overflow
        self.down_until = now + wait * random.uniform(0.8, 1.2)

    def answered(self) -> None:
        """The server answered: route to it as usual."""
        self.fails = 0
        self.down_until = 0.0

    def up(self, now: float) -> bool:
        """Not being avoided after a failure."""
        return self.down_until <= now

    def ahead_missed(self, now: float) -> float:
        """An ahead prefill here was not usable for a reason of this server's. When that made
        AHEAD_MISSES in a row, none goes ahead here for a while: the seconds (AHEAD_OFF_S,
        doubled per switch-off since the last bound one, up to AHEAD_OFF_MAX_S); else 0."""
        self.ahead_misses += 1
        if self.ahead_misses < AHEAD_MISSES:
            return 0.0
        self.ahead_misses = 0
        off = min(AHEAD_OFF_MAX_S, AHEAD_OFF_S * 2 ** min(self.ahead_offs, 16))
        self.ahead_offs += 1
        self.ahead_off_until = now + off
        return off

    def ahead_used(self) -> None:
        """An ahead prefill here was bound: the misses in a row and the switch-offs start
        again."""
        self.ahead_misses = 0
        self.ahead_offs = 0

    def ahead_on(self, now: float) -> bool:
        """Whether a prefill may go ahead here (not switched off after misses in a row)."""
        return self.ahead_off_until <= now

    def snapshot(self) -> dict[str, Any]:
        """Counters as JSON."""
        return {"url": self.url, "in_flight": self.in_flight, "requests": self.requests,
                "errors": self.errors, "consecutive_failures": self.fails}
