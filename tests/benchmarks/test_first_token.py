"""The serving benchmark's first-token figures (issue 59): time to token 2 from ``vllm bench
serve``'s per-request lists, the "P sampled -> D received" hop from lw's timelines, P's prefill
time, and the report's table against the single server; no engines."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import serving
from benchmarks._first_token import (
    BEFORE_DONE_KEYS,
    CLOCK_TOLERANCE_S,
    add_token2,
    before_done_refusals,
    before_done_share,
    first_token_hops,
    hop_summary,
    merge_before_done,
    p_prefill_s,
    percentile,
    token1_before_done,
    token2_ms,
)
from benchmarks._plan import BOTH_EXTRA, NO_LINK, SETUPS, Bench, LinkRow, Shape
from benchmarks._report import print_table
from lw.fsm.messages import PROTOCOL_VERSION, Sender, StatusReply, TimelineEntry


def test_token2_is_ttft_plus_the_first_itl_of_each_successful_request() -> None:
    res = {"ttfts": [0.100, 0.0, 0.200, 0.150],
           "itls": [[0.020, 0.030], [], [0.005], []],
           "errors": ["", "HTTP 502", "", ""]}
    # the failed request and the one with a single chunk have no token 2
    assert token2_ms(res) == pytest.approx([120.0, 205.0])
    assert token2_ms({"ttfts": [0.1], "itls": [[0.01]]}) == pytest.approx([110.0])  # no errors
    assert token2_ms({"median_ttft_ms": 10.0}) == []  # without --save-detailed


def test_percentile_interpolates_as_vllm_bench_reports() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 2.0, 3.0], 50) == 2.5
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def test_add_token2_keeps_p50_and_p99_and_drops_the_texts() -> None:
    res = {"ttfts": [0.1, 0.2, 0.3], "itls": [[0.01], [0.02], [0.03]], "errors": ["", "", ""],
           "generated_texts": ["a", "b", "c"]}
    add_token2(res)
    assert res["median_token2_ms"] == pytest.approx(220.0)
    assert res["p99_token2_ms"] == pytest.approx(327.8)
    assert "generated_texts" not in res
    bare: dict[str, object] = {}
    add_token2(bare)
    assert bare["median_token2_ms"] is None


def _reply(role: str, now: float, wall: float,
           events: list[tuple[float, str, str, str]]) -> StatusReply:
    worker = Sender(role, 0, 1, "tcp://127.0.0.1:5600")
    return StatusReply(version=PROTOCOL_VERSION, worker=worker, role=role,  # type: ignore[arg-type]
                       now=now, wall=wall, timeline=[TimelineEntry(t, [rid], ev, "", "", detail)
                                 for t, rid, ev, detail in events])


def test_hops_put_p_and_d_on_the_wall_clock_and_match_ids() -> None:
    """P's clock reads 500 s behind the wall, D's 100 s: the hop is wall time. A request P
    computed ahead is matched under D's id; a sub-transfer under its transfer's."""
    sent, taken = "token 5 to tcp://10.0.0.2:5600 (epoch 1)", "token 5 of epoch 1 from P p0"
    p = _reply("prefill", 10.0, 510.0, [
        (0.900, "t1", "first_token", "token 5: held until D accepts"),  # not sent yet
        (1.000, "t1", "first_token", sent),
        (2.000, "ahead-7", "first_token", sent), (2.500, "ahead-7", "renamed", "t2"),
        (3.000, "t3@1", "first_token", sent),
        (4.000, "t4", "first_token", sent),  # D never took it: left out
        (4.100, "t5", "first_token", "refused: first_token_from_p is off on this worker"),
        (0.500, "t0", "first_token", sent),  # before ``since``: an earlier run's
        (1.500, "t1", "layer_computed", ""),
    ])
    d = _reply("decode", 410.0, 510.0, [
        (401.0025, "t1", "first_token", taken), (402.004, "t2", "first_token", taken),
        (403.010, "t3", "first_token", taken), (400.6, "t0", "first_token", taken),
        (404.050, "t4", "first_token", "token 5 of epoch 1: the epoch was given up"),
        (404.200, "t5", "first_token", "refused: first_token_from_p is off on this worker"),
        (409.000, "t1", "first_token", taken),  # a second take: the first one counts
    ])
    hops = first_token_hops([p, d], since=500.9)
    assert sorted(round(h * 1e3, 1) for h in hops) == [2.5, 4.0, 10.0]
    assert first_token_hops([_reply("prefill", 0, 0, [(1.0, "t1", "admitted", "")])]) == []
    assert hop_summary([h * 1e3 for h in hops]) == "4.0 / 10.0"
    assert hop_summary([]) == "n/a"


def test_p_prefill_is_the_prefill_post_to_the_last_layer() -> None:
    times = [{"p_sent": 1.0, "last_computed": 1.25}, {"p_sent": 2.0},
             {"p_sent": 3.0, "last_computed": 3.5, "admitted": 3.1}]
    assert p_prefill_s(times) == pytest.approx([0.25, 0.5])


def test_lw_off_is_lw_with_the_first_token_from_d() -> None:
    """``lw-off``'s key is one this checkout's connector knows (an unknown one fails the
    engine), and the set-ups without P/D are runnable."""
    assert BOTH_EXTRA["lw-off"] == {"first_token_from_p": False}
    assert set(BOTH_EXTRA["lw-off"]) <= serving.lw_config_keys()
    assert {"lw-off", *NO_LINK} <= set(SETUPS) and set(NO_LINK) <= set(serving.STARTERS)


def _res(rep: int, ttft: float, token2: float | None = None, **kw: object) -> dict[str, object]:
    return {"rep": rep, "median_ttft_ms": ttft, "p99_ttft_ms": ttft, "median_tpot_ms": 10.0,
            "median_token2_ms": token2, "median_e2el_ms": ttft + 310.0,
            "request_throughput": 1.0, "output_throughput": 30.0, "failed": 0, **kw}


def test_the_first_token_table_pairs_each_set_up_with_the_single_server_of_its_repeat(
        capsys: pytest.CaptureFixture[str]) -> None:
    shape, row = Shape(128, 1, 8), LinkRow("uncapped")
    bench = Bench("llama 32 layers", Path("/nonexistent/tiny-32l"), Path("/tmp"), [shape],
                  [row], 0, 1.0)
    bench.prefills = {(0, 128): 0.080, (1, 128): 0.100}
    bench.results[(shape.key, "-", "single")] = [_res(0, 100.0, 110.0), _res(1, 120.0, 130.0)]
    bench.results[(shape.key, "-", "single-proxy")] = [_res(0, 103.0, 113.0),
                                                       _res(1, 125.0, 135.0)]
    k = (shape.key, row.key)
    bench.results[(*k, "lw")] = [
        _res(0, 150.0, 220.0, p_prefill_ms=90.0, first_token_hop_ms=[1.0, 2.0, 9.0]),
        _res(1, 156.0, 234.0, p_prefill_ms=94.0, first_token_hop_ms=[3.0])]
    bench.results[(*k, "lw-off")] = [_res(0, 200.0, 211.0, p_prefill_ms=91.0,
                                          first_token_hop_ms=[])]
    print_table(bench, shape, row, link_mode=True)
    out = capsys.readouterr().out
    label = "llama 32 layers in128-c1 link=uncapped"
    # the main table: token 2 and E2E beside TTFT; the single set-ups cross no link
    assert "| token 2 p50 ms | E2E p50 ms |" in out
    assert "| lw P/D auto, d-first | 153 (150-156) | 153 | 227 | 463 |" in out
    assert "| single vLLM behind lw proxy (no link) | 114 (103-125) |" in out
    # lw 1.50 and 1.30 over the single server: the median 1.40, not 153/110
    assert ("| lw P/D auto, d-first | 1.40 (1.30-1.50) | 1.90 (1.80-2.00) | 1.10 (1.08-1.12) "
            "| 92 (90-94) | 90 (80-100) | 2.5 / 9.0 |") in out
    assert "| lw P/D auto, d-first, first token from D | 2.00 | 1.92 |" in out
    assert "| 91 | 90 (80-100) | n/a |" in out  # no first_token events: said, not hidden
    assert "| single vLLM behind lw proxy | 1.04 (1.03-1.04) | 1.03 (1.03-1.04) |" in out
    assert f"proxy_hop_ms: +4.0  ({label}; TTFT p50 of the single server" in out
    assert "+3.0-+5.0 over 2 repeats" in out
    assert f"ttft_p50_ratio_first_token_from_p_vs_off: 0.75  ({label})" in out
    assert f"token2_p50_ratio_first_token_from_p_vs_off: 1.04  ({label})" in out


# ------------------------------------------------------------- token 1 before D's last DONE
TAKEN = "token 5 of epoch 1 from P p0"


def _d(now: float, wall: float, events: list[tuple[float, str, str, str]],
       truncated: bool = False) -> StatusReply:
    r = _reply("decode", now, wall, events)
    return StatusReply(version=r.version, worker=r.worker, role="decode", now=now, wall=wall,
                       timeline=r.timeline, truncated=truncated)


def test_token1_before_done_compares_the_proxy_relay_with_ds_last_done_on_the_wall_clock() -> None:
    """D's timeline runs 100 s behind the wall (its monotonic clock), a second D worker (TP)
    1,100 s behind; the proxy's milestones are wall times. Requests: t1 before, t2 after, t3
    no first token at the proxy, t4 no all_done, t5 D allocated before the proxy POSTed to it
    and t6 the proxy relayed a token D had not taken yet (clock mismatches), t7 a re-prefill
    whose second epoch's DONE is the last one, on the later of two D workers."""
    proxy = {
        "t0": {"received": 99.0, "d_sent": 99.001, "first_token": 99.05},  # an earlier run
        "t1": {"received": 500.0, "d_sent": 500.001, "first_token": 500.050},
        "t1@0": {"meta_posted": 500.010, "p_sent": 500.011},  # a sub-transfer: not a request
        "t2": {"received": 501.0, "d_sent": 501.001, "first_token": 501.120},
        "t3": {"received": 502.0, "d_sent": 502.001},
        "t4": {"received": 503.0, "d_sent": 503.001, "first_token": 503.040},
        "t5": {"received": 504.0, "d_sent": 504.010, "first_token": 504.040},
        "t6": {"received": 505.0, "d_sent": 505.001, "first_token": 505.030},
        "t7": {"received": 506.0, "d_sent": 506.001, "first_token": 506.050},
    }
    d0 = _d(420.0, 520.0, [
        (400.004, "t1", "allocated", ""), (400.040, "t1", "first_token", TAKEN),
        (400.0605, "t1", "all_done", ""),
        (401.004, "t2", "allocated", ""), (401.100, "t2", "all_done", ""),
        (402.004, "t3", "allocated", ""),
        (403.004, "t4", "allocated", ""), (403.030, "t4", "sender_done", "P p0 rank 0"),
        (404.005, "t5", "allocated", ""), (404.090, "t5", "all_done", ""),
        (405.004, "t6", "allocated", ""), (405.035, "t6", "first_token", TAKEN),
        (405.090, "t6", "all_done", ""),
        (406.004, "t7@0", "allocated", ""), (406.040, "t7@1", "first_token", TAKEN),
        (406.070, "t7@1", "all_done", ""),
        (406.045, "t7@0", "first_token", "token 5 of epoch 0: the epoch was given up"),
    ])
    d1 = _d(-580.0, 520.0, [(-593.920, "t7@1", "all_done", "")])  # 506.080 on the wall
    p = _reply("prefill", 0.0, 600.0, [(506.0, "t8", "all_done", ""),  # not D's: ignored
                                       (505.020, "t6", "first_token", "token 5 to tcp://d")])
    c = token1_before_done([p, d0, d1], proxy, since=500.0)
    assert {k: c[k] for k in BEFORE_DONE_KEYS} == {
        "before": 2, "after": 1, "no_first_token": 1, "no_done": 1, "clock": 2}
    assert c["lead_ms"] == pytest.approx([10.5, -20.0, 30.0])
    assert c["truncated"] == 0
    assert before_done_share(c) == "2/3 (67 %)"
    assert before_done_refusals(c) == ("1 without the proxy's first token, 1 without D's "
                                       "all_done, 2 clock mismatch")


