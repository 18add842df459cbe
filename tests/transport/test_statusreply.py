"""A status query by a proxy's transfer id (what its client sees as ``x-request-id``) finds the
transfer's sub-transfers: their live rows and their timeline, kept after they ended (so that the
proxy, and ``lw status``, can say why a failed one failed)."""

from __future__ import annotations

from typing import Any

from lw.contract.transfer_ids import sub_transfer_id
from lw.fsm.messages import RequestStatus
from lw.fsm.timeline import Timeline
from lw.transport.statusreply import of_transfer, status_reply
from lw.transport.wire import Sender

TID = "0123456789abcdef0123456789abcdef"


class _Endpoint:
    """What status_reply reads of an endpoint."""

    def __init__(self, live: list[str]) -> None:
        self.me = Sender("D", 0, 1, "tcp://127.0.0.1:1")
        self.timeline = Timeline(64)
        self.counters: dict[str, int] = {}
        self._live = live

    def live_requests(self) -> list[str]:
        return list(self._live)

    def status(self, now: float, req_id: str = "") -> list[RequestStatus]:
        ids = self._live if not req_id else [r for r in self._live if r == req_id]
        return [RequestStatus(r, "RECEIVING", 0.0, "", 1.0, 1) for r in ids]


def test_a_transfer_id_finds_its_sub_transfers_long_and_hashed_too() -> None:
    long_tid = "t" * 250
    subs = [f"{TID}@cmpl-1-0", f"{TID}@cmpl-1-1", sub_transfer_id(long_tid, "r" * 40)]
    assert "@" in subs[2] and len(subs[2]) <= 256  # hashed: its head is the cut transfer id
    t = Timeline(64)
    for i, rid in enumerate([*subs, f"{TID}x@cmpl", "other", TID]):
        t.record(float(i), rid, "fail", "RECEIVING", "FAILED", f"why {i}")
    t.record(9.0, (subs[0], "other"), "layer_computed", detail=0)
    got = [e[1] for e in of_transfer(t, TID)]
    assert got == [subs[0], subs[1], TID, (subs[0], "other")]  # oldest first, not TIDx@...
    assert [e[1] for e in of_transfer(t, long_tid)] == [subs[2]]
    assert [e[1] for e in of_transfer(t, subs[1])] == [subs[1]]  # a sub-transfer: exactly it


def test_the_reply_has_the_live_sub_transfers_and_their_ended_history() -> None:
    ep = _Endpoint([f"{TID}@a", "other@b"])
    ep.timeline.record(1.0, f"{TID}@z", "fail", "RECEIVING", "FAILED", "KV checksum mismatch")
    ep.timeline.record(2.0, "other@b", "claim", "PREFILL_REQUESTED", "RECEIVING")
    reply: Any = status_reply(ep, "decode", {}, 5.0, TID, timeline=10)
    assert [r.req_id for r in reply.requests] == [f"{TID}@a"]
    assert [(e.req_ids, e.event, e.detail) for e in reply.timeline] == [
        ([f"{TID}@z"], "fail", "KV checksum mismatch")]
    assert [r.req_id for r in status_reply(ep, "decode", {}, 5.0).requests] == [
        f"{TID}@a", "other@b"]
