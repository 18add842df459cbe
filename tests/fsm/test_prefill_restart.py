"""D's view of a P worker that came back as a new process (a higher incarnation): what the old
process claimed is lost, what the new one claims is served, and a request routed to the engine
that nobody claimed yet is given ``restart_claim_s`` to be claimed by the new process.

The case that made this precise (CI, test_e2e_failover): a restarted prefill server's first
message to D was its claim of the very request the proxy had just sent it, and D failed that
request as lost with the old process, then re-prefilled it on a server that was being killed.
"""

from __future__ import annotations

from lw.fsm import ArmTimer, DecodeConfig, DecodeEndpoint, Quarantine, Send
from lw.fsm.effects import Reprefill
from lw.fsm.messages import PROTOCOL_VERSION, MetaReply, MetaRequest, Sender

from .harness import d_layout, d_sender

L = 2
P_ADDR = "tcp://p/0"


def _d(retry: int = 1) -> DecodeEndpoint:
    return DecodeEndpoint(d_sender(), d_layout(L),
                          DecodeConfig(retry_prefill=retry, restart_claim_s=5.0))


def _p(incarnation: int, rank: int = 0) -> Sender:
    return Sender("P", rank, incarnation, f"{P_ADDR}{rank}")


def _claim(d: DecodeEndpoint, rid: str, sender: Sender, now: float = 0.0) -> list:
    out = d.on_message(MetaRequest(PROTOCOL_VERSION, rid, sender, True,
                                   d._reqs[rid].blocks), now)
    [status] = [e.msg.status for e in out if isinstance(e, Send) and isinstance(e.msg, MetaReply)]
    assert status == "accepted", (rid, out)
    return out


def _routed(d: DecodeEndpoint, rid: str, block: int, ranks: int = 1) -> None:
    d.add_request(rid, (block,), ranks, 0.0)
    d.prefill_routed(rid, "P", P_ADDR, 0, 0.0)


def test_the_new_process_claiming_a_routed_request_is_served_and_the_old_claims_are_lost() -> None:
    d = _d()
    _routed(d, "old", 1)
    _claim(d, "old", _p(1))
    _routed(d, "fresh", 2)  # sent to the restarted server: its claim is how D learns of it
    out = _claim(d, "fresh", _p(2), 1.0)
    assert d.state_of("fresh") == "RECEIVING"
    assert d.counters["peer_restarts"] == 1
    # "old" was claimed by incarnation 1: lost, prefilled again once its sender is fenced
    assert d.state_of("old") == "FENCING" and d._reqs["old"].retries == 1
    assert not any(isinstance(e, ArmTimer) and e.key == ("claim", "fresh") for e in out)


def test_a_routed_request_nobody_claimed_waits_for_the_new_process_then_is_prefilled_again(
) -> None:
    d = _d()
    _routed(d, "known", 1)
    _claim(d, "known", _p(1))
    _routed(d, "late", 2)  # the new process claims it, after the restart is known
    _routed(d, "orphan", 3)  # went to the old process: nobody will claim it
    out = d.peer_answered(_p(2), 1.0)  # a heartbeat answered by the new process
    due = {e.key: e.at for e in out if isinstance(e, ArmTimer) and e.key[0] == "claim"}
    assert due == {("claim", "late"): 6.0, ("claim", "orphan"): 6.0}
    assert d.state_of("late") == d.state_of("orphan") == "PREFILL_REQUESTED"
    _claim(d, "late", _p(2), 2.0)
    assert d.on_timer(("claim", "late"), 6.0) == []
    assert d.state_of("late") == "RECEIVING"
    out = d.on_timer(("claim", "orphan"), 6.0)
    [again] = [e for e in out if isinstance(e, Reprefill)]
    assert (again.req_id, again.epoch, again.avoid) == ("orphan", 1, ("P",))
    assert "did not claim the request within restart_claim_s=5.0s" in again.reason


def test_without_a_retry_budget_a_routed_request_is_left_to_its_deadline() -> None:
    d = _d(retry=0)
    d.add_request("a", (1,), 1, 0.0)
    _claim(d, "a", _p(1))
    _routed(d, "b", 2)
    out = d.peer_answered(_p(2), 1.0)
    assert d.state_of("a") == "FAILED"  # claimed by the old process: no retry to spend
    assert any(isinstance(e, Quarantine) and e.req_id == "a" for e in out)
    assert d.state_of("b") == "PREFILL_REQUESTED"
    assert not any(isinstance(e, ArmTimer) and e.key[0] == "claim" for e in out)


def test_the_same_or_an_older_incarnation_answering_changes_nothing() -> None:
    d = _d()
    _routed(d, "r", 1)
    _claim(d, "r", _p(2))
    assert d.peer_answered(_p(2), 1.0) == [] and d.peer_answered(_p(1), 1.0) == []
    assert d.state_of("r") == "RECEIVING" and d.counters["peer_restarts"] == 0


def test_a_restart_learned_rank_by_rank_does_not_fail_the_new_ranks_claims() -> None:
    """Each TP rank of a restarted P engine tells its own new incarnation: rank 1's news must
    not fail what rank 0's new process already claimed (nor rank 0's what rank 1 claims)."""
    d = _d()
    d.add_request("old", (1,), 2, 0.0)
    _claim(d, "old", _p(10, 0))
    _claim(d, "old", _p(11, 1))
    _routed(d, "new", 2, ranks=2)
    _claim(d, "new", _p(20, 0), 1.0)
    assert d._reqs["old"].retries == 1  # rank 0's old process claimed it
    _claim(d, "new", _p(21, 1), 1.0)
    assert d.state_of("new") == "RECEIVING" and d._reqs["new"].retries == 0
    assert d.counters["peer_restarts"] == 2


def test_a_claim_timer_of_an_epoch_left_since_does_nothing() -> None:
    d = _d()
    _routed(d, "r", 1)
    d.peer_answered(_p(1), 0.5)  # first sight: no restart
    d.peer_answered(_p(2), 1.0)  # restart: "r" is due to be claimed by 6.0
    assert d._reqs["r"].claim_due == "P"
    d.peer_lost("P", "heartbeats lost", 2.0)  # lost anyway: epoch 1, route and due forgotten
    assert d._reqs["r"].epoch == 1 and d._reqs["r"].claim_due == ""
    assert d.on_timer(("claim", "r"), 6.0) == []
    assert d._reqs["r"].epoch == 1 and d.state_of("r") == "PREFILL_REQUESTED"
