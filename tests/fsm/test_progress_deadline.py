"""P's request deadline by progress (issue 40): with ``progress_timeout_s`` a request that
keeps making progress (layers computed, D's answers, writes landing on its decoder, another
request's included) lives up to its cap, ``request_timeout_s``; one that makes none for that
long fails early and says so. Off (0), the cap alone decides, as before."""

from __future__ import annotations

import pytest

from lw.fsm import DecodeConfig, DecodeEndpoint, PrefillConfig, PrefillEndpoint, PrefillRequest

from .harness import D_ADDR, Pair, d_layout, d_sender, p_sender

L = 3
SLOW = PrefillConfig(request_timeout_s=20.0, progress_timeout_s=2.0)


def _pair(pcfg: PrefillConfig) -> Pair:
    return Pair([PrefillEndpoint(p_sender(0), L, pcfg)],
                DecodeEndpoint(d_sender(), d_layout(L), DecodeConfig(prefill_timeout_s=30,
                                                                     lease_s=40)))


def _start(pair: Pair, rid: str, blocks: tuple[int, ...]) -> None:
    pair.absorb("d", pair.d.add_request(rid, blocks, 1, pair.now))
    req = PrefillRequest(rid, D_ADDR, blocks, blocks, 1)
    pair.absorb(0, pair.ps[0].add_request(req, pair.now))


def _land_one(pair: Pair) -> None:
    rank, w = pair.writes.pop(0)
    pair.absorb(rank, pair.ps[rank].transfer_done(w.req_id, w.seq, True, "", pair.now))
    pair.deliver_all()


def test_a_request_whose_writes_keep_landing_lives_past_the_progress_timeout() -> None:
    pair = _pair(SLOW)
    _start(pair, "r1", (1, 2, 3))
    pair.deliver_all()
    for layer in range(L):
        pair.absorb(0, pair.ps[0].layer_computed(layer, ["r1"], pair.now))
    for t in (1.5, 3.0, 4.5):  # a slow link: one write lands every 1.5 s, under 2 s
        pair.advance(t)
        _land_one(pair)
    assert pair.ps[0].state_of("r1") in ("DONE", "LAYER_2_SENT")
    assert pair.ps[0].counters["deadlines"] == 0


def test_a_request_queued_behind_another_on_the_same_link_is_not_stalled() -> None:
    """Writes to one D complete in submission order: r2's wait while r1's land, and that
    is the link's progress, not r2 stuck."""
    pair = _pair(SLOW)
    _start(pair, "r1", (1, 2, 3))
    _start(pair, "r2", (4, 5, 6))
    pair.deliver_all()
    for layer in range(L):
        pair.absorb(0, pair.ps[0].layer_computed(layer, ["r1", "r2"], pair.now))
    r1 = [w for w in pair.writes if w[1].req_id == "r1"]
    r2 = [w for w in pair.writes if w[1].req_id == "r2"]
    pair.writes = r1 + r2
    for i in range(2 * L):
        pair.advance(1.5 * (i + 1))
        _land_one(pair)
    assert pair.ps[0].counters["deadlines"] == 0
    assert [f.ok for f in pair.finished] == [True, True]


def test_a_request_with_no_progress_fails_early_and_says_why() -> None:
    pair = _pair(SLOW)
    _start(pair, "r1", (1, 2, 3))
    pair.deliver_all()
    pair.absorb(0, pair.ps[0].layer_computed(0, ["r1"], pair.now))
    pair.advance(1.0)
    _land_one(pair)  # progress at 1.0, then nothing: the engine stopped computing it
    pair.advance(2.9)
    assert pair.ps[0].state_of("r1") == "LAYER_0_SENT"
    pair.advance(3.1)
    assert pair.ps[0].state_of("r1") == "FAILED"
    (fin,) = pair.finished
    assert "no progress for 2.0s (progress_timeout_s 2s" in fin.reason


def test_the_cap_ends_a_request_however_steady_its_progress() -> None:
    pair = _pair(PrefillConfig(request_timeout_s=5.0, progress_timeout_s=2.0))
    _start(pair, "r1", (1, 2, 3))
    pair.deliver_all()
    for t in (1.5, 3.0, 4.5):  # a layer every 1.5 s: never 2 s without progress
        pair.advance(t)
        pair.absorb(0, pair.ps[0].layer_computed(int(t / 1.5) - 1, ["r1"], pair.now))
    pair.advance(5.0)
    assert pair.ps[0].state_of("r1") == "FAILED"
    pair.complete_writes()  # the writes in flight end; then the blocks go back
    (fin,) = pair.finished
    assert "deadline of 5.0s passed" in fin.reason


