"""Progressive push in the core: each chunk's complete blocks go out layer by layer as that chunk
computes them; DONE only once the last chunk's last layer and every earlier write completed."""

from __future__ import annotations

import pytest

from lw.fsm import DecodeEndpoint, PrefillEndpoint, PrefillRequest, ProtocolError, RecvDone
from lw.fsm.prefill_request import blocks_complete
from lw.transport.wire import DoneSending

from .harness import D_ADDR, Pair, d_layout, d_sender, p_sender

L = 3
REMOTE = (10, 11, 12, 13, 14)


def make() -> Pair:
    pair = Pair([PrefillEndpoint(p_sender(0), L)], DecodeEndpoint(d_sender(), d_layout(L)))
    pair.absorb("d", pair.d.add_request("r", REMOTE, 1, pair.now))
    return pair


def first_chunk(pair: Pair, local: tuple[int, ...]) -> None:
    req = PrefillRequest("r", D_ADDR, local, REMOTE, 1, final=False)
    pair.absorb(0, pair.ps[0].add_request(req, pair.now))


def compute(pair: Pair) -> None:
    for layer in range(L):
        pair.absorb(0, pair.ps[0].layer_computed(layer, ["r"], pair.now))


def finish(pair: Pair) -> None:
    """Every write lands and every message is delivered: the request ends on P."""
    pair.complete_writes()
    pair.deliver_all()


def test_each_chunk_writes_its_blocks_layer_by_layer() -> None:
    pair = make()
    p = pair.ps[0]
    first_chunk(pair, (1, 2))
    pair.deliver_all()  # D accepts during the first chunk
    compute(pair)
    assert [(w.layer, w.seq, w.local_blocks, w.remote_blocks) for _, w in pair.writes] == [
        (k, k, (1, 2), (10, 11)) for k in range(L)]
    pair.complete_writes()
    assert p.state_of("r") == "CHUNK_SENT"
    assert not [s for s in pair.queue if isinstance(s.msg, DoneSending)]
    pair.absorb(0, p.add_chunk("r", (3, 4), False, pair.now))
    compute(pair)
    pair.complete_writes()
    pair.absorb(0, p.add_chunk("r", (5,), True, pair.now))
    pair.absorb(0, p.layer_computed(0, ["r"], pair.now))
    (_, w), = pair.writes
    assert (w.layer, w.seq, w.local_blocks, w.remote_blocks) == (0, 2 * L, (5,), (14,))
    pair.absorb(0, p.layer_computed(1, ["r"], pair.now))
    pair.absorb(0, p.layer_computed(2, ["r"], pair.now))
    pair.complete_writes()
    assert p.state_of("r") == f"LAYER_{L - 1}_SENT"
    (done,) = [s.msg for s in pair.queue if isinstance(s.msg, DoneSending)]
    assert done.num_blocks == len(REMOTE)
    pair.deliver_all()
    assert p.state_of("r") == "DONE" and pair.recv == [RecvDone("r")]


def test_done_waits_for_an_earlier_chunks_write() -> None:
    """The last chunk's layers all written while chunk 0's layer 2 is still in flight: no DONE
    until it completes (the variant this test guards is in the checker's list)."""
    pair = make()
    p = pair.ps[0]
    first_chunk(pair, (1, 2, 3))
    pair.deliver_all()
    compute(pair)
    late = pair.writes.pop()  # chunk 0, layer 2 stays in flight
    pair.complete_writes()
    pair.absorb(0, p.add_chunk("r", (4, 5), True, pair.now))
    compute(pair)
    pair.complete_writes()
    assert not [s for s in pair.queue if isinstance(s.msg, DoneSending)]
    assert p.state_of("r") == "LAYER_1_SENT"  # counted in (chunk, layer) order
    pair.writes.append(late)
    pair.complete_writes()
    assert [s for s in pair.queue if isinstance(s.msg, DoneSending)]


def test_chunks_computed_before_meta_are_remembered() -> None:
    pair = make()
    p = pair.ps[0]
    first_chunk(pair, (1,))
    compute(pair)
    pair.absorb(0, p.add_chunk("r", (2, 3, 4, 5), True, pair.now))
    compute(pair)
    assert pair.writes == []
    pair.deliver_all()
    assert [(w.seq, w.remote_blocks) for _, w in pair.writes] == (
        [(k, (10,)) for k in range(L)] + [(L + k, (11, 12, 13, 14)) for k in range(L)])
    finish(pair)
    assert p.state_of("r") == "DONE"


