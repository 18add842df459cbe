"""Computing ahead in the core: a prefill admitted before D's blocks are known (AHEAD) computes
and sends nothing; bound to D's blocks it writes the layers computed so far once D accepts, and
none of D's own prefix hit; unbound in time it fails and frees its blocks, and a later bind is
refused without a write."""

from __future__ import annotations

import pytest

from lw.fsm import DecodeEndpoint, PrefillEndpoint, PrefillRequest, ProtocolError, RecvDone
from lw.fsm.prefill_request import PrefillConfig
from lw.transport.wire import DoneSending, MetaRequest

from .harness import D_ADDR, Pair, d_layout, d_sender, p_sender

L = 2
WAIT = 3.0


def make(remote: tuple[int, ...] = (10, 11, 12)) -> Pair:
    cfg = PrefillConfig(ahead_wait_s=WAIT)
    pair = Pair([PrefillEndpoint(p_sender(0), L, cfg)], DecodeEndpoint(d_sender(), d_layout(L)))
    pair.absorb("d", pair.d.add_request("r", remote, 1, pair.now))
    return pair


def compute(pair: Pair) -> None:
    for layer in range(L):
        pair.absorb(0, pair.ps[0].layer_computed(layer, ["r"], pair.now))


def bound(remote: tuple[int, ...], prompt: str = "") -> PrefillRequest:
    """D's parameters as the driver hands them to bind (local blocks and final are P's own)."""
    return PrefillRequest("r", D_ADDR, (), remote, 1, prompt=prompt)


def test_computed_ahead_sends_nothing_then_catches_up_after_the_bind() -> None:
    pair = make()
    p = pair.ps[0]
    pair.absorb(0, p.add_ahead("r", (1, 2, 3), True, "", pair.now))
    assert p.state_of("r") == "AHEAD"
    compute(pair)
    assert not pair.writes and not pair.queue  # nothing known of D: nothing sent
    pair.absorb(0, p.bind(bound((10, 11, 12)), 0, pair.now))
    assert p.state_of("r") == "AWAIT_DECODER_META"
    assert [type(s.msg) for s in pair.queue] == [MetaRequest]
    assert not pair.writes  # not before D accepted
    pair.deliver_all()
    assert [(w.layer, w.local_blocks, w.remote_blocks) for _, w in pair.writes] == [
        (k, (1, 2, 3), (10, 11, 12)) for k in range(L)]
    pair.complete_writes()
    pair.deliver_all()
    assert p.state_of("r") == "DONE" and pair.recv == [RecvDone("r")]
    assert [f.ok for f in pair.finished] == [True]


def test_d_prefix_hit_blocks_are_computed_but_never_written() -> None:
    """P computed the whole prompt in two chunks; D holds the first two blocks itself: the
    first chunk writes nothing, the second writes only the block D asked for."""
    pair = make(remote=(12,))
    p = pair.ps[0]
    pair.absorb(0, p.add_ahead("r", (1, 2), False, "", pair.now))
    compute(pair)
    pair.absorb(0, p.add_chunk("r", (3,), True, pair.now))
    pair.absorb(0, p.bind(bound((12,)), 2, pair.now))
    pair.deliver_all()
    assert p.state_of("r") == "CHUNK_SENT"  # chunk 0 had nothing to write
    compute(pair)
    assert [(w.seq, w.local_blocks, w.remote_blocks) for _, w in pair.writes] == [
        (L + k, (3,), (12,)) for k in range(L)]
    pair.complete_writes()
    (done,) = [s.msg for s in pair.queue if isinstance(s.msg, DoneSending)]
    assert done.num_blocks == 1
    pair.deliver_all()
    assert p.state_of("r") == "DONE" and pair.recv == [RecvDone("r")]


def test_bound_mid_prompt_later_chunks_map_onto_d_blocks() -> None:
    pair = make(remote=(11, 12))
    p = pair.ps[0]
    pair.absorb(0, p.add_ahead("r", (1,), False, "", pair.now))
    pair.absorb(0, p.bind(bound((11, 12)), 1, pair.now))
    pair.deliver_all()
    compute(pair)  # chunk 0 is D's hit: no write
    assert not pair.writes
    pair.absorb(0, p.add_chunk("r", (2, 3), True, pair.now))
    compute(pair)
    assert {(w.local_blocks, w.remote_blocks) for _, w in pair.writes} == {((2, 3), (11, 12))}
    pair.complete_writes()
    pair.deliver_all()
    assert p.state_of("r") == "DONE"


