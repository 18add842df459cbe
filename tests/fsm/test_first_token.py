"""P's first token travels to D bound to the claim it was computed under (protocol 6): P sends it
once, as soon as D accepted the claim (or after the DONE, from the claim it remembers), never
for a failed request and only from TP rank 0; D takes it only for the request's live epoch, from
a sender it accepted for that epoch, for the request's prompt, once."""

from __future__ import annotations

import pytest

from lw.fsm import (
    DecodeConfig,
    DecodeEndpoint,
    FirstTokenTaken,
    PrefillConfig,
    PrefillEndpoint,
    PrefillRequest,
    ProtocolError,
    Send,
)
from lw.fsm.kvmap import make_format
from lw.fsm.messages import PROTOCOL_VERSION, FirstToken, KVLayout, LayerLayout
from lw.transport.wire import DoneSending, FailedSending, MetaRequest

from .harness import D_ADDR, Pair, d_layout, d_sender, p_sender
from .test_endpoints import L, compute_all

PROMPT = "0123456789abcdef0123456789abcdef"
OTHER = "fedcba9876543210fedcba9876543210"
ON_P = PrefillConfig(first_token_from_p=True)
ON_D = DecodeConfig(first_token_from_p=True)


def pair(pcfg: PrefillConfig = ON_P, dcfg: DecodeConfig = ON_D, **kw: object) -> Pair:
    return Pair([PrefillEndpoint(p_sender(), L, pcfg, **kw)],  # type: ignore[arg-type]
                DecodeEndpoint(d_sender(), d_layout(L), dcfg))


def start(pr: Pair, rid: str = "r1", epoch: int = 0, prompt: str = PROMPT) -> None:
    pr.absorb("d", pr.d.add_request(rid, (5, 6, 7), 1, pr.now, prompt=prompt))
    req = PrefillRequest(rid, D_ADDR, (1, 2, 3), (5, 6, 7), 1, epoch=epoch, prompt=prompt)
    pr.absorb(0, pr.ps[0].add_request(req, pr.now))


def run_to_done(pr: Pair, rid: str = "r1") -> None:
    """Both sides DONE, with no token from P's scheduler (its DONE waited for one)."""
    pr.deliver_all()
    compute_all(pr, rid)
    pr.complete_writes()
    pr.advance(pr.now + ON_P.first_token_wait_s)
    pr.deliver_all()


def tokens_queued(pr: Pair) -> list[FirstToken]:
    return [s.msg for s in pr.queue if isinstance(s.msg, FirstToken)]


def taken(pr: Pair) -> list[FirstTokenTaken]:
    return [e for e in pr.other if isinstance(e, FirstTokenTaken)]


def token_msg(rid: str = "r1", epoch: int = 0, engine: str = "P", prompt: str = PROMPT,
              token: int = 42) -> FirstToken:
    sender = p_sender()
    if engine != "P":
        sender = type(sender)(engine, 0, 1, "tcp://other/0")
    return FirstToken(PROTOCOL_VERSION, rid, sender, epoch, token, prompt, "spec-a")


# ------------------------------------------------------------------------------------------ P
def test_p_sends_the_token_once_as_soon_as_the_claim_is_accepted() -> None:
    pr = pair()
    start(pr)
    pr.deliver_all()  # META_READY
    out = pr.ps[0].first_token("r1", 42, "spec-a", pr.now)
    (send,) = [e for e in out if isinstance(e, Send)]
    assert send.dest == D_ADDR
    assert send.msg == FirstToken(PROTOCOL_VERSION, "r1", p_sender(), 0, 42, PROMPT, "spec-a")
    assert pr.ps[0].first_token("r1", 43, "spec-a", pr.now) == []  # once per request
    assert pr.ps[0].counters["first_tokens_sent"] == 1
    assert pr.ps[0].counters["first_tokens_refused"] == 1
    pr.absorb(0, out)
    pr.deliver_all()
    assert taken(pr) == [FirstTokenTaken("r1", 42, "spec-a", 0)]