def test_token1_before_done_tolerates_a_reading_apart_and_says_a_timeline_was_cut() -> None:
    """Causality broken by less than CLOCK_TOLERANCE_S is the (now, wall) pair read apart: the
    request is judged. A D reply that left entries out is named beside its missing DONEs."""
    slack = CLOCK_TOLERANCE_S / 2
    proxy = {"a": {"received": 10.0, "d_sent": 10.001 + slack, "first_token": 10.020},
             "b": {"received": 11.0, "d_sent": 11.001, "first_token": 11.020}}
    d = _d(20.0, 20.0, [(10.001, "a", "allocated", ""), (10.020 + slack, "a", "first_token",
                                                          TAKEN),
                        (10.050, "a", "all_done", "")], truncated=True)
    c = token1_before_done([d], proxy)
    assert (c["before"], c["no_done"], c["clock"], c["truncated"]) == (1, 1, 0, 1)
    assert before_done_refusals(c) == "1 without D's all_done, 1 D timeline(s) truncated"
    # without D's replies nothing is judged, and it says so
    none = token1_before_done([], proxy)
    assert before_done_share(none) == "n/a" and none["no_done"] == 2
    assert before_done_share(None) == "n/a" and before_done_refusals(None) == ""


def test_merge_before_done_adds_runs_and_skips_runs_without_counts() -> None:
    a = {"before": 5, "after": 1, "no_first_token": 0, "no_done": 1, "clock": 0,
         "lead_ms": [1.0], "truncated": 0}
    b = {"before": 6, "after": 0, "no_first_token": 1, "no_done": 0, "clock": 2,
         "lead_ms": [2.0, 3.0], "truncated": 1}
    m = merge_before_done([a, None, b, {}])
    assert {k: m[k] for k in (*BEFORE_DONE_KEYS, "truncated")} == {
        "before": 11, "after": 1, "no_first_token": 1, "no_done": 1, "clock": 2,
        "truncated": 1}
    assert m["lead_ms"] == [1.0, 2.0, 3.0]
    assert before_done_share(m) == "11/12 (92 %)"


