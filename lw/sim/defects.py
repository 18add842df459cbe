"""Endpoints that re-create bugs found in the wild, as the smallest change to the real ones.

Each class subclasses :class:`~lw.fsm.PrefillEndpoint` or :class:`~lw.fsm.DecodeEndpoint` and
changes one decision (usually by filtering or rewriting the effects the real code returns), so
that the checker runs lw's own protocol with exactly that defect put back. They are for
``lw check --design NAME`` only (see :mod:`lw.sim.variants`); nothing in production uses them.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from lw.fsm import (
    ArmTimer,
    CancelTimer,
    DecodeEndpoint,
    Effect,
    PrefillEndpoint,
    PrefillRequest,
    Send,
)
from lw.fsm.decode_request import DecodeRecord
from lw.fsm.effects import Granted, KeptSums, TimerKey
from lw.fsm.failures import FailureKind
from lw.fsm.lifecycles import AHEAD, DONE, FAILED, RECEIVING
from lw.fsm.messages import (
    PROTOCOL_VERSION,
    AbortAck,
    DoneSending,
    FailedSending,
    FirstToken,
    KVLayout,
    Message,
    MetaReply,
    MetaRequest,
)
from lw.fsm.prefill_request import PrefillRecord
from lw.fsm.silence import fixed_budget_loses

_FINAL = (DONE, FAILED)


class _LayoutOutlivesRestart(PrefillEndpoint):
    """The #4650 defects' common part: a D worker's layout is never forgotten, and ``_confirm``
    says what P makes of a restarted D's acceptance that comes without a layout."""

    def _forget_layout(self, addr: str) -> None:
        return None  # a lost or restarted peer keeps its cached layout

    def _confirm(self, msg: MetaReply, cached: KVLayout) -> MetaReply:
        raise NotImplementedError

    def on_message(self, msg: Message, now: float) -> list[Effect]:
        """A reply without a layout confirms the cached one, whatever its incarnation."""
        if isinstance(msg, MetaReply) and msg.status == "accepted" and msg.layout is None:
            cached = self.layouts.get(msg.responder.addr)
            if cached is not None and cached.incarnation != msg.responder.incarnation:
                msg = self._confirm(msg, cached)
        return super().on_message(msg, now)


class StaleLayoutCache(_LayoutOutlivesRestart):
    """vllm-ascend #4650: D's layout is cached per D address with no notion of incarnation.

    A restarted D's answer is taken as confirming the cached layout (upstream keyed the cache by
    engine and never invalidated it), so P writes at the addresses of the dead process."""

    def _confirm(self, msg: MetaReply, cached: KVLayout) -> MetaReply:
        """The cached addresses, relabelled as the new incarnation's."""
        self.layouts.by_addr[msg.responder.addr] = msgspec.structs.replace(
            cached, incarnation=msg.responder.incarnation)
        return msg


class DeadIncarnationLayout(_LayoutOutlivesRestart):
    """vllm-ascend #4650 and nothing else: D's cached layout outlives D's restart and is used as
    it is, with the dead process's addresses (and its incarnation): P takes the restarted D's
    reply as coming from the process whose layout it holds."""

    def _confirm(self, msg: MetaReply, cached: KVLayout) -> MetaReply:
        """The reply, as if the dead process had sent it."""
        who = msgspec.structs.replace(msg.responder, incarnation=cached.incarnation)
        return msgspec.structs.replace(msg, responder=who)


SUFFIX = "-7f3a"  # what vLLM appends to a request id inside the engine (vllm #27987)


class SuffixedRequestId(PrefillEndpoint):
    """vllm-ascend #6360: DONE carries P's engine-internal request id (with vLLM's random
    suffix) instead of the id D registered, so D can never match it."""

    def _done_msg(self, rec: object, checksums: list[int]) -> DoneSending:
        msg = super()._done_msg(rec, checksums)  # type: ignore[arg-type]
        return msgspec.structs.replace(msg, req_id=msg.req_id + SUFFIX)