def test_p_holds_a_token_until_d_accepts_and_nothing_waits_for_it() -> None:
    pr = pair()
    start(pr)  # the claim is not answered yet: AWAIT_DECODER_META
    assert pr.ps[0].first_token("r1", 7, "s", pr.now) == []
    compute_all(pr)  # layers go on being recorded
    pr.deliver_all()  # the claim is accepted: the token goes with the layers' writes
    assert taken(pr) == [FirstTokenTaken("r1", 7, "s", 0)]
    assert pr.writes, "the held token must not delay the writes"
    pr.complete_writes()
    pr.deliver_all()
    assert pr.ps[0].state_of("r1") == "DONE" and pr.d.state_of("r1") == "DONE"
    events = [e[2:5] for e in pr.ps[0].timeline.of("r1") if e[2] == "first_token"]
    assert [e[1] for e in events] == ["AWAIT_DECODER_META", "META_READY"]


def test_p_sends_the_token_of_a_request_already_done_from_its_remembered_claim() -> None:
    pr = pair()
    start(pr, epoch=0)
    run_to_done(pr)  # its DONE waited for the token first_token_wait_s, then went
    assert pr.ps[0].live_requests() == []  # released: D acknowledged the DONE
    out = pr.ps[0].first_token("r1", 9, "s", pr.now)
    assert [s.msg.token for s in out if isinstance(s, Send)] == [9]
    assert pr.ps[0].first_token("r1", 9, "s", pr.now) == []  # the claim is spent
    pr.absorb(0, out)
    pr.deliver_all()
    assert taken(pr) == [FirstTokenTaken("r1", 9, "s", 0)]


def test_p_holds_the_token_of_a_request_computed_ahead_until_bound_and_accepted() -> None:
    pr = pair()
    p = pr.ps[0]
    pr.absorb(0, p.add_ahead("ahead-1", (1, 2, 3), True, PROMPT, pr.now))
    compute_all(pr, "ahead-1")
    assert p.first_token("ahead-1", 5, "s", pr.now) == []  # held: no decoder known
    pr.absorb("d", pr.d.add_request("d-1", (5, 6, 7), 1, pr.now, prompt=PROMPT))
    req = PrefillRequest("d-1", D_ADDR, (), (5, 6, 7), 1, prompt=PROMPT)
    pr.absorb(0, p.bind(req, 0, pr.now, ahead_id="ahead-1"))
    assert tokens_queued(pr) == []  # bound, but D has not accepted yet
    pr.deliver_all()
    assert taken(pr) == [FirstTokenTaken("d-1", 5, "s", 0)]  # under D's id


def test_p_resolves_the_ahead_id_of_a_request_bound_and_released() -> None:
    pr = pair()
    p = pr.ps[0]
    pr.absorb(0, p.add_ahead("ahead-1", (1, 2, 3), True, PROMPT, pr.now))
    pr.absorb("d", pr.d.add_request("d-1", (5, 6, 7), 1, pr.now, prompt=PROMPT))
    pr.absorb(0, p.bind(PrefillRequest("d-1", D_ADDR, (), (5, 6, 7), 1, prompt=PROMPT), 0,
                        pr.now, ahead_id="ahead-1"))
    run_to_done(pr, "d-1")
    assert p.live_requests() == []
    out = p.first_token("ahead-1", 5, "s", pr.now)  # the scheduler still names the ahead id
    assert [s.msg.req_id for s in out if isinstance(s, Send)] == ["d-1"]
    assert p.first_token("d-1", 5, "s", pr.now) == []


