"""Heartbeats: which peers a worker's live requests wait on have gone quiet, and which to probe.

The core says whom its live requests need (``awaited_peers``) and decides what a lost peer
means for them (``peer_lost``); this keeps the clock of when each was last heard from and
how long a silence each has lately shown it comes back from."""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["Liveness"]


class Liveness:
    """A needed peer silent past its budget is lost; one quiet for about an interval is probed.

    The budget is ``misses`` intervals (the floor), raised to ``factor`` times the longest
    silence the peer lately came back from, never above ``cap_s``: a slow peer (starved of
    CPU, paused by its GC) is not a dead one. A round that comes late (this worker was
    stopped or starved) restarts every peer's clock, and one merely behind its time takes the
    delay off: the silence was ours."""

    # A silence the peer came back from weighs half as much each minute: load on a host (a
    # benchmark, a busy neighbour, GC pressure) lasts minutes, and a dead peer must not go
    # undetected for long because of a pause that is long past.
    HALF_LIFE_S = 60.0

    def __init__(self, interval_s: float, misses: int, *, cap_s: float = 30.0,
                 factor: float = 3.0) -> None:
        if not interval_s >= 0 or not math.isfinite(interval_s):
            raise ValueError(f"heartbeat_s must be >= 0 (0: off), got {interval_s}")
        if misses < 1:
            raise ValueError(f"heartbeat_misses must be >= 1, got {misses}")
        if not math.isfinite(cap_s) or not cap_s > 0:
            raise ValueError(f"heartbeat_cap_s must be a finite number of seconds > 0 (a dead "
                             f"peer must be found some time), got {cap_s}")
        if not math.isfinite(factor) or not factor >= 1:
            raise ValueError(f"heartbeat_factor must be >= 1 (a budget under a silence the peer "
                             f"came back from loses it at its next such pause), got {factor}")
        floor = interval_s * misses
        if interval_s > 0 and cap_s < floor:
            raise ValueError(f"heartbeat_cap_s ({cap_s}) must be >= heartbeat_s × "
                             f"heartbeat_misses ({floor:g}): it bounds how far the budget "
                             "grows above that floor")
        self.interval_s = interval_s
        self.floor_s = floor
        self.cap_s = cap_s
        self.factor = factor
        # a silence this short cannot lift the budget over the floor: heard() skips it cheaply
        self._telling_gap = floor / factor
        self.next_round = 0.0
        self._last_round = 0.0
        self._heard: dict[str, float] = {}  # peer address -> when we last heard from it
        # peer address -> (longest silence it came back from, when): the connection's history,
        # kept while the peer is not needed and until it no longer lifts the budget
        self._shown: dict[str, tuple[float, float]] = {}
        # peer address -> when it was last heard before it was declared lost: if it speaks
        # again, that silence is one it came back from (the pause that cost a request is the
        # one most worth learning)
        self._lost: dict[str, float] = {}

    @property
    def on(self) -> bool:
        """Whether heartbeats run at all (interval 0: off)."""
        return self.interval_s > 0

    def due(self, now: float) -> bool:
        """Whether a round is due at ``now`` (and if so, the next one is an interval away)."""
        if not self.on or now < self.next_round:
            return False
        self.next_round = now + self.interval_s
        return True

    def heard(self, addr: str, now: float) -> None:
        """Any message from ``addr`` counts; the silence it ends is one the peer came back from."""
        last = self._heard.get(addr)
        if last is None and self._lost:
            last = self._lost.pop(addr, None)
        self._heard[addr] = now
        # Only silences while the peer was needed (and so probed) count: _heard forgets the
        # others at each round, and an idle peer's silence says nothing of its pauses.
        if last is not None and now - last > self._telling_gap:
            self._came_back(addr, now - last, now)

    def budget(self, addr: str, now: float) -> float:
        """How long ``addr`` may be silent at ``now`` before it is lost."""
        shown = self._shown.get(addr)
        if shown is None:
            return self.floor_s
        return min(self.cap_s, max(self.floor_s, self.factor * self._decayed(shown, now)))

    def round(self, needed: Iterable[str], now: float
              ) -> tuple[list[str], list[tuple[str, float]], bool]:
        """One heartbeat round over the peers ``needed`` now: (addresses to probe, (address,
        seconds quiet) of those silent past their budget, whether this round came late). Whether
        a silent one is lost is the core's verdict; the driver reports it with :meth:`lost`."""
        order = list(needed)
        wanted = set(order)
        heard = self._heard
        for addr in [a for a in heard if a not in wanted]:
            del heard[addr]  # not needed now: its clock starts again when it is
        self._forget(wanted, now)
        since = now - self._last_round
        self._last_round = now
        late = since > 2 * self.interval_s
        if late:
            for addr in heard:
                heard[addr] = now
        elif since > self.interval_s:
            # Behind its time (our loop starved or busy): the peers went unasked that long.
            behind = since - self.interval_s
            for addr, t in heard.items():
                heard[addr] = min(now, t + behind)
        probe: list[str] = []
        silent: list[tuple[str, float]] = []
        for addr in order:
            quiet = now - heard.setdefault(addr, now)
            if quiet > self.floor_s and quiet > self.budget(addr, now):
                silent.append((addr, quiet))
            if quiet >= self.interval_s * 0.9:
                probe.append(addr)  # a silent peer is still asked: an answer ends its silence
        return probe, silent, late

    def lost(self, addr: str, *, learn: bool = True) -> None:
        """``addr`` was declared lost: its clock stops. With ``learn``, if it speaks again,
        that silence is one it came back from; without (our connection to it was down: its
        process died or its host was cut off), whoever speaks next at that address paused
        for nothing: a restarted server's downtime would otherwise lift its budget to the
        cap, and its next death would be found only there."""
        last = self._heard.pop(addr, None)
        if last is not None and learn:
            self._lost[addr] = last

    def _came_back(self, addr: str, silence: float, now: float) -> None:
        shown = self._shown.get(addr)
        if shown is None or silence > self._decayed(shown, now):
            self._shown[addr] = (silence, now)

    def _decayed(self, shown: tuple[float, float], now: float) -> float:
        longest, at = shown
        return longest * 0.5 ** (max(0.0, now - at) / self.HALF_LIFE_S)

    def _forget(self, wanted: set[str], now: float) -> None:
        """Drop the history of peers not needed whose pauses no longer lift their budget, and
        of lost peers silent past the cap (a silence that long would only be capped)."""
        for addr in [a for a, t in self._lost.items() if now - t > 2 * self.cap_s]:
            del self._lost[addr]
        shown = self._shown
        for addr in [a for a, s in shown.items()
                     if a not in wanted and self._decayed(s, now) <= self._telling_gap]:
            del shown[addr]
