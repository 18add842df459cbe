"""What the checker found in the core (lw/fsm): regression tests, and failing tests for open ones.

Finding 1 (fixed in 5d40564): P sent FailedSending while a write of the request was still in
flight; D took it as "this sender stopped", released the blocks, and the write landed in another
request's KV. Found by `lw check --design d-first --dp 1 --requests 1 --layers 1 --faults`.

Finding 2 (fixed: peer_lost no longer counts lost senders as stopped): ``DecodeEndpoint.peer_lost``
released a claimed request's blocks at once (RecvFailed), but the lost P may have had a write
fail "in doubt" (its bytes may still land; the core itself makes D wait for the lease in that
case) and never got to say so. Minimal trace (10 steps):
D allocates r0, P computes layer 0, D accepts P, the layer-0 write times out (in doubt), the P
engine crashes before its FailedSending(in_doubt) is delivered, D learns that P is gone and frees
block 0 while the timed-out write's bytes may still land. With ``crash_zombies`` (bytes a
crashed process handed to the transport may still land) 9 steps suffice: no timeout needed.
Suggested fix: in ``peer_lost`` do not count lost senders as stopped; fail the request so that it
is quarantined until the lease expires (the Abort to the dead peer is harmless).

Finding 3 (fixed): with several targets (one P rank writing into several D TP ranks), a second
``MetaReply(accepted)`` from a target that had already accepted, while another target has not
answered yet, fires ``meta_accepted`` in AWAIT_DECODER_META ("declared duplicate" in
``PrefillEndpoint._on_meta_reply``), which the table maps to META_READY. The request then counts
as claimed everywhere: the next ``layer_computed`` submits writes to the target that never
accepted (no layout: ``AssertionError`` in ``_submit_ready``; with ``-O``, a WriteLayer with no
layout into a D worker that never authorised it). A duplicate reply needs no fault: the meta
retry timer resends to every target not yet accepted, so a slow D answers twice. Found by
``lw check --dp 1 --d-tp 2 --requests 1 --layers 1 --faults --no-p-loss-detection`` in 9 steps.
Fix: an accepted reply that leaves another target pending (first or duplicate) fires the declared
``target_accepted`` row, which stays in AWAIT_DECODER_META; only the last target's fires
``meta_accepted``.
"""

from __future__ import annotations

from lw.fsm import (
    DecodeEndpoint,
    PrefillEndpoint,
    PrefillRequest,
    Quarantine,
    RecvFailed,
    Send,
    WriteLayer,
)
from lw.fsm.lifecycles import AWAIT_DECODER_META
from lw.sim.explorer import explore
from lw.sim.world import WorldConfig
from lw.transport.wire import FailedSending, KVLayout, LayerLayout, MetaRequest, Sender


def _pair() -> tuple[PrefillEndpoint, DecodeEndpoint]:
    layout = KVLayout("D", 1, "d0-te:1", [LayerLayout(0x1000, 4096, 4096, 4)])
    p = PrefillEndpoint(Sender("P", 0, 1, "p0"), 1)
    d = DecodeEndpoint(Sender("D", 0, 1, "d0"), layout)
    return p, d


def _claimed_with_a_write_in_flight() -> tuple[PrefillEndpoint, DecodeEndpoint]:
    p, d = _pair()
    d.add_request("r0", (0,), 1, 0.0)
    out = p.add_request(PrefillRequest("r0", "d0", (0,), (0,), 1), 0.0)
    meta_req = next(e.msg for e in out if isinstance(e, Send) and isinstance(e.msg, MetaRequest))
    reply = next(e.msg for e in d.on_message(meta_req, 0.0) if isinstance(e, Send))
    p.on_message(reply, 0.0)  # accepted: P may write now
    writes = [e for e in p.layer_computed(0, ["r0"], 0.0) if isinstance(e, WriteLayer)]
    assert len(writes) == 1 and p.inflight_writes("r0") == 1
    return p, d


