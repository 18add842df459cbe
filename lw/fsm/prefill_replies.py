"""P's endpoint: what it makes of D's replies (MetaReply, Ack, Abort). A part of
:class:`lw.fsm.prefill.PrefillEndpoint`, split from it as a concern of its own."""

from __future__ import annotations

from typing import Any

from lw.fsm.effects import ArmTimer, CancelTimer, Effect, Send
from lw.fsm.lifecycles import AWAIT_DECODER_META, DONE, FAILED
from lw.fsm.machine import ProtocolError
from lw.fsm.messages import PROTOCOL_VERSION, Abort, AbortAck, Ack, FailedSending, MetaReply

__all__ = ["DecoderReplies"]

# Aborted epochs a tombstone keeps per request (its newest): D aborts each lost epoch's claimers,
# and a few lost epochs of one request is already rare.
TOMB_EPOCHS = 8


class DecoderReplies:
    """D's answers to P's claims, DONEs and its aborts: the methods PrefillEndpoint takes from
    here."""

    def _on_meta_reply(self: Any, msg: MetaReply, now: float,
                       out: list[Effect]) -> None:
        rec = self._reqs.get(msg.req_id)
        # a reply to a claim of another prefill attempt (epoch) is not about ours
        t = (rec.target(msg.responder.addr) if rec is not None and msg.epoch == rec.req.epoch
             else None)
        if rec is None or t is None:
            self._stale(msg)
            if msg.status == "accepted" and (rec is not None or self._finished.get(
                    msg.req_id) == FAILED):
                # D took us as a sender after we gave up (or never asked it): tell it now.
                out.append(Send(msg.responder.addr, FailedSending(
                    PROTOCOL_VERSION, msg.req_id, self.me, 1, "sender had already failed",
                    msg.req_id in self._in_doubt, epoch=msg.epoch)))
            return
        if msg.status == "accepted" and rec.state == FAILED:
            t.claimed = True  # D expects a word from us: FailedSending once drained
        if msg.status == "refused":
            if rec.state == AWAIT_DECODER_META:
                self._fail(rec, f"decoder {t.addr} refused the request: {msg.reason}", now, out)
            else:
                self._fire(rec, "meta_unknown", now)  # late refusal of an earlier try: stale
            return
        if msg.status == "unknown":
            self._fire(rec, "meta_unknown", now)
            if rec.state == AWAIT_DECODER_META:
                # D's worker has not registered it yet (it takes its step's metadata after
                # D's scheduler asked for the prefill; a claim computed ahead comes that soon):
                # ask again soon, backing off to meta_retry_s, not after the whole of it
                retry = self.config.unknown_retry_s * 2 ** max(rec.meta_tries - 1, 0)
                out.append(ArmTimer(("meta", rec.req.req_id),
                                    now + min(retry, self.config.meta_retry_s)))
            return
        if rec.state != AWAIT_DECODER_META:
            self._fire(rec, "meta_accepted", now)  # declared duplicate
            return
        if t.accepted:  # a duplicate from a target that accepted while others have not yet
            self._fire(rec, "target_accepted", now)
            return
        t.claimed = True
        layout = msg.layout or self.layouts.get(t.addr)
        if layout is None or layout.incarnation != msg.responder.incarnation:
            # D restarted since we cached its layout (or never sent one): ask again with it.
            self._forget_layout(t.addr)
            self._send_meta_request(rec, t, now, out)
            return
        segs, problem = self.layouts.check(t.addr, layout, rec.req.remote_blocks)
        if segs is None:
            self._fail(rec, problem, now, out)
            return
        self.layouts.keep(t.addr, layout)
        t.segs = segs
        t.layout = layout
        t.accepted = True
        rec.progress_at = now
        if all(x.accepted for x in rec.targets):
            out.append(CancelTimer(("meta", rec.req.req_id)))
            self._fire(rec, "meta_accepted", now)
            self._send_first(rec, now, out)  # a first token held for the claim goes now
            self._submit_ready(rec, out, now)
        else:
            self._fire(rec, "target_accepted", now)  # found by the model checker (finding 3)

    def _on_ack(self: Any, msg: Ack, now: float, out: list[Effect]) -> None:
        rec = self._reqs.get(msg.req_id)
        t = rec.target(msg.responder.addr) if rec is not None else None
        if rec is None or t is None:
            self._stale(msg)
            return
        if msg.of == "failed":
            return  # D has our FailedSending; nothing waits on it
        if rec.state == FAILED or rec.state == DONE:
            self._fire(rec, "ack", now)
            return
        if not msg.accepted:
            self._fail(rec, f"decoder {t.addr} had already failed the request", now, out)
            return
        if not rec.final or rec.sent < rec.limit:
            raise ProtocolError("prefill", rec.req.req_id, rec.state, "ack",
                                f"acknowledgement from {t.addr} before DONE was sent")
        t.acked = True
        if all(x.acked for x in rec.targets):
            self._fire(rec, "ack", now)
            self._cancel_timers(rec.req.req_id, out)
            self._maybe_release(rec, out)

    def _on_abort(self: Any, msg: Abort, now: float, out: list[Effect]) -> None:
        rid = msg.req_id
        rec = self._reqs.get(rid)
        if rec is None:
            if rid not in self._finished:
                # D gave up this epoch before it reached us: make sure we never start it.
                self._bury(rid, msg.epoch, now, out)
            out.append(Send(msg.responder.addr, AbortAck(PROTOCOL_VERSION, rid, self.me,
                                                         known=rid in self._finished,
                                                         in_doubt=rid in self._in_doubt,
                                                         epoch=msg.epoch)))
            return
        if msg.epoch != rec.req.epoch:
            # An abort of another prefill attempt of this request (D moved on to a new epoch,
            # or this is an old D's word): it does not stop ours, and ours has no write of it.
            self._stale(msg)
            out.append(Send(msg.responder.addr, AbortAck(PROTOCOL_VERSION, rid, self.me,
                                                         known=False, epoch=msg.epoch)))
            return
        rec.abort_acks.append(msg.responder.addr)
        t = rec.target(msg.responder.addr)
        if t is not None:
            t.claimed = False  # D initiated: the AbortAck tells it we stopped
        self._fail(rec, f"decoder aborted: {msg.reason}", now, out)
        self._maybe_release(rec, out)

    def _bury(self: Any, rid: str, epoch: int, now: float, out: list[Effect]) -> None:
        """Remember that D aborted claim epoch ``epoch`` of a request not seen here, so that
        this epoch's prefill, if it comes within ``tombstone_ttl_s``, fails unstarted (an Abort
        names one epoch: D's re-prefill of the request under a later one is served).

        Bounded: ``tombstone_memory`` request ids, each with its newest TOMB_EPOCHS epochs; past
        that the oldest are forgotten and counted (``tombstones_forgotten``). Forgetting one
        costs a claim D refuses: D aborts an epoch only as it fails it or moves on to the next,
        and then answers that epoch's MetaRequest "refused" (or "unknown" once it forgot the
        request) and never authorises its write; P holds the blocks until that answer (or,
        for "unknown", until meta_attempts run out)."""
        kept = tuple(sorted({*self._tombstones.pop(rid, ()), epoch}))
        if len(kept) > TOMB_EPOCHS:
            self.counters["tombstones_forgotten"] += len(kept) - TOMB_EPOCHS
            kept = kept[-TOMB_EPOCHS:]
        self._tombstones[rid] = kept  # (re)inserted last: the first entry is the oldest
        out.append(ArmTimer(("tomb", rid), now + self.config.tombstone_ttl_s))
        while len(self._tombstones) > self.config.tombstone_memory:
            old = next(iter(self._tombstones))
            self.counters["tombstones_forgotten"] += len(self._tombstones.pop(old))
            out.append(CancelTimer(("tomb", old)))

    def _unbury(self: Any, rid: str, epoch: int, out: list[Effect]) -> bool:
        """Whether D aborted this epoch of the request before it came here (the tombstone,
        which stops one prefill, is then spent)."""
        kept = self._tombstones.get(rid, ())
        if epoch not in kept:
            return False
        left = tuple(e for e in kept if e != epoch)
        if left:
            self._tombstones[rid] = left
        else:
            del self._tombstones[rid]
            out.append(CancelTimer(("tomb", rid)))
        return True