def test_off_the_cap_alone_decides_as_before() -> None:
    pair = _pair(PrefillConfig(request_timeout_s=5.0))
    _start(pair, "r1", (1, 2, 3))
    pair.deliver_all()
    pair.advance(4.9)  # no progress at all for 4.9 s: still waited for
    assert pair.ps[0].state_of("r1") == "META_READY"
    pair.advance(5.0)
    assert pair.ps[0].state_of("r1") == "FAILED"


@pytest.mark.parametrize("bad", [-1.0, 20.0, 30.0])
def test_a_progress_timeout_not_under_the_cap_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="progress_timeout_s must be 0 .off. or between"):
        PrefillConfig(request_timeout_s=20.0, progress_timeout_s=bad)


def _fire_p_timers(pair: Pair, to: float) -> None:
    """P's due timers up to ``to``, nothing delivered (D is starved: it answers nothing)."""
    while True:
        due = sorted((at, key) for (who, key), at in pair.timers.items() if who == 0 and at <= to)
        if not due:
            break
        at, key = due[0]
        del pair.timers[(0, key)]
        pair.now = at
        pair.absorb(0, pair.ps[0].on_timer(key, at))
    pair.now = to


def test_resend_until_deadline_keeps_a_silent_d_asked_until_the_cap() -> None:
    """With heartbeats on, a D that answers no DONE is judged by the liveness verdict, not by a
    count: P resends DONE past ack_attempts, and the request deadline still ends it."""
    cfg = PrefillConfig(ack_attempts=2, ack_retry_s=0.5, request_timeout_s=10.0,
                        resend_until_deadline=True)
    pair = _pair(cfg)
    _start(pair, "r1", (1, 2, 3))
    pair.deliver_all()
    for layer in range(L):
        pair.absorb(0, pair.ps[0].layer_computed(layer, ["r1"], pair.now))
    pair.complete_writes()
    dones = [s for s in pair.queue if type(s.msg).__name__ == "DoneSending"]
    assert len(dones) == 1
    pair.queue.clear()  # D is starved: its DONE answers never come
    _fire_p_timers(pair, 6.0)
    sent = sum(type(s.msg).__name__ == "DoneSending" for s in pair.queue)
    assert pair.ps[0].state_of("r1") not in ("FAILED", "DONE")
    assert sent >= 10  # five times the two attempts a count would have allowed
    _fire_p_timers(pair, 10.0)
    assert pair.ps[0].state_of("r1") == "FAILED"


def test_by_default_the_attempts_end_a_request_whose_d_answers_nothing() -> None:
    pair = _pair(PrefillConfig(ack_attempts=2, ack_retry_s=0.5, request_timeout_s=10.0))
    _start(pair, "r1", (1, 2, 3))
    pair.deliver_all()
    for layer in range(L):
        pair.absorb(0, pair.ps[0].layer_computed(layer, ["r1"], pair.now))
    pair.complete_writes()
    pair.queue.clear()
    _fire_p_timers(pair, 1.6)
    assert pair.ps[0].state_of("r1") == "FAILED"
    assert "no acknowledgement of DONE after 2 tries" in pair.finished[0].reason


def test_the_deadline_fires_once_at_the_instant_it_was_armed_for() -> None:
    """Progress at 0.2 s and 8 s without more: the timer armed for 8.2 s fails the request when
    it fires at 8.2 s. 8.2 - 0.2 < 8 in floating point: compared so, the timer was armed again
    for the same instant, for ever (the trace validator's clock found it)."""
    pair = _pair(PrefillConfig(request_timeout_s=20.0, progress_timeout_s=8.0))
    _start(pair, "r1", (1, 2, 3))
    pair.deliver_all()
    pair.advance(0.2)
    pair.absorb(0, pair.ps[0].layer_computed(0, ["r1"], pair.now))
    fired = 0
    real = pair.ps[0].on_timer

    def counting(key: object, now: float) -> list:
        nonlocal fired
        fired += 1
        assert fired < 10, "the deadline timer keeps firing at the same instant"
        return real(key, now)

    pair.ps[0].on_timer = counting  # type: ignore[method-assign]
    pair.advance(8.2)
    assert pair.ps[0].state_of("r1") == "FAILED"


def test_progress_marks_say_what_the_progress_deadline_reads() -> None:
    """The links' last landings and each request's last progress, as lw validate keys them."""
    pair = _pair(SLOW)
    _start(pair, "r1", (1, 2, 3))
    pair.deliver_all()
    pair.advance(1.0)
    pair.absorb(0, pair.ps[0].layer_computed(0, ["r1"], pair.now))
    pair.advance(1.5)
    _land_one(pair)
    pair.ps[0].link_moved("elsewhere", 1.7)
    landed, marks = pair.ps[0].progress_marks()
    assert dict(landed) == {D_ADDR: 1.5, "elsewhere": 1.7} and marks == [1.5]
