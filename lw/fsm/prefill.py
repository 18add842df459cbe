"""The prefill-side endpoint: one P worker rank's requests, driven by events, returning effects.

Nothing here blocks or does I/O. ``layer_computed`` is the hot path: it is called once per layer
with the requests in the batch and only records the layer or emits writes for it.

A request has one or more *targets*: the D workers (TP ranks) this P rank writes into. Each target
is claimed separately (MetaRequest / MetaReply), receives its own per-layer writes (the byte runs
of each block that carry the heads both hold, see :mod:`lw.fsm.kvmap`) and its own DoneSending.
The request's lifecycle moves as one: META_READY once every target accepted, LAYER_k_SENT once
layer k reached every target, DONE once every target acknowledged. A rank with no target (MLA
with more P ranks than D ranks) has nothing to send and finishes at once.

Progressive push (chunked prefill): a request may be added at its first chunk with only the
blocks that chunk completes (``PrefillRequest.final`` false); :meth:`PrefillEndpoint.add_chunk`
announces each later chunk and its newly complete blocks. Every chunk runs every layer, and layer
k of chunk c writes chunk c's blocks of layer k as soon as it is computed. Writes are numbered in
(chunk, layer) order (``WriteLayer.seq``); DONE goes out once the last chunk's last layer and
every write before it have completed.

Computing ahead: :meth:`PrefillEndpoint.add_ahead` admits a request before D's blocks are known
(state AHEAD): its chunks are announced and its layers computed into P's own blocks, and nothing
is sent. :meth:`PrefillEndpoint.bind` hands it D's blocks (and D's prefix hit, whose blocks P
computed but does not write); from then on it is a request like any other, the layers computed
before the bind written once D accepts. Unbound after ``ahead_wait_s`` it fails and its blocks
go back; a bind that comes later is refused and writes nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from lw.fsm.effects import (
    ArmTimer,
    CancelTimer,
    Effect,
    KeptSums,
    Send,
    SendFinished,
    Sums,
    TimerKey,
)
from lw.fsm.endpoint import LifecycleEndpoint
from lw.fsm.lifecycles import (
    AHEAD,
    AWAIT_DECODER_META,
    DONE,
    FAILED,
    META_READY,
    prefill_declaration,
)
from lw.fsm.machine import ProtocolError
from lw.fsm.messages import (
    MAX_TEXT,
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    Ack,
    DoneSending,
    FailedSending,
    KVFormat,
    KVLayout,
    Message,
    MetaReply,
    MetaRequest,
    RequestStatus,
    Sender,
)
from lw.fsm.prefill_ahead import AheadBinding
from lw.fsm.prefill_first_token import FirstTokens
from lw.fsm.prefill_layouts import Layouts
from lw.fsm.prefill_replies import DecoderReplies
from lw.fsm.prefill_request import (
    PrefillConfig,
    PrefillRecord,
    PrefillRequest,
    _Target,
    checksum_problem,
)
from lw.fsm.prefill_writes import LayerWrites
from lw.fsm.snapshot import ENDPOINT_RULES, OMIT, RECORD_RULES, UNORDERED, Rules, derive
from lw.fsm.status import prefill_row, prefill_span
from lw.fsm.timeline import Timeline

_FINAL = (DONE, FAILED)


class PrefillEndpoint(LayerWrites, AheadBinding, DecoderReplies, FirstTokens,
                      LifecycleEndpoint):
    """Protocol logic of one P worker rank (events in, effects out; time is an argument).

    ``local`` describes this rank's own KV memory (per-layer block bytes and head format); with
    it, writes carry the byte runs computed from both formats. Without it blocks are opaque and
    copied whole (both sides must then have the same block bytes)."""

    SIDE = "prefill"
    IMMUTABLE = ("declaration", "_table", "config", "me", "local", "fmt")

    def __init__(self, me: Sender, num_layers: int, config: PrefillConfig | None = None,
                 local: KVLayout | None = None) -> None:
        if local is not None and len(local.layers) != num_layers:
            raise ValueError(f"local layout has {len(local.layers)} layers, not {num_layers}")
        self.me = me
        self.num_layers = num_layers
        self.config = config or PrefillConfig()
        self.local = local
        self.fmt = local.fmt if local is not None else KVFormat()
        self.declaration = prefill_declaration(num_layers)
        self._table = self.declaration.compile()
        self._reqs: dict[str, PrefillRecord] = {}
        self.layouts = Layouts(num_layers, local)  # per D worker address
        # req_id -> the claim epochs D aborted before the request reached us (_bury)
        self._tombstones: dict[str, tuple[int, ...]] = {}
        self._finished: OrderedDict[str, str] = OrderedDict()  # req_id -> final state
        self._in_doubt: set[str] = set()  # finished requests with a write whose bytes may land
        self._landed_at: dict[str, float] = {}  # D address -> when a write to it last landed
        # a request computed ahead, bound and renamed while it lives: its ahead id -> D's id.
        # A driver may bind it mid-step, after the forward queued layers under the ahead id.
        self._aliases: dict[str, str] = {}
        self._done_claims: OrderedDict = OrderedDict()  # released DONE, token due (FirstTokens)
        self._done_alias: dict[str, str] = {}
        self._sent_first: OrderedDict[str, tuple[int, str]] = OrderedDict()  # (FirstTokens)
        self.timeline = Timeline(self.config.timeline_entries)
        self._ring = self.timeline.ring
        self._durations = self.timeline.durations
        self.counters: dict[str, int] = {
            "requests": 0,
            "done": 0,
            "failed": 0,
            "deadlines": 0,
            "stale_messages": 0,
            "layer_writes": 0,
            "no_target": 0,
            "bad_chunks": 0,
            "ahead": 0,
            "late_binds": 0,
            "tombstones_forgotten": 0,
            "first_tokens_sent": 0,
            "first_tokens_refused": 0,
        }

    # ----------------------------------------------------------------------------- inspection
    def inflight_writes(self, req_id: str) -> int:
        """Writes handed to the data plane for this request and not completed yet."""
        rec = self._reqs.get(req_id)
        return rec.inflight if rec is not None else 0

    def snapshot(self) -> tuple:
        """A canonical, hashable summary of the endpoint's protocol state (for the checker):
        every field of the endpoint and its records except those SNAPSHOT_RULES names."""
        return derive(self, SNAPSHOT_RULES)

    def cached_layouts(self) -> dict[str, KVLayout]:
        """The KV layout cached per D worker address (P asks again after a D restart: the
        checker keys its states by the incarnation each one came from)."""
        return dict(self.layouts.by_addr)

    def awaited_peers(self) -> dict[str, str]:
        """D workers a live request still needs (address -> what :meth:`peer_lost` takes):
        the peers a liveness detector should watch."""
        return {t.addr: t.addr for r in self._reqs.values() if r.state not in _FINAL
                for t in r.targets}

    def _row(self, rec: PrefillRecord, now: float) -> RequestStatus:
        return prefill_row(self, rec, now)

    def _span(self, rec: PrefillRecord) -> float:
        return prefill_span(self, rec)

    def _timed(self, src: str, event: str) -> bool:
        # LAYER_k -> LAYER_k+1 is one sample per layer and request (the per-layer write
        # latency histogram covers it); a LAYER_SENT sample then means the wait for the Ack
        return event != "layer_sent" or src == META_READY

    # ----------------------------------------------------------------------------- events
    def add_request(self, req: PrefillRequest, now: float) -> list[Effect]:
        """The scheduler hands us a request to push to D (its prefill completes in this step)."""
        if req.req_id in self._reqs:
            raise ValueError(f"request {req.req_id!r} is already live on {self._who()}")
        if len(req.local_blocks) != len(req.remote_blocks) and (
                req.final or len(req.local_blocks) > len(req.remote_blocks)):
            raise ValueError(
                f"request {req.req_id!r}: {len(req.local_blocks)} local blocks but "
                f"{len(req.remote_blocks)} remote blocks"
                + ("" if req.final else " (a first chunk completes at most every block)")
            )
        if len(set(req.targets)) != len(req.targets):
            raise ValueError(f"request {req.req_id!r}: a decoder is named twice in "
                             f"{req.targets}")
        self._finished.pop(req.req_id, None)
        self._forget_done_claim(req.req_id)  # an older attempt's claim takes no token now
        self._sent_first.pop(req.req_id, None)
        rec = PrefillRecord(req, AWAIT_DECODER_META, now, now + self.config.request_timeout_s)
        if req.local_blocks or req.final:
            self._announce(rec, req.local_blocks)
        self._reqs[req.req_id] = rec
        self.counters["requests"] += 1
        self.timeline.record(now, req.req_id, "admitted", "", AWAIT_DECODER_META,
                             f"{len(req.local_blocks)} blocks to {', '.join(req.targets)}"
                             + ("" if req.final else
                                f" (first chunk; {len(req.remote_blocks)} in all)"))
        out: list[Effect] = []
        if self._tombstones and self._unbury(req.req_id, req.epoch, out):
            self._fail(rec, f"decoder aborted the request (claim epoch {req.epoch}) before it "
                            "reached this worker", now, out)
            return out
        problem = self._checksum_problem(req)
        if problem:  # refused before any claim or write: its DONE could never be taken
            self._fail(rec, problem, now, out)
            return out
        if not rec.targets:
            # This rank holds no KV that any D rank takes from it (MLA: another rank sends).
            self.counters["no_target"] += 1
            self._fire(rec, "no_target", now)
            self._maybe_release(rec, out)
            return out
        t = self.config.progress_timeout_s
        out.append(ArmTimer(("deadline", req.req_id), min(rec.deadline, now + t) if t
                            else rec.deadline))
        self._send_meta_requests(rec, now, out)
        return out

    def _checksum_problem(self, req: PrefillRequest) -> str:
        """Why the DONE of a request sent to D's blocks ``req.remote_blocks`` could not carry
        its KV checksums (kv_checksum; one per layer and block), or ""."""
        if not self.config.kv_checksum or not req.targets:
            return ""
        return checksum_problem(self.num_layers, len(req.remote_blocks))

    def _renamed(self, req_id: str) -> PrefillRecord | None:
        """The live record of a request bound under another id than ``req_id``, its id
        while it was computed ahead (a layer the forward reported before the bind reached it)."""
        new = self._aliases.get(req_id)
        return self._reqs.get(new) if new is not None else None

    def on_message(self, msg: Message, now: float) -> list[Effect]:
        """A side-channel message from a D worker arrived."""
        out: list[Effect] = []
        if isinstance(msg, MetaReply):
            self._on_meta_reply(msg, now, out)
        elif isinstance(msg, Ack):
            self._on_ack(msg, now, out)
        elif isinstance(msg, Abort):
            self._on_abort(msg, now, out)
        else:
            raise ProtocolError(
                "prefill", getattr(msg, "req_id", "?"), "-", type(msg).__name__,
                "a P worker only accepts MetaReply, Ack and Abort",
            )
        return out

    def on_timer(self, key: TimerKey, now: float) -> list[Effect]:
        """A timer armed by an earlier ArmTimer effect fired."""
        kind, rid = key
        out: list[Effect] = []
        if kind == "tomb":
            self._tombstones.pop(rid, None)
            return out
        rec = self._reqs.get(rid)
        if rec is None:
            return out  # timer of a released request: nothing depends on it any more
        if kind == "deadline":
            if rec.state == AHEAD:
                self.counters["deadlines"] += 1
                self._fail(rec, f"not bound to a decoder's parameters within ahead_wait_s="
                                f"{self.config.ahead_wait_s:g}s", now, out)
            elif rec.state not in _FINAL:
                why = self._stalled(rec, now, out)
                if why:
                    self.counters["deadlines"] += 1
                    self._fail(rec, why, now, out)
        elif kind == "meta":
            self._fire(rec, "meta_timer", now)
            if rec.state == AWAIT_DECODER_META:
                if (rec.meta_tries >= self.config.meta_attempts
                        and not self.config.resend_until_deadline):
                    self.counters["deadlines"] += 1
                    waiting = [t.addr for t in rec.targets if not t.accepted]
                    self._fail(
                        rec, f"decoder at {', '.join(waiting)} did not accept the request "
                        f"after {rec.meta_tries} MetaRequests", now, out,
                    )
                else:
                    self._send_meta_requests(rec, now, out)
        elif kind == "ack":
            self._fire(rec, "ack_timer", now)
            if rec.state not in _FINAL:
                if (rec.ack_tries >= self.config.ack_attempts
                        and not self.config.resend_until_deadline):
                    self.counters["deadlines"] += 1
                    self._fail(rec, f"no acknowledgement of DONE after {rec.ack_tries} tries",
                               now, out)
                else:
                    self._send_done(rec, out)
                    out.append(ArmTimer(("ack", rid), now + self.config.ack_retry_s))
        else:
            raise ValueError(f"unknown timer kind {kind!r} for request {rid!r}")
        return out

    def abort(self, req_id: str, reason: str, now: float) -> list[Effect]:
        """The local scheduler aborted a request (client gone, preemption, shutdown)."""
        out: list[Effect] = []
        rec = self._reqs.get(req_id)
        if rec is not None:
            self._fail(rec, f"aborted locally: {reason}", now, out)
        return out

    def peer_lost(self, decoder_addr: str, reason: str, now: float) -> list[Effect]:
        """The D worker at ``decoder_addr`` is gone or restarted: fail what it was to receive."""
        out: list[Effect] = []
        self._forget_layout(decoder_addr)
        self._landed_at.pop(decoder_addr, None)
        for rec in list(self._reqs.values()):
            t = rec.target(decoder_addr)
            if t is not None and rec.state not in _FINAL:
                # A claimed D still gets our FailedSending (fire and forget): one declared
                # lost may be alive, its protocol thread starved, and then fails or retries
                # the request at once instead of at its prefill deadline.
                self._fail(rec, f"decoder lost: {reason}", now, out)
        return out

    def link_moved(self, addr: str, now: float) -> None:
        """A write to the D worker at ``addr`` landed: every request writing there progresses
        (with ``progress_timeout_s``). The trace validator calls it for the other requests'
        writes a one-request world does not hold (a landed write of this endpoint's does the
        same inline)."""
        self._landed_at[addr] = now

    def progress_marks(self) -> tuple[Mapping[str, float], list[float]]:
        """What ``progress_timeout_s`` reads: when a write last landed per D address, and each
        request's last progress, in record order (lw validate keys its states by them)."""
        return self._landed_at, [rec.progress_at for rec in self._reqs.values()]

    def _stalled(self, rec: PrefillRecord, now: float, out: list[Effect]) -> str:
        """Why a live request whose deadline timer fired fails now, or "" (its timer armed
        again) while it still makes progress before its cap."""
        t = self.config.progress_timeout_s
        if not t or now >= rec.deadline:
            return f"deadline of {self.config.request_timeout_s}s passed"
        landed = self._landed_at
        last = max([rec.progress_at, *(landed.get(tg.addr, 0.0) for tg in rec.targets)])
        # Compared with the very time the timer is armed for: ``now - last < t`` can hold at
        # ``now == last + t`` in floating point (8.2 - 0.2 < 8), and a timer armed again for
        # the instant it fires at fires for ever without the request failing (the checker's
        # clock, which stands still between the two, found it: lw validate).
        due = last + t
        if now < due:
            out.append(ArmTimer(("deadline", rec.req.req_id), min(rec.deadline, due)))
            return ""
        return (f"no progress for {now - last:.1f}s (progress_timeout_s {t:g}s; nothing "
                f"computed, answered or landing on its decoder)")

    # ----------------------------------------------------------------------------- helpers
    def _who(self) -> str:
        return f"P {self.me.engine_id} rank {self.me.rank}"

    def _stale(self, msg: Message) -> None:
        rid = getattr(msg, "req_id", "?")
        if rid in self._finished or rid in self._reqs:
            self.counters["stale_messages"] += 1
            return
        raise ProtocolError("prefill", rid, "UNKNOWN", type(msg).__name__,
                            f"no such request on {self._who()}")

    def _forget_layout(self, addr: str) -> None:
        self.layouts.forget(addr)

    def _send_meta_requests(self, rec: PrefillRecord, now: float, out: list[Effect]) -> None:
        """(Re)send MetaRequest to every target that has not accepted yet; one retry timer."""
        rec.meta_tries += 1
        for t in rec.targets:
            if not t.accepted:
                out.append(Send(t.addr, MetaRequest(PROTOCOL_VERSION, rec.req.req_id, self.me,
                                                    self.layouts.get(t.addr) is None,
                                                    rec.req.remote_blocks, self.fmt,
                                                    rec.req.epoch, rec.req.prompt)))
        out.append(ArmTimer(("meta", rec.req.req_id), now + self.config.meta_retry_s))

    def _send_meta_request(self, rec: PrefillRecord, t: _Target, now: float,
                           out: list[Effect]) -> None:
        """Ask one target again (its layout is needed); the retry timer covers the others."""
        rec.meta_tries += 1
        out.append(Send(t.addr, MetaRequest(PROTOCOL_VERSION, rec.req.req_id, self.me,
                                            True, rec.req.remote_blocks, self.fmt,
                                            rec.req.epoch, rec.req.prompt)))
        out.append(ArmTimer(("meta", rec.req.req_id), now + self.config.meta_retry_s))

    def _send_done(self, rec: PrefillRecord, out: list[Effect]) -> None:
        rec.done_held = False
        rec.ack_tries += 1
        todo = tuple(t.addr for t in rec.targets if not t.acked)
        if self.config.kv_checksum:
            # Each target's DONE carries the CRC-32C of what we wrote there, which the driver
            # kept as the writes left (WriteLayer.checksum): ask for them; on_sums sends the
            # DONEs, in the same interpreter call (lw.fsm.effects).
            out.append(KeptSums(rec.req.req_id, todo, self.num_layers))
            return
        msg = self._done_msg(rec, [])
        out += [Send(addr, msg) for addr in todo]

    def _done_msg(self, rec: PrefillRecord, checksums: list[int]) -> DoneSending:
        """This sender's DONE for ``rec``: every layer of every block written."""
        return DoneSending(PROTOCOL_VERSION, rec.req.req_id, self.me, rec.req.expected_senders,
                           self.num_layers, checksums=checksums, num_blocks=len(rec.local),
                           epoch=rec.req.epoch)

    def on_sums(self, answer: Sums, now: float) -> list[Effect]:
        """The CRC-32C the driver kept that a :class:`KeptSums` asked for: each target's DONE
        with those of the writes to it, layer by layer."""
        ask = answer.ask
        rec = self._reqs.get(ask.req_id)
        # (a live record is not final here: DONE is asked for once every write has completed,
        # and a request that fails or ends with none in flight is released at once)
        if rec is None or not isinstance(ask, KeptSums):
            raise ProtocolError("prefill", ask.req_id, rec.state if rec else "UNKNOWN", "sums",
                                "checksums nobody asked for")
        return [Send(addr, self._done_msg(rec, [c for layer in sums for c in layer]))
                for addr, sums in zip(ask.targets, answer.sums, strict=True)]

    def _fail(self, rec: PrefillRecord, reason: str, now: float, out: list[Effect]) -> None:
        if rec.state in _FINAL:
            self._fire(rec, "fail", now)
            return
        self._fire(rec, "fail", now, reason)
        rec.reason = reason
        rid = rec.req.req_id
        self._cancel_timers(rid, out)
        # FailedSending tells D "this sender stopped": it waits in _maybe_release until no
        # write is in flight (found by the model checker: sent earlier, D freed blocks that a
        # write still landed in).
        self._maybe_release(rec, out)

    @staticmethod
    def _cancel_timers(rid: str, out: list[Effect]) -> None:
        """A final request waits for nothing: drop its retry and deadline timers."""
        for kind in ("meta", "ack", "deadline"):
            out.append(CancelTimer((kind, rid)))

    def _maybe_release(self, rec: PrefillRecord, out: list[Effect]) -> None:
        """Hand the blocks back only when final and no write can still read them."""
        if rec.state not in _FINAL or rec.inflight > 0:
            return
        rid = rec.req.req_id
        if self._reqs.get(rid) is not rec:
            return
        del self._reqs[rid]
        ok = rec.state == DONE
        self.counters["done" if ok else "failed"] += 1
        out.append(SendFinished(rid, ok, rec.reason))
        if not ok:
            for t in rec.targets:
                if t.claimed:
                    out.append(Send(t.addr, FailedSending(
                        PROTOCOL_VERSION, rid, self.me, rec.req.expected_senders,
                        rec.reason[:MAX_TEXT], rec.in_doubt, rec.req.epoch)))
        for addr in rec.abort_acks:
            out.append(Send(addr, AbortAck(PROTOCOL_VERSION, rid, self.me, known=True,
                                           in_doubt=rec.in_doubt, epoch=rec.req.epoch)))
        self._finished[rid] = rec.state
        aliases = [a for a, r in self._aliases.items() if r == rid] if self._aliases else []
        for aid in aliases:
            del self._aliases[aid]
        if ok:
            self._keep_done_claim(rec, aliases)
        if rec.in_doubt:
            self._in_doubt.add(rid)
        while len(self._finished) > self.config.finished_memory:
            self._in_doubt.discard(self._finished.popitem(last=False)[0])