class MetaErrorKillsWorker(PrefillEndpoint):
    """vllm-ascend #7514: when P cannot get a dead D's metadata, the error is raised inside the
    forward pass (the layer hook) and the P worker dies, instead of failing the request."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.meta_errors: set[str] = set()

    def _fail(self, rec: object, reason: str, now: float, out: list[Effect]) -> None:
        if "decoder lost" in reason or "did not accept" in reason:
            self.meta_errors.add(rec.req.req_id)  # type: ignore[attr-defined]
        super()._fail(rec, reason, now, out)  # type: ignore[arg-type]

    def layer_computed(self, layer: int, req_ids: Iterable[str], now: float) -> list[Effect]:
        """Raise for a request whose decoder metadata could not be obtained."""
        rids = list(req_ids)
        bad = sorted(self.meta_errors.intersection(rids))
        if bad:
            raise RuntimeError(f"update_decoder_info failed for {', '.join(bad)}")
        return super().layer_computed(layer, rids, now)

    def snapshot(self) -> tuple:
        """The core's snapshot plus the remembered metadata errors."""
        return (super().snapshot(), tuple(sorted(self.meta_errors)))


class NoAckTimeout(PrefillEndpoint):
    """vllm-ascend #7855: after DONE, P waits for D's acknowledgement with no timeout (no ack
    retry, and the request deadline no longer applies once every layer is sent)."""

    def _send_done(self, rec: object, out: list[Effect]) -> None:
        super()._send_done(rec, out)  # type: ignore[arg-type]
        out.append(CancelTimer(("deadline", rec.req.req_id)))  # type: ignore[attr-defined]

    def transfer_done(self, req_id: str, layer: int, ok: bool, reason: str, now: float,
                      in_doubt: bool = False) -> list[Effect]:
        """The real completion, without the acknowledgement timer."""
        out = super().transfer_done(req_id, layer, ok, reason, now, in_doubt)
        return [e for e in out if not (isinstance(e, ArmTimer) and e.key[0] == "ack")]


class DoneSentOnce(PrefillEndpoint):
    """vllm-ascend #8166: DONE is sent once; when it is lost P never sends it again (it gives up
    when its acknowledgement does not come)."""

    def on_timer(self, key: TimerKey, now: float) -> list[Effect]:
        """The real timer, without the DONE resend."""
        out = super().on_timer(key, now)
        if key[0] != "ack":
            return out
        return [e for e in out if not (isinstance(e, KeptSums) or (
            isinstance(e, Send) and isinstance(e.msg, DoneSending)))]


class FailedWriteAsDone(PrefillEndpoint):
    """vllm-ascend #8959: a failed layer transfer is counted as complete, so P reports DONE
    for KV that never arrived."""

    def transfer_done(self, req_id: str, layer: int, ok: bool, reason: str, now: float,
                      in_doubt: bool = False) -> list[Effect]:
        """Every completion is taken as a success."""
        return super().transfer_done(req_id, layer, True, "", now)


def _free_at_once(ep: DecodeEndpoint, req_id: str) -> None:
    """Count every accepted sender of a live request as stopped: failing it frees at once."""
    rec = ep.record(req_id)
    if rec is not None and rec.state not in _FINAL:
        rec.stopped.update(rec.claimers)


class AbortFreesAtOnce(DecodeEndpoint):
    """vLLM #48633 (C1): D's abort frees the request's blocks at once (no quarantine) while P
    may still be writing into them."""

    def abort(self, req_id: str, reason: str, now: float,
              kind: FailureKind = FailureKind.ABORTED) -> list[Effect]:
        """Abort, releasing the blocks without waiting for the senders."""
        _free_at_once(self, req_id)
        return super().abort(req_id, reason, now, kind)


