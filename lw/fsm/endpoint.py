"""What the prefill and decode endpoints share: live requests' records driven through a compiled
lifecycle table, the final states of recently finished requests, the timeline, and the
inspection that ``lw status``, the stuck alarm and the checker read.

Each endpoint sets the attributes declared here in its ``__init__`` and says how to describe
one of its records (:meth:`LifecycleEndpoint._row`, :meth:`LifecycleEndpoint._span`)."""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any, ClassVar

from lw.fsm.failures import Failure
from lw.fsm.machine import ProtocolError
from lw.fsm.messages import RequestStatus, Sender
from lw.fsm.silence import Silence, silence_loses

__all__ = ["LifecycleEndpoint"]


class LifecycleEndpoint:
    """Base of PrefillEndpoint and DecodeEndpoint: firing declared events, and inspection."""

    SIDE: ClassVar[str] = ""  # "prefill" or "decode": names the lifecycle in a ProtocolError
    # The attributes a subclass's __init__ sets that never change afterwards: a copier of
    # endpoints (the checker's, lw.sim.clone) may share them between copies.
    IMMUTABLE: ClassVar[tuple[str, ...]] = ()

    # Set by the subclass's __init__ (declared here: this class reads them).
    config: Any
    _table: dict[tuple[str, str], str]
    _reqs: dict[str, Any]  # req_id -> the side's record (state, since, alarmed, ...)
    _finished: OrderedDict[str, str]  # req_id -> final state, for a while after release
    _ring: deque | None
    _durations: deque | None

    # ----------------------------------------------------------------------------- inspection
    def state_of(self, req_id: str) -> str | None:
        """Current lifecycle state of a live request, or its final state if recently finished."""
        rec = self._reqs.get(req_id)
        return rec.state if rec is not None else self._finished.get(req_id)

    def record(self, req_id: str) -> Any:
        """The live record of a request (the side's record type), or None: for a subclass
        that changes one decision and reads what the core decided on."""
        return self._reqs.get(req_id)

    def live_requests(self) -> list[str]:
        """Requests whose blocks lw still holds (not yet released to the scheduler)."""
        return list(self._reqs)

    def status(self, now: float, req_id: str = "") -> list[RequestStatus]:
        """``lw status`` rows: every live request (or only ``req_id``), what each waits for."""
        if not req_id:
            return [self._row(r, now) for r in self._reqs.values()]
        rec = self._reqs.get(req_id)
        return [] if rec is None else [self._row(rec, now)]

    def stuck(self, now: float) -> list[RequestStatus]:
        """Requests that just passed ``stuck_fraction`` of their deadline in one state (each
        reported once per state: the stuck-request alarm). Rows are built only for those."""
        frac = self.config.stuck_fraction
        out: list[RequestStatus] = []
        for rec in self._reqs.values():
            if not rec.alarmed and now - rec.since > frac * self._span(rec):
                rec.alarmed = True
                out.append(self._row(rec, now))
        return out

    def _row(self, rec: Any, now: float) -> RequestStatus:
        """The ``lw status`` row of one record."""
        raise NotImplementedError

    def _span(self, rec: Any) -> float:
        """The deadline the record's time in its current state is measured against."""
        raise NotImplementedError

    # ----------------------------------------------------------------------------- liveness
    # Whether a silence loses the peer: lw's verdict (a checker variant puts another back).
    silence_loses = staticmethod(silence_loses)

    def peer_silent(self, peer: str, silence: Silence, now: float) -> list[Any] | None:
        """A peer live requests need (``peer``: what :meth:`peer_lost` takes) has been silent:
        the effects of losing it, or None while it is judged slow, not dead."""
        if not self.silence_loses(silence):
            return None
        return self.peer_lost(peer, silence.reason(), now)

    def peer_lost(self, peer: str, reason: str, now: float) -> list[Any]:
        """A peer is gone: what that means for the requests that need it (the side's own)."""
        raise NotImplementedError

    def peer_answered(self, responder: Sender, now: float) -> list[Any]:
        """A peer answered our heartbeat as ``responder``: its incarnation may show that it
        restarted (the side's own verdict; none by default)."""
        return []

    # ----------------------------------------------------------------------------- dispatch
    def _timed(self, src: str, event: str) -> bool:
        """Whether leaving ``src`` by ``event`` records a time-in-state sample."""
        return True

    def _fire(self, rec: Any, event: str, now: float, detail: str | int | Failure = "") -> str:
        """Move ``rec`` by ``event`` as the lifecycle table says (ProtocolError if it does not
        allow it); timeline entry and time-in-state sample when observed. The next state."""
        src = rec.state
        try:
            nxt = self._table[(src, event)]
        except KeyError:
            raise ProtocolError(self.SIDE, rec.req_id, src, event) from None
        ring = self._ring
        if ring is not None:
            ring.append((now, rec.req_id, event, src, nxt, detail))
            if nxt != src and self._timed(src, event):
                self._durations.append((src, now - rec.since))  # type: ignore[union-attr]
        if nxt != src:
            rec.state = nxt
            rec.since = now
            rec.alarmed = False
        return nxt