# What snapshot() leaves out or abstracts, and why. Every other field of the endpoint and of its
# records is in the snapshot (lw/fsm/snapshot.py): a field added later is hashed by default.
SNAPSHOT_RULES: Rules = {
    PrefillEndpoint: {
        **ENDPOINT_RULES,
        "num_layers": (OMIT, "fixed when made"),
        "local": (OMIT, "fixed when made (own layout)"),
        "fmt": (OMIT, "fixed when made (own head format)"),
        "_tombstones": (UNORDERED, "its order only decides which tombstone is forgotten past "
                                   "tombstone_memory (65,536) request ids"),
        "_landed_at": (OMIT, "read only with progress_timeout_s on, which the checker's worlds "
                             "leave off"),
        "_aliases": (OMIT, "a driver's delivery order (a layer queued before a mid-step "
                           "bind); the worlds bind between events, so it is never read there"),
        "_done_claims": (UNORDERED, "its order only decides which claim is forgotten past "
                                    "finished_memory (4096) requests"),
        "_done_alias": (OMIT, "an index of the ahead ids _done_claims holds (a pure function "
                              "of it)"),
        "_sent_first": (OMIT, "read only to drop a repeated token instead of refusing it: "
                              "neither sends anything (only a counter differs)"),
    },
    Layouts: {
        "num_layers": (OMIT, "fixed when made"),
        "local": (OMIT, "fixed when made (own layout)"),
        "fmt": (OMIT, "fixed when made (own head format)"),
        "segs": (OMIT, "cache of a pure function of a layout (the used one is in _Target.segs)"),
    },
    PrefillRecord: {
        **RECORD_RULES,
        "progress_at": (OMIT, "read only with P's progress_timeout_s on, which the "
                              "checker's worlds leave off (their deadline is the cap alone); "
                              "lw validate turns it on for a run that had it and keys it itself "
                              "(ValidationWorld.key)"),
    },
    _Target: {},
}
