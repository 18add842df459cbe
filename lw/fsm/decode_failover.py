"""What becomes of a D request's blocks when the senders of its claim epoch are lost: prefill
failover (another epoch, in the same blocks once the old senders are fenced, or in fresh ones
while a ghost holds the old), and the end of a lease (a part of
:class:`lw.fsm.decode.DecodeEndpoint`).

With ``fence_data`` a lease that ends while some sender never confirmed it stopped does not
free or reuse the blocks: it asks the driver to fence the data plane from those senders
(:class:`FenceData`) and goes on only once the fence holds (``data_fenced``). The lease bounds
when P *issues* writes (its request deadline plus its transfer timeout); it does not bound when
bytes a lossy TCP link still carries arrive (benchmarks/late_landing.py: up to 83 s after the
write was reported failed), and D cannot refuse bytes, only messages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lw.fsm.decode_ghosts import Ghosts, grant_problem
from lw.fsm.decode_request import DecodeConfig, DecodeRecord
from lw.fsm.effects import (
    ArmTimer,
    CancelTimer,
    Effect,
    FenceData,
    FreshBlocks,
    Granted,
    Reprefill,
    Send,
)
from lw.fsm.failures import FailureKind
from lw.fsm.lifecycles import DECODE_LIVE, FENCING
from lw.fsm.machine import ProtocolError
from lw.fsm.messages import MAX_TEXT, PROTOCOL_VERSION, Abort, Sender
from lw.fsm.timeline import Timeline


class Failover:
    """D's failover and lease logic, mixed into :class:`lw.fsm.decode.DecodeEndpoint` (whose
    attributes and helpers it uses)."""

    __slots__ = ()

    config: DecodeConfig
    me: Sender
    counters: dict[str, int]
    timeline: Timeline
    _reqs: dict[str, DecodeRecord]
    _ghosts: Ghosts

    if TYPE_CHECKING:  # the endpoint's, not overridden here
        def _fire(self, rec: DecodeRecord, trigger: str, now: float,
                  detail: str = "") -> None: ...

        def _fail(self, rec: DecodeRecord, kind: FailureKind, reason: str, now: float,
                  out: list[Effect]) -> None: ...

        def _release(self, rec: DecodeRecord, out: list[Effect]) -> None: ...

    # ----------------------------------------------------------------------------- leases
    def _lease_over(self, rec: DecodeRecord, now: float, out: list[Effect]) -> None:
        """A request's lease passed (FENCING or FAILED): fence the data plane from the senders
        that may still have bytes in flight first (``fence_data``), else go on."""
        pending = tuple(s for k, s in rec.claimers.items() if k not in rec.stopped)
        if self.config.fence_data and pending:
            rec.fencing = True
            self.counters["fences"] += 1
            self.timeline.record(now, rec.req_id, "fence_data", rec.state, rec.state,
                                 f"epoch {rec.epoch}: lease over, fencing "
                                 f"{len(pending)} sender(s)")
            out.append(FenceData(rec.req_id, rec.epoch, pending))
            return
        self._quiet(rec, now, out)

    def _quiet(self, rec: DecodeRecord, now: float, out: list[Effect]) -> None:
        """No byte of the request's current epoch can land any more: the next epoch (FENCING)
        or the blocks back (FAILED); either ends any fence the record waited for."""
        self.counters["leases_expired"] += 1
        if rec.state == FENCING:
            self._new_epoch(rec, now, out)
        else:
            self._fire(rec, "lease_expired", now)
            self._release(rec, out)

    def data_fenced(self, req_id: str, epoch: int, ok: bool, reason: str,
                    now: float) -> list[Effect]:
        """The driver's answer to a :class:`FenceData`: with ``ok`` no byte of those senders
        can land here any more; else (``reason``) the blocks stay held and the fence is asked
        again after ``fence_retry_s``. An answer nobody waits for (the senders confirmed they
        stopped meanwhile, the request moved on) changes nothing."""
        if (req_id, epoch) in self._ghosts.held:
            return self._ghosts.fenced(req_id, epoch, ok, reason, now,
                                       self.config.fence_retry_s)
        out: list[Effect] = []
        rec = self._reqs.get(req_id)
        if rec is None or rec.epoch != epoch or not rec.fencing:
            self.counters["stale_fences"] += 1
            return out
        if not ok:
            rec.fencing = False
            self.counters["fence_failures"] += 1
            self.timeline.record(now, req_id, "fence_failed", rec.state, rec.state,
                                 reason[:MAX_TEXT])
            rec.deadline = now + self.config.fence_retry_s
            out.append(ArmTimer(("lease", req_id), rec.deadline))
            return out
        self.timeline.record(now, req_id, "fenced", rec.state, rec.state, f"epoch {epoch}")
        self._quiet(rec, now, out)
        return out

    # ----------------------------------------------------------------------------- failover
    def _lose(self, rec: DecodeRecord, kind: FailureKind, reason: str, engine_id: str,
              now: float, out: list[Effect]) -> None:
        """The current epoch's P is gone: another epoch if the budget allows, else fail (for
        ``kind``)."""
        if rec.retries >= self.config.retry_prefill:
            self._fail(rec, kind, reason, now, out)
            return
        rec.retries += 1
        if self.config.retry_prefill_avoid == "lost" and engine_id not in rec.avoid:
            rec.avoid = (*rec.avoid, engine_id)
        rec.reason = reason
        pending = [s for k, s in rec.claimers.items() if k not in rec.stopped]
        if not pending:
            # No sender of this epoch can write any more (none was accepted, or each said it
            # stopped): a new epoch may use the same blocks at once.
            out.append(CancelTimer(("deadline", rec.req_id)))
            self._new_epoch(rec, now, out)
            return
        if self.config.retry_fresh_blocks and (rec.req_id, rec.epoch) not in self._ghosts.held:
            # The next epoch may receive elsewhere: ask the driver for fresh blocks; on_fresh
            # goes on with its answer, in the same interpreter call (lw.fsm.effects). The
            # deadline stays armed until then (a driver that never answers cannot strand it).
            rec.asking = True
            out.append(FreshBlocks(rec.req_id, rec.epoch + 1, len(rec.blocks)))
            return
        out.append(CancelTimer(("deadline", rec.req_id)))
        self._fence(rec, pending, now, out)

    def _restarted(self, sender: Sender, prev: int, claim_of: str, now: float,
                   out: list[Effect]) -> None:
        """P worker ``sender`` came back as a new process (incarnation ``prev`` before): what
        its old process claimed is lost. A request routed to its engine and claimed by none of
        its workers yet may have gone to either process: the new one has ``restart_claim_s``
        to claim it (``claim_of``, the request the message that told us claims, is its own)."""
        engine, key = sender.engine_id, (sender.engine_id, sender.rank)
        reason = (f"prefill engine {engine} lost: restarted (incarnation {prev} -> "
                  f"{sender.incarnation})")
        for rec in list(self._reqs.values()):
            if rec.state not in DECODE_LIVE:
                continue
            old = rec.claimers.get(key)
            if old is not None and old.incarnation < sender.incarnation:
                self._lose(rec, FailureKind.PREFILL_LOST, reason, engine, now, out)
            elif (self.config.retry_prefill and rec.req_id != claim_of
                  and rec.awaits_claim_from(engine)):
                rec.claim_due = engine
                out.append(ArmTimer(("claim", rec.req_id), now + self.config.restart_claim_s))

    def _claim_overdue(self, rec: DecodeRecord, now: float, out: list[Effect]) -> None:
        """The "claim" timer of a request whose routed P engine restarted: lost unless one of
        that engine's workers claimed the epoch since."""
        engine, rec.claim_due = rec.claim_due, ""
        if engine and rec.awaits_claim_from(engine):
            self._lose(rec, FailureKind.PREFILL_LOST,
                       f"prefill engine {engine} restarted and did not claim the request within "
                       f"restart_claim_s={self.config.restart_claim_s}s", engine, now, out)

    def on_fresh(self, answer: Granted, now: float) -> list[Effect]:
        """The driver's answer to a :class:`FreshBlocks`: with blocks, the lost epoch becomes a
        ghost (its blocks quarantined, its senders aborted) and the request goes on at once
        under the next epoch in the fresh blocks, where no byte of the lost epoch can land (its
        writes name the old blocks). Refused: FENCING, as without the setting."""
        ask = answer.ask
        rec = self._reqs.get(ask.req_id)
        if rec is None or not rec.asking or ask.epoch != rec.epoch + 1:
            raise ProtocolError("decode", ask.req_id, rec.state if rec else "UNKNOWN", "fresh",
                                "fresh blocks nobody asked for")
        rec.asking = False
        out: list[Effect] = [CancelTimer(("deadline", rec.req_id))]
        pending = {k: s for k, s in rec.claimers.items() if k not in rec.stopped}
        if answer.blocks is None:
            self.counters["fresh_refused"] += 1
            self._fence(rec, list(pending.values()), now, out)
            return out
        held = {b for r in self._reqs.values() for b in r.blocks} | self._ghosts.held_blocks()
        problem = grant_problem(answer.blocks, len(rec.blocks), held)
        if problem:
            raise ProtocolError("decode", rec.req_id, rec.state, "fresh", problem)
        self.counters["fresh_blocks"] += 1
        out += self._ghosts.hold(rec.req_id, rec.epoch, rec.blocks, pending, rec.reason, now)
        rec.blocks = tuple(answer.blocks)
        self._new_epoch(rec, now, out)
        return out

    def _fence(self, rec: DecodeRecord, pending: list[Sender], now: float,
               out: list[Effect]) -> None:
        """Wait out the lost epoch in the request's own blocks (FENCING)."""
        # A sender of this epoch may still write into our blocks, and D cannot refuse bytes,
        # only messages: stop it and wait, as a quarantine, before another P writes there.
        reason = rec.reason
        self._fire(rec, "fence", now, reason)
        for sender in pending:
            out.append(Send(sender.addr, Abort(PROTOCOL_VERSION, rec.req_id, self.me,
                                               reason[:MAX_TEXT], rec.epoch)))
        rec.deadline = now + self.config.lease_s
        out.append(ArmTimer(("lease", rec.req_id), rec.deadline))

    def _maybe_quiet(self, rec: DecodeRecord, now: float, out: list[Effect]) -> None:
        """A fenced epoch whose every accepted sender confirmed it stopped: go on at once."""
        if rec.state == FENCING and all(k in rec.stopped for k in rec.claimers):
            out.append(CancelTimer(("lease", rec.req_id)))
            self._new_epoch(rec, now, out)

    def _new_epoch(self, rec: DecodeRecord, now: float, out: list[Effect]) -> None:
        """Start the next claim epoch: forget the old senders, ask the driver for a prefill."""
        rec.epoch += 1
        rec.fencing = False
        fenced = rec.state == FENCING
        self._fire(rec, "retry", now, f"epoch {rec.epoch}: {rec.reason}")
        rec.claimers, rec.by_rank, rec.formats, rec.sums = {}, {}, {}, {}
        rec.done, rec.stopped = set(), set()
        rec.route, rec.claim_due = None, ""
        self.counters["reprefills"] += 1
        rec.deadline = now + self.config.prefill_timeout_s
        out.append(ArmTimer(("deadline", rec.req_id), rec.deadline))
        out.append(Reprefill(rec.req_id, rec.epoch, rec.blocks, rec.avoid, rec.reason[:MAX_TEXT],
                             fenced))
