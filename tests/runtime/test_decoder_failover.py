"""Several decoders behind the synthetic proxy: requests spread over them, and when one dies the
requests that streamed no token yet move to a live one (a fresh D-first round, verified there)
while those that did fail; nothing leaks on P or on the live decoder (issue 22, item 5)."""

from __future__ import annotations

import pytest

from lw.lab.synthetic import ClusterConfig, run_cluster
from lw.lab.synthetic.router import Lost, Router

from .conftest import needs_mooncake
from .test_faults import FAST


# ----------------------------------------------------------------------------- the router
def test_router_spreads_over_the_least_loaded_and_takes_turns_on_ties() -> None:
    r = Router([f"c{i}" for i in range(5)], slots=2, window=2)
    picks = []
    while r.pending:
        slot = r.pick([0, 1])
        if slot is None:
            break
        picks.append(slot)
        r.start(r.pending.popleft(), slot)
    assert picks == [0, 1, 0, 1]  # the window (2 per decoder) stops the fifth
    assert r.pick([0, 1]) is None and list(r.pending) == ["c4"]
    assert r.ended("c1") == "c1" and r.pick([0, 1]) == 1  # the one with room
    assert r.pick([0]) is None  # decoder 1 is not ready: decoder 0 is full


def test_router_moves_only_requests_without_a_token_and_never_picks_a_dead_decoder() -> None:
    r = Router(["a", "b", "c"], slots=2, window=4)
    for _ in range(2):
        r.start(r.pending.popleft(), 0)
    r.start(r.pending.popleft(), 1)
    r.streamed("a", 1)
    assert r.held(0) == {"a": 1, "b": 0} and r.held(1) == {"c": 0}
    lost = r.decoder_lost(0)
    assert lost == [Lost("a", "a", 1), Lost("b", "b", 0)]
    assert [r.may_move(x, max_tries=2) for x in lost] == [False, True]
    r.retry("b")
    assert r.pick([0, 1]) == 1  # decoder 0 is down
    assert r.start(r.pending.popleft(), 1) == "b.retry1"  # a new transfer id: a fresh round
    assert r.client_of("b") is None and r.client_of("b.retry1") == "b"
    assert r.ended("b") is None  # a late result of the dead attempt changes nothing
    assert not r.may_move(Lost("b.retry1", "b", 0), max_tries=2)  # its tries are spent
    assert r.decoder_lost(1) and not r.may_move(Lost("c", "c", 0), max_tries=5)  # none left


def test_config_of_several_decoders() -> None:
    assert ClusterConfig(decoders=2).decode_tokens == 8
    assert ClusterConfig().decode_tokens == 0  # one decoder: done once verified, as before
    with pytest.raises(ValueError, match="single decoder"):
        ClusterConfig(decoders=2, fault="freeze-decoder-mid-transfer")
    with pytest.raises(ValueError, match="decoders must be"):
        ClusterConfig(decoders=0)


# ----------------------------------------------------------------------------- clusters
def test_inprocess_two_decoders_share_the_requests_and_stream_every_token() -> None:
    cfg = ClusterConfig(**{**FAST, "data_plane": "inprocess", "transfer_timeout_s": 1.0,  # type: ignore[arg-type]
                           "requests": 12, "decoders": 2, "decode_tokens": 3,
                           "token_ms": 1.0})
    res = run_cluster(cfg)
    assert not res.errors and res.ok, (res.errors, res.reasons)
    assert res.done == 12 and res.failed == 0 and res.leaked == 0
    assert res.tokens == 12 * 3
    assert res.summary_line() == ("summary done=12 failed=0 leaked_blocks=0 corrupt=0 "
                                  "failed_after_first_token=0")


@needs_mooncake
@pytest.mark.parametrize("abort_rate", [0.0, 0.2])
def test_kill_one_of_two_decoders_fails_only_requests_past_their_first_token(
        abort_rate: float) -> None:
    """The done-when of issue 22 (synthetic, decode side) on a small cluster; with client
    aborts, a request whose client went away is neither moved nor counted as K."""
    cfg = ClusterConfig(**{**FAST, "requests": 32, "decoders": 2,  # type: ignore[arg-type]
                           "fault": "kill-decoder", "abort_rate": abort_rate})
    res = run_cluster(cfg)
    assert not res.errors, (res.errors, res.log_dir)
    assert res.accounted == 32 and res.double_reports == 0
    assert res.failed == res.failed_after_first_token + res.client_gone, res.reasons
    assert res.done == 32 - res.failed
    assert res.client_gone <= res.aborts and (abort_rate or not res.aborts)
    assert res.corrupt == 0 and res.leaked == 0, (res.leaked_p, res.leaked_d)
    assert res.p_unreported == 0
    # the kill found requests before their first token; each moved and was verified anew
    # (a moved request whose client then went away fails instead)
    assert res.failovers > 0, (res.counters, res.reasons, res.client_gone)
    assert res.failovers - res.client_gone <= res.counters["failovers_done"] <= res.failovers
    assert res.ok


def test_demo_with_two_decoders_reports_tokens_and_the_new_summary_field(
        capsys: pytest.CaptureFixture[str]) -> None:
    from lw.lab.demo import main

    rc = main(["--engine", "synthetic", "--data-plane", "inprocess", "--requests", "6",
               "--layers", "3", "--decoders", "2", "--token-ms", "1", "--quiet"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0, "\n".join(out)
    assert out[-1] == ("summary done=6 failed=0 leaked_blocks=0 corrupt=0 "
                       "failed_after_first_token=0")
    assert any("2 decoders (least loaded first), 8 tokens per request" in ln for ln in out)
    assert any("tokens streamed to the client" in ln and ln.endswith(" 48") for ln in out)
    # a fault aimed at the one decoder is refused with several
    assert main(["--engine", "synthetic", "--decoders", "2", "--fault",
                 "freeze-decoder-mid-transfer"]) == 2