@pytest.mark.parametrize("when", ["held", "after"])
def test_p_never_sends_the_token_of_a_failed_request(when: str) -> None:
    pr = pair()
    start(pr)
    if when == "held":
        assert pr.ps[0].first_token("r1", 3, "s", pr.now) == []
    pr.absorb(0, pr.ps[0].abort("r1", "client gone", pr.now))
    pr.deliver_all()
    if when == "after":
        assert pr.ps[0].first_token("r1", 3, "s", pr.now) == []
    assert tokens_queued(pr) == [] and taken(pr) == []
    assert pr.ps[0].counters["first_tokens_sent"] == 0


def test_a_token_held_while_d_refuses_the_claim_is_never_sent() -> None:
    pr = pair()
    pr.absorb("d", pr.d.add_request("r1", (5, 6, 7), 1, pr.now, prompt=PROMPT))
    req = PrefillRequest("r1", D_ADDR, (1, 2, 3), (5, 6, 7), 1, prompt=OTHER)  # D refuses it
    pr.absorb(0, pr.ps[0].add_request(req, pr.now))
    assert pr.ps[0].first_token("r1", 3, "s", pr.now) == []
    pr.deliver_all()
    assert pr.ps[0].state_of("r1") == "FAILED"
    assert tokens_queued(pr) == [] and taken(pr) == []


def test_only_tp_rank_0_sends_the_token() -> None:
    fmt = make_format(tp_rank=1, tp_size=2, total_heads=2, block_tokens=16, dtype="bf16")
    local = KVLayout("P", 1, "p-te:1", [LayerLayout(0x1000 * (i + 1), 256, 256, 64)
                                         for i in range(L)], fmt)
    p = PrefillEndpoint(p_sender(1), L, ON_P, local=local)
    p.add_request(PrefillRequest("r1", D_ADDR, (1,), (5,), 2), 0.0)
    assert p.first_token("r1", 3, "s", 0.0) == []
    assert p.counters["first_tokens_refused"] == 0  # not a refusal: rank 0 speaks for P


def test_p_refuses_tokens_when_off_or_out_of_bounds_or_unknown() -> None:
    pr = pair(pcfg=PrefillConfig())
    start(pr)
    pr.deliver_all()
    assert pr.ps[0].first_token("r1", 3, "s", pr.now) == []
    on = pair()
    start(on)
    on.deliver_all()
    p = on.ps[0]
    assert p.first_token("r1", -1, "s", on.now) == []
    assert p.first_token("r1", 2**31, "s", on.now) == []
    assert p.first_token("r1", 3, "x" * 65, on.now) == []
    assert p.first_token("r1", 3, "a b", on.now) == []
    assert p.first_token("nope", 3, "s", on.now) == []
    assert p.counters["first_tokens_refused"] == 5
    assert [s for s in p.first_token("r1", 3, "s", on.now) if isinstance(s, Send)]


# ------------------------------------------------------------------------------------------ D
def claimed_d(epoch_prompt: str = PROMPT, cfg: DecodeConfig = ON_D) -> DecodeEndpoint:
    d = DecodeEndpoint(d_sender(), d_layout(L), cfg)
    d.add_request("r1", (5, 6, 7), 1, 0.0, prompt=epoch_prompt)
    d.on_message(MetaRequest(PROTOCOL_VERSION, "r1", p_sender(), True, (5, 6, 7),
                             prompt=PROMPT), 0.0)
    return d


def test_d_takes_a_live_epochs_token_once_and_the_kv_lifecycle_does_not_move() -> None:
    d = claimed_d()
    out = d.on_message(token_msg(), 1.0)
    assert out == [FirstTokenTaken("r1", 42, "spec-a", 0)]  # no timer, no state change
    assert d.state_of("r1") == "RECEIVING"
    assert d.on_message(token_msg(), 1.0) == []  # a duplicate: not reported twice
    assert d.counters["first_tokens_taken"] == 1


def test_d_takes_the_token_of_a_request_already_done() -> None:
    pr = pair()
    start(pr)
    run_to_done(pr)
    assert pr.d.state_of("r1") == "DONE"
    assert pr.d.on_message(token_msg(), pr.now) == [FirstTokenTaken("r1", 42, "spec-a", 0)]
    assert pr.d.on_message(token_msg(), pr.now) == []  # a duplicate after the DONE


