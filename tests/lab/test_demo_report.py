"""``lw demo --engine vllm``'s report, without engines: the TTFT lines compare medians of the
measured requests only, say what each side's figure includes, and claim no direction the numbers
do not show; warm-up prompts share no prefix block with the measured ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from lw.lab.demo_client import Result, make_prompt
from lw.lab.vllm_demo import (
    LONG_PROMPT_LENGTHS,
    PROMPT_LENGTHS,
    shared_prefix_prompts,
    warmup_prompts,
)
from lw.lab.vllm_report import (
    predict_prefix_hits,
    report,
    report_warmup,
    start_line,
    ttft_summary,
)

# the run, the single engine's 16.6 s warm-up left out: P/D is the slower side
SINGLE = [0.052, 0.040, 0.061, 0.050, 0.045, 0.055, 0.058, 0.049]
PD = [0.068, 0.094, 0.080, 0.070, 0.072, 0.081, 0.090, 0.075]


def test_ttft_lines_compare_medians_of_the_measured_requests() -> None:
    """Medians and ranges per side, the warm-ups named as excluded, what P/D adds said."""
    lines = ttft_summary(SINGLE, PD, warmups=1)
    assert lines[0] == ("TTFT       median (min-max) of 8 measured requests per side, "
                        "1 warm-up per side excluded")
    assert "single engine" in lines[1] and "51 ms (40-61)" in lines[1]
    assert "P/D" in lines[2] and "78 ms (68-94)" in lines[2]
    assert "proxy hop" in lines[2] and "P's token to D" in lines[2]
    assert lines[-1] == "TTFT       P/D's median is 26 ms above the single engine's (x1.52)"
    assert not any("mean" in line for line in lines)


def test_one_slow_request_does_not_turn_the_comparison_around() -> None:
    """A cold first request measured by mistake moves a mean by seconds, the median not."""
    lines = ttft_summary([16.6, *SINGLE[1:]], PD, warmups=0)
    assert "52 ms (40-16600)" in lines[1]
    assert "above" in lines[-1] and "0 warm-ups per side" in lines[0]


@pytest.mark.parametrize(("pd", "says"), [
    ([0.030] * 8, "P/D's median is 20 ms below the single engine's (x0.60)"),
    ([0.0502] * 8, "P/D's median equals the single engine's (to the ms)"),
])
def test_the_direction_is_the_numbers(pd: list[float], says: str) -> None:
    assert ttft_summary([0.050] * 8, pd, warmups=2)[-1] == "TTFT       " + says


def test_requests_without_a_first_token_are_counted_not_hidden() -> None:
    lines = ttft_summary([0.05, 0.06], [None, 0.07], warmups=1)
    assert "(single engine 2 of 2, P/D 1 of 2)" in lines[0]
    assert "   70 ms   " in lines[2]  # one figure: no range
    only = ttft_summary([0.05], [None], warmups=1)
    assert only[-1] == "TTFT       no comparison: no first token from P/D"


@pytest.mark.parametrize("prompts", [
    [make_prompt(PROMPT_LENGTHS[i % 4], seed=i) for i in range(64)],
    [make_prompt(LONG_PROMPT_LENGTHS[i % 4], seed=i) for i in range(8)],
    shared_prefix_prompts(16),
])
def test_warmups_seed_no_prefix_hit(prompts: list[str]) -> None:
    """Sent first, the warm-ups leave every measured prompt's predicted hits as without them
    (the tiny model's tokenizer: one token per word)."""
    warm = warmup_prompts(prompts, 3)
    assert len(set(warm)) == 3 and warm == warmup_prompts(prompts, 3)
    vocab: dict[str, int] = {}
    ids = [[vocab.setdefault(w, len(vocab)) for w in p.split()] for p in [*warm, *prompts]]
    with_warm = predict_prefix_hits(ids, 32, 32)
    assert with_warm[3:] == predict_prefix_hits(ids[3:], 32, 32)
    assert all(held == 0 for held, _, _ in with_warm[:3])


def _done(text: str = "x", ttft: float = 0.05) -> Result:
    return Result(text=text, ttft_s=ttft, finish_reason="length", tokens=["token_id:1"],
                  top_logprobs=[{"token_id:1": -0.1}])


def test_the_summary_counts_the_measured_requests_and_d_from_before(
        capsys: pytest.CaptureFixture[str]) -> None:
    """done= is the measured requests; D's lw core figures are deltas (the warm-up is in
    ``before_d``); a failed warm-up is named in the summary and fails the run."""
    ref, pd = [_done(ttft=t) for t in SINGLE], [_done(ttft=t) for t in PD]
    before = {"lw_requests_done_total": 1.0}
    after = {"lw_requests_done_total": 9.0}
    args = (["a b"] * 8, ref, pd, 0, before, after, after)
    assert report(*args, before_d=before, warmups=1) == 0
    out = capsys.readouterr().out.splitlines()
    assert "P: done=8 " in next(line for line in out if line.startswith("lw core"))
    assert "D: done=8 " in next(line for line in out if line.startswith("lw core"))
    assert "1 warm-up per side excluded" in next(line for line in out
                                                 if line.startswith("TTFT"))
    assert out[-1] == "summary done=8 failed=0 leaked_blocks=0 mismatched=0"
    assert report(*args, before_d=before, warmups=1, warmup_failed=1) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "summary done=8 failed=0 leaked_blocks=0 mismatched=0 warmup_failed=1"


def test_the_warmup_line_says_what_it_took(capsys: pytest.CaptureFixture[str]) -> None:
    failed = report_warmup([_done(ttft=16.6)], [Result(error="HTTP 500: boom")])
    out = capsys.readouterr().out
    assert failed == 1
    assert "1 request per side, not measured" in out
    assert "single engine 16.6 s; P/D HTTP 500: boom" in out


def test_a_server_that_dies_after_the_requests_is_named_not_a_traceback(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Seen on a loaded 2-core run: D's worker died after the last request, and the demo ended
    in a ConnectError traceback. It names the server and its log, and what it knows."""
    from types import SimpleNamespace

    from lw.lab.local_cluster import free_port
    from lw.lab.vllm_demo import _server_gone

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cluster = SimpleNamespace(url=lambda name: dead, servers={
        n: SimpleNamespace(log_path=tmp_path / f"{n}.log") for n in ("prefill", "decode")})
    pd = [Result(text="x", finish_reason="length"), Result(error="HTTP 502")]
    assert _server_gone(cluster, pd, ConnectionRefusedError(111, "refused")) == 1  # type: ignore[arg-type]
    out, err = capsys.readouterr()
    assert "error: the decode server stopped answering after the requests" in err
    assert str(tmp_path / "decode.log") in err
    assert out.strip() == ("summary done=1 failed=1 leaked_blocks=unknown mismatched=unknown "
                           "server_died=1")


def test_the_start_line_says_how_the_proxy_started_the_prefills() -> None:
    """From the proxy's counters: bound ahead, fallen back, and why others went D first."""
    m = {"prefills": 9, "ahead_bound": 6, "ahead_fallbacks": 1, "ahead_unbound": 0,
         "ahead_skipped_p_busy": 2, "ahead_skipped_full": 0, "requests": 9}
    assert start_line(m) == ("starts     9 prefills: 6 sent ahead and bound, 1 fallbacks to "
                              "D first; not sent ahead: p_busy 2")
    assert start_line({"prefills": 3}) == ("starts     3 prefills: 0 sent ahead and bound, 0 "
                                            "fallbacks to D first")


def test_token2_lines_compare_medians(capsys: pytest.CaptureFixture[str]) -> None:
    """Time to token 2 beside the single engine's; a request without a second token is
    counted."""
    from lw.lab.vllm_demo import token2_summary

    lines = token2_summary([0.060, 0.070, 0.080], [0.090, None, 0.110])
    assert "(single engine 3 of 3, P/D 2 of 3)" in lines[0]
    assert "70 ms (60-80)" in lines[1] and "100 ms (90-110)" in lines[2]
    assert lines[-1] == "token 2    P/D's median is 30 ms above the single engine's (x1.43)"
    assert token2_summary([0.05], [None], note="")[-1] == (
        "token 2    no comparison: no second token from P/D")
    ref = [_done(ttft=t) for t in SINGLE]
    pd = [_done(ttft=t) for t in PD]
    for r in (*ref, *pd):
        r.token2_s = (r.ttft_s or 0.0) + 0.010
    report(["a b"] * 8, ref, pd, 0, {}, {}, {}, warmups=1)
    out = capsys.readouterr().out.splitlines()
    assert "tok2 1 eng  tok2 P/D" in next(line for line in out if line.startswith(" #"))
    assert "     62 ms     78 ms" in out[2]  # request 0: 52 + 10 and 68 + 10
    assert "token 2    P/D's median is 26 ms above the single engine's (x1.43)" in out


def test_complete_times_the_second_token_by_logprobs_tokens_or_chunks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk's logprobs tokens count each (two in one chunk: token 2 came with token 1),
    a chunk without logprobs counts one."""
    import json

    import httpx

    from lw.lab import demo_client

    def sse(chunks: list[dict[str, object]]) -> bytes:
        events = [f"data: {json.dumps({'choices': [c]})}\n\n" for c in chunks]
        return ("".join(events) + "data: [DONE]\n\n").encode()

    bodies = {
        "two": sse([{"text": "a b", "logprobs": {"tokens": ["token_id:1", "token_id:2"]}},
                    {"text": " c", "finish_reason": "length"}]),
        "plain": sse([{"text": "a"}]),
    }
    real = httpx.Client

    for name, want_token2 in (("two", True), ("plain", False)):
        transport = httpx.MockTransport(
            lambda req, body=bodies[name]: httpx.Response(200, content=body))
        monkeypatch.setattr(httpx, "Client",
                            lambda *a, transport=transport, **kw: real(*a, transport=transport,
                                                                       **kw))
        res = demo_client.complete("http://demo.invalid", "p", max_tokens=3)
        assert res.error == "" and res.ttft_s is not None
        assert (res.token2_s is not None) is want_token2
        if want_token2:
            assert res.token2_s == pytest.approx(res.ttft_s, abs=0.05)
