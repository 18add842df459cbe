"""P's tombstones (D's Aborts for requests P has not seen) and its refusal of a request whose DONE
could not carry its KV checksums.

A tombstone names the claim epoch D aborted: a re-prefill of the same request under a later
epoch is served. Tombstones are bounded (``tombstone_memory`` request ids, a few epochs each);
past the bound the oldest is forgotten and counted, and what that costs (a claim D refuses) is
shown against a real DecodeEndpoint. With ``kv_checksum`` on, a request of more layers x blocks
than a DONE carries is refused before any claim or write."""

from __future__ import annotations

import pytest

from lw.fsm import (
    ArmTimer,
    CancelTimer,
    DecodeConfig,
    DecodeEndpoint,
    PrefillConfig,
    PrefillEndpoint,
    PrefillRequest,
    Reprefill,
    Send,
    SendFinished,
    WriteLayer,
)
from lw.fsm.messages import MAX_CHECKSUMS
from lw.fsm.prefill_replies import TOMB_EPOCHS
from lw.transport.wire import (
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    DoneSending,
    MetaReply,
    MetaRequest,
    WireError,
    decode,
    encode,
)

from .harness import D_ADDR, Pair, d_layout, d_sender, p_sender

L = 2


def _abort(rid: str, epoch: int = 0) -> Abort:
    return decode(encode(Abort(PROTOCOL_VERSION, rid, d_sender(), "prefill engine P lost",
                               epoch=epoch)))


def _req(rid: str = "r", epoch: int = 0, blocks: tuple[int, ...] = (1,),
         final: bool = True, targets: str | tuple[str, ...] = D_ADDR) -> PrefillRequest:
    remote = tuple(b + 100 for b in blocks)
    return PrefillRequest(rid, targets, blocks if final else blocks[:1], remote, epoch=epoch,
                          final=final)


def _failed(out: list) -> list[str]:
    return [f.reason for f in out if isinstance(f, SendFinished) and not f.ok]


def _claims(out: list) -> list[int]:
    """The epochs of the MetaRequests among ``out``."""
    return [e.msg.epoch for e in out if isinstance(e, Send) and isinstance(e.msg, MetaRequest)]


# ------------------------------------------------------------------------ tombstones and epochs
def test_an_abort_of_a_lost_epoch_does_not_stop_the_re_prefill_of_the_next() -> None:
    """A restarted P gets D's Abort of epoch 0 for a request it does not know; D's epoch-1
    re-prefill of the request, routed to the same worker, claims as usual."""
    p = PrefillEndpoint(p_sender(), L)
    out = p.on_message(_abort("r", epoch=0), 0.0)
    assert [(type(e.msg), e.msg.epoch) for e in out if isinstance(e, Send)] == [(AbortAck, 0)]
    out = p.add_request(_req("r", epoch=1), 1.0)
    assert not _failed(out)
    assert _claims(out) == [1] and p.state_of("r") == "AWAIT_DECODER_META"


def test_an_abort_stops_only_the_epoch_it_names_once_each() -> None:
    """Two epochs aborted before either reached P: each one's prefill fails unstarted, and
    neither spends the other's tombstone; the tombstone's timer goes with its last epoch."""
    p = PrefillEndpoint(p_sender(), L)
    p.on_message(_abort("r", epoch=1), 0.0)
    p.on_message(_abort("r", epoch=0), 0.0)
    out = p.add_request(_req("r", epoch=0), 1.0)
    assert [("claim epoch 0" in r and "before it reached" in r) for r in _failed(out)] == [True]
    assert not _claims(out) and not any(isinstance(e, CancelTimer) and e.key == ("tomb", "r")
                                        for e in out)
    out = p.add_request(_req("r", epoch=1), 2.0)
    assert [("claim epoch 1" in r) for r in _failed(out)] == [True] and not _claims(out)
    assert any(isinstance(e, CancelTimer) and e.key == ("tomb", "r") for e in out)
    out = p.add_request(_req("r", epoch=2), 3.0)  # never aborted
    assert not _failed(out) and _claims(out) == [2]