def _counts(before: int, after: int, **kw: int) -> dict[str, object]:
    c: dict[str, object] = dict.fromkeys(BEFORE_DONE_KEYS, 0)
    c.update(before=before, after=after, truncated=0,
             lead_ms=[10.0] * before + [-5.0] * after, **kw)
    return c


def test_the_report_gives_issue_59s_two_bounds_per_set_up_with_ps_first_token(
        capsys: pytest.CaptureFixture[str]) -> None:
    """At kv_over_prefill 1.0: lw 11/12 before D's last DONE (met), lw-compute 10/12 (not),
    lw-off the control; lw's token 2 is within +5 ms of lw-off's TTFT in one repeat of two, not
    by the median; lw-progressive ran without counts (an older result): no share line, but its
    token 2 is judged."""
    shape, row = Shape(1024, 1, 6), LinkRow("factor", 1.0)
    bench = Bench("llama 32 layers", Path("/nonexistent/tiny-32l"), Path("/tmp"), [shape],
                  [row], 0, 1.0)
    bench.prefills = {(0, 1024): 0.500, (1, 1024): 0.520}
    bench.results[(shape.key, "-", "single")] = [_res(0, 500.0, 520.0), _res(1, 520.0, 540.0)]
    k = (shape.key, row.key)
    bench.results[(*k, "lw")] = [
        _res(0, 480.0, 503.0, token1_before_done=_counts(6, 0)),
        _res(1, 500.0, 531.0, token1_before_done=_counts(5, 1, no_done=1))]
    bench.results[(*k, "lw-compute")] = [
        _res(0, 470.0, 512.0, token1_before_done=_counts(5, 1)),
        _res(1, 490.0, 530.0, token1_before_done=_counts(5, 1, clock=1))]
    bench.results[(*k, "lw-off")] = [
        _res(0, 500.0, 520.0, token1_before_done=_counts(0, 6)),
        _res(1, 520.0, 540.0, token1_before_done=_counts(0, 6))]
    bench.results[(*k, "lw-progressive")] = [_res(0, 600.0, 640.0)]
    print_table(bench, shape, row, link_mode=True)
    out = capsys.readouterr().out
    label = "llama 32 layers in1024-c1 kv_over_prefill=1.0"
    assert "| P sampled -> D received p50 / max ms | token 1 before D's last DONE |" in out
    assert "| lw P/D auto, d-first | " in out and "| n/a | 11/12 (92 %) |" in out
    assert "| 10/12 (83 %) |" in out  # lw-compute
    assert "| lw P/D auto, d-first, first token from D | " in out
    assert out.count("| n/a | - |") == 1  # lw-off: no hops, and its share only as the control
    assert (f"token1_before_last_done_lw: 11/12 (92 %)  ({label}; per repeat 6/6 (100 %), "
            "5/6 (83 %); D's last DONE - the first token's relay, p50 +10.0 ms; issue 59 asks "
            ">= 90% here: met; not judged: 1 without D's all_done)") in out
    assert (f"token1_before_last_done_lw_compute: 10/12 (83 %)  ({label}; per repeat "
            "5/6 (83 %), 5/6 (83 %); D's last DONE - the first token's relay, p50 +10.0 ms; "
            "issue 59 asks >= 90% here: NOT met; not judged: 1 clock mismatch)") in out
    assert (f"token1_before_last_done_lw_off: 0/12 (0 %)  ({label}; per repeat 0/6 (0 %), "
            "0/6 (0 %); D's last DONE - the first token's relay, p50 -5.0 ms; control: D "
            "samples token 1 after its last DONE, so above 0 the clocks or events are "
            "wrong)") in out
    assert "token1_before_last_done_lw_progressive" not in out
    # lw: 503 - 500 = +3, 531 - 520 = +11; median +7 > +5
    assert (f"token2_minus_off_ttft_ms_lw: +7.0  ({label}; token 2 p50 minus lw-off's TTFT "
            "p50 of the same repeat: +3.0, +11.0; issue 59 asks <= +5 ms: NOT met by the "
            "median, 1/2 repeat(s) within)") in out
    assert (f"token2_minus_off_ttft_ms_lw_compute: +11.0  ({label}; token 2 p50 minus "
            "lw-off's TTFT p50 of the same repeat: +12.0, +10.0;") in out
    assert (f"token2_minus_off_ttft_ms_lw_progressive: +140.0  ({label}; token 2 p50 minus "
            "lw-off's TTFT p50 of the same repeat: +140.0; issue 59 asks <= +5 ms: NOT met by "
            "the median, 0/1 repeat(s) within)") in out