class DeadlineFreesAtOnce(DecodeEndpoint):
    """issue 12 (4c): when D's own deadline fires it frees the blocks at once, although a P
    write may be in flight (found only by a unit test until the clock became abstract)."""

    def on_timer(self, key: TimerKey, now: float) -> list[Effect]:
        """The deadline releases the blocks without waiting for the senders."""
        if key[0] == "deadline":
            _free_at_once(self, key[1])
        return super().on_timer(key, now)


class NoDeadline(DecodeEndpoint):
    """vLLM #46283: D has no deadline for a request whose P never reports, so its blocks are
    never reclaimed."""

    def add_request(self, req_id: str, block_ids: tuple[int, ...],
                    expected_senders: int | Iterable[int], now: float) -> list[Effect]:
        """Register the request without arming its deadline."""
        out = super().add_request(req_id, block_ids, expected_senders, now)  # type: ignore[arg-type]
        return [e for e in out if not isinstance(e, ArmTimer)]


class LeaseFreesInFlight(DecodeEndpoint):
    """vLLM #41383's lease (and lw before issue 40): the end of the lease frees or reuses a
    request's blocks at once, on the premise that a write given up on lands within its timeout
    or never; no fence stops the bytes a lossy link still carries."""

    def _lease_over(self, rec: DecodeRecord, now: float, out: list[Effect]) -> None:
        self._quiet(rec, now, out)


class FenceFailureTrusted(DecodeEndpoint):
    """A driver's fence that did not hold taken as held: D frees or reuses the blocks after a
    fence whose cut connections were never closed (a fence reported by its start, not its
    outcome)."""

    def data_fenced(self, req_id: str, epoch: int, ok: bool, reason: str,
                    now: float) -> list[Effect]:
        return super().data_fenced(req_id, epoch, True, reason, now)


class LeaseOnlyFence(LeaseFreesInFlight):
    """The same lease, and nothing ties the bytes in D's blocks to the claim (lw with
    kv_checksum off): a late write is decoded as the next claim's KV."""

    def _verify(self, rec: object, key: tuple[str, int], msg: DoneSending,
                local: object) -> None:
        return None


class DoneAfterLastChunk(PrefillEndpoint):
    """Progressive push, DONE counted per chunk: P sends DONE once every write of the prompt's
    last chunk has completed, although a write of an earlier chunk is still in flight (a
    sender that tracks completions per chunk and takes the last chunk's as the request's;
    only a data plane that completes writes out of order reaches it)."""

    def transfer_done(self, req_id: str, seq: int, ok: bool, reason: str, now: float,
                      in_doubt: bool = False) -> list[Effect]:
        """The real completion, then DONE as soon as the last chunk is written."""
        out = super().transfer_done(req_id, seq, ok, reason, now, in_doubt)
        rec = self.record(req_id)
        if rec is None or rec.state in _FINAL or not rec.final or rec.ack_tries:
            return out
        last = rec.limit - self.num_layers  # the last chunk's first write
        if rec.submitted == rec.limit and not any(s >= last for s in rec.pending):
            self._send_done(rec, out)
            out.append(ArmTimer(("ack", req_id), now + self.config.ack_retry_s))
        return out