def test_a_restarted_p_serves_ds_re_prefill_end_to_end() -> None:
    """D loses the P that claimed epoch 0 (it restarted); D's Abort reaches the new process at
    the same address, which never saw the request; D re-prefills under epoch 1 there and the
    transfer completes."""
    old = PrefillEndpoint(p_sender(), L)
    pair = Pair([old], DecodeEndpoint(d_sender(), d_layout(L), DecodeConfig(retry_prefill=1)))
    pair.absorb("d", pair.d.add_request("r", (10,), 1, pair.now))
    pair.absorb(0, old.add_request(PrefillRequest("r", D_ADDR, (1,), (10,)), pair.now))
    pair.deliver_all()
    assert old.state_of("r") == "META_READY"
    new = pair.ps[0] = PrefillEndpoint(p_sender(), L)  # restarted: knows nothing of "r"
    pair.absorb("d", pair.d.peer_lost("P", "restarted", pair.now))
    pair.deliver_all()  # D's Abort(epoch 0) -> new P's tombstone and AbortAck -> D's epoch 1
    (again,) = [e for e in pair.other if isinstance(e, Reprefill)]
    assert again.epoch == 1
    pair.absorb(0, new.add_request(
        PrefillRequest("r", D_ADDR, (1,), again.block_ids, epoch=1), pair.now))
    pair.deliver_all()
    for layer in range(L):
        pair.absorb(0, new.layer_computed(layer, ["r"], pair.now))
    pair.complete_writes()
    pair.deliver_all()
    assert [(f.req_id, f.ok) for f in pair.finished] == [("r", True)]
    assert [type(r).__name__ for r in pair.recv] == ["RecvDone"]


# ------------------------------------------------------------------------ bounded tombstones
def test_tombstone_memory_must_be_at_least_one() -> None:
    with pytest.raises(ValueError, match="tombstone_memory"):
        PrefillConfig(tombstone_memory=0)
    assert PrefillConfig().tombstone_memory == 65536


def test_tombstones_past_the_bound_forget_the_oldest_and_count_it() -> None:
    """A flood of Aborts for unknown ids keeps at most tombstone_memory of them: the oldest is
    forgotten, its timer cancelled, and the count is in the endpoint's counters."""
    p = PrefillEndpoint(p_sender(), L, PrefillConfig(tombstone_memory=3))
    armed: set[tuple] = set()
    for i in range(5):
        for e in p.on_message(_abort(f"r{i}"), float(i)):
            if isinstance(e, ArmTimer):
                armed.add(e.key)
            elif isinstance(e, CancelTimer):
                armed.discard(e.key)
    assert armed == {("tomb", "r2"), ("tomb", "r3"), ("tomb", "r4")}
    assert sorted(p._tombstones) == ["r2", "r3", "r4"]
    assert p.counters["tombstones_forgotten"] == 2
    assert not _failed(p.add_request(_req("r0"), 6.0))  # forgotten: it claims
    assert _failed(p.add_request(_req("r4"), 6.0))  # remembered: refused


def test_a_repeated_abort_makes_its_tombstone_the_newest() -> None:
    p = PrefillEndpoint(p_sender(), L, PrefillConfig(tombstone_memory=3))
    for rid in ("a", "b", "c", "a", "d"):
        p.on_message(_abort(rid), 0.0)
    assert sorted(p._tombstones) == ["a", "c", "d"]  # "b" was the oldest when "d" came


def test_a_tombstone_keeps_only_its_newest_aborted_epochs() -> None:
    """Aborts of one id under ever new epochs cannot grow one tombstone either."""
    p = PrefillEndpoint(p_sender(), L)
    for epoch in range(TOMB_EPOCHS + 2):
        p.on_message(_abort("r", epoch), 0.0)
    assert len(p._tombstones["r"]) == TOMB_EPOCHS
    assert p.counters["tombstones_forgotten"] == 2
    assert not _failed(p.add_request(_req("r", epoch=0), 1.0))


def test_a_forgotten_tombstone_costs_a_claim_d_refuses_and_no_write() -> None:
    """What the docstring of _bury claims: D aborted the epoch (its request failed), P forgot
    the tombstone, the epoch's prefill comes late: D refuses the claim, nothing is written."""
    p = PrefillEndpoint(p_sender(), L, PrefillConfig(tombstone_memory=1))
    pair = Pair([p], DecodeEndpoint(d_sender(), d_layout(L)))
    pair.absorb("d", pair.d.add_request("r", (10,), 1, pair.now))
    other = PrefillEndpoint(p_sender(), L)  # the P of epoch 0 that claimed it, then was lost
    claim = [e for e in other.add_request(PrefillRequest("r", D_ADDR, (1,), (10,)), 0.0)
             if isinstance(e, Send)]
    pair.d.on_message(decode(encode(claim[0].msg)), 0.0)
    aborts = [e.msg for e in pair.d.abort("r", "client gone", 0.0)
              if isinstance(e, Send) and isinstance(e.msg, Abort)]
    assert [a.epoch for a in aborts] == [0]
    p.on_message(decode(encode(aborts[0])), 0.0)
    p.on_message(_abort("x"), 0.0)  # forgets r's tombstone
    assert "r" not in p._tombstones and p.counters["tombstones_forgotten"] == 1
    pair.absorb(0, p.add_request(PrefillRequest("r", D_ADDR, (1,), (10,)), 1.0))
    pair.deliver_all()
    assert [(f.ok, "refused" in f.reason) for f in pair.finished] == [(False, True)]
    assert not pair.writes