def test_unbound_in_time_fails_frees_and_refuses_a_late_bind() -> None:
    pair = make()
    p = pair.ps[0]
    pair.absorb(0, p.add_ahead("r", (1, 2, 3), True, "", pair.now))
    compute(pair)
    pair.advance(WAIT + 0.1)
    assert p.state_of("r") == "FAILED"
    (fin,) = pair.finished
    assert not fin.ok and "ahead_wait_s=3s" in fin.reason
    assert not pair.queue  # D never heard of this P: nothing to tell it
    assert p.bind(bound((10, 11, 12)), 0, pair.now) == []  # refused: the blocks are gone
    assert not pair.writes and p.counters["late_binds"] == 1


@pytest.mark.parametrize(("remote", "first", "prompt", "why"), [
    ((10, 11), 0, "", "the prompt has 3 blocks; D holds 0 and asks for 2"),
    ((10, 11, 12), 1, "", "the prompt has 3 blocks; D holds 1 and asks for 3"),
    ((10, 11, 12), 0, "other", "another prompt"),
    ((), 0, "", "D holds 0 blocks and asks for 0"),
])
def test_parameters_that_do_not_fit_fail_without_a_claim(
        remote: tuple[int, ...], first: int, prompt: str, why: str) -> None:
    pair = make()
    p = pair.ps[0]
    pair.absorb(0, p.add_ahead("r", (1, 2, 3), True, "mine" if prompt else "", pair.now))
    pair.absorb(0, p.bind(bound(remote, prompt), first, pair.now))
    assert p.state_of("r") == "FAILED"
    assert why in pair.finished[0].reason
    assert not pair.queue and not pair.writes  # no claim, no write


def test_a_bind_is_only_for_a_request_computed_ahead() -> None:
    pair = make()
    p = pair.ps[0]
    with pytest.raises(ProtocolError, match="no such request"):
        p.bind(bound((10, 11, 12)), 0, pair.now)
    pair.absorb(0, p.add_request(PrefillRequest("r", D_ADDR, (1, 2, 3), (10, 11, 12)),
                                 pair.now))
    with pytest.raises(ProtocolError, match="only a request computed ahead"):
        p.bind(bound((10, 11, 12)), 0, pair.now)


def test_an_aborted_ahead_request_frees_at_once() -> None:
    pair = make()
    p = pair.ps[0]
    pair.absorb(0, p.add_ahead("r", (1, 2, 3), True, "", pair.now))
    pair.absorb(0, p.abort("r", "client left", pair.now))
    assert [f.ok for f in pair.finished] == [False] and p.live_requests() == []
    assert ("0", ("deadline", "r")) not in {(str(w), k) for w, k in pair.timers}


def test_status_names_the_wait_for_d_parameters() -> None:
    pair = make()
    p = pair.ps[0]
    pair.absorb(0, p.add_ahead("r", (1, 2, 3), True, "", pair.now))
    pair.absorb(0, p.layer_computed(0, ["r"], pair.now))
    (row,) = p.status(pair.now)
    assert row.state == "AHEAD" and "waiting for D's parameters" in row.waiting_for
    assert "1 of 2 layers computed" in row.waiting_for


def test_bound_to_no_decoder_ends_at_once_and_its_wait_is_disarmed() -> None:
    """A rank that writes nothing (MLA's idle rank, a D that holds the whole prompt)."""
    pair = make()
    p = pair.ps[0]
    pair.absorb(0, p.add_ahead("r", (1, 2, 3), True, "", pair.now))
    pair.absorb(0, p.bind(PrefillRequest("r", (), (), ()), 3, pair.now))
    assert p.state_of("r") == "DONE" and [f.ok for f in pair.finished] == [True]
    assert not [k for k in pair.timers if k[0] == 0] and not pair.queue


def test_admitted_under_its_own_id_bound_under_ds() -> None:
    """P admits the request before D has named it (D's sub-transfer id): the bind renames it,
    and every message and report from then on carries D's id."""
    pair = make()
    p = pair.ps[0]
    pair.absorb(0, p.add_ahead("t-ahead", (1, 2, 3), True, "", pair.now))
    for layer in range(L):
        pair.absorb(0, p.layer_computed(layer, ["t-ahead"], pair.now))
    pair.absorb(0, p.bind(bound((10, 11, 12)), 0, pair.now, ahead_id="t-ahead"))
    assert p.state_of("r") == "AWAIT_DECODER_META" and p.state_of("t-ahead") is None
    assert (0, ("deadline", "t-ahead")) not in pair.timers
    pair.deliver_all()
    pair.complete_writes()
    pair.deliver_all()
    assert p.state_of("r") == "DONE" and pair.recv == [RecvDone("r")]
    assert [f.req_id for f in pair.finished] == ["r"]