def test_first_chunk_without_a_complete_block_claims_d_early() -> None:
    pair = make()
    p = pair.ps[0]
    first_chunk(pair, ())
    with pytest.raises(ProtocolError, match="no chunk is announced"):
        p.layer_computed(0, ["r"], pair.now)  # its layers are not reported for this request
    pair.deliver_all()
    assert p.state_of("r") == "META_READY"
    pair.absorb(0, p.add_chunk("r", (1, 2, 3, 4, 5), True, pair.now))
    compute(pair)
    finish(pair)
    assert p.state_of("r") == "DONE"


def test_bad_chunks_fail_the_request_saying_what_was_wrong() -> None:
    pair = make()
    p = pair.ps[0]
    with pytest.raises(ValueError, match="6 local blocks but 5 remote"):
        p.add_request(PrefillRequest("x", D_ADDR, (1, 2, 3, 4, 5, 6), REMOTE, 1, final=False),
                      0.0)
    with pytest.raises(ProtocolError, match="no such request"):
        p.add_chunk("nope", (1,), True, 0.0)
    for bad, final, why in (((), False, "completes no block"),
                            ((3, 4), True, "4 of 5 blocks complete after this chunk"),
                            ((3, 4, 5, 6), False, "6 of 5 blocks")):
        pair = make()
        p = pair.ps[0]
        first_chunk(pair, (1, 2))
        pair.deliver_all()
        pair.absorb(0, p.add_chunk("r", bad, final, 0.0))
        assert p.state_of("r") == "FAILED" and why in pair.finished[0].reason
        assert p.layer_computed(0, ["r"], 0.0) == []  # a failed request computes on, unsent
        assert p.counters["bad_chunks"] == 1
    pair = make()
    p = pair.ps[0]
    first_chunk(pair, (1, 2))
    pair.absorb(0, p.add_chunk("r", (3, 4, 5), True, 0.0))
    pair.absorb(0, p.add_chunk("r", (6,), True, 0.0))
    assert "after the prompt's last chunk" in pair.finished[0].reason


def test_chunk_of_a_released_request_is_stale() -> None:
    pair = make()
    p = pair.ps[0]
    first_chunk(pair, (1, 2))
    pair.absorb(0, p.abort("r", "client gone", 0.0))
    assert p.state_of("r") == "FAILED" and p.live_requests() == []
    assert p.add_chunk("r", (3, 4, 5), True, 0.0) == []
    assert p.layer_computed(0, ["r"], 0.0) == []


def test_failed_mid_chunks_stops_writing_and_releases_after_writes_end() -> None:
    pair = make()
    p = pair.ps[0]
    first_chunk(pair, (1, 2))
    pair.deliver_all()
    pair.absorb(0, p.layer_computed(0, ["r"], pair.now))
    pair.absorb(0, p.abort("r", "preempted", pair.now))
    assert p.live_requests() == ["r"]  # layer 0's write still reads the blocks
    pair.absorb(0, p.layer_computed(1, ["r"], pair.now))
    assert len(pair.writes) == 1  # nothing new is written once failed
    pair.complete_writes()
    assert p.live_requests() == [] and [f.ok for f in pair.finished] == [False]


def test_d_refuses_a_done_that_does_not_cover_its_blocks() -> None:
    """A sender whose DONE covers fewer blocks than D receives (a P that lost track of its
    chunks) fails the request on D instead of decoding partial KV, and its blocks stay
    quarantined until that sender confirms it stopped."""
    from lw.fsm import RecvFailed

    pair = make()
    first_chunk(pair, (1, 2, 3))
    p = pair.ps[0]
    pair.deliver_all()
    compute(pair)
    pair.complete_writes()
    assert p.state_of("r") == "CHUNK_SENT"
    pair.absorb("d", pair.d.on_message(DoneSending(1, "r", p.me, 1, L, num_blocks=3), pair.now))
    assert pair.d.state_of("r") == "FAILED"
    assert pair.recv == [] and "r" in pair.d.quarantined()  # nothing says P's writes ended
    pair.deliver_all()  # P hears the refusal, stops, and says so
    assert p.state_of("r") == "FAILED"
    (failed,) = pair.recv
    assert isinstance(failed, RecvFailed) and "covers 3 blocks, we receive 5" in failed.reason


def test_blocks_complete_after_a_chunk() -> None:
    """Whole blocks until the prompt ends; then the last, partial one too."""
    assert [blocks_complete(t, 100, 16) for t in (0, 15, 16, 64, 99, 100, 120)] == [
        0, 0, 1, 4, 6, 7, 7]