def test_d_refuses_a_token_of_an_epoch_it_left() -> None:
    d = claimed_d(cfg=DecodeConfig(first_token_from_p=True, retry_prefill=2))
    # epoch 0's P fails: D asks for a re-prefill under epoch 1 (P said it stopped: no fence)
    d.on_message(FailedSending(PROTOCOL_VERSION, "r1", p_sender(), 1, "boom", epoch=0), 1.0)
    assert d.record("r1").epoch == 1
    assert d.on_message(token_msg(epoch=0), 2.0) == []
    assert d.counters["first_tokens_refused"] == 1 and d.counters["stale_epoch"] >= 1
    p2 = type(p_sender())("P2", 0, 1, "tcp://p2/0")
    d.on_message(MetaRequest(PROTOCOL_VERSION, "r1", p2, True, (5, 6, 7), epoch=1,
                             prompt=PROMPT), 3.0)
    got = d.on_message(FirstToken(PROTOCOL_VERSION, "r1", p2, 1, 8, PROMPT, "s"), 3.0)
    assert got == [FirstTokenTaken("r1", 8, "s", 1)]


def test_d_refuses_a_stale_epochs_token_after_the_done() -> None:
    pr = pair()
    start(pr)
    run_to_done(pr)
    assert pr.d.on_message(token_msg(epoch=1), pr.now) == []
    assert pr.d.counters["first_tokens_refused"] == 1
    assert pr.d.on_message(token_msg(epoch=0), pr.now)  # the right one still goes


def test_d_refuses_a_token_from_a_sender_it_never_accepted_or_for_another_prompt() -> None:
    d = claimed_d()
    with pytest.raises(ProtocolError, match="never accepted"):
        d.on_message(token_msg(engine="X"), 1.0)
    with pytest.raises(ProtocolError, match="prompt"):
        d.on_message(token_msg(prompt=OTHER), 1.0)
    assert d.on_message(token_msg(), 1.0)  # neither spent the epoch's token


def test_d_refuses_a_token_for_an_unknown_or_failed_request_without_raising() -> None:
    d = claimed_d()
    assert d.on_message(token_msg(rid="never"), 1.0) == []
    assert d.counters["unknown_requests"] == 1
    d.abort("r1", "client gone", 1.0)  # quarantined: P has not confirmed it stopped
    assert d.state_of("r1") == "FAILED"
    assert d.on_message(token_msg(), 1.0) == []
    assert d.counters["first_tokens_refused"] == 2 and d.counters["first_tokens_taken"] == 0


def test_d_with_first_tokens_off_takes_none() -> None:
    d = claimed_d(cfg=DecodeConfig())
    assert d.on_message(token_msg(), 1.0) == []
    assert d.counters["first_tokens_refused"] == 1


def test_a_request_admitted_again_forgets_its_older_attempts_claim() -> None:
    """P: the same transfer id admitted again (a re-prefill routed back here) that fails: its
    token is not sent under the earlier attempt's claim. D: likewise for an id allocated again."""
    pr = pair()
    start(pr, epoch=0)
    run_to_done(pr)
    p = pr.ps[0]
    p.add_request(PrefillRequest("r1", D_ADDR, (1, 2, 3), (5, 6, 7), 1, epoch=1,
                                 prompt=PROMPT), pr.now)
    p.abort("r1", "client gone", pr.now)
    assert p.state_of("r1") == "FAILED"
    assert p.first_token("r1", 3, "s", pr.now) == []
    d = pr.d
    d.add_request("r1", (5, 6, 7), 1, pr.now, prompt=PROMPT)
    d.abort("r1", "client gone", pr.now)
    assert d.on_message(token_msg(epoch=0), pr.now) == []


