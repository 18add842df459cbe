"""``failure_kind`` against the reasons the decode endpoint really writes: each way a D request
fails, driven through the core, is named by its kind (metrics' labels, the proxy's client
errors), so a reworded reason in lw.fsm.decode fails here rather than turning into "other"."""

from __future__ import annotations

from lw.fsm import DecodeConfig, RecvFailed
from lw.fsm.status import FAILURE_KINDS, failure_kind

from .harness import Pair
from .test_endpoints import compute_all, make_pair, send_done, start


def _reason(pair: Pair) -> str:
    """The reason D reported r1 failed with (the one its timeline keeps)."""
    (failed,) = [r for r in pair.recv if isinstance(r, RecvFailed)]
    assert failed.reason == next(e[5] for e in pair.d.timeline.of("r1") if e[2] == "fail")
    return failed.reason


def test_a_checksum_mismatch() -> None:
    pair = make_pair(dcfg=DecodeConfig(kv_checksum=True))
    sums = list(range(3 * 3))
    sums[4] += 1
    send_done(pair, sums, list(range(3 * 3)))
    assert failure_kind(_reason(pair)) == "checksum_mismatch"


def test_a_done_without_checksums() -> None:
    pair = make_pair(dcfg=DecodeConfig(kv_checksum=True))
    send_done(pair, [], list(range(3 * 3)))
    assert failure_kind(_reason(pair)) == "bad_done"


def test_a_failed_write_on_p() -> None:
    pair = make_pair()
    start(pair)
    pair.deliver_all()
    compute_all(pair)
    pair.writes.pop(0)
    pair.absorb(0, pair.ps[0].transfer_done("r1", 0, False, "peer closed", 0.0))
    pair.complete_writes()
    pair.deliver_all()
    assert failure_kind(_reason(pair)) == "prefill_failed"


def test_the_prefill_deadline() -> None:
    pair = make_pair(dcfg=DecodeConfig(prefill_timeout_s=5, lease_s=100))
    pair.absorb("d", pair.d.add_request("r1", (5, 6, 7), 1, 0.0))
    pair.advance(6.0)  # nobody claimed: reported at once
    assert failure_kind(_reason(pair)) == "prefill_deadline"


def test_a_lost_prefill_worker() -> None:
    pair = make_pair(dcfg=DecodeConfig(prefill_timeout_s=50, lease_s=100))
    start(pair)
    pair.deliver_all()  # claimed: P's bytes may still land, so the lease decides
    pair.absorb("d", pair.d.peer_lost("P", "no message or heartbeat answer for 3.0s", 1.0))
    pair.advance(102.0)
    assert failure_kind(_reason(pair)) == "prefill_lost"


def test_local_aborts_and_a_failed_metaserver_call() -> None:
    for why, kind in (("request FINISHED_ABORTED", "aborted"),
                      ("metaserver: POST http://proxy/v1/metaserver answered 503: no prefill "
                       "server", "metaserver")):
        pair = make_pair()
        pair.absorb("d", pair.d.add_request("r1", (5, 6, 7), 1, 0.0))
        pair.absorb("d", pair.d.abort("r1", why, 0.0))
        assert failure_kind(_reason(pair)) == kind


def test_reasons_that_quote_another_keep_their_own_kind() -> None:
    assert failure_kind("prefill sender ('P', 0) failed: aborted locally: request "
                        "FINISHED_ABORTED") == "prefill_failed"
    assert failure_kind("prefill sender ('P', 0) failed: deadline of 30s passed") \
        == "prefill_failed"
    assert failure_kind("KV checksum mismatch from sender P rank 0: 1 of 9 block(s) differ, "
                        "first layer 1 block 6 (found at the last DONE, from P rank 1: bytes "
                        "changed after it was verified)") == "checksum_mismatch"
    assert failure_kind("") == failure_kind("new words") == "other"
    assert all(k == k.lower() and " " not in k for k in FAILURE_KINDS)  # metric label values


def test_a_checksum_mismatch_with_budget_left_is_prefilled_again_in_the_same_blocks() -> None:
    """A bad transfer loses its epoch as a lost P does (issue 40): the mismatching sender is
    aborted and, once it said it stopped, D asks for a new prefill of the same blocks under
    the next epoch, avoiding that P's engine; the request does not fail (with no budget it
    does: test_a_checksum_mismatch)."""
    from lw.fsm import Reprefill

    pair = make_pair(dcfg=DecodeConfig(kv_checksum=True, retry_prefill=1, prefill_timeout_s=30,
                                       lease_s=100))
    sums = list(range(3 * 3))
    sums[4] += 1
    send_done(pair, sums, list(range(3 * 3)))  # the refused DONE: P stops, says so
    assert pair.recv == []
    (again,) = [e for e in pair.other if isinstance(e, Reprefill)]
    assert (again.req_id, again.epoch, again.avoid) == ("r1", 1, ("P",))
    assert "KV checksum mismatch" in again.reason
    assert pair.d.counters["checksum_mismatches"] == 1 and pair.d.record("r1").epoch == 1
    assert pair.d.state_of("r1") == "PREFILL_REQUESTED"
