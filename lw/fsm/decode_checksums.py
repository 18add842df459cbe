"""Whether the bytes in a D request's blocks are what its senders wrote: KV checksums (a part of
:class:`lw.fsm.decode.DecodeEndpoint`).

With ``kv_checksum`` a sender's DONE carries CRC-32C per layer and block it wrote; D asks its
driver for the sums over its own memory (:class:`SumBlocks`) and finishes the DONE in
:meth:`Checksums.on_sums`: matching, the sender is done; differing, the epoch is lost.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from lw.fsm.decode_request import DecodeRecord, SenderKey, ack
from lw.fsm.effects import Effect, SumBlocks, SumPlan, Sums
from lw.fsm.failures import Failure, FailureKind
from lw.fsm.kvmap import block_segments
from lw.fsm.machine import ProtocolError
from lw.fsm.messages import DoneSending, KVLayout, Sender


class Checksums:
    """D's checksum verification, mixed into :class:`lw.fsm.decode.DecodeEndpoint` (whose
    attributes and helpers it uses)."""

    __slots__ = ()

    me: Sender
    layout: KVLayout
    counters: dict[str, int]
    _reqs: dict[str, DecodeRecord]

    if TYPE_CHECKING:  # the endpoint's, not overridden here
        def _lose(self, rec: DecodeRecord, kind: FailureKind, reason: str, engine_id: str,
                  now: float, out: list[Effect]) -> None: ...

        def _sender_done(self, rec: DecodeRecord, key: SenderKey, msg: DoneSending,
                         now: float, out: list[Effect]) -> None: ...

    def sum_plan(self, req_id: str, sender: SenderKey) -> SumPlan | None:
        """Where ``sender`` wrote for a live request (None if it did not claim it)."""
        rec = self._reqs.get(req_id)
        if rec is None or sender not in rec.formats:
            return None
        return self._plan(rec, sender)

    def _plan(self, rec: DecodeRecord, sender: SenderKey) -> SumPlan:
        """Our block ids in request order and, per layer, the (offset, length) runs of each
        block ``sender`` (a claimer) wrote: what its checksums cover."""
        fmt, mine = rec.formats[sender], self.layout.fmt
        n_p, n_d = fmt.head_hi - fmt.head_lo, mine.head_hi - mine.head_lo
        runs = []
        for lay in self.layout.layers:
            p_len = lay.block_len // n_d * n_p  # pair_problem made the head sizes equal
            segs = block_segments(fmt, p_len, mine, lay.block_len)
            runs.append(tuple((dst, n) for _src, dst, n in segs))
        return SumPlan(sender, rec.blocks, tuple(runs))

    def _to_verify(self, rec: DecodeRecord, key: SenderKey) -> list[SenderKey]:
        # An earlier sender's blocks were verified at its DONE, but bytes of a superseded claim
        # (an in-doubt write of a request these blocks served before) may land after that:
        # the last DONE verifies everything the request is about to be reported loaded with.
        if len(rec.done | {key}) < rec.expected:
            return [key]
        return [*sorted(rec.done - {key}), key]

    def _checksum_problem(self, rec: DecodeRecord, key: SenderKey, sent: Sequence[int],
                          kv_sums: Sequence[int]) -> Failure | None:
        """None when the sender's checksums match ours, else what differs (layer and block):
        a DONE without the checksums it owes is a bad DONE, differing bytes a mismatch."""
        who = f"sender {key[0]} rank {key[1]}"
        if not sent:
            return Failure(FailureKind.BAD_DONE, f"KV checksum: {who} sent none (is "
                                                 "kv_checksum on on the prefill side?)")
        want = len(self.layout.layers) * len(rec.blocks)
        if len(kv_sums) != want or len(sent) != want:
            return Failure(FailureKind.BAD_DONE,
                           f"KV checksum: {who} sent {len(sent)} checksums ({len(kv_sums)} "
                           f"local sums), expected {want} ({len(self.layout.layers)} layers x "
                           f"{len(rec.blocks)} blocks)")
        nb = len(rec.blocks)
        bad = [i for i, (a, b) in enumerate(zip(sent, kv_sums, strict=True)) if a != b]
        if not bad:
            return None
        first = ", ".join(f"layer {i // nb} block {rec.blocks[i % nb]}" for i in bad[:4])
        return Failure(FailureKind.CHECKSUM_MISMATCH,
                       f"KV checksum mismatch from {who}: {len(bad)} of {want} block(s) differ, "
                       f"first {first}")

    def _verify(self, rec: DecodeRecord, key: SenderKey, msg: DoneSending,
                local: Mapping[SenderKey, Sequence[int]]) -> Failure | None:
        """None when every sender :meth:`_to_verify` names still matches its checksums
        (``local``: the driver's sums over our blocks, per sender it was asked for)."""
        for k in self._to_verify(rec, key):
            sent = msg.checksums if k == key else rec.sums.get(k, ())
            bad = self._checksum_problem(rec, k, sent, local.get(k, ()))
            if bad is not None:
                return bad if k == key else bad._replace(
                    reason=f"{bad.reason} (found at the last DONE, from {key[0]} rank {key[1]}: "
                           "bytes changed after it was verified)")
        return None
    def on_sums(self, answer: Sums, now: float) -> list[Effect]:
        """The driver's CRC-32C of our blocks that a :class:`SumBlocks` asked for: verify the
        DONE that asked against them, then count its sender done or fail the request."""
        ask = answer.ask
        rec = self._reqs.get(ask.req_id)
        msg = rec.asked if rec is not None else None
        if rec is None or msg is None or not isinstance(ask, SumBlocks):
            raise ProtocolError("decode", ask.req_id, rec.state if rec else "UNKNOWN", "sums",
                                "checksums nobody asked for")
        if len(answer.sums) != len(ask.plans):
            raise ProtocolError("decode", ask.req_id, rec.state, "sums",
                                f"sums for {len(answer.sums)} senders, asked for "
                                f"{len(ask.plans)}")
        rec.asked = None
        key = (msg.sender.engine_id, msg.sender.rank)
        local = {plan.sender: [c for layer in sums for c in layer]
                 for plan, sums in zip(ask.plans, answer.sums, strict=True)}
        out: list[Effect] = []
        bad = self._verify(rec, key, msg, local)
        if bad is not None:
            # Bytes differ from what the sender says it wrote: a write may still be in
            # flight (a sender whose DONE came early) as well as corrupted. Refused; the
            # blocks stay fenced (or quarantined) until it confirms it stopped or the lease
            # ends.
            # A bad transfer is a lost epoch like a lost P: prefilled again (budget allowing;
            # the sender's engine avoided as a lost one is) once this epoch's senders stopped.
            self.counters["checksum_mismatches"] += 1
            out.append(ack(self.me, msg, "done", False))
            self._lose(rec, bad.kind, bad.reason, key[0], now, out)
            return out
        rec.sums[key] = tuple(msg.checksums)
        self._sender_done(rec, key, msg, now, out)
        return out