# ------------------------------------------------------------------------ checksums of a DONE
def test_the_checksum_bound_is_the_wires() -> None:
    """MAX_CHECKSUMS is exactly what a DONE carries across the wire."""
    me = p_sender()
    ok = DoneSending(PROTOCOL_VERSION, "r", me, 1, 1, checksums=[7] * MAX_CHECKSUMS)
    assert len(decode(encode(ok)).checksums) == MAX_CHECKSUMS
    over = DoneSending(PROTOCOL_VERSION, "r", me, 1, 1, checksums=[7] * (MAX_CHECKSUMS + 1))
    with pytest.raises(WireError):
        decode(encode(over))


def _over(layers: int) -> tuple[int, ...]:
    """Blocks one too many for a DONE of ``layers`` layers to carry their checksums."""
    return tuple(range(MAX_CHECKSUMS // layers + 1))


def test_kv_checksum_refuses_a_request_too_large_for_one_done_before_any_claim() -> None:
    blocks = _over(L)
    p = PrefillEndpoint(p_sender(), L, PrefillConfig(kv_checksum=True))
    out = p.add_request(_req("r", blocks=blocks), 0.0)
    n = L * len(blocks)
    assert _failed(out) == [f"kv_checksum needs {n:,} checksums ({L} layers x "
                            f"{len(blocks):,} blocks), over the 131,072 a DONE carries"]
    assert not any(isinstance(e, (Send, WriteLayer)) for e in out)
    assert p.record("r") is None and p.counters["failed"] == 1  # released at once


def test_kv_checksum_refuses_a_progressive_push_at_its_first_chunk() -> None:
    """A chunked prompt's size is known at its first chunk (D's blocks are all named)."""
    p = PrefillEndpoint(p_sender(), L, PrefillConfig(kv_checksum=True))
    out = p.add_request(_req("r", blocks=_over(L), final=False), 0.0)
    assert ["over the 131,072" in r for r in _failed(out)] == [True] and not _claims(out)


def test_a_request_of_exactly_the_bound_or_without_checksums_is_served() -> None:
    exact = tuple(range(MAX_CHECKSUMS // L))
    p = PrefillEndpoint(p_sender(), L, PrefillConfig(kv_checksum=True))
    assert _claims(p.add_request(_req("a", blocks=exact), 0.0)) == [0]
    plain = PrefillEndpoint(p_sender(), L)
    assert _claims(plain.add_request(_req("b", blocks=_over(L)), 0.0)) == [0]
    none = p.add_request(_req("c", blocks=_over(L), targets=()), 0.0)  # sends no DONE
    assert [f.ok for f in none if isinstance(f, SendFinished)] == [True]


def test_kv_checksum_refuses_a_bind_too_large_for_one_done() -> None:
    """Computed ahead, then bound to more of D's blocks than a DONE's checksums cover."""
    blocks = _over(L)
    p = PrefillEndpoint(p_sender(), L, PrefillConfig(kv_checksum=True))
    p.add_ahead("r", blocks, True, "", 0.0)
    out = p.bind(PrefillRequest("r", D_ADDR, (), tuple(b + 100 for b in blocks)), 0, 1.0)
    assert ["do not fit: kv_checksum needs" in r for r in _failed(out)] == [True]
    assert not _claims(out)


def test_the_refusal_reaches_no_decoder_and_a_meta_reply_after_it_is_stale() -> None:
    """Refused before any claim: a reply D might still send for it finds the request gone."""
    p = PrefillEndpoint(p_sender(), L, PrefillConfig(kv_checksum=True))
    p.add_request(_req("r", blocks=_over(L)), 0.0)
    reply = MetaReply(PROTOCOL_VERSION, "r", "refused", d_sender(), None, "late")
    assert p.on_message(decode(encode(reply)), 1.0) == []
    assert p.counters["stale_messages"] == 1
