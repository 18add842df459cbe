"""WorkerLoop: the core on real ZMQ sockets with the in-process data plane, in one process."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from lw.fsm import (
    ArmTimer,
    CancelTimer,
    DecodeConfig,
    DecodeEndpoint,
    PrefillConfig,
    Quarantine,
    RecvDone,
    RecvFailed,
    SendFinished,
    WriteLayer,
)
from lw.transport.hookcost import hook_cost_report, measure_hook_cost
from lw.transport.linkmeter import LinkMeter, host_of
from lw.transport.runtime import WorkerLoop
from lw.transport.sidechannel import SideChannel
from lw.transport.wire import (
    PROTOCOL_VERSION,
    AbortAck,
    DoneSending,
    HeartbeatAck,
    KVLayout,
    LayerLayout,
    MetaRequest,
    Sender,
)

from .loops import BLEN, NBLK, L, Pair, make_pair, wait_for

KEY = b"cluster-key-for-tests-0123456789"


@pytest.fixture
def pair() -> Iterator[Pair]:
    pr = make_pair()
    yield pr
    pr.stop()


def test_happy_path_moves_the_bytes(pair: Pair) -> None:
    local, remote = (1, 2, 3), (5, 6, 9)  # 5,6 contiguous remotely, 1,2,3 locally
    pair.start("r1", local, remote)
    pair.compute("r1", local)
    pair.wait_reports(1, 1)
    assert pair.p_reports == [SendFinished("r1", True, "")]
    assert pair.d_reports == [RecvDone("r1")]
    assert pair.verify("r1", remote)
    s = pair.p.stats()
    assert s["loop.transfers_ok"] >= 1 and s["loop.bytes_ok"] == 4 * 3 * BLEN
    assert s["side.replies_matched"] >= 2  # MetaRequest and DoneSending answered in-line
    assert s["live_requests"] == 0 and pair.d.stats()["live_requests"] == 0
    assert s["loop.protocol_errors"] == 0 and s["loop.core_errors"] == 0
    assert pair.p.tail_samples() and pair.p.stats()["tail_max_s"] < 5


def test_the_loop_measures_goodput_per_decode_host(pair: Pair) -> None:
    pair.p.writes.link = LinkMeter(min_bytes=1)  # the pair's layers are small
    local, remote = (1, 2, 3), (5, 6, 9)
    pair.start("r1", local, remote)
    pair.compute("r1", local)
    pair.wait_reports(1, 1)
    assert wait_for(lambda: pair.p.writes.link.samples >= 1)
    (host,) = pair.p.writes.link.goodput
    assert host == host_of(pair.d.addr) and pair.p.writes.link.goodput[host] > 0


def test_layers_computed_before_decoder_knows_the_request() -> None:
    # P asks every 50 ms; 10,000 attempts: it still asks when D learns of the request, however
    # slow the machine (with 20, it would give up after a second)
    pair = make_pair(pcfg=PrefillConfig(meta_retry_s=0.05, meta_attempts=10_000,
                                        ack_retry_s=0.05, ack_attempts=600,
                                        request_timeout_s=600))
    try:
        local, remote = (0, 1), (2, 3)
        pair.start("r1", local, remote, d_first=False)  # D answers "unknown" for a while
        pair.compute("r1", local)
        wait_for(lambda: pair.d.stats()["loop.messages"] >= 3)  # D said "unknown" (3 claims)
        pair.collect()
        assert pair.p_reports == []
        assert pair.p.run(lambda lp: lp.endpoint.state_of("r1")).result(5) == \
            "AWAIT_DECODER_META"
        pair.d.call("add_request", "r1", remote, 1).result(5)
        pair.wait_reports(1, 1)
        assert pair.p_reports == [SendFinished("r1", True, "")]
        assert pair.verify("r1", remote)
    finally:
        pair.stop()


def test_many_requests_in_one_batch_are_grouped_per_layer(pair: Pair) -> None:
    reqs = [(f"r{i}", (2 * i, 2 * i + 1), (2 * i + 1, 2 * i)) for i in range(6)]
    for rid, local, remote in reqs:
        pair.start(rid, local, remote)
    wait_for(lambda: all(pair.p.run(lambda lp, r=rid: lp.endpoint.state_of(r)).result(5)
                         == "META_READY" for rid, _, _ in reqs))
    for layer in range(4):
        for rid, local, _ in reqs:
            for j, blk in enumerate(local):
                pair.pattern.fill(pair.p_mem[layer, blk], rid, layer, j)
        pair.p.layer_computed(layer, [r[0] for r in reqs])
    pair.wait_reports(6, 6)
    assert all(isinstance(r, SendFinished) and r.ok for r in pair.p_reports)
    assert all(pair.verify(rid, remote) for rid, _, remote in reqs)
    # one per wake-up of the loop (layers drained together share one), never one per request
    assert 1 <= pair.p.stats()["loop.transfers_submitted"] <= 4


def test_layer_batch_wakes_the_loop_for_the_first_and_last_layer_only() -> None:
    pair = make_pair(layer_batch_s=60.0, hot_poll_s=0.0)  # no hot poll: only wake() wakes it
    try:
        local, remote = (1, 2), (3, 4)
        pair.start("r1", local, remote)
        wait_for(lambda: pair.p.run(lambda lp: lp.endpoint.state_of("r1")).result(5)
                 == "META_READY")
        woke: list[int] = []
        real_wake = pair.p.inbox.wake

        def counting_wake() -> None:
            if threading.current_thread() is threading.main_thread():
                woke.append(1)
            real_wake()

        pair.p.inbox.wake = counting_wake  # type: ignore[method-assign]
        for layer in range(L):
            wait_for(lambda: not pair.p.inbox.wake_pending)  # as if the loop had drained meanwhile
            pair.compute("r1", local, range(layer, layer + 1))
        # layer 0 (after a quiet spell) and the last layer wake it; the rest wait in the inbox
        assert len(woke) == 2
        pair.wait_reports(1, 1)
        assert pair.p_reports == [SendFinished("r1", True, "")]
        assert pair.verify("r1", remote)
    finally:
        pair.stop()


def test_layer_batch_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="layer_batch_s"):
        make_pair(layer_batch_s=-1.0)


def test_failed_write_fails_both_sides_and_frees_after_quarantine(pair: Pair) -> None:
    local, remote = (1, 2), (3, 4)
    pair.start("r1", local, remote)
    wait_for(lambda: pair.p.run(lambda lp: lp.endpoint.state_of("r1")).result(5)
             == "META_READY")
    pair.p_dp.fail_next(1)
    pair.compute("r1", local)
    pair.wait_reports(1, 1)
    [fin] = pair.p_reports
    assert isinstance(fin, SendFinished) and not fin.ok and "injected" in fin.reason
    pair.wait_reports(1, 1)
    assert isinstance(pair.d_reports[-1], RecvFailed)
    assert pair.d_reports[-1].block_ids == remote


def test_decoder_deadline_reports_failure() -> None:
    pr = make_pair(dcfg=DecodeConfig(prefill_timeout_s=0.2, lease_s=10))
    try:
        pr.d.call("add_request", "lonely", (1,), 1).result(5)
        pr.wait_reports(0, 1)
        [rep] = pr.d_reports
        assert isinstance(rep, RecvFailed) and "deadline" in rep.reason
    finally:
        pr.stop()


def test_frozen_decoder_never_blocks_the_hook() -> None:
    # The frozen write is held in flight until the test unfreezes D (its timeout is 60 s); the
    # request's deadline (2 s, from add_request) fires meanwhile.
    pr = make_pair(pcfg=PrefillConfig(meta_retry_s=0.05, request_timeout_s=2.0), timeout_s=60.0)
    try:
        local, remote = (1, 2), (3, 4)
        pr.start("r1", local, remote)
        wait_for(lambda: pr.p.run(lambda lp: lp.endpoint.state_of("r1")).result(5)
                 == "META_READY")
        pr.p_dp.freeze(pr.d_dp.session)
        worst = 0.0
        for layer in range(4):
            t0 = time.perf_counter()
            pr.p.layer_computed(layer, ["r1"])
            worst = max(worst, time.perf_counter() - t0)
        # timing: a hook never waits for the frozen write (held for up to 60 s); a hook that
        # does not block takes microseconds, so 1 s is a generous bound on a loaded machine
        assert worst < 1.0, worst
        wait_for(lambda: pr.p_dp.stats()["pending"] >= 1)  # the write is in flight, frozen
        wait_for(lambda: pr.p.stats()["core.deadlines"] >= 1)  # the request's deadline fired
        # it failed the request, but its blocks are released (SendFinished) only once the
        # writes that read them have returned: not while the frozen write is in flight
        pr.collect()
        assert pr.p_reports == [] and pr.p_dp.stats()["pending"] >= 1
        pr.p_dp.unfreeze(pr.d_dp.session)
        pr.wait_reports(1, 0)
        [fin] = pr.p_reports
        assert isinstance(fin, SendFinished) and not fin.ok and "deadline" in fin.reason, fin
    finally:
        pr.p_dp.unfreeze(pr.d_dp.session)
        pr.stop()


def test_protocol_errors_from_the_network_are_counted_and_dropped(pair: Pair) -> None:
    rogue = SideChannel()
    try:
        bogus = DoneSending(PROTOCOL_VERSION, "never-seen", Sender("X", 0, 1, rogue.addr), 1, 4)
        rogue.send(pair.d.addr, bogus)  # answered "not accepted", counted, nothing else
        bogus_ack = AbortAck(PROTOCOL_VERSION, "never-seen", Sender("X", 0, 1, rogue.addr), True)
        rogue.send(pair.d.addr, bogus_ack)  # refused by the core: a protocol error
        rogue.send(pair.p.addr, MetaRequest(PROTOCOL_VERSION, "x", Sender("X", 0, 1,
                                                                         rogue.addr), True, ()))
        wait_for(lambda: pair.d.stats()["loop.protocol_errors"] == 1
                 and pair.d.stats()["core.unknown_requests"] == 1
                 and pair.p.stats()["loop.protocol_errors"] == 1)
        local, remote = (1,), (2,)
        pair.start("ok", local, remote)  # the loops go on as if nothing happened
        pair.compute("ok", local)
        pair.wait_reports(1, 1)
        assert pair.d_reports == [RecvDone("ok")]
    finally:
        rogue.close()


def test_cluster_key_mismatch_is_dropped_and_counted() -> None:
    pr = make_pair(pcfg=PrefillConfig(meta_retry_s=0.05, meta_attempts=4, request_timeout_s=2),
                   dcfg=DecodeConfig(prefill_timeout_s=0.5, lease_s=10), d_key=KEY, p_key=None)
    try:
        local, remote = (1,), (2,)
        pr.start("r1", local, remote)
        pr.compute("r1", local)
        pr.wait_reports(1, 1)
        assert isinstance(pr.p_reports[0], SendFinished) and not pr.p_reports[0].ok
        assert isinstance(pr.d_reports[0], RecvFailed)
        # P's 4 claims were sent before it failed; D may read the last one after its deadline
        wait_for(lambda: pr.d.stats()["side.unauthenticated"] >= 4)
    finally:
        pr.stop()


def test_bad_block_ids_fail_the_write_not_the_loop(pair: Pair) -> None:
    local, remote = (NBLK + 5,), (1,)  # local block outside this worker's layout
    pair.start("r1", local, remote)
    for layer in range(4):
        pair.p.layer_computed(layer, ["r1"])
    pair.wait_reports(1, 1)
    fin = pair.p_reports[0]
    assert isinstance(fin, SendFinished) and not fin.ok and "cannot address" in fin.reason
    assert pair.p.stats()["loop.write_setup_failures"] >= 1


def test_entries_merge_contiguous_block_runs() -> None:
    side = SideChannel()
    from lw.fsm import PrefillEndpoint

    local = [LayerLayout(0x10000 + i * 0x1000, 64, 64, 32) for i in range(2)]
    loop = WorkerLoop(PrefillEndpoint(Sender("P", 0, 1, side.addr), 2), side, None,
                      local_layout=local)
    try:
        remote = KVLayout("D", 1, "s", [LayerLayout(0x90000 + i * 0x1000, 64, 64, 32)
                                        for i in range(2)])
        w = WriteLayer("r", 1, remote, (1, 2, 3, 7), (4, 5, 6, 9))
        assert loop.memory.entries(w) == [(0x11000 + 64, 0x91000 + 4 * 64, 3 * 64),
                                    (0x11000 + 7 * 64, 0x91000 + 9 * 64, 64)]
        strided = KVLayout("D", 2, "s", [LayerLayout(0x90000, 128, 64, 32),
                                         LayerLayout(0xA0000, 64, 64, 32)])
        w2 = WriteLayer("q", 0, strided, (1, 2), (4, 5))  # remote stride != len: no merging
        assert loop.memory.entries(w2) == [(0x10000 + 64, 0x90000 + 4 * 128, 64),
                                     (0x10000 + 128, 0x90000 + 5 * 128, 64)]
    finally:
        loop.stop()


class _RecordingDecode(DecodeEndpoint):
    """Records timer firings (to test the loop's timer heap)."""

    fired: list[tuple[tuple[str, str], float]]

    def on_timer(self, key, now):  # type: ignore[no-untyped-def]
        self.fired.append((key, now))
        return []


def test_timers_replace_and_cancel() -> None:
    side = SideChannel()
    layout = KVLayout("D", 1, "s", [LayerLayout(4096, 64, 64, 4)])
    ep = _RecordingDecode(Sender("D", 0, 1, side.addr), layout)
    ep.fired = []
    loop = WorkerLoop(ep, side).start()
    try:
        t0 = time.monotonic()
        loop.run(lambda lp: lp._execute([
            ArmTimer(("a", "x"), t0 + 0.05),
            ArmTimer(("a", "x"), t0 + 0.25),  # replaces the first
            ArmTimer(("b", "y"), t0 + 0.1),
            CancelTimer(("b", "y")),
            ArmTimer(("c", "z"), t0 + 0.15),
        ], None)).result(5)
        wait_for(lambda: len(ep.fired) >= 2)
        time.sleep(0.1)  # a cancelled or replaced timer that still fired would show by now
        keys = [k for k, _ in ep.fired]
        assert keys == [("c", "z"), ("a", "x")]
        assert ep.fired[1][1] >= t0 + 0.25
    finally:
        loop.stop()


def test_call_errors_come_back_in_the_future(pair: Pair) -> None:
    pair.d.call("add_request", "dup", (1,), 1).result(5)
    with pytest.raises(ValueError, match="already live"):
        pair.d.call("add_request", "dup", (1,), 1).result(5)
    with pytest.raises(ValueError):
        pair.d.call("on_message", None)
    assert pair.d.stats()["loop.call_errors"] == 1


def test_decoder_fails_claims_of_a_restarted_prefill_engine(pair: Pair) -> None:
    rogue = SideChannel()
    try:
        pair.d.call("add_request", "old", (1,), 1).result(5)
        pair.d.call("add_request", "new", (2,), 1).result(5)
        rogue.send(pair.d.addr, MetaRequest(PROTOCOL_VERSION, "old",
                                            Sender("P9", 0, 1, rogue.addr), True, (1,)))
        wait_for(lambda: pair.d.stats()["loop.messages"] >= 1)
        rogue.send(pair.d.addr, MetaRequest(PROTOCOL_VERSION, "new",
                                            Sender("P9", 0, 2, rogue.addr), True, (2,)))
        pair.wait_reports(0, 1)
        [rep] = pair.d_reports
        # quarantined, not freed: bytes the old incarnation handed to the transport may land
        assert isinstance(rep, Quarantine) and rep.req_id == "old" and "restarted" in rep.reason
        assert pair.d.stats()["core.peer_restarts"] == 1
        assert pair.d.run(lambda lp: lp.endpoint.state_of("new")).result(5) == "RECEIVING"
    finally:
        rogue.close()


def test_a_heartbeat_answered_by_a_new_process_fails_the_old_ones_claims(pair: Pair) -> None:
    """A P restarted at the same address answers D's heartbeats, so it never falls silent: the
    incarnation in its answer is what tells D that the old process's claims are lost."""
    rogue = SideChannel()
    try:
        pair.d.call("add_request", "old", (1,), 1).result(5)
        rogue.send(pair.d.addr, MetaRequest(PROTOCOL_VERSION, "old",
                                            Sender("P9", 0, 1, rogue.addr), True, (1,)))
        wait_for(lambda: pair.d.stats()["loop.messages"] >= 1)
        rogue.send(pair.d.addr, HeartbeatAck(PROTOCOL_VERSION, Sender("P9", 0, 2, rogue.addr)))
        pair.wait_reports(0, 1)
        [rep] = pair.d_reports
        assert isinstance(rep, Quarantine) and rep.req_id == "old" and "restarted" in rep.reason
        assert pair.d.stats()["core.peer_restarts"] == 1
    finally:
        rogue.close()


def test_quarantine_is_reported(pair: Pair) -> None:
    local, remote = (1,), (2,)
    pair.start("r1", local, remote)
    wait_for(lambda: pair.p.run(lambda lp: lp.endpoint.state_of("r1")).result(5)
             == "META_READY")
    pair.p.stop()  # P vanishes after its claim: D must quarantine on abort
    pair.d.call("abort", "r1", "client went away").result(5)
    pair.wait_reports(0, 1)
    assert isinstance(pair.d_reports[0], Quarantine)


def test_hook_cost_helper_runs() -> None:
    rep = hook_cost_report(8, 4, steps=1)
    # timing: the hook is cheap (tens of microseconds idle); 0.1 s only catches a hook that
    # waits for the loop or the network, also on a loaded machine with GIL contention
    assert 0 < rep["hook_mean_s"] < 0.1 and rep["loop_per_layer_s"] > 0
    assert measure_hook_cost(4, 2) > 0


def test_calls_after_stop_fail_at_once(pair: Pair) -> None:
    pair.d.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        pair.d.call("abort", "x", "why").result(1)
    pair.d.layer_computed(0, ["x"])  # a hook after stop is a no-op, never an error


def test_wait_reports_ends_when_a_transfer_does(pair: Pair) -> None:
    """An engine's idle step waits on this instead of spinning: it returns at the report."""
    assert pair.d.wait_reports(0.01) is False  # nothing in progress: the whole timeout
    local, remote = (1, 2), (5, 6)
    pair.start("r1", local, remote)
    pair.compute("r1", local)
    t0 = time.monotonic()
    assert pair.d.wait_reports(120.0) is True
    # timing: it returned at the report, not at the end of its 120 s timeout
    assert time.monotonic() - t0 < 60.0
    assert pair.d.wait_reports(120.0) is True  # not drained yet: at once
    pair.wait_reports(1, 1)
    assert pair.d_reports == [RecvDone("r1")]


def test_chunks_move_their_bytes_as_they_are_computed(pair: Pair) -> None:
    """Progressive push over real sockets: each chunk's blocks land before the next chunk
    computes; the checksums-free DONE covers every block."""
    from lw.fsm import PrefillRequest

    local, remote = (1, 2, 3), (5, 6, 9)
    pair.d.call("add_request", "r1", remote, 1).result(5)
    addr = pair.d.addr
    pair.p.call("add_request", PrefillRequest("r1", addr, local[:2], remote, 1, final=False)
                ).result(5)
    pair.compute("r1", local[:2])
    wait_for(lambda: pair.p.endpoint.state_of("r1") == "CHUNK_SENT")
    assert pair.verify("r1", remote[:2])
    pair.p.call("add_chunk", "r1", local[2:], True).result(5)
    for layer in range(L):  # chunk 2 computes the request's third block (index 2)
        pair.pattern.fill(pair.p_mem[layer, local[2]], "r1", layer, 2)
        pair.p.layer_computed(layer, ["r1"])
    pair.wait_reports(1, 1)
    assert pair.p_reports == [SendFinished("r1", True, "")]
    assert pair.d_reports == [RecvDone("r1")]
    assert pair.verify("r1", remote)