class DonePerChunk(PrefillEndpoint):
    """Progressive push with a one-shot DONE path run per chunk: once every write of a chunk
    has completed, P sends a DONE covering the blocks written so far (the core sends one DONE,
    after the last chunk)."""

    def transfer_done(self, req_id: str, seq: int, ok: bool, reason: str, now: float,
                      in_doubt: bool = False) -> list[Effect]:
        """The real completion, then a DONE for each chunk fully written but the last."""
        rec = self.record(req_id)
        before = rec.sent if rec is not None else 0
        out = super().transfer_done(req_id, seq, ok, reason, now, in_doubt)
        L = self.num_layers
        if rec is None or rec.state in _FINAL or rec.sent // L == before // L:
            return out
        if rec.final and rec.sent == rec.limit:
            return out  # the last chunk: the real DONE went out
        done = sum(len(local) for local, _remote in rec.chunks[:rec.sent // L])
        msg = DoneSending(PROTOCOL_VERSION, req_id, self.me, rec.req.expected_senders, L,
                          num_blocks=done)
        out += [Send(t.addr, msg) for t in rec.targets]  # no sums: refused for its blocks first
        return out


class DoneCoversAll(DecodeEndpoint):
    """D counts a sender done at its DONE without checking which blocks it covers (the core
    refuses a DONE whose ``num_blocks`` is not the request's)."""

    def on_message(self, msg: Message, now: float) -> list[Effect]:
        """The real handler, told that every DONE covers every block."""
        if isinstance(msg, DoneSending) and msg.num_blocks is not None:
            msg = msgspec.structs.replace(msg, num_blocks=None)
        return super().on_message(msg, now)


class ClaimBlocksUnchecked(DecodeEndpoint):
    """D before protocol 3: a sender is accepted for a request whatever D blocks its prefill
    was started with (the claim named only the request), so a forged or mistaken metaserver
    call aims P's writes at another request's blocks."""

    def _claim_problem(self, rec: object, msg: MetaRequest) -> str:  # type: ignore[override]
        honest = msgspec.structs.replace(msg, blocks=rec.blocks)  # type: ignore[attr-defined]
        return super()._claim_problem(rec, honest)  # type: ignore[arg-type]


class RetryUnfenced(DecodeEndpoint):
    """Prefill failover without fencing: the lost P's senders are taken as stopped, so the new
    claim epoch starts at once in the same blocks while the old epoch's bytes may still land
    (sgl#24527's late writer into reused pages, within one request)."""

    def _lose(self, rec: DecodeRecord, kind: FailureKind, reason: str, engine_id: str,
              now: float, out: list[Effect]) -> None:
        if rec.retries < self.config.retry_prefill:
            rec.stopped |= set(rec.claimers)
        super()._lose(rec, kind, reason, engine_id, now, out)


class RetryUnbounded(DecodeEndpoint):
    """Prefill failover without a budget: every lost P is retried, however often it happened
    (an abort storm when the prefills keep failing, sgl#28651's class)."""

    def _lose(self, rec: DecodeRecord, kind: FailureKind, reason: str, engine_id: str,
              now: float, out: list[Effect]) -> None:
        rec.retries = 0
        super()._lose(rec, kind, reason, engine_id, now, out)


class GhostReleasedAtOnce(DecodeEndpoint):
    """Prefill failover into fresh blocks whose old blocks go back at once: the new epoch
    receives elsewhere, so the old blocks look unused, and they are freed while a write of the
    lost epoch may still land in them (over whatever request the scheduler gives them to)."""

    def on_fresh(self, answer: Granted, now: float) -> list[Effect]:
        out = super().on_fresh(answer, now)
        rid, epoch = answer.ask.req_id, answer.ask.epoch - 1
        if (rid, epoch) in self._ghosts.held and answer.blocks is not None:
            out += self._ghosts.release(rid, epoch, "released at once", now)
        return out


class BadTransferFailed(DecodeEndpoint):
    """A transfer whose bytes fail D's checksums fails its request at once, whatever the
    prefill retry budget (lw before issue 40): a live P could have prefilled it again."""

    def _lose(self, rec: DecodeRecord, kind: FailureKind, reason: str, engine_id: str,
              now: float, out: list[Effect]) -> None:
        if kind is FailureKind.CHECKSUM_MISMATCH:
            self._fail(rec, kind, reason, now, out)
            return
        super()._lose(rec, kind, reason, engine_id, now, out)


class GhostTrustsInDoubt(DecodeEndpoint):
    """Prefill failover into fresh blocks whose ghost takes any answer of an old sender as its
    stop: an AbortAck or FailedSending that says a write of that epoch is in doubt releases the
    old blocks as a clean one would, while that write may still land in them."""

    def _to_ghost(self, msg: Message, now: float, out: list[Effect]) -> bool:
        if (isinstance(msg, AbortAck | FailedSending) and msg.in_doubt
                and (msg.req_id, msg.epoch) in self._ghosts.held):
            msg = msgspec.structs.replace(msg, in_doubt=False)
        return super()._to_ghost(msg, now, out)


class FixedBudgetPrefill(PrefillEndpoint):
    """A heartbeat lease with one fixed budget: a D silent past it is lost, however alive
    its process (lw before issue 40; most heartbeat leases)."""

    silence_loses = staticmethod(fixed_budget_loses)


class FixedBudgetDecode(DecodeEndpoint):
    """The same fixed budget on D's side, for the P it waits on."""

    silence_loses = staticmethod(fixed_budget_loses)



class AheadIgnoresHit(PrefillEndpoint):
    """Computing ahead: the bind pairs P's blocks with D's from the prompt's first block on, as
    if D held no prefix of its own: with a hit, P's prefix blocks go into D's suffix slots."""

    def bind(self, req: PrefillRequest, first: int, now: float) -> list[Effect]:
        rec = self._reqs.get(req.req_id)
        if rec is not None and rec.state == AHEAD and first:
            left = len(req.remote_blocks)  # P's first blocks, as many as D asks for
            raw = [local for local, _remote in rec.chunks]
            rec.chunks, rec.local, rec.limit, rec.announced = [], (), 0, 0
            for local in raw:
                take = local[:max(0, left)]
                left -= len(take)
                self._announce(rec, take)
            first = 0
        return super().bind(req, first, now)


class LateBindResurrects(PrefillEndpoint):
    """Computing ahead: a bind that comes after P dropped the request (its blocks freed) takes
    it up again, its layers remembered as computed, and writes from the freed blocks."""

    def bind(self, req: PrefillRequest, first: int, now: float) -> list[Effect]:
        rid = req.req_id
        old = self._dropped.get(rid)
        if rid not in self._reqs and old is not None:
            chunks, final, computed = old
            self._finished.pop(rid, None)
            out = self.add_ahead(rid, chunks[0], final and len(chunks) == 1, req.prompt, now)
            for i, local in enumerate(chunks[1:], 1):
                out += self.add_chunk(rid, local, final and i == len(chunks) - 1, now)
            self._reqs[rid].computed = computed
            return out + super().bind(req, first, now)
        return super().bind(req, first, now)

    def _maybe_release(self, rec: PrefillRecord, out: list[Effect]) -> None:
        if rec.state == FAILED and rec.inflight == 0 and not rec.targets:
            self._dropped[rec.req.req_id] = ([local for local, _r in rec.chunks], rec.final,
                                             rec.computed)
        super()._maybe_release(rec, out)

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._dropped: dict[str, tuple[list[tuple[int, ...]], bool, int]] = {}


class AheadNeverDropped(PrefillEndpoint):
    """Computing ahead with no deadline: a prefill computed ahead that is never bound (its D
    died, or held the whole prompt) keeps P's blocks for ever."""

    def add_ahead(self, req_id: str, local_blocks: tuple[int, ...], final: bool, prompt: str,
                  now: float) -> list[Effect]:
        out = super().add_ahead(req_id, local_blocks, final, prompt, now)
        return [e for e in out if not isinstance(e, ArmTimer)]


class StaleEpochToken(DecodeEndpoint):
    """A first token matched by request id alone: P's token of a claim epoch D left (the
    prefill it gave up) is taken for the request's current epoch, which has none yet."""

    def _on_first_token(self, msg: FirstToken, now: float, out: list[Effect]) -> None:
        rec = self._reqs.get(msg.req_id)
        if (rec is not None and msg.epoch != rec.epoch and rec.state == RECEIVING
                and rec.token_epoch != rec.epoch and self.config.first_token_from_p):
            rec.token_epoch = rec.epoch
            self._take_token(rec, msg, now, out)
            return
        super()._on_first_token(msg, now, out)
