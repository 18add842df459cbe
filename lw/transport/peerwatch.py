"""A worker loop's watch over its peers (a part of :class:`lw.transport.runtime.WorkerLoop`):
heartbeat rounds over the peers the core's live requests need, and the core's verdict on each
one silent past its budget (:mod:`lw.transport.liveness` keeps the clocks and budgets).

A silent peer goes to the core (``peer_silent``) with what our connection to it shows; the
core keeps it (logged once per kind of evidence) or declares it lost, and the loop performs
what follows. Any message from a peer, or bytes of ours landing at it, is a sign of life."""

from __future__ import annotations

import logging
from collections.abc import Callable

from lw.fsm import DecodeEndpoint, Effect, PrefillEndpoint
from lw.fsm.silence import GONE, Silence
from lw.transport.liveness import Liveness
from lw.transport.sidechannel import SideChannel
from lw.transport.wire import PROTOCOL_VERSION, Heartbeat

__all__ = ["PeerWatch"]

log = logging.getLogger("lw.runtime")


class PeerWatch:
    """Heartbeats and silent peers for one worker loop (loop thread only).

    ``core_error(what, exc)`` is told of the core raising; ``execute(effects)`` performs the
    core's effects for a lost peer; ``counters`` is the loop's (``heartbeats_sent``,
    ``peers_lost``, ``self_stalls``)."""

    __slots__ = ("_core_error", "_execute", "_slow_noted", "counters", "endpoint", "liveness",
                 "name", "side")

    def __init__(self, name: str, liveness: Liveness, endpoint: PrefillEndpoint | DecodeEndpoint,
                 side: SideChannel, counters: dict[str, int | float],
                 core_error: Callable[[str, Exception], None],
                 execute: Callable[[list[Effect]], None]) -> None:
        self.name = name
        self.liveness = liveness
        self.endpoint = endpoint
        self.side = side
        self.counters = counters
        self._core_error = core_error
        self._execute = execute
        self._slow_noted: dict[str, str] = {}  # silent peers kept, by the evidence last logged

    def heard(self, addr: str, now: float) -> None:
        """A message from the peer at ``addr`` (or our bytes landing there): it lives."""
        if not self.liveness.on:
            return
        self.liveness.heard(addr, now)
        if self._slow_noted.pop(addr, None) is not None:
            log.info("%s: peer %s speaks again", self.name, addr)

    def round(self, now: float) -> None:
        """Probe quiet peers that live requests need; hand silent ones to the core."""
        try:
            peers = self.endpoint.awaited_peers()
        except Exception as exc:
            self._core_error("awaited_peers", exc)
            return
        hb = self.liveness
        probe, silent, late = hb.round(peers, now)
        if late:  # we were stopped or starved ourselves: our silence, not the peers'
            self.counters["self_stalls"] += 1
        for addr in [a for a in self._slow_noted if a not in peers]:
            del self._slow_noted[addr]  # no longer needed: nothing waits on it
        for addr, quiet in silent:
            # whether our connection to it is up: its process lives however slow it is
            process = self.side.link_evidence(addr)
            silence = Silence(quiet, hb.budget(addr, now), hb.cap_s, process)
            try:
                effects = self.endpoint.peer_silent(peers[addr], silence, now)
            except Exception as exc:
                self._core_error("peer_silent", exc)
                continue
            if effects is None:
                if self._slow_noted.get(addr) != process:
                    self._slow_noted[addr] = process
                    log.info("%s: peer %s silent %.1fs past its %.1fs budget, kept: %s",
                             self.name, addr, quiet, silence.budget_s, process)
                continue
            hb.lost(addr, learn=process != GONE)
            self._slow_noted.pop(addr, None)
            self.counters["peers_lost"] += 1
            log.warning("%s: peer %s lost: %s", self.name, addr, silence.reason())
            self._execute(effects)
        for addr in probe:
            self.counters["heartbeats_sent"] += 1
            self.side.send(addr, Heartbeat(PROTOCOL_VERSION, self.endpoint.me))