def test_the_share_has_no_verdict_off_the_1_0_row_nor_a_token2_line_without_lw_off(
        capsys: pytest.CaptureFixture[str]) -> None:
    shape, row = Shape(1024, 4, 16), LinkRow("uncapped")
    bench = Bench("llama 32 layers", Path("/nonexistent/tiny-32l"), Path("/tmp"), [shape],
                  [row], 0, 1.0)
    bench.results[(shape.key, row.key, "lw")] = [
        _res(0, 480.0, 500.0, token1_before_done=_counts(3, 0, no_first_token=1))]
    print_table(bench, shape, row, link_mode=True)
    out = capsys.readouterr().out
    assert ("token1_before_last_done_lw: 3/3 (100 %)  (llama 32 layers in1024-c4 "
            "link=uncapped; D's last DONE - the first token's relay, p50 +10.0 ms; not judged: "
            "1 without the proxy's first token)") in out
    assert "issue 59 asks" not in out and "token2_minus_off" not in out


def test_token_1s_path_is_phased_from_ps_last_layer_to_the_proxys_relay() -> None:
    """P's sent token and D's taking it become milestones: a held token and a refused one do
    not; the three token phases chain from P's last layer to the proxy's first token."""
    from lw.ops.client import Snapshot
    from lw.ops.phases import TOKEN_PHASES, milestones, phase_means

    p = _reply("prefill", 10.0, 110.0, [
        (1.000, "t1", "layer_computed", ""),
        (1.002, "t1", "first_token", "token 5: held until D accepts"),
        (1.004, "t1", "first_token", "token 5 to tcp://10.0.0.2:5600 (epoch 1)"),
        (1.000, "t2", "layer_computed", ""),
        (1.003, "t2", "first_token", "refused: first_token_from_p is off on this worker"),
    ])
    d = _reply("decode", 20.0, 120.0, [
        (1.005, "t1", "first_token", "token 5 of epoch 1 from P p0"),
        (1.006, "t2", "first_token", "refused: first_token_from_p is off on this worker"),
    ])
    ms = milestones(Snapshot([p, d]), {"t1": {"first_token": 101.012}})
    assert ms["t1"].times["token_sent"] == pytest.approx(101.004)
    assert ms["t1"].times["token_taken"] == pytest.approx(101.005)
    assert "token_sent" not in ms["t2"].times and "token_taken" not in ms["t2"].times
    rows = {name: (round(mean * 1e3, 1), n) for name, mean, n in
            phase_means(ms, TOKEN_PHASES)}
    assert list(rows.values()) == [(4.0, 1), (1.0, 1), (7.0, 1)]
