"""Which P senders may write into a D request's blocks: the answer to a ``MetaRequest`` (a
part of :class:`lw.fsm.decode.DecodeEndpoint`).

A claim is accepted only for a live request of the current claim epoch, for the block ids and
prompt D registered, in a KV format D can pair with, from a sender that the request still
expects (by P TP rank, or by count) and that together with the others writes every head.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from lw.fsm.decode_request import DecodeRecord, brief_blocks
from lw.fsm.effects import Effect, Send
from lw.fsm.kvmap import describe, expected_senders, pair_problem
from lw.fsm.lifecycles import DECODE_LIVE, FAILED, FENCING
from lw.fsm.messages import MAX_TEXT, PROTOCOL_VERSION, KVLayout, MetaReply, MetaRequest, Sender


class Claims:
    """D's answers to claims, mixed into :class:`lw.fsm.decode.DecodeEndpoint` (whose
    attributes and helpers it uses)."""

    __slots__ = ()

    me: Sender
    layout: KVLayout
    counters: dict[str, int]
    _reqs: dict[str, DecodeRecord]
    _finished: OrderedDict[str, str]

    if TYPE_CHECKING:  # the endpoint's, not overridden here
        def _fire(self, rec: DecodeRecord, trigger: str, now: float,
                  detail: str = "") -> None: ...

        def _other_epoch(self, rec: DecodeRecord, epoch: int, now: float) -> bool: ...

    def _reply(self, msg: MetaRequest, status: str, reason: str = "",
               layout: KVLayout | None = None) -> Send:
        return Send(msg.sender.addr, MetaReply(PROTOCOL_VERSION, msg.req_id, status, self.me,
                                               layout, reason[:MAX_TEXT], msg.epoch))

    def _on_meta_request(self, msg: MetaRequest, now: float, out: list[Effect]) -> None:
        rec = self._reqs.get(msg.req_id)
        if rec is None:
            if msg.req_id in self._finished:
                self.counters["refused"] += 1
                fin = self._finished[msg.req_id]
                out.append(self._reply(msg, "refused", f"request already {fin}"))
            else:
                # Not allocated here (yet, or ever): never authorises a write.
                out.append(self._reply(msg, "unknown", "no such request on this decode worker"))
            return
        if self._other_epoch(rec, msg.epoch, now):
            # A P of another prefill attempt (one we gave up on): it must never write here.
            self.counters["refused"] += 1
            out.append(self._reply(msg, "refused", f"claim epoch {msg.epoch} is not the "
                                   f"request's current epoch {rec.epoch}"))
            return
        key = (msg.sender.engine_id, msg.sender.rank)
        layout = self.layout if msg.want_layout else None
        if key in rec.claimers:
            self._fire(rec, "claim", now)
            if rec.state in (FAILED, FENCING):  # a failed or fenced epoch authorises no write
                out.append(self._reply(msg, "refused", rec.reason))
            else:
                out.append(self._reply(msg, "accepted", layout=layout))
            return
        if rec.state not in DECODE_LIVE:
            self._fire(rec, "claim", now)
            self.counters["refused"] += 1
            out.append(self._reply(msg, "refused", f"request is {rec.state}: {rec.reason}"))
            return
        why = self._claim_problem(rec, msg)
        if why:
            self.counters["refused"] += 1
            out.append(self._reply(msg, "refused", why))
            return
        if rec.ranks is not None:
            rec.by_rank[msg.fmt.tp_rank] = key
        rec.claimers[key] = msg.sender
        rec.formats[key] = msg.fmt
        self._fire(rec, "claim", now, f"P {key[0]} rank {key[1]}")
        out.append(self._reply(msg, "accepted", layout=layout))

    def _claim_problem(self, rec: DecodeRecord, msg: MetaRequest) -> str:
        """Why a new sender may not write into this request's blocks ("" if it may)."""
        if tuple(msg.blocks) != rec.blocks:
            # Its prefill was started with other block ids than D registered (a forged or
            # mistaken metaserver call): its writes would land in another request's blocks.
            return (f"the sender would write D block(s) {brief_blocks(msg.blocks)}, but this "
                    f"request receives into {brief_blocks(rec.blocks)}")
        if rec.prompt and msg.prompt != rec.prompt:
            # Its prefill computed another prompt than the one these blocks were allocated for
            # (chat template, tokenizer or a forged call): its KV would be wrong KV here.
            return (f"the sender computed prompt {msg.prompt[:8] or '(unnamed)'}, but this "
                    f"request's blocks are for prompt {rec.prompt[:8]}")
        why = pair_problem(msg.fmt, self.layout.fmt)
        if why:
            return why
        if rec.ranks is None:
            if len(rec.claimers) >= rec.expected:
                return f"request already has its {rec.expected} expected senders"
            if len(rec.claimers) + 1 == rec.expected:
                return self._uncovered(rec, msg)
            return ""
        rank = msg.fmt.tp_rank
        if rank not in rec.ranks:
            return (f"P TP rank {rank} (of {msg.fmt.tp_size}) is not a sender of this D worker, "
                    f"which expects P TP ranks {sorted(rec.ranks)} (does it know the prefill "
                    "TP size?)")
        want = expected_senders(self.layout.fmt, msg.fmt.tp_size)
        if want != rec.ranks:
            # D waits for one DONE per rank it counted; counted for another P TP size, it
            # would report the request loaded with some of its heads never written.
            return (f"a prefill of TP {msg.fmt.tp_size} writes this D worker's heads from P "
                    f"TP ranks {sorted(want)}, but it waits for ranks {sorted(rec.ranks)} only: "
                    "its prefill TP size (peer_tp_size) is not the prefill's")
        if rank in rec.by_rank:
            return f"P TP rank {rank} was already claimed by sender {rec.by_rank[rank]}"
        return ""

    def _uncovered(self, rec: DecodeRecord, msg: MetaRequest) -> str:
        """Why the last of ``expected`` senders would leave some of D's heads unwritten."""
        fmts = [*rec.formats.values(), msg.fmt]
        d = self.layout.fmt
        missing = [h for h in range(d.head_lo, d.head_hi)
                   if not any(f.head_lo <= h < f.head_hi for f in fmts)]
        if not missing:
            return ""
        return (f"with this sender the request's {rec.expected} senders would leave KV heads "
                f"{missing[0]}..{missing[-1]} of {describe(d)} unwritten")