def test_p_holds_done_until_its_token_so_the_token_reaches_d_first() -> None:
    """The token leaves P a step after P sampled it, the DONE as the last write lands: DONE
    waits for the token (bounded), so that on the one side channel D has the token first."""
    pr = pair()
    start(pr)
    pr.deliver_all()
    compute_all(pr)
    pr.complete_writes()  # every write landed, no token yet: DONE held, not sent
    assert not [s for s in pr.queue if isinstance(s.msg, DoneSending)]
    assert pr.ps[0].state_of("r1") != "DONE"
    pr.absorb(0, pr.ps[0].first_token("r1", 42, "s", pr.now))
    kinds = [type(s.msg).__name__ for s in pr.queue]
    assert kinds.index("FirstToken") < kinds.index("DoneSending")  # the token first
    pr.deliver_all()
    assert taken(pr) == [FirstTokenTaken("r1", 42, "s", 0)]
    assert pr.ps[0].state_of("r1") == "DONE" and pr.d.state_of("r1") == "DONE"
    assert pr.ps[0].counters["first_tokens_sent"] == 1


def test_p_without_the_feature_or_with_the_token_sent_holds_no_done() -> None:
    for cfg, token_first in ((PrefillConfig(), False), (ON_P, True)):
        pr = pair(cfg, DecodeConfig())
        start(pr)
        pr.deliver_all()
        if token_first:
            pr.absorb(0, pr.ps[0].first_token("r1", 42, "s", pr.now))
        compute_all(pr)
        pr.complete_writes()
        assert [s for s in pr.queue if isinstance(s.msg, DoneSending)], cfg


def test_p_drops_a_repeat_of_the_token_it_holds_or_sent_and_refuses_another() -> None:
    """P's runner hands the token over as it samples it and P's scheduler a step later: the
    second copy of the same token is dropped (not a refusal), live or released, under D's id or
    the ahead id; a different token is still refused, and so is the old token once the id was
    admitted again."""
    pr = pair()
    start(pr)
    pr.deliver_all()
    p = pr.ps[0]
    assert [s for s in p.first_token("r1", 42, "spec-a", pr.now) if isinstance(s, Send)]
    assert p.first_token("r1", 42, "spec-a", pr.now) == []
    assert p.counters["first_tokens_refused"] == 0
    assert p.first_token("r1", 43, "spec-a", pr.now) == []
    assert p.counters["first_tokens_refused"] == 1
    compute_all(pr, "r1")
    pr.complete_writes()
    pr.deliver_all()
    assert p.live_requests() == []
    assert p.first_token("r1", 42, "spec-a", pr.now) == []  # released: still the repeat
    assert p.first_token("r1", 42, "spec-b", pr.now) == []
    assert p.counters["first_tokens_refused"] == 2
    # a request computed ahead, its token sent after the release under the ahead id
    pr.absorb(0, p.add_ahead("ahead-1", (1, 2, 3), True, PROMPT, pr.now))
    pr.absorb("d", pr.d.add_request("d-1", (5, 6, 7), 1, pr.now, prompt=PROMPT))
    pr.absorb(0, p.bind(PrefillRequest("d-1", D_ADDR, (), (5, 6, 7), 1, prompt=PROMPT), 0,
                        pr.now, ahead_id="ahead-1"))
    run_to_done(pr, "d-1")
    assert [s for s in p.first_token("ahead-1", 5, "s", pr.now) if isinstance(s, Send)]
    assert p.first_token("d-1", 5, "s", pr.now) == []
    assert p.first_token("ahead-1", 5, "s", pr.now) == []
    assert p.counters["first_tokens_refused"] == 2
    # the same id admitted again (here failing): the old token is no repeat of anything now
    start(pr, epoch=1)
    pr.deliver_all()
    assert p.first_token("r1", 42, "spec-a", pr.now) == []
    assert p.counters["first_tokens_refused"] == 3
