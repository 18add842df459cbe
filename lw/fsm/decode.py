"""The decode-side endpoint: D's requests whose blocks were allocated before prefill started.

D accepts P senders per request (MetaRequest), counts their DONE messages and reports the request
finished only when every expected sender has written every layer. A failed request's blocks are
quarantined until every accepted sender confirmed it stopped, or until a lease expires (and,
with ``fence_data``, the data plane was fenced from the senders that never confirmed). With
``retry_fresh_blocks`` a lost claim epoch's blocks are quarantined the same way (a ghost of that
epoch) while the request goes on at once in fresh blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from lw.fsm.decode_checksums import Checksums
from lw.fsm.decode_claims import Claims
from lw.fsm.decode_failover import Failover
from lw.fsm.decode_first_token import FirstTokenIntake
from lw.fsm.decode_ghosts import GHOST_RULES, Ghosts
from lw.fsm.decode_request import DecodeConfig, DecodeRecord, SenderKey, ack
from lw.fsm.effects import (
    ArmTimer,
    CancelTimer,
    Effect,
    EpochTimer,
    Quarantine,
    RecvDone,
    RecvFailed,
    Send,
    SumBlocks,
    TimerKey,
)
from lw.fsm.endpoint import LifecycleEndpoint
from lw.fsm.failures import Failure, FailureKind
from lw.fsm.lifecycles import (
    DECODE_LIVE,
    DONE,
    FAILED,
    FENCING,
    PREFILL_REQUESTED,
    decode_declaration,
)
from lw.fsm.machine import ProtocolError
from lw.fsm.messages import (
    MAX_TEXT,
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    DoneSending,
    FailedSending,
    FirstToken,
    KVLayout,
    Message,
    MetaRequest,
    RequestStatus,
    Sender,
)
from lw.fsm.snapshot import ENDPOINT_RULES, OMIT, RECORD_RULES, UNORDERED, Rules, derive
from lw.fsm.status import decode_row, decode_span
from lw.fsm.timeline import Timeline

_FINAL = (DONE, FAILED)


class DecodeEndpoint(Claims, Checksums, Failover, FirstTokenIntake, LifecycleEndpoint):
    """Protocol logic of one D worker (events in, effects out; time is an argument)."""

    SIDE = "decode"
    IMMUTABLE = ("declaration", "_table", "config", "me", "layout")

    def __init__(self, me: Sender, layout: KVLayout, config: DecodeConfig | None = None) -> None:
        if layout.engine_id != me.engine_id or layout.incarnation != me.incarnation:
            raise ValueError("layout must belong to this worker (engine id and incarnation)")
        self.me = me
        self.layout = layout
        self.config = config or DecodeConfig()
        self.declaration = decode_declaration()
        self._table = self.declaration.compile()
        self._reqs: dict[str, DecodeRecord] = {}
        self._finished: OrderedDict[str, str] = OrderedDict()
        self._incarnations: dict[SenderKey, int] = {}  # newest incarnation seen per P worker
        self.timeline = Timeline(self.config.timeline_entries)
        self._ring = self.timeline.ring
        self._durations = self.timeline.durations
        self.counters: dict[str, int] = dict.fromkeys((
            "peer_restarts", "requests", "done", "failed", "deadlines", "leases_expired",
            "stale_messages", "refused", "checksum_mismatches", "unknown_requests", "reprefills",
            "stale_epoch", "fresh_blocks", "fresh_refused", "ghosts_released", "fences",
            "fence_failures", "stale_fences", "first_tokens_taken", "first_tokens_refused"), 0)
        self._done_claims: OrderedDict = OrderedDict()  # DONE, first token due (FirstTokenIntake)
        # retry_fresh_blocks: abandoned claim epochs whose blocks are quarantined; they outlive
        # their request if need be
        self._ghosts = Ghosts(me, self.config.lease_s, self.counters, self.timeline,
                              self.config.fence_data)

    # ----------------------------------------------------------------------------- inspection
    def quarantined(self) -> dict[str, tuple[int, ...]]:
        """Failed requests whose blocks must not be touched yet."""
        return {r.req_id: r.blocks for r in self._reqs.values() if r.state == FAILED}

    def ghosts(self) -> dict[tuple[str, int], tuple[int, ...]]:
        """Abandoned claim epochs (request, epoch) whose blocks must not be touched yet."""
        return self._ghosts.blocks()

    def snapshot(self) -> tuple:
        """A canonical, hashable summary of the endpoint's protocol state (for the checker):
        every field of the endpoint and its records except those SNAPSHOT_RULES names."""
        return derive(self, SNAPSHOT_RULES)

    def awaited_peers(self) -> dict[str, str]:
        """P workers a live request still waits for (address -> the engine id
        :meth:`peer_lost` takes): the peers a liveness detector should watch."""
        peers = {s.addr: k[0] for r in self._reqs.values() if r.state not in _FINAL
                 for k, s in r.claimers.items() if k not in r.done}
        # The P a prefill was sent to, before it claims: a dead one's orphans are found by
        # heartbeats, not by our prefill deadline. Only with a retry budget: without one, the
        # deadline gives a P behind a partition that heals in time the chance to finish.
        if self.config.retry_prefill:
            peers.update({r.route[1]: r.route[0] for r in self._reqs.values()
                          if r.route is not None and r.state in DECODE_LIVE})
        return peers

    def _row(self, rec: DecodeRecord, now: float) -> RequestStatus:
        return decode_row(self, rec, now)

    def _span(self, rec: DecodeRecord) -> float:
        return decode_span(self, rec)

    # ----------------------------------------------------------------------------- events
    def add_request(
        self, req_id: str, block_ids: tuple[int, ...],
        expected_senders: int | Collection[int], now: float, prompt: str = "",
    ) -> list[Effect]:
        """Blocks were allocated for a request whose prefill is about to be requested.

        ``expected_senders`` is the set of P TP ranks that write into this worker (each claims
        with its format and sends one DONE), or just how many senders, of any rank; ``prompt``
        the digest of the prompt the blocks are for (a claim must name the same)."""
        if req_id in self._reqs:
            raise ValueError(f"request {req_id!r} is already live on D {self.me.engine_id}")
        if isinstance(expected_senders, int):
            ranks, count = None, expected_senders
        else:
            ranks = frozenset(expected_senders)
            count = len(ranks)
        if count < 1:
            raise ValueError(f"request {req_id!r}: expected_senders must be >= 1")
        self._finished.pop(req_id, None)
        self._done_claims.pop(req_id, None)  # an older attempt's claim takes no token now
        deadline = now + self.config.prefill_timeout_s
        self._reqs[req_id] = DecodeRecord(req_id, tuple(block_ids), count, ranks, now, deadline,
                                          prompt)
        self.counters["requests"] += 1
        self.timeline.record(now, req_id, "allocated", "", PREFILL_REQUESTED,
                             f"{len(block_ids)} blocks, expects "
                             + (f"P TP ranks {sorted(ranks)}" if ranks is not None
                                else f"{count} sender(s)"))
        return [ArmTimer(("deadline", req_id), deadline)]

    def on_message(self, msg: Message, now: float) -> list[Effect]:
        """A side-channel message from a P worker arrived. With ``kv_checksum`` a DoneSending
        is finished by :meth:`on_sums`, once the driver summed what :class:`SumBlocks` asks."""
        out: list[Effect] = []
        sender = getattr(msg, "sender", None)
        if sender is not None:
            claim_of = msg.req_id if isinstance(msg, MetaRequest) else ""
            self._note_incarnation(sender, claim_of, now, out)
        if isinstance(msg, MetaRequest):
            self._on_meta_request(msg, now, out)
        elif self._to_ghost(msg, now, out):
            pass  # a message of an abandoned claim epoch, taken by its ghost
        elif isinstance(msg, DoneSending):
            self._on_done(msg, now, out)
        elif isinstance(msg, FailedSending):
            self._on_failed(msg, now, out)
        elif isinstance(msg, AbortAck):
            self._on_abort_ack(msg, now, out)
        elif isinstance(msg, FirstToken):
            self._on_first_token(msg, now, out)
        else:
            raise ProtocolError(
                "decode", getattr(msg, "req_id", "?"), "-", type(msg).__name__,
                "a D worker only accepts MetaRequest, DoneSending, FailedSending, AbortAck and "
                "FirstToken",
            )
        return out

    def on_timer(self, key: TimerKey, now: float) -> list[Effect]:
        """A timer armed by an earlier ArmTimer effect fired."""
        if isinstance(key, EpochTimer):  # a ghost's lease
            return self._ghosts.on_timer(key, now)
        kind, rid = key
        out: list[Effect] = []
        rec = self._reqs.get(rid)
        if rec is None:
            return out
        if kind == "deadline":
            if rec.state in DECODE_LIVE:
                self.counters["deadlines"] += 1
                self._fail(rec, FailureKind.PREFILL_DEADLINE,
                           f"prefill deadline of {self.config.prefill_timeout_s}s passed", now, out)
        elif kind == "claim":
            self._claim_overdue(rec, now, out)
        elif kind == "lease":
            # The old epoch's senders issue no more writes (FENCING: then the next epoch;
            # FAILED: the blocks back), once their bytes in flight are fenced (fence_data).
            self._lease_over(rec, now, out)
        else:
            raise ValueError(f"unknown timer kind {kind!r} for request {rid!r}")
        return out

    def abort(self, req_id: str, reason: str, now: float,
              kind: FailureKind = FailureKind.ABORTED) -> list[Effect]:
        """The local scheduler aborted a request whose KV had not fully arrived (``kind``: a
        driver's own cause, e.g. METASERVER when the proxy could not be asked for the prefill)."""
        out: list[Effect] = []
        rec = self._reqs.get(req_id)
        if rec is not None and rec.state not in _FINAL:
            self._fail(rec, kind, f"aborted locally: {reason}", now, out)
        return out

    def peer_lost(self, engine_id: str, reason: str, now: float) -> list[Effect]:
        """A P engine died or restarted: re-prefill (budget allowing) or fail what it was
        sending or was asked to prefill, without waiting for the deadline. Its senders are NOT
        counted as stopped: bytes it had in flight may still land (found by the model checker),
        so the blocks stay quarantined (or fenced) until the lease ends."""
        out: list[Effect] = []
        for rec in list(self._reqs.values()):
            routed = (self.config.retry_prefill and rec.route is not None
                      and rec.route[0] == engine_id)
            if rec.state in DECODE_LIVE and (
                    routed or any(k[0] == engine_id for k in rec.claimers)):
                self._lose(rec, FailureKind.PREFILL_LOST,
                           f"prefill engine {engine_id} lost: {reason}", engine_id, now, out)
        return out

    def peer_answered(self, responder: Sender, now: float) -> list[Effect]:
        """A P worker answered our heartbeat: a new incarnation at the address we watch means
        the old process is gone (a quick restart answers heartbeats, so silence never shows)."""
        out: list[Effect] = []
        self._note_incarnation(responder, "", now, out)
        return out

    def prefill_routed(self, req_id: str, engine_id: str, addr: str, epoch: int,
                       now: float) -> list[Effect]:
        """The driver sent epoch ``epoch`` of a request's prefill to the P worker at ``addr``
        (engine ``engine_id``): watch it from now on, claimed or not."""
        rec = self._reqs.get(req_id)
        if rec is not None and rec.state in DECODE_LIVE and epoch == rec.epoch:
            rec.route = (engine_id, addr)
            self.timeline.record(now, req_id, "routed", rec.state, rec.state,
                                 f"epoch {epoch} to P {engine_id}")
        return []

    def _other_epoch(self, rec: DecodeRecord, epoch: int, now: float) -> bool:
        """Whether a message of claim epoch ``epoch`` belongs to another epoch (then it is
        counted and must not act on the request)."""
        if epoch == rec.epoch:
            return False
        self._fire(rec, "stale_epoch", now, f"epoch {epoch}, current {rec.epoch}")
        self.counters["stale_epoch"] += 1
        return True

    def _note_incarnation(self, sender: Sender, claim_of: str, now: float,
                          out: list[Effect]) -> None:
        """A higher incarnation of a P worker means the old process is gone: fail its claims
        (``claim_of``: the request the message claims, if it is a claim)."""
        key = (sender.engine_id, sender.rank)
        prev = self._incarnations.get(key)
        if prev is None:
            if len(self._incarnations) < 65536:  # bounded: forged senders cannot grow it forever
                self._incarnations[key] = sender.incarnation
            return
        if sender.incarnation <= prev:
            return
        self._incarnations[key] = sender.incarnation
        self.counters["peer_restarts"] += 1
        self._restarted(sender, prev, claim_of, now, out)

    # ----------------------------------------------------------------------------- messages

    def _on_done(self, msg: DoneSending, now: float, out: list[Effect]) -> None:
        rec = self._reqs.get(msg.req_id)
        if rec is None:
            fin = self._stale(msg)
            out.append(ack(self.me, msg, "done", fin == DONE))
            return
        if self._other_epoch(rec, msg.epoch, now):
            out.append(ack(self.me, msg, "done", False))
            return
        key = (msg.sender.engine_id, msg.sender.rank)
        if key not in rec.claimers:
            raise ProtocolError("decode", msg.req_id, rec.state, "sender_done",
                                f"sender {key} was never accepted for this request")
        problem = ""
        if msg.num_layers != len(self.layout.layers):
            problem = (f"sender {key} reports {msg.num_layers} layers, we have "
                       f"{len(self.layout.layers)}")
        elif msg.num_blocks is not None and msg.num_blocks != len(rec.blocks):
            problem = (f"sender {key}'s DONE covers {msg.num_blocks} blocks, we receive "
                       f"{len(rec.blocks)}")
        if problem:
            # A DONE that does not describe our request: the sender's view of it differs from
            # ours, so nothing says its writes have ended (found by the model checker with a P
            # that sends DONE per chunk). Refused; the blocks stay quarantined until the sender
            # confirms it stopped (its FailedSending after the refusal) or the lease ends.
            self._fail(rec, FailureKind.BAD_DONE, problem, now, out)
            self._fire(rec, "sender_done", now)
            out.append(ack(self.me, msg, "done", False))
            return
        if rec.state in (FAILED, FENCING):
            self._fire(rec, "sender_done", now)
            rec.stopped.add(key)
            out.append(ack(self.me, msg, "done", False))
            self._maybe_release(rec, out)
            self._maybe_quiet(rec, now, out)
            return
        if self.config.kv_checksum:
            # Only our memory says whether the bytes match: ask for its sums over every sender
            # this DONE verifies; on_sums finishes the DONE with the answer, in the same
            # interpreter call (no other event comes between: lw.fsm.effects).
            rec.asked = msg
            plans = tuple(self._plan(rec, k) for k in self._to_verify(rec, key))
            out.append(SumBlocks(rec.req_id, self.layout, plans))
            return
        self._sender_done(rec, key, msg, now, out)

    def _sender_done(self, rec: DecodeRecord, key: SenderKey, msg: DoneSending, now: float,
                     out: list[Effect]) -> None:
        """A sender's DONE is accepted: count it, and finish the request at the last one."""
        self._fire(rec, "sender_done", now, f"P {key[0]} rank {key[1]}")
        rec.done.add(key)
        out.append(ack(self.me, msg, "done", True))
        if rec.state != DONE and len(rec.done) == rec.expected:
            self._fire(rec, "all_done", now)
            out.append(CancelTimer(("deadline", rec.req_id)))
            out.append(RecvDone(rec.req_id))
            self.counters["done"] += 1
            self._keep_done_claim(rec)  # P's first token may still come
            self._forget(rec)

    def _on_failed(self, msg: FailedSending, now: float, out: list[Effect]) -> None:
        rec = self._reqs.get(msg.req_id)
        if rec is None:
            self._stale(msg)
            out.append(ack(self.me, msg, "failed", False))
            return
        if self._other_epoch(rec, msg.epoch, now):
            out.append(ack(self.me, msg, "failed", False))
            return
        key = (msg.sender.engine_id, msg.sender.rank)
        if key not in rec.claimers:
            raise ProtocolError("decode", msg.req_id, rec.state, "fail",
                                f"FailedSending from {key}, which was never accepted")
        if not msg.in_doubt:  # in doubt: a timed-out write may still land; the lease decides
            rec.stopped.add(key)
        if rec.state not in DECODE_LIVE:
            self._fire(rec, "fail" if rec.state == DONE else "sender_stopped", now)
            out.append(ack(self.me, msg, "failed", False))
            self._maybe_release(rec, out)
            self._maybe_quiet(rec, now, out)
            return
        out.append(ack(self.me, msg, "failed", True))
        # The sender's failure report: another P may succeed where it did not (budget allowing).
        self._lose(rec, FailureKind.PREFILL_FAILED, f"prefill sender {key} failed: {msg.reason}",
                   key[0], now, out)

    def _on_abort_ack(self, msg: AbortAck, now: float, out: list[Effect]) -> None:
        rec = self._reqs.get(msg.req_id)
        if rec is None:
            self._stale(msg)
            return
        if msg.epoch != rec.epoch:  # an earlier epoch's sender; it was quiet before this one
            self.counters["stale_epoch"] += 1
            return
        key = (msg.sender.engine_id, msg.sender.rank)
        if rec.state not in (FAILED, FENCING):
            raise ProtocolError("decode", msg.req_id, rec.state, "sender_stopped",
                                "AbortAck for a request we did not abort")
        self._fire(rec, "sender_stopped", now)
        if not msg.in_doubt:
            rec.stopped.add(key)
        self._maybe_release(rec, out)
        self._maybe_quiet(rec, now, out)

    # ----------------------------------------------------------------------------- helpers
    def _to_ghost(self, msg: Message, now: float, out: list[Effect]) -> bool:
        """Whether a message of an abandoned epoch went to its ghost (its effects into out)."""
        if not isinstance(msg, DoneSending | FailedSending | AbortAck):
            return False
        rec = self._reqs.get(msg.req_id)
        got = self._ghosts.take(msg, None if rec is None else rec.epoch, now)
        out += got or ()
        return got is not None

    def _stale(self, msg: Message) -> str:
        rid = getattr(msg, "req_id", "?")
        fin = self._finished.get(rid)
        if fin is None:
            if isinstance(msg, DoneSending | FailedSending):
                # Not ours (we restarted, or forgot it): "not accepted" lets the sender fail
                # now instead of retrying DONE until its attempts run out.
                self.counters["unknown_requests"] += 1
                return FAILED
            raise ProtocolError("decode", rid, "UNKNOWN", type(msg).__name__,
                                f"no such request on D {self.me.engine_id}")
        self.counters["stale_messages"] += 1
        return fin

    def _fail(self, rec: DecodeRecord, kind: FailureKind, reason: str, now: float,
              out: list[Effect]) -> None:
        """Fail a live request for ``kind`` (decided here, by the caller: never read back from
        the words of ``reason``): quarantine its blocks or, no sender pending, release them."""
        if rec.state in _FINAL:
            self._fire(rec, "fail", now)
            return
        fenced = rec.state == FENCING  # its lease runs already, from when the epoch was lost
        self._fire(rec, "fail", now, Failure(kind, reason))
        rec.reason = reason
        rec.kind = kind
        out.append(CancelTimer(("deadline", rec.req_id)))
        pending = [s for k, s in rec.claimers.items() if k not in rec.stopped]
        if not pending:
            self._release(rec, out)
            return
        out.append(Quarantine(rec.req_id, rec.blocks, reason, kind))
        for sender in pending:
            abort = Abort(PROTOCOL_VERSION, rec.req_id, self.me, reason[:MAX_TEXT], rec.epoch)
            out.append(Send(sender.addr, abort))
        if not fenced:
            rec.deadline = now + self.config.lease_s
            out.append(ArmTimer(("lease", rec.req_id), rec.deadline))

    def _maybe_release(self, rec: DecodeRecord, out: list[Effect]) -> None:
        if rec.state == FAILED and all(k in rec.stopped for k in rec.claimers):
            out.append(CancelTimer(("lease", rec.req_id)))
            self._release(rec, out)

    def _release(self, rec: DecodeRecord, out: list[Effect]) -> None:
        if self._reqs.get(rec.req_id) is not rec:
            return
        self.counters["failed"] += 1
        out.append(RecvFailed(rec.req_id, rec.blocks, rec.reason, rec.kind))
        self._forget(rec)

    def _forget(self, rec: DecodeRecord) -> None:
        del self._reqs[rec.req_id]
        self._finished[rec.req_id] = rec.state
        while len(self._finished) > self.config.finished_memory:
            self._finished.popitem(last=False)


# What snapshot() leaves out or abstracts, and why. Every other field of the endpoint and of its
# records is in the snapshot (lw/fsm/snapshot.py): a field added later is hashed by default.
SNAPSHOT_RULES: Rules = {
    DecodeEndpoint: {
        **ENDPOINT_RULES,
        "layout": (OMIT, "fixed when made (own layout)"),
        "_done_claims": (UNORDERED, "its order only decides which claim is forgotten past "
                                    "finished_memory (4096) requests"),
    },
    DecodeRecord: {**RECORD_RULES,
                   "kind": (OMIT, "why it failed, as data: set with the reason, copied into "
                                  "reports, never decided on")},
    **GHOST_RULES,
}
