"""What each live request waits for, in words: the rows of ``lw status`` and the stuck alarm.
(What a failed one failed of is data: lw.fsm.failures.)

The endpoints know, for every request, its declared state and the event that would move it;
these functions turn that into :class:`RequestStatus` rows. Pure: ``now`` is an argument.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from lw.fsm.lifecycles import (
    AHEAD,
    AWAIT_DECODER_META,
    DONE,
    FAILED,
    FENCING,
    PREFILL_REQUESTED,
    RECEIVING,
)
from lw.fsm.messages import MAX_TEXT, RequestStatus, Sender

if TYPE_CHECKING:
    from lw.fsm.decode_request import DecodeConfig
    from lw.fsm.decode_request import DecodeRecord as DReq
    from lw.fsm.prefill_request import PrefillConfig
    from lw.fsm.prefill_request import PrefillRecord as PReq


class PrefillEndpoint(Protocol):
    """What a P row needs of its endpoint (lw.fsm.prefill.PrefillEndpoint has it)."""

    @property
    def config(self) -> PrefillConfig: ...

    @property
    def num_layers(self) -> int: ...


class DecodeEndpoint(Protocol):
    """What a D row needs of its endpoint (lw.fsm.decode.DecodeEndpoint has it)."""

    @property
    def config(self) -> DecodeConfig: ...


def _join(xs: list[str], limit: int = 4) -> str:
    return ", ".join(xs[:limit]) + (f" and {len(xs) - limit} more" if len(xs) > limit else "")


def prefill_row(ep: PrefillEndpoint, rec: PReq, now: float) -> RequestStatus:
    """One P request: its state, what it waits for and from which D workers."""
    cfg = ep.config
    L = ep.num_layers
    st = rec.state
    peers: list[str] = []
    one = rec.final and rec.limit <= L  # pushed in one chunk: count layers
    total = L if one else rec.limit
    unit = "layers" if one else (f"layer writes ({len(rec.chunks)} chunk(s)"
                                 + (")" if rec.final else " so far, more to come)"))
    if st == AHEAD:
        what = (f"computed ahead, waiting for D's parameters (bind); {rec.computed} of {total} "
                f"{unit} computed")
    elif st == AWAIT_DECODER_META:
        peers = [t.addr for t in rec.targets if not t.accepted]
        what = (f"waiting for MetaReply(accepted) from D {_join(peers)} (try {rec.meta_tries} "
                f"of {cfg.meta_attempts}); {rec.computed} of {total} {unit} computed")
    elif st == FAILED:
        peers = [t.addr for t in rec.targets]
        what = (f"failed ({rec.reason}); waiting for {rec.inflight} write(s) in flight to D "
                f"{_join(peers)} to end before the blocks go back to the scheduler")
    elif not rec.final or rec.sent < rec.limit:
        peers = [t.addr for t in rec.targets]
        what = (f"writing: {rec.sent} of {total} {unit} written to D {_join(peers)}, "
                f"{rec.inflight} write(s) in flight, {rec.computed} of {total} computed")
        if rec.computed < rec.limit and rec.computed <= rec.sent:
            what += f"; waiting for the forward pass to compute layer {rec.computed % L}" + (
                "" if one else f" of chunk {rec.computed // L}")
        elif rec.computed == rec.limit and not rec.final:
            what += "; waiting for the scheduler's next chunk"
    elif st != DONE:
        peers = [t.addr for t in rec.targets if not t.acked]
        what = (f"waiting for Ack of DoneSending from D {_join(peers)} (try {rec.ack_tries} of "
                f"{cfg.ack_attempts})")
    else:
        what = "done; releasing"
    return RequestStatus(
        req_id=rec.req.req_id, state=st, in_state_s=now - rec.since, waiting_for=what[:MAX_TEXT],
        deadline_in_s=rec.deadline - now, blocks=len(rec.local), peers=peers[:64],
        layers_done=rec.sent, layers_total=total,
        stuck=now - rec.since > cfg.stuck_fraction * prefill_span(ep, rec))


def decode_row(ep: DecodeEndpoint, rec: DReq, now: float) -> RequestStatus:
    """One D request: its state, which P senders it waits for, its deadline or lease."""
    cfg = ep.config
    st = rec.state
    claimers = rec.claimers
    peers: list[str] = []
    unclaimed = ("" if rec.ranks is None else
                 _join([f"P TP rank {r}" for r in sorted(rec.ranks - set(rec.by_rank))]))
    if st == PREFILL_REQUESTED:
        who = unclaimed or f"{rec.expected} P sender(s)"
        where = f"P {rec.route[0]}" if rec.route else "P (prefill not started there yet?)"
        what = f"waiting for MetaRequest from {who} of {where}, epoch {rec.epoch}"
    elif st == RECEIVING:
        waiting = [s for k, s in claimers.items() if k not in rec.done]
        peers = [s.addr for s in waiting]
        names = [f"P {s.engine_id} rank {s.rank}" for s in waiting]
        if unclaimed:
            names.append(f"{unclaimed} (not claimed yet)")
        what = (f"waiting for DoneSending from {_join(names)}; {len(rec.done)} of "
                f"{rec.expected} sender(s) done")
    else:  # FAILED: quarantined until every accepted sender stopped, or the lease ends
        waiting = [s for k, s in claimers.items() if k not in rec.stopped]
        peers = [s.addr for s in waiting]
        names = [f"P {s.engine_id} rank {s.rank}" for s in waiting]
        until = ("the data-plane fence of their host(s) (lease over)" if rec.fencing
                 else "the lease")
        what = (f"{'fenced before a re-prefill' if st == FENCING else 'quarantined'} "
                f"({rec.reason}); waiting for FailedSending/AbortAck from {_join(names)} or "
                f"{until}")
    return RequestStatus(
        req_id=rec.req_id, state=st, in_state_s=now - rec.since, waiting_for=what[:MAX_TEXT],
        deadline_in_s=rec.deadline - now, blocks=len(rec.blocks), peers=peers[:64],
        quarantined=st in (FAILED, FENCING),
        stuck=now - rec.since > cfg.stuck_fraction * decode_span(ep, rec))


def prefill_span(ep: PrefillEndpoint, rec: PReq) -> float:
    """The deadline a P request's time in one state is measured against."""
    return ep.config.ahead_wait_s if rec.state == AHEAD else ep.config.request_timeout_s


def decode_span(ep: DecodeEndpoint, rec: DReq) -> float:
    """The deadline a D request's time in one state is measured against (quarantine: lease)."""
    return ep.config.lease_s if rec.state in (FAILED, FENCING) else ep.config.prefill_timeout_s


def status_line(role: str, worker: Sender, row: RequestStatus) -> str:
    """One request on one worker as a single line (the stuck alarm logs exactly this)."""
    side = "P" if role == "prefill" else "D"
    dl = row.deadline_in_s
    when = f"deadline in {dl:.1f}s" if dl >= 0 else f"deadline passed {-dl:.1f}s ago"
    if row.quarantined:
        when = when.replace("deadline", "lease ends" if dl >= 0 else "lease")
    return (f"{side} {worker.engine_id} rank {worker.rank} request {row.req_id} {row.state} "
            f"for {row.in_state_s:.1f}s: {row.waiting_for}; {when}; {row.blocks} blocks held")
