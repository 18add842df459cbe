"""Heartbeats: which peers a worker's live requests wait on have gone quiet, and which to probe.

The core says whom its live requests need (``awaited_peers``) and decides what a lost peer
means for them (``peer_lost``); this only keeps the clock of when each was last heard from."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["Liveness"]


class Liveness:
    """A peer needed and silent for ``misses`` heartbeat intervals is lost; one quiet for about
    an interval is probed. A round that comes late (this worker was stopped or starved) restarts
    every peer's clock: the silence was ours."""

    def __init__(self, interval_s: float, misses: int) -> None:
        if interval_s < 0 or misses < 1:
            raise ValueError("heartbeat_s must be >= 0 (0: off) and heartbeat_misses >= 1")
        self.interval_s = interval_s
        self.lost_after_s = interval_s * misses
        self.next_round = 0.0
        self._last_round = 0.0
        self._heard: dict[str, float] = {}  # peer address -> when we last heard from it

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
        """Any message from ``addr`` counts."""
        self._heard[addr] = now

    def round(self, needed: Iterable[str], now: float
              ) -> tuple[list[str], list[tuple[str, float]], bool]:
        """One heartbeat round over the peers ``needed`` now: (addresses to probe, (address,
        seconds quiet) of the lost ones, whether this round came late)."""
        order = list(needed)
        wanted = set(order)
        heard = self._heard
        for addr in [a for a in heard if a not in wanted]:
            del heard[addr]  # not needed now: its clock starts again when it is
        late = now - self._last_round > 2 * self.interval_s
        self._last_round = now
        if late:
            for addr in heard:
                heard[addr] = now
        probe: list[str] = []
        lost: list[tuple[str, float]] = []
        for addr in order:
            quiet = now - heard.setdefault(addr, now)
            if quiet > self.lost_after_s:
                del heard[addr]
                lost.append((addr, quiet))
            elif quiet >= self.interval_s * 0.9:
                probe.append(addr)
        return probe, lost, late