def test_a_late_bind_under_the_ahead_id_is_refused() -> None:
    pair = make()
    p = pair.ps[0]
    pair.absorb(0, p.add_ahead("t-ahead", (1, 2, 3), True, "", pair.now))
    pair.advance(WAIT + 0.1)
    assert p.bind(bound((10, 11, 12)), 0, pair.now, ahead_id="t-ahead") == []
    assert p.state_of("r") is None and p.counters["late_binds"] == 1


def test_refuses_bind_only_for_an_ahead_id_that_ended_or_failed_before_a_bind() -> None:
    """What P's worker asks before telling the proxy a bind was refused, and what bind() then
    does: an ahead id that ended here unbound is refused; one still live, bound (renamed) or
    never seen is not."""
    pair = make()
    p = pair.ps[0]
    assert not p.refuses_bind("t-ahead")  # never seen
    pair.absorb(0, p.add_ahead("t-ahead", (1, 2, 3), True, "", pair.now))
    assert not p.refuses_bind("t-ahead")  # live, waiting for D's params
    pair.absorb(0, p.add_ahead("t-bound", (4, 5, 6), True, "", pair.now))
    pair.absorb(0, p.bind(bound((10, 11, 12)), 0, pair.now, ahead_id="t-bound"))
    assert not p.refuses_bind("t-bound")  # bound: renamed to D's id
    compute(pair)
    pair.deliver_all()
    pair.complete_writes()
    pair.deliver_all()
    assert p.state_of("r") == "DONE"
    assert not p.refuses_bind("t-bound")  # ended bound, under D's id
    pair.advance(WAIT + 0.1)
    assert p.state_of("t-ahead") == "FAILED"  # dropped at its ahead wait
    assert p.refuses_bind("t-ahead")
    assert p.bind(PrefillRequest("r2", D_ADDR, (), (10, 11, 12), 1), 0, pair.now,
                  ahead_id="t-ahead") == []  # as bind() does


def test_a_layer_reported_under_the_ahead_id_after_the_bind_counts_for_d_s() -> None:
    """A driver binds mid-step: the forward queued a layer under the ahead id that reaches the
    core after the rename. It counts for the renamed request (else its write never comes and
    the request fails at its deadline); once the request ended the old id means nothing."""
    pair = make()
    p = pair.ps[0]
    pair.absorb(0, p.add_ahead("t-ahead", (1, 2, 3), True, "", pair.now))
    pair.absorb(0, p.layer_computed(0, ["t-ahead"], pair.now))
    pair.absorb(0, p.bind(bound((10, 11, 12)), 0, pair.now, ahead_id="t-ahead"))
    pair.absorb(0, p.layer_computed(1, ["t-ahead"], pair.now))  # queued before the bind
    pair.deliver_all()
    assert [(w.layer, w.remote_blocks) for _, w in pair.writes] == [
        (k, (10, 11, 12)) for k in range(L)]
    pair.complete_writes()
    pair.deliver_all()
    assert p.state_of("r") == "DONE" and pair.recv == [RecvDone("r")]
    assert p.layer_computed(0, ["t-ahead"], pair.now) == [] and not p._aliases


def test_a_claim_d_does_not_know_yet_is_asked_again_soon_backing_off() -> None:
    """A bind that comes as soon as D's call (computing ahead) can claim before D's worker
    registered the request: D answers "unknown", and P asks again after unknown_retry_s
    (doubling per try up to meta_retry_s), not after the whole meta_retry_s."""
    cfg = PrefillConfig(ahead_wait_s=WAIT)
    pair = Pair([PrefillEndpoint(p_sender(0), L, cfg)], DecodeEndpoint(d_sender(), d_layout(L)))
    p = pair.ps[0]
    pair.absorb(0, p.add_ahead("r", (1, 2, 3), True, "", pair.now))
    compute(pair)
    pair.absorb(0, p.bind(bound((10, 11, 12)), 0, pair.now))
    pair.deliver_all()  # D has not registered "r": unknown
    assert pair.timers[(0, ("meta", "r"))] == pytest.approx(cfg.unknown_retry_s)
    pair.advance(cfg.unknown_retry_s)  # asked again: still unknown, the next wait doubles
    assert pair.timers[(0, ("meta", "r"))] == pytest.approx(3 * cfg.unknown_retry_s)
    pair.absorb("d", pair.d.add_request("r", (10, 11, 12), 1, pair.now))  # registered now
    pair.advance(3 * cfg.unknown_retry_s)
    assert [(w.layer, w.remote_blocks) for _, w in pair.writes] == [
        (k, (10, 11, 12)) for k in range(L)]
    pair.complete_writes()
    pair.deliver_all()
    assert p.state_of("r") == "DONE" and pair.recv == [RecvDone("r")]
