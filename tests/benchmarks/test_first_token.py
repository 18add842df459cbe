"""The serving benchmark's first-token figures (issue 59): time to token 2 from ``vllm bench
serve``'s per-request lists, the "P sampled -> D received" hop from lw's timelines, P's prefill
time, and the report's table against the single server; no engines."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import serving
from benchmarks._first_token import (
    add_token2,
    first_token_hops,
    hop_summary,
    p_prefill_s,
    percentile,
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