def test_finding_1_failed_sending_waits_for_writes_in_flight() -> None:
    """Regression: FailedSending only once no write of the request is in flight."""
    p, d = _claimed_with_a_write_in_flight()
    out = p.abort("r0", "client gone", 0.0)
    assert not [e for e in out if isinstance(e, Send) and isinstance(e.msg, FailedSending)]
    out = p.transfer_done("r0", 0, True, "", 1.0)  # the write ends: now D may be told
    failed = [e.msg for e in out if isinstance(e, Send) and isinstance(e.msg, FailedSending)]
    assert len(failed) == 1 and p.inflight_writes("r0") == 0
    assert any(isinstance(e, RecvFailed) for e in d.on_message(failed[0], 1.0))


def test_finding_1_explorer_regression() -> None:
    """The faults that found finding 1 (aborts, failed writes) find nothing any more."""
    cfg = WorldConfig(design="d-first", dp=1, requests=1, layers=2, faults=True,
                      fault_kinds=("write", "abort"), abstract_time=False)  # as found
    res = explore(cfg)
    assert res.counterexample is None, res.counterexample.violation.headline()


def test_finding_2_peer_lost_must_not_release_before_the_lease() -> None:
    """A lost sender may have a write in doubt: D must quarantine, not free, the blocks."""
    p, d = _claimed_with_a_write_in_flight()
    p.transfer_done("r0", 0, False, "mooncake timeout", 10.0, in_doubt=True)
    # ... and the P engine dies before its FailedSending(in_doubt) is delivered.
    out = d.peer_lost("P", "P engine restarted", 11.0)
    released = [e for e in out if isinstance(e, RecvFailed)]
    assert not released, (
        f"D released block(s) {released[0].block_ids} on peer_lost although the lost sender's "
        "timed-out write may still land (expected a Quarantine until the lease expires)")
    assert any(isinstance(e, Quarantine) for e in out)


def test_finding_2_found_by_the_explorer() -> None:
    """d-first with faults (crashes, timeouts) holds where finding 2 was found (it failed
    there while finding 2 was open)."""
    cfg = WorldConfig(design="d-first", dp=1, requests=1, layers=1, faults=True,
                      crash_zombies=False, abstract_time=False)  # as found
    res = explore(cfg)
    ce = res.counterexample
    assert ce is None, ce.violation.headline() if ce else ""


def test_finding_3_duplicate_accept_from_one_target_does_not_claim_the_others() -> None:
    """P writes into D TP ranks d0 and d1; d0's accepted reply arrives twice before d1 answers."""
    layouts = [KVLayout("D", 1, f"d{j}-te:1", [LayerLayout(0x1000, 4096, 4096, 4)])
               for j in range(2)]
    p = PrefillEndpoint(Sender("P", 0, 1, "p0"), 1)
    d0 = DecodeEndpoint(Sender("D", 0, 1, "d0"), layouts[0])
    d0.add_request("r0", (0,), 1, 0.0)
    out = p.add_request(PrefillRequest("r0", ("d0", "d1"), (0,), (0,), 1), 0.0)
    to_d0 = next(e.msg for e in out if isinstance(e, Send) and e.dest == "d0")
    reply = next(e.msg for e in d0.on_message(to_d0, 0.0) if isinstance(e, Send))
    p.on_message(reply, 0.0)
    p.on_message(reply, 0.1)  # a duplicate (network, or the answer to a retried MetaRequest)
    assert p.state_of("r0") == AWAIT_DECODER_META, "d1 has not accepted P yet"
    writes = [e for e in p.layer_computed(0, ["r0"], 0.2) if isinstance(e, WriteLayer)]
    assert writes == [], "no write before every target accepted"


def test_finding_3_found_by_the_explorer() -> None:
    """d-first with one P rank writing two D TP ranks holds (before the fix a timer-driven
    MetaRequest retry sufficed to break it: aborts are the only injected faults here)."""
    cfg = WorldConfig(design="d-first", dp=1, d_tp=2, requests=1, layers=1, faults=True,
                      fault_kinds=("abort",))
    # The whole space takes minutes; before the fix BFS met the bug after 1,474 states.
    res = explore(cfg, max_states=5000)
    ce = res.counterexample
    assert ce is None, ce.violation.headline() if ce else ""
