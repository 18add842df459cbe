"""End to end on real engines: ``vllm serve`` prefill + decode with lw's connector (Mooncake over
TCP), the D-first proxy, and a reference ``vllm serve`` without connector, on a tiny random model.

Servers start once for the module (about a minute on 2 cores) and are killed in the finalizer.
Checked: greedy P/D outputs equal the single engine's (one block, many blocks, chunked prefill;
streaming and not; completions and chat; concurrent requests); no block stays held on either
server (vLLM's kv cache usage and lw's own gauges); client aborts at any moment leak nothing;
a request whose prefill cannot be requested fails fast with an error; killing the decode server
mid-run gives errors, not hangs, and the prefill server keeps serving and releases its blocks;
the official ``openai`` client's ``n=2`` (completions and chat, streaming and not) and a
two-prompt list get as many choices as from the single engine (one transfer per vLLM request);
a repeated prompt is served from D's prefix cache (its tail computed on D, nothing moved);
``lw status --proxy`` (the workers the proxy learned from a request it relayed) lists a request
waiting on D and an empty table once it is gone; a real Prometheus server scrapes lw's series
from P's and D's /metrics; forged
metaserver calls (unsigned, another key, no grant, replayed) are refused and the control plane
is not on the public port, with the victim's output unharmed; a prefill aimed at other D blocks
than D registered is refused at its claim before a byte moves; ``lw proxy --sidecar`` (llm-d's
routing sidecar position) prefills on the P its request header names; a proxy whose first decode
server is dead moves the request to the live one; with vLLM's tracing on,
a traced request's trace holds vLLM's and lw's spans (OTLP/HTTP to a local receiver).
The decode-server kill is the last test: it ends the cluster.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("mooncake.engine")
pytest.importorskip("httpx")

import httpx  # noqa: E402

from lw.contract import tracefile  # noqa: E402
from lw.contract.auth import signed_call  # noqa: E402
from lw.contract.params import (  # noqa: E402
    CONTRACT_VERSION,
    decoder_params,
    prompt_digest,
    sign_params,
)
from lw.lab.local_cluster import Server, free_port, wait_ready  # noqa: E402
from lw.lab.oracle import DRIFT, TOP_K, Verdict  # noqa: E402
from lw.lab.oracle import compare as _compare  # noqa: E402
from lw.lab.tiny_model import make_tiny_model  # noqa: E402
from lw.lab.trace_export import validate_trace, write_cluster_trace  # noqa: E402
from lw.lab.vllm_demo import (  # noqa: E402
    MODEL_NAME,
    LocalCluster,
    Result,
    blocks_in_use,
    complete,
    make_prompt,
    metrics,
)
from lw.proxy.state import build_prefill_body  # noqa: E402
from lw.transport.dataplane.planted import TRUNCATE_ENV  # noqa: E402
from lw.transport.sidechannel import parse_cluster_key  # noqa: E402
from tests.vllm_adapter.otlp_receiver import Receiver  # noqa: E402

pytestmark = pytest.mark.slow

LENGTHS = {"one_block": 12, "many_blocks": 90, "chunked": 700}  # words ~ tokens; 256/step
MAX_TOKENS = 16
VICTIM_TOKENS = 300  # an answer long enough to keep a victim's transfer live (forged calls)
# Short deadlines so that failure paths finish within the test: P's push deadline on both
# sides (D derives its lease, 30 s, and the transfer timeout, 10 s, from it).
P_EXTRA = {"request_timeout_s": 10}
D_EXTRA = {"prefill_timeout_s": 15, "request_timeout_s": 10}


@pytest.fixture(scope="module")
def otlp() -> Iterator[Receiver]:
    """Where every engine of the cluster exports its OpenTelemetry spans (vLLM's and lw's)."""
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, otlp: Receiver,
            shared_reference: Callable[[str], Server]) -> Iterator[LocalCluster]:
    work = tmp_path_factory.mktemp("e2e")
    model = make_tiny_model(work / "model")
    c = LocalCluster(model=model, workdir=work / "logs", shared_reference=shared_reference("llama"),
                     p_extra=P_EXTRA, d_extra=D_EXTRA, otlp_endpoint=otlp.url)
    # P truncates its writes while this file exists (test_planted_truncated_writes_...)
    _truncate_flag[0] = work / "truncate-writes"
    os.environ[TRUNCATE_ENV] = str(_truncate_flag[0])
    try:
        c.start(timeout=360)
        os.environ.pop(TRUNCATE_ENV, None)
        yield c
    finally:
        os.environ.pop(TRUNCATE_ENV, None)
        c.stop()


_truncate_flag: list[Path] = [Path()]  # set by the cluster fixture


_reference: dict[tuple[str, int], Result] = {}


def proxy_params(c: LocalCluster, metaserver: str, tid: str) -> dict[str, Any]:
    """D's params as the cluster's proxy would sign them (for tests that stand in for it)."""
    return sign_params(parse_cluster_key(c.cluster_key), "decode",
                       decoder_params(metaserver, tid, "g" * 32))


def reference(c: LocalCluster, prompt: str, max_tokens: int = MAX_TOKENS) -> Result:
    """The single engine's greedy output with its top logprobs (cached per prompt)."""
    key = (prompt, max_tokens)
    if key not in _reference:
        r = complete(c.url("reference"), prompt, max_tokens, stream=False, logprobs=TOP_K)
        assert not r.error, r.error
        _reference[key] = r
    return _reference[key]


def compare(want: Result, got: Result) -> Verdict:
    """The output oracle with the dense tiny model's drift tolerance (lw.lab.oracle)."""
    return _compare(want, got, drift=DRIFT["llama"])


def judged(c: LocalCluster, url: str, prompt: str, stream: bool = True) -> Verdict:
    """Send ``prompt`` to ``url`` and judge the answer against the reference with the output
    oracle (equal tokens, or a near tie of the reference's at the first divergence)."""
    got = complete(url, prompt, MAX_TOKENS, stream=stream, logprobs=TOP_K)
    return compare(reference(c, prompt), got)


def held(c: LocalCluster) -> dict[str, float]:
    """Blocks in use per server (vLLM) and lw's gauges, for assertion messages."""
    out: dict[str, float] = {}
    for name in ("prefill", "decode"):
        m = metrics(c.url(name))
        out[f"{name}.blocks"] = blocks_in_use(c.url(name))
        out[f"{name}.lw_live"] = m.get("lw_live_requests", 0.0)
        out[f"{name}.lw_held"] = m.get("lw_held_blocks", 0.0)
    return out


def wait_idle(c: LocalCluster, timeout: float = 60.0) -> dict[str, float]:
    """Wait until both servers hold no block (vLLM and lw agree); return the last reading
    (a generous deadline: a passing test returns as soon as both are idle)."""
    deadline = time.monotonic() + timeout
    while True:
        h = held(c)
        if not any(h.values()) or time.monotonic() > deadline:
            return h
        time.sleep(0.25)


def test_outputs_equal_single_engine(cluster: LocalCluster) -> None:
    for i, (kind, n) in enumerate(LENGTHS.items()):
        prompt = make_prompt(n, seed=100 + i)
        want = reference(cluster, prompt)
        for stream in (False, True):
            got = complete(cluster.url("proxy"), prompt, MAX_TOKENS, stream=stream,
                           logprobs=TOP_K)
            assert not got.error, f"{kind} stream={stream}: {got.error}"
            assert (v := compare(want, got)).same, f"{kind} stream={stream}: {v}"
            assert got.finish_reason == "length"
    assert not any((h := wait_idle(cluster)).values()), h


def test_planted_truncated_writes_are_caught_by_the_oracle(cluster: LocalCluster) -> None:
    """P writes only the first 64 bytes of each entry while the flag file exists (checksums
    are off in this cluster): the output oracle, which forgives a divergence at the reference's
    own near tie, must still call wrong KV a mismatch (issue 20). Once the file is gone the
    next request equals the reference again."""
    flag = _truncate_flag[0]
    prompts = [make_prompt(LENGTHS["many_blocks"], seed=900 + i) for i in range(3)]
    wants = [reference(cluster, p) for p in prompts]
    flag.write_text("64")
    try:
        gots = [complete(cluster.url("proxy"), p, MAX_TOKENS, logprobs=TOP_K) for p in prompts]
    finally:
        flag.unlink()
    assert not any(g.error for g in gots), [g.error for g in gots]
    verdicts = [compare(w, g) for w, g in zip(wants, gots, strict=True)]
    # Each of 24 planted runs here was a mismatch by the drift check (2026-12-02): the oracle's
    # docstring has the measurements.
    assert not any(v.same for v in verdicts), [str(v) for v in verdicts]
    prompt = make_prompt(LENGTHS["many_blocks"], seed=910)
    got = complete(cluster.url("proxy"), prompt, MAX_TOKENS, logprobs=TOP_K)
    assert (v := compare(reference(cluster, prompt), got)).same, v
    assert not any((h := wait_idle(cluster)).values()), h


def test_chat_completion_equals_single_engine(cluster: LocalCluster) -> None:
    body = {"model": MODEL_NAME, "temperature": 0.0, "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": make_prompt(150, seed=7)}]}
    texts = []
    for name in ("reference", "proxy"):
        r = httpx.post(cluster.url(name) + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["message"]["content"])
    assert texts[0] == texts[1] and texts[0]


def test_transfer_figures_and_blocks_back_to_baseline(cluster: LocalCluster) -> None:
    p_before, d_before = metrics(cluster.url("prefill")), metrics(cluster.url("decode"))
    prompt = make_prompt(300, seed=11)  # 300+ tokens: 10 blocks of 32
    assert (v := judged(cluster, cluster.url("proxy"), prompt)).same, v
    assert not any((h := wait_idle(cluster)).values()), h

    def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    # Connector stats reach /metrics on vLLM's logging interval, not with the response.
    deadline = time.monotonic() + 60
    while True:
        p_after, d_after = metrics(cluster.url("prefill")), metrics(cluster.url("decode"))
        if (delta(p_after, p_before, "lw_requests_done_total") >= 1
                and delta(d_after, d_before, "lw_requests_done_total") >= 1) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.5)

    nbytes = delta(p_after, p_before, "lw_transfer_bytes_total")
    block_bytes = 4 * 32 * 128 * 2  # kv heads x block size x (K+V head dims) x bf16
    assert nbytes % (2 * block_bytes) == 0 and nbytes >= 10 * 2 * block_bytes  # 2 layers
    assert delta(p_after, p_before, "lw_requests_done_total") == 1
    assert delta(d_after, d_before, "lw_requests_done_total") == 1
    assert delta(p_after, p_before, "lw_transfer_failures_total") == 0
    assert delta(d_after, d_before, "lw_deadlines_fired_total") == 0
    assert delta(p_after, p_before, "lw_transfer_seconds_total") > 0


def test_concurrent_requests(cluster: LocalCluster) -> None:
    prompts = [make_prompt((12, 90, 300, 700)[i % 4], seed=200 + i) for i in range(8)]
    want = [reference(cluster, p) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda ip: complete(cluster.url("proxy"), ip[1], MAX_TOKENS,
                                                stream=ip[0] % 2 == 0, logprobs=TOP_K),
                            enumerate(prompts)))
    assert [g.error for g in got] == [""] * 8
    verdicts = [compare(r, g) for r, g in zip(want, got, strict=True)]
    assert all(v.same for v in verdicts), [str(v) for v in verdicts]
    assert not any((h := wait_idle(cluster)).values()), h


def _choices(client: Any, api: str, stream: bool, **kw: Any) -> dict[int, tuple[str, str]]:
    """index -> (text, finish_reason) of every choice, streamed or not (openai client)."""
    create = (client.chat.completions.create if api == "chat"
              else client.completions.create)
    out: dict[int, tuple[str, str]] = {}
    if not stream:
        for c in create(stream=False, **kw).choices:
            text = c.message.content if api == "chat" else c.text
            out[c.index] = (text or "", c.finish_reason or "")
        return out
    for chunk in create(stream=True, **kw):
        for c in chunk.choices:
            text = (c.delta.content if api == "chat" else c.text) or ""
            old_text, old_finish = out.get(c.index, ("", ""))
            out[c.index] = (old_text + text, c.finish_reason or old_finish)
    return out


def test_openai_client_n2_and_prompt_lists_like_single_engine(cluster: LocalCluster) -> None:
    openai = pytest.importorskip("openai")
    clients = {name: openai.OpenAI(base_url=cluster.url(name) + "/v1", api_key="none",
                                   max_retries=0, timeout=120)
               for name in ("reference", "proxy")}
    prompt = make_prompt(90, seed=301)
    sampled = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 1.0, "n": 2,
               "extra_body": {"ignore_eos": True}}  # sampling may draw EOS: keep "length"
    cases: list[tuple[str, bool, dict[str, Any]]] = []
    for stream in (False, True):
        cases.append(("completions", stream, {**sampled, "prompt": prompt}))
        cases.append(("chat", stream, {**sampled,
                                        "messages": [{"role": "user", "content": prompt}]}))
        # lm-eval-harness's local-completions: a list of prompts, greedy.
        cases.append(("completions", stream, {
            "model": MODEL_NAME, "max_tokens": 8, "temperature": 0.0,
            "extra_body": {"ignore_eos": True},
            "prompt": [make_prompt(40, seed=302 + stream), make_prompt(120, seed=304)]}))
    for api, stream, kw in cases:
        want = _choices(clients["reference"], api, stream, **kw)
        got = _choices(clients["proxy"], api, stream, **kw)
        what = f"{api} stream={stream} n={kw.get('n', 1)}"
        assert sorted(got) == sorted(want) and len(got) == 2, what
        assert {fin for _, fin in got.values()} == {"length"}, (what, got)
        if kw["temperature"] == 0.0:
            assert got == want, what
    assert not any((h := wait_idle(cluster)).values()), h


def _answers(client: Any, api: str, stream: bool, **kw: Any) -> dict[int, tuple[Any, ...]]:
    """index -> (token ids, text, finish_reason, stop_reason) of every choice, and -1 -> the
    usage (non-streamed: the response's; streamed: the last chunk's), with the openai client."""
    create = (client.chat.completions.create if api == "chat"
              else client.completions.create)
    extra = {**kw.pop("extra_body", {}), "return_token_ids": True}
    out: dict[int, tuple[Any, ...]] = {}
    if not stream:
        r = create(stream=False, extra_body=extra, **kw)
        for c in r.choices:
            text = c.message.content if api == "chat" else c.text
            out[c.index] = (list(getattr(c, "token_ids", None) or ()), text or "",
                            c.finish_reason, getattr(c, "stop_reason", None))
        out[-1] = (r.usage.prompt_tokens, r.usage.completion_tokens)
        return out
    acc: dict[int, list[Any]] = {}
    usage = None
    for chunk in create(stream=True, extra_body=extra,
                        stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            a = acc.setdefault(c.index, [[], "", None, None])
            a[0] += list(getattr(c, "token_ids", None) or ())
            a[1] += (c.delta.content if api == "chat" else c.text) or ""
            a[2] = c.finish_reason or a[2]
            a[3] = getattr(c, "stop_reason", None) or a[3]
        if chunk.usage is not None:
            usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
    out = {i: tuple(a) for i, a in acc.items()}
    out[-1] = usage
    return out


_FALLBACK = re.compile(r'^lw_first_token_fallbacks_total\{[^}]*reason="([a-z_]+)"[^}]*\}\s+(\S+)',
                       re.MULTILINE)


def _first_token_counts(url: str) -> dict[str, float]:
    """D's first-token counters, fallbacks by reason as ``fallback:<reason>``."""
    m = metrics(url)
    out = {k: m.get(f"lw_{k}_total", 0.0) for k in (
        "first_token_from_p", "last_token_recomputed", "ended_at_first_token")}
    for reason, value in _FALLBACK.findall(httpx.get(url + "/metrics", timeout=10).text):
        out[f"fallback:{reason}"] = out.get(f"fallback:{reason}", 0.0) + float(value)
    return out


def test_first_token_from_p_outputs_equal_single_engine(cluster: LocalCluster) -> None:
    """D streams the token P sampled and continues from it: per choice the token ids, text,
    finish and stop reasons, and the usage equal the single engine's, streamed and not, for
    greedy and seeded sampling (n=2), a stop id equal to token 1, max_tokens 1 and min_tokens;
    no eligible request recomputes its last prompt token; requests that read more than the
    token (logprobs) take vLLM's path, counted, with outputs equal too."""
    openai = pytest.importorskip("openai")
    clients = {name: openai.OpenAI(base_url=cluster.url(name) + "/v1", api_key="none",
                                   max_retries=0, timeout=120)
               for name in ("reference", "proxy")}
    d_url = cluster.url("decode")
    before = _first_token_counts(d_url)
    seeds = iter(range(410, 500))

    def short() -> str:  # under one block: D's prefix cache never holds it
        return make_prompt(12, seed=next(seeds))

    def longer() -> str:  # a prompt of its own: a hit in D's prefix cache would compute the
        return make_prompt(90, seed=next(seeds))  # tail on D, and D would sample token 1

    def stop_at_token_1() -> dict[str, Any]:  # a prompt and a stop id equal to its token 1
        prompt = longer()
        t1 = _answers(clients["reference"], "completions", False, model=MODEL_NAME,
                      prompt=prompt, max_tokens=1, temperature=0.0)[0][0][0]
        return {"prompt": prompt, "extra_body": {"stop_token_ids": [t1]}}

    greedy = {"model": MODEL_NAME, "max_tokens": 12, "temperature": 0.0}
    seeded = {"model": MODEL_NAME, "max_tokens": 12, "temperature": 0.8, "seed": 7, "n": 2,
              "extra_body": {"ignore_eos": True}}
    eligible: list[tuple[str, bool, dict[str, Any]]] = []
    for stream in (False, True):
        eligible += [
            ("completions", stream, {**greedy, "prompt": short()}),
            ("chat", stream, {**greedy, "messages": [{"role": "user", "content": longer()}]}),
            ("completions", stream, {**seeded, "prompt": longer()}),
            ("completions", stream, {**greedy, **stop_at_token_1()}),
            ("completions", stream, {**greedy, "prompt": longer(), "max_tokens": 1}),
            ("completions", stream, {**greedy, "prompt": short(),
                                     "extra_body": {"min_tokens": 3}}),
        ]
    fallback = [
        ("completions", False, {**greedy, "prompt": longer(), "logprobs": 2}),
        ("chat", True, {**greedy, "messages": [{"role": "user", "content": short()}],
                        "logprobs": True, "top_logprobs": 2}),
    ]
    # (structured output is not among them: on this tiny model's word-level tokenizer the
    # single engine's own grammar backend rejects its tokens; lw's refusal of it is a unit
    # test, tests/vllm_adapter/test_first_token_scheduler.py)
    from_p = 0  # choices that take P's token
    for api, stream, kw in eligible + fallback:
        want = _answers(clients["reference"], api, stream, **dict(kw))
        got = _answers(clients["proxy"], api, stream, **dict(kw))
        assert got == want, f"{api} stream={stream} {kw}"
        from_p += (len(want) - 1) * ((api, stream, kw) in eligible)
        if "stop_token_ids" in kw.get("extra_body", {}):
            assert got[0][2:] == ("stop", kw["extra_body"]["stop_token_ids"][0]), got
    # unseeded random sampling stays random: P's draws, not one fixed token
    one = short()
    firsts = {_answers(clients["proxy"], "completions", False, model=MODEL_NAME, prompt=one,
                       max_tokens=1, temperature=1.0)[0][0][0] for _ in range(20)}
    assert len(firsts) >= 2, firsts
    assert not any((h := wait_idle(cluster)).values()), h
    deadline = time.monotonic() + 60  # connector stats reach /metrics on vLLM's interval
    while True:
        after = _first_token_counts(d_url)
        gained = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        # a token that came after P's DONE hold and D's wait both lapsed (a loaded machine)
        # takes vLLM's path, counted "late": the outputs above are equal either way
        late = gained.get("fallback:late", 0)
        if gained["first_token_from_p"] + late >= from_p + 20 and \
                gained.get("fallback:logprobs", 0) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert late <= 2, f"{gained}"
    assert gained["first_token_from_p"] == from_p + 20 - late, f"{gained}"
    assert gained["last_token_recomputed"] == 2 + late, f"{gained}"  # the two fallbacks
    # stop id (x2), max_tokens 1 (x2), the 20 random ones
    assert 2 + 2 + 20 - late <= gained["ended_at_first_token"] <= 2 + 2 + 20, f"{gained}"
    assert gained.get("fallback:logprobs") == 2, f"{gained}"


def test_repeated_prompt_tail_computed_on_decode(cluster: LocalCluster) -> None:
    """D holds all but the prompt's last block: it computes that itself, P moves nothing."""
    prompt = make_prompt(150, seed=311)
    assert (v := judged(cluster, cluster.url("proxy"), prompt, stream=False)).same, v
    assert not any((h := wait_idle(cluster)).values()), h
    d_before = metrics(cluster.url("decode"))
    calls = httpx.get(cluster.control_url + "/metrics-json", timeout=10).json()
    assert (v := judged(cluster, cluster.url("proxy"), prompt)).same, v
    after = httpx.get(cluster.control_url + "/metrics-json", timeout=10).json()
    # D asked for no prefill: no metaserver call, so P computed and moved nothing.
    assert after["metaserver_calls"] == calls["metaserver_calls"]
    assert after["requests"] == calls["requests"] + 1
    deadline = time.monotonic() + 60  # stats reach /metrics on vLLM's logging interval
    while True:
        d_after = metrics(cluster.url("decode"))
        tails = d_after.get("lw_local_tails_total", 0) - d_before.get("lw_local_tails_total", 0)
        if tails >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert tails >= 1
    hits = (d_after.get("lw_prefix_hit_blocks_total", 0)
            - d_before.get("lw_prefix_hit_blocks_total", 0))
    assert hits >= 4  # 150+ tokens: at least 4 full blocks of 32 held
    assert not any((h := wait_idle(cluster)).values()), h


def _raw_abort(url: str, body: dict[str, Any], after_s: float) -> None:
    """Send a request and drop the connection after ``after_s`` (a client going away)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        time.sleep(after_s)


def test_client_aborts_leak_nothing(cluster: LocalCluster) -> None:
    proxy = cluster.url("proxy")
    # Mid-decode: the KV has arrived, the client leaves after the first tokens.
    body = {"model": MODEL_NAME, "prompt": make_prompt(300, seed=31), "max_tokens": 1500,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", proxy + "/v1/completions",
                                                           json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") and '"text"' in line:
                break
    # At every other moment: before D allocated, while P computes or writes, after.
    d_before = metrics(cluster.url("decode"))
    for i, after in enumerate((0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0)):
        _raw_abort(proxy, {**body, "prompt": make_prompt(700, seed=40 + i), "max_tokens": 200,
                           "stream": i % 2 == 0}, after)
    assert not any((h := wait_idle(cluster, timeout=40)).values()), h
    d_after = metrics(cluster.url("decode"))
    print("aborted while receiving on D:", {k: d_after.get(k, 0) - d_before.get(k, 0) for k in (
        "lw_requests_failed_total", "lw_quarantines_total", "lw_requests_done_total")})
    # Both servers still serve correctly.
    prompt = make_prompt(90, seed=55)
    assert (v := judged(cluster, proxy, prompt)).same, v


def test_prefill_that_cannot_be_requested_fails_fast(cluster: LocalCluster) -> None:
    """D's metaserver call fails: the request ends in an error at once, not at the deadline."""
    dead = f"http://127.0.0.1:{_closed_port()}/v1/metaserver"
    body = {"model": MODEL_NAME, "prompt": make_prompt(90, seed=61), "max_tokens": 4,
            "temperature": 0.0,
            "kv_transfer_params": proxy_params(cluster, dead, "e2e-dead-metaserver")}
    t0 = time.monotonic()
    r = httpx.post(cluster.url("decode") + "/v1/completions", json=body, timeout=60)
    took = time.monotonic() - t0
    # timing: the property itself (an error at once, not at D's 15 s deadline); D computes
    # nothing for this request, so a slow machine is slow by far less than that
    assert took < D_EXTRA["prefill_timeout_s"], f"took {took:.1f}s: waited for the deadline"
    assert r.status_code != 200 or r.json()["choices"][0]["finish_reason"] not in (
        "length", "stop"), r.text
    assert not any((h := wait_idle(cluster)).values()), h
    assert metrics(cluster.url("decode")).get("lw_metaserver_failures_total", 0) >= 1


@pytest.mark.parametrize("path,content", [
    ("/v1/completions", json.dumps({"model": MODEL_NAME, "prompt": ""})),
    ("/v1/chat/completions", json.dumps({"model": MODEL_NAME, "messages": []})),
    ("/v1/completions", "{not json"),
    ("/v1/chat/completions", "{not json"),
    ("/v1/completions", "[1, 2]"),
    ("/v1/completions", json.dumps({"prompt": "hello there", "max_tokens": 2})),
])
def test_proxy_answers_like_a_single_vllm_server(cluster: LocalCluster, path: str,
                                                 content: str) -> None:
    """What a client parses is the same through lw's proxy as from one vLLM server: status,
    and for an error the whole body: relayed from D for a JSON object; a body that is no JSON
    object is refused by the proxy itself (never relayed: a parser more lenient than the
    proxy's must not see it) with vLLM's own error object; a body without ``model`` is
    served."""
    answers = [httpx.post(cluster.url(name) + path, content=content,
                          headers={"content-type": "application/json"}, timeout=60)
               for name in ("reference", "proxy")]
    single, proxied = answers
    assert proxied.status_code == single.status_code, (single.text, proxied.text)
    if single.status_code == 200:
        assert proxied.json()["choices"] and proxied.json()["model"] == single.json()["model"]
    else:  # relayed from D, or the proxy's own refusal in vLLM's words (issue 61 item 6)
        assert proxied.json() == single.json()


def test_forged_metaserver_calls_are_refused_and_the_victim_unharmed(
        cluster: LocalCluster) -> None:
    """An attacker who can send completions, and one who even holds the cluster key, cannot
    start a prefill of a victim's request: the control plane is not on the public port, and
    unsigned, forged, replayed and grantless calls are refused; the victim's output equals the
    single engine's and P prefilled nothing but the victim's own call."""
    proxy, control = cluster.url("proxy"), cluster.control_url
    for method, path in (("POST", "/v1/metaserver"), ("GET", "/lw/timeline"),
                         ("GET", "/metrics-json")):
        assert httpx.request(method, proxy + path, json={}, timeout=10).status_code == 404
    before = httpx.get(control + "/metrics-json", timeout=10).json()
    key = parse_cluster_key(cluster.cluster_key)
    url = control + "/v1/metaserver"
    victims = 0
    seen: list[tuple[str, Any]] = []
    for attempt in range(3):  # a victim that ends before the first forged call lands: again
        known = set(httpx.get(control + "/lw/timeline", timeout=10).json())
        # chunked on P and a long answer: live for hundreds of decode steps, however fast the
        # machine (a 16-token victim ended before the forged calls on a loaded machine)
        prompt = make_prompt(700, seed=791 + attempt)
        box: list[Verdict] = []

        def victim_run(p: str = prompt, b: list[Verdict] = box) -> None:
            got = complete(proxy, p, VICTIM_TOKENS, stream=True, logprobs=TOP_K)
            b.append(compare(reference(cluster, p, VICTIM_TOKENS), got))

        victim = threading.Thread(target=victim_run)
        victim.start()
        victims += 1
        tid = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the id a client sees (x-request-id): the timeline's
            fresh = set(httpx.get(control + "/lw/timeline", timeout=10).json()) - known
            tid = next((t for t in fresh if "@" not in t), "")
            if tid:
                break
            time.sleep(0.005)
        assert tid, "the victim's transfer never showed up"
        forged = {"transfer_id": tid, "sub_transfer_id": f"{tid}@cmpl-{tid}-0",
                  "prompt_token_ids": [1, 2, 3],
                  "kv_transfer_params": {"remote_engine_id": "evil", "remote_host": "127.0.0.1",
                                         "remote_port": 1, "remote_block_ids": [0, 1, 2],
                                         "remote_tp_size": 1, "lw_geometry": "g",
                                         "lw_params_version": CONTRACT_VERSION,
                                         "lw_prompt_digest": prompt_digest([1, 2, 3])},
                  "grant": "0" * 32}
        # First, while the victim is live: a holder of the cluster key still lacks the grant
        # (403), and a copy of that call is refused as a replay.
        content, headers = signed_call(key, forged)
        codes = [httpx.post(url, content=content, headers=headers, timeout=10).status_code
                 for _ in range(2)]
        codes.append(httpx.post(url, json=forged, timeout=10).status_code)  # unsigned
        content, headers = signed_call(b"an-attackers-own-key-0123456789", forged)
        codes.append(httpx.post(url, content=content, headers=headers, timeout=10).status_code)
        seen.append((tid, httpx.get(control + "/lw/timeline", timeout=10).json().get(tid)))
        victim.join(300)
        [verdict] = box
        assert verdict.same, verdict
        if codes[0] != 404:  # 404: the victim had ended (unknown transfer); try another
            break
    assert codes == [403, 401, 401, 401], (codes, seen)
    after = httpx.get(control + "/metrics-json", timeout=10).json()
    assert after["metaserver_refused"] - before["metaserver_refused"] == 3 * victims + 1
    assert after["prefills"] - before["prefills"] == victims  # the victims' own, nothing else
    assert not any((h := wait_idle(cluster)).values()), h


class _Interposer(http.server.BaseHTTPRequestHandler):
    """A metaserver that a forged call got through (it holds the cluster key, as a compromised
    proxy would): it starts D's prefill on P with D's block ids reversed (what a forged or
    mistaken call would name), then the honest one."""

    prefill_url = ""
    status_workers: list[str] = []
    cluster_key = ""
    seen: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        msg = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).seen.append(msg)
        self.send_response(202)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")
        threading.Thread(target=self._prefill_twice, args=(msg,), daemon=True).start()

    def _prefill_twice(self, msg: dict[str, Any]) -> None:
        kv = msg["kv_transfer_params"]
        key = parse_cluster_key(type(self).cluster_key)
        honest = build_prefill_body({"model": MODEL_NAME}, kv, msg["sub_transfer_id"],
                                    msg["prompt_token_ids"], key=key)
        forged = build_prefill_body({"model": MODEL_NAME}, {
            **kv, "remote_block_ids": kv["remote_block_ids"][::-1]}, msg["sub_transfer_id"],
            msg["prompt_token_ids"], key=key)
        url = type(self).prefill_url + "/v1/completions"
        httpx.post(url, json=forged, timeout=60)
        # The honest prefill reuses the sub-transfer id: wait until P's push of the forged one
        # has failed (D refused its claim), as P's timeline says, not for a fixed time
        self._wait_prefill_failed(msg["sub_transfer_id"], timeout=60.0)
        httpx.post(url, json=honest, timeout=60)

    def _wait_prefill_failed(self, sub: str, timeout: float) -> None:
        """Poll P's timeline until its request ``sub`` reached FAILED (or ``timeout`` passes:
        the test's assertions on the timeline then say what happened)."""
        from lw.ops.client import query

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            snap = query(type(self).status_workers, type(self).cluster_key, timeline=10_000,
                         timeout_s=5)
            if any(e.dst == "FAILED" for r in snap.replies if r.role == "prefill"
                   for e in r.timeline if sub in e.req_ids):
                return
            time.sleep(0.05)

    def log_message(self, *args: Any) -> None:
        pass


class _Canary(http.server.BaseHTTPRequestHandler):
    """A listener at the URL an attacker names: every request that reaches it is a failure."""

    hits: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        type(self).hits.append(self.path)
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_GET = do_POST  # noqa: N815

    def log_message(self, *args: Any) -> None:
        pass


def test_hostile_requests_mixed_into_honest_load_reach_nothing(cluster: LocalCluster) -> None:
    """The issue's attacks on the real engines, through the proxy and straight at P's and D's
    vLLM ports, while honest requests run: a client's transfer params make no call to the URL
    they name (the SSRF through the raw relay), a wrong type is a 400 naming the field (an
    empty 500 before), unsigned params are refused at the engines' own ports; the honest
    outputs equal the single engine's, and nothing stays held."""
    _Canary.hits = []
    canary = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Canary)
    threading.Thread(target=canary.serve_forever, daemon=True).start()
    steal = f"http://127.0.0.1:{canary.server_port}/steal"
    evil = {"do_remote_prefill": True, "transfer_id": "evil-1", "metaserver": steal}
    forged_p = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "evil@1",
                "remote_engine_id": "evil", "remote_host": "127.0.0.1",
                "remote_port": canary.server_port, "remote_block_ids": [0, 1],
                "remote_tp_size": 1, "lw_geometry": "g", "lw_params_version": CONTRACT_VERSION,
                "lw_prompt_digest": "0" * 32}
    proxy, d, p = cluster.url("proxy"), cluster.url("decode"), cluster.url("prefill")
    base = {"model": MODEL_NAME, "prompt": "hello there friend", "max_tokens": 4}
    cases: list[tuple[str, str, dict[str, Any], int, str | None]] = [
        ("ssrf via the raw relay", proxy, {"stream": None, "kv_transfer_params": evil}, 200,
         None),  # D serves it alone: the client's params were dropped
        ("ssrf in vllm_xargs", proxy, {"stream": None, "vllm_xargs": {
            "kv_transfer_params": evil}}, 200, None),
        ("xargs wrong type, proxy", proxy, {"vllm_xargs": {"kv_transfer_params": "x"}}, 400,
         "vllm_xargs.kv_transfer_params"),
        ("xargs wrong type, D", d, {"vllm_xargs": {"kv_transfer_params": "x"}}, 400,
         "vllm_xargs.kv_transfer_params"),
        ("xargs wrong type, P", p, {"vllm_xargs": {"kv_transfer_params": "x"}}, 400,
         "vllm_xargs.kv_transfer_params"),
        ("unsigned ssrf params, D", d, {"kv_transfer_params": {
            **evil, "metaserver_grant": "g" * 32}}, 400, "kv_transfer_params"),
        ("forged signature, D", d, {"kv_transfer_params": {
            **evil, "metaserver_grant": "g" * 32, "lw_contract": CONTRACT_VERSION,
            "lw_sig": "0" * 64}}, 400, "kv_transfer_params.lw_sig"),
        ("unsigned prefill params, P", p, {"kv_transfer_params": forged_p}, 400,
         "kv_transfer_params"),
    ]
    before = httpx.get(cluster.control_url + "/metrics-json", timeout=10).json()
    try:
        with ThreadPoolExecutor(3) as pool:
            honest = [pool.submit(judged, cluster, proxy, make_prompt(90, seed=930 + i))
                      for i in range(3)]
            for name, url, extra, status, field in cases:
                r = httpx.post(url + "/v1/completions", json={**base, **extra}, timeout=120)
                assert r.status_code == status, (name, r.status_code, r.text)
                if field is not None:
                    err = r.json()["error"]
                    assert err["param"].startswith(field), (name, err)
                    assert err["param"] in err["message"], (name, err)
                    assert err["type"] == "BadRequestError", (name, err)
            verdicts = [f.result(timeout=300) for f in honest]
    finally:
        canary.shutdown()
    assert _Canary.hits == [], _Canary.hits  # no engine called the attacker's URL
    assert all(v.same for v in verdicts), verdicts
    after = httpx.get(cluster.control_url + "/metrics-json", timeout=10).json()
    assert after["client_transfer_params_dropped"] - before[
        "client_transfer_params_dropped"] == 2
    assert after["client_transfer_params_refused"] - before[
        "client_transfer_params_refused"] == 1
    for url in (d, p):  # both engines serve the next request
        assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert not any((h := wait_idle(cluster)).values()), h


def test_decode_refuses_a_prefill_aimed_at_other_blocks(cluster: LocalCluster) -> None:
    """The second line: a prefill started with other D block ids than D registered for the
    request (here its own blocks reversed, which would scramble its KV) is refused at P's claim
    before a byte moves; the honest prefill that follows still lands and the output equals the
    single engine's."""
    _Interposer.prefill_url, _Interposer.seen = cluster.url("prefill"), []
    _Interposer.status_workers = cluster.status_workers()
    _Interposer.cluster_key = cluster.cluster_key
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Interposer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        # several blocks: reversed is another placement; a seed no other prompt starts with (a
        # prefix D holds would be computed there, with no prefill to interpose)
        prompt = make_prompt(90, seed=1092)
        got = complete(cluster.url("decode"), prompt, MAX_TOKENS, stream=False,
                       logprobs=TOP_K, extra={"kv_transfer_params": proxy_params(
                           cluster, f"http://127.0.0.1:{server.server_port}/m",
                           "e2e-interposed")})
    finally:
        server.shutdown()
    [msg] = _Interposer.seen
    assert len(msg["kv_transfer_params"]["remote_block_ids"]) > 1
    assert not got.error, got.error
    assert (v := compare(reference(cluster, prompt), got)).same, v
    # P's lifecycle of that request: the forged prefill failed at its claim, before META_READY
    # (no layer is written before it), then the honest one went through.
    from lw.ops.client import query

    sub = msg["sub_transfer_id"]
    snap = query(cluster.status_workers(), cluster.cluster_key, timeline=10_000, timeout_s=5)
    events = sorted((e for r in snap.replies if r.role == "prefill" for e in r.timeline
                     if sub in e.req_ids), key=lambda e: e.t)
    admitted = [i for i, e in enumerate(events) if e.event == "admitted"]
    assert len(admitted) == 2, [(e.event, e.dst, e.detail) for e in events]
    first = events[admitted[0]:admitted[1]]
    assert [e.dst for e in first][-1] == "FAILED", [(e.event, e.dst, e.detail) for e in first]
    assert not any(e.dst == "META_READY" or e.dst.startswith("LAYER_") for e in first)
    assert "receives into" in " ".join(e.detail for e in first)
    assert any(e.dst == "DONE" for e in events[admitted[1]:])
    assert not any((h := wait_idle(cluster)).values()), h


def test_lw_status_lists_a_request_in_flight_then_an_empty_table(
        cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    """A metaserver that accepts the prefill request and never starts it keeps the request on D
    waiting for its senders: lw status names it; after the client leaves, nothing is live. The
    workers are those the proxy learned from a request it relayed (``lw status --proxy``)."""
    import http.server

    from lw.ops import cli
    from lw.ops.client import query, workers_from_proxy
    from lw.ops.render import table

    assert judged(cluster, cluster.url("proxy"), make_prompt(40, seed=72)).same
    workers = workers_from_proxy(cluster.control_url)
    assert sorted(workers) == sorted(cluster.status_workers())

    class Silent(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Silent)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    body = {"model": MODEL_NAME, "prompt": make_prompt(90, seed=71), "max_tokens": 4,
            "temperature": 0.0, "stream": True,
            "kv_transfer_params": proxy_params(
                cluster, f"http://127.0.0.1:{srv.server_port}/meta", "e2e-status")}
    try:
        with httpx.Client(timeout=30) as client, client.stream(
                "POST", cluster.url("decode") + "/v1/completions", json=body):
            deadline = time.monotonic() + 30
            rows: list[Any] = []
            while not rows and time.monotonic() < deadline:
                snap = query(workers, cluster.cluster_key, timeout_s=3)
                rows = [(r, q) for r in snap.replies for q in r.requests]
                time.sleep(0.1)
            assert not snap.silent, snap.silent
            text = table(snap)
            assert len(rows) == 1, text
            reply, row = rows[0]
            assert reply.role == "decode" and row.req_id.startswith("e2e-status@"), text
            assert row.state == "PREFILL_REQUESTED" and "MetaRequest" in row.waiting_for
            assert 0 < row.deadline_in_s <= D_EXTRA["prefill_timeout_s"]
            capsys.readouterr()
            code = cli.main(["--proxy", cluster.control_url, "--json",
                             "--cluster-key", cluster.cluster_key])
            out = json.loads(capsys.readouterr().out)
            assert code == 0 and not out["silent"], out["silent"]
            assert row.req_id in [q["req_id"] for w in out["workers"] for q in w["requests"]]
        # the client left: D aborts the request, nothing was claimed, the blocks come back
        assert not any((h := wait_idle(cluster)).values()), h
        snap = query(workers, cluster.cluster_key, timeout_s=3)
        assert not snap.silent and not any(r.requests for r in snap.replies), table(snap)
        assert "0 live request(s)" in table(snap)
    finally:
        srv.shutdown()


def test_transfer_spans_join_the_clients_trace(cluster: LocalCluster, otlp: Receiver) -> None:
    """vLLM's tracing is on in every engine: a request carrying a W3C traceparent gets, in that
    trace, vLLM's request span from P and from D and lw's transfer span from each side (all
    children of the client's span: vLLM 0.32 makes its request span only at the end, in its API
    server), with lw's lifecycle phases beneath lw's spans."""
    trace_id, client_span = os.urandom(16).hex(), os.urandom(8).hex()
    prompt = make_prompt(90, seed=310)
    got = complete(cluster.url("proxy"), prompt, MAX_TOKENS, stream=True, logprobs=TOP_K,
                   headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
    assert not got.error, got.error
    assert compare(reference(cluster, prompt), got).same

    def complete_tree(spans: list[Any]) -> bool:
        names = [s.name for s in spans]
        return (names.count("llm_request") >= 2 and "lw.kv_push" in names
                and "lw.kv_receive" in names and "lw.await_done_ack" in names
                and "lw.receiving" in names)

    spans = otlp.wait(trace_id, complete_tree, timeout=60)
    names = sorted(s.name for s in spans)
    assert complete_tree(spans), names
    by_name = {s.name: s for s in spans}
    push, recv = by_name["lw.kv_push"], by_name["lw.kv_receive"]
    tops = [s for s in spans if s.name in ("llm_request", "lw.kv_push", "lw.kv_receive")]
    assert all(s.parent_id == client_span for s in tops), [(s.name, s.parent_id) for s in tops]
    assert push.attributes["lw.outcome"] == "ok" and recv.attributes["lw.outcome"] == "ok"
    assert push.attributes["lw.transfer_id"] == recv.attributes["lw.transfer_id"]
    assert push.attributes["lw.bytes"] > 0 and ":" in push.attributes["lw.peer"]
    under_push = {s.name for s in spans if s.parent_id == push.span_id}
    assert {"lw.claim", "lw.chunk_written", "lw.await_done_ack"} <= under_push, under_push
    assert {s.name for s in spans if s.parent_id == recv.span_id} == {"lw.await_claim",
                                                                      "lw.receiving"}
    chunk = next(s for s in spans if s.name == "lw.chunk_written")
    assert chunk.events and chunk.events[0][0] == "layer_written"
    assert push.start_ns <= chunk.start_ns <= chunk.end_ns <= push.end_ns
    assert not any(s.error for s in spans), [(s.name, s.error) for s in spans if s.error]


def test_sidecar_prefills_on_the_prefill_server_the_header_names(
        cluster: LocalCluster, tmp_path: Any) -> None:
    """``lw proxy --sidecar`` in front of the cluster's D, driven as llm-d's scheduler drives its
    routing sidecar: a request naming P in ``x-prefiller-host-port`` is prefilled there (P's
    prompt tokens grow by it) and its output equals the single engine's; without the header D
    computes it alone (P sees nothing); a P outside the allowlist is refused before D sees it;
    D's own /metrics answers through the sidecar; nothing stays held."""
    p_url, d_url = cluster.url("prefill"), cluster.url("decode")
    target = p_url.removeprefix("http://")
    port = free_port()
    control = next(p for p in iter(free_port, None) if p != port)
    argv = [sys.executable, "-m", "lw.proxy.server", "--sidecar", "--decode", d_url,
            "--allow-prefiller", target, "--host", "127.0.0.1", "--port", str(port),
            "--control-host", "127.0.0.1", "--control-port", str(control), "--timeout", "120",
            "--log-level", "warning"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", LW_CLUSTER_KEY=cluster.cluster_key)
    side = Server("sidecar", argv, env, f"http://127.0.0.1:{port}", tmp_path / "sidecar.log")
    side.start()
    try:
        wait_ready([side], 60)

        def prompt_tokens(url: str) -> float:
            return metrics(url).get("vllm:prompt_tokens_total", 0.0)

        p_before = prompt_tokens(p_url)
        for i, stream in enumerate((False, True)):
            prompt = make_prompt(90, seed=520 + i)  # seeds no other test uses: no prefix hit
            got = complete(side.url, prompt, MAX_TOKENS, stream=stream, logprobs=TOP_K,
                           headers={"x-prefiller-host-port": target})
            assert not got.error, f"stream={stream}: {got.error}\n{side.tail()}"
            assert (v := compare(reference(cluster, prompt), got)).same, v
        m = httpx.get(f"http://127.0.0.1:{control}/metrics-json", timeout=10).json()
        assert m["prefills"] == 2 and m["prefill_failures"] == 0, m
        assert [b["url"] for b in m["prefill"]] == [p_url] and m["prefill"][0]["requests"] == 2
        assert prompt_tokens(p_url) - p_before >= 2 * 80  # both prompts prefilled on P

        p_before, d_before = prompt_tokens(p_url), prompt_tokens(d_url)
        prompt = make_prompt(60, seed=522)
        got = complete(side.url, prompt, MAX_TOKENS, stream=True, logprobs=TOP_K)
        assert not got.error, got.error
        assert (v := compare(reference(cluster, prompt), got)).same, v
        m = httpx.get(f"http://127.0.0.1:{control}/metrics-json", timeout=10).json()
        assert m["prefills"] == 2 and m["metaserver_calls"] == 2, m  # D computed it alone
        assert prompt_tokens(d_url) > d_before and prompt_tokens(p_url) == p_before

        body = {"model": MODEL_NAME, "prompt": make_prompt(20, seed=523), "max_tokens": 2}
        d_before = prompt_tokens(d_url)
        r = httpx.post(side.url + "/v1/completions", json=body, timeout=30,
                       headers={"x-prefiller-host-port": "127.0.0.1:1"})
        assert r.status_code == 403 and r.json()["error"]["type"] == "ForbiddenError", r.text
        assert prompt_tokens(d_url) == d_before
        # a client's transfer fields through the sidecar: a wrong type is a 400 naming it (a 502
        # wrapping D's empty 500 before); a well-typed one is dropped, D serves the body alone
        r = httpx.post(side.url + "/v1/completions", timeout=30, json={
            **body, "vllm_xargs": {"kv_transfer_params": "x"}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "vllm_xargs.kv_transfer_params", r.text
        r = httpx.post(side.url + "/v1/completions", timeout=120, json={
            **body, "stream": None, "kv_transfer_params": {
                "do_remote_prefill": True, "transfer_id": "evil-1",
                "metaserver": "http://127.0.0.1:1/steal"}})
        assert r.status_code == 200, r.text
        m = httpx.get(f"http://127.0.0.1:{control}/metrics-json", timeout=10).json()
        assert m["client_transfer_params_dropped"] == 1 and m["metaserver_calls"] == 2, m
        assert "vllm:kv_cache_usage_perc" in httpx.get(side.url + "/metrics", timeout=10).text
        assert not any((h := wait_idle(cluster)).values()), h
    finally:
        side.stop()


@pytest.mark.parametrize("mode", ["admit-ahead", "compute-ahead", "d-first"])
def test_start_modes_equal_single_engine_and_bind_every_prefill(
        cluster: LocalCluster, tmp_path: Any, mode: str) -> None:
    """A second proxy in ``--start-mode admit-ahead`` (or ``compute-ahead``) in front of the
    same engines: each request's prefill reaches P with its request to D; P admits it and
    computes nothing until it fetched D's params (compute-ahead: computes at once, writes once
    the params bind it), and the outputs (completions sequential and concurrent, a chat
    completion) equal the single engine's, every prefill bound ahead, none started twice; a
    chat request P tokenizes differently would fall back (tests/proxy/test_ahead.py). In
    ``d-first`` (no longer the default the cluster's proxy runs) none goes ahead: each prefill
    is started once D allocated, with the same outputs."""
    port = free_port()
    control = next(p for p in iter(free_port, None) if p != port)
    argv = [sys.executable, "-m", "lw.proxy.server", "--prefill", cluster.url("prefill"),
            "--decode", cluster.url("decode"), "--start-mode", mode, "--host",
            "127.0.0.1", "--port", str(port), "--control-host", "127.0.0.1", "--control-port",
            str(control), "--timeout", "120", "--log-level", "warning",
            # the two concurrent prompts both go ahead (by default the second, finding P busy
            # with the first, would start D first: tests/proxy/test_ahead.py)
            "--ahead-p-busy", "2"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", LW_CLUSTER_KEY=cluster.cluster_key)
    ahead = Server("ahead-proxy", argv, env, f"http://127.0.0.1:{port}",
                   tmp_path / "ahead-proxy.log")
    p_before = metrics(cluster.url("prefill"))
    ahead.start()
    try:
        wait_ready([ahead], 60)
        # fresh prompts per mode: D's prefix cache holds the other mode's (D would compute them
        # itself, and the prefill computed ahead is dropped: a fallback, not what is tested)
        base = {"admit-ahead": 1300, "compute-ahead": 1400, "d-first": 1500}[mode]
        prompts = [make_prompt(n, seed=base + i) for i, n in enumerate((12, 90, 700, 40))]
        for i, prompt in enumerate(prompts[:2]):
            got = complete(ahead.url, prompt, MAX_TOKENS, stream=i % 2 == 1, logprobs=TOP_K)
            assert not got.error, f"{got.error}\n{ahead.tail()}"
            assert (v := compare(reference(cluster, prompt), got)).same, v
        wants = [reference(cluster, p) for p in prompts[2:]]
        with ThreadPoolExecutor(2) as pool:
            gots = list(pool.map(lambda p: complete(ahead.url, p, MAX_TOKENS, logprobs=TOP_K),
                                 prompts[2:]))
        for w, g in zip(wants, gots, strict=True):
            assert not g.error and (v := compare(w, g)).same, (g.error, v)
        body = {"model": MODEL_NAME, "temperature": 0.0, "max_tokens": MAX_TOKENS,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": make_prompt(150, seed=base + 10)}]}
        texts = []
        for url in (cluster.url("reference"), ahead.url):
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["message"]["content"])
        assert texts[0] == texts[1] and texts[0]
        m = httpx.get(f"http://127.0.0.1:{control}/metrics-json", timeout=10).json()
        n = len(prompts) + 1
        went = 0 if mode == "d-first" else n
        assert (m["ahead_started"], m["ahead_bound"], m["prefills"]) == (went, went, n), m
        assert m["ahead_fallbacks"] == m["ahead_unbound"] == m["prefill_failures"] == 0, m
        assert not any((h := wait_idle(cluster)).values()), h
        if mode == "compute-ahead":  # P's worker (its own process) bound as the params came
            key = "lw_ahead_bound_early_total"
            deadline = time.monotonic() + 60  # connector stats: on vLLM's logging interval
            while (early := metrics(cluster.url("prefill")).get(key, 0.0)
                   - p_before.get(key, 0.0)) < 1 and time.monotonic() < deadline:
                time.sleep(0.5)
            assert 1 <= early <= n, early
            # ... and each request computed ahead (renamed at its bind) is a behaviour of the
            # checked model's compute-ahead design (lw validate)
            path = str(tmp_path / "run.jsonl")
            answered, silent, _ = write_cluster_trace(cluster, path, source="test_e2e ahead")
            assert not silent, silent
            workers = tracefile.load(path).workers
            # (P's timeline ring keeps its newest entries: on this shared cluster the first
            # request's may be gone; the validator needs a request's whole history)
            admitted = {e.reqs[0] for w in workers if w.role == "prefill" for e in w.entries
                        if e.event == "admitted" and e.dst == "AHEAD"}
            ahead_ids = sorted(new for old, new in tracefile.renames(workers).items()
                               if old in admitted)
            assert len(ahead_ids) >= 3, ahead_ids  # the newest: the concurrent two, the chat
            ok, line, bad = validate_trace(path, only=ahead_ids)
            assert ok, line + "\n" + "\n".join(bad)
    finally:
        ahead.stop()


def test_a_dead_decode_server_is_replaced_before_the_first_token(
        cluster: LocalCluster, tmp_path: Any) -> None:
    """A proxy whose first decode server is dead: the request moves to the live D (a fresh
    transfer) and its output equals the single engine's; the dead one is then avoided for its
    backoff (1 s, ±20 %), and tried again after it with a doubled backoff (a loaded machine can
    take that long for one request; tests/proxy/test_failover.py times the avoidance)."""
    port = free_port()
    control = next(p for p in iter(free_port, None) if p != port)
    argv = [sys.executable, "-m", "lw.proxy.server", "--prefill", cluster.url("prefill"),
            "--decode", f"http://127.0.0.1:{_closed_port()}", "--decode", cluster.url("decode"),
            "--port", str(port), "--control-port", str(control), "--timeout", "120",
            "--log-level", "warning"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", LW_CLUSTER_KEY=cluster.cluster_key)
    proxy = Server("failover-proxy", argv, env, f"http://127.0.0.1:{port}",
                   tmp_path / "proxy.log", health="/v1/models")
    proxy.start()
    try:
        wait_ready([proxy], 60)
        started = []
        for i, stream in enumerate((True, False)):
            prompt = make_prompt(90, seed=530 + i)
            started.append(time.monotonic())
            got = complete(proxy.url, prompt, MAX_TOKENS, stream=stream, logprobs=TOP_K)
            assert not got.error, f"{got.error}\n{proxy.tail()}"
            assert (v := compare(reference(cluster, prompt), got)).same, v
            if i == 0:
                m = httpx.get(f"http://127.0.0.1:{control}/metrics-json", timeout=10).json()
                assert m["decode_failovers"] == 1 and m["errors"] == 0, m
        m = httpx.get(f"http://127.0.0.1:{control}/metrics-json", timeout=10).json()
        dead = m["decode"][0]
        if started[1] - started[0] < 0.8:  # within the shortest backoff: avoided
            assert m["decode_failovers"] == 1, m
        # the dead server failed once per try, and every try moved the request
        assert m["decode_failovers"] == dead["consecutive_failures"] in (1, 2), m
        assert m["errors"] == 0, m
        assert not any((h := wait_idle(cluster)).values()), h
    finally:
        proxy.stop()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stream(url: str, prompt: str, max_tokens: int, started: threading.Event,
            out: list[tuple[str, str | None, float]]) -> None:
    """Stream a completion; set ``started`` on the first text; append (error, finish, end)."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    error, finish = "", None
    try:
        with httpx.Client(timeout=60) as client, client.stream(
                "POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}"
            else:
                for line in r.iter_lines():
                    if not line.startswith("data:") or line.endswith("[DONE]"):
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:
                        error = str(event["error"])[:200]
                        break
                    choice = event["choices"][0]
                    if choice.get("text"):
                        started.set()
                    finish = choice.get("finish_reason") or finish
    except (httpx.HTTPError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    started.set()
    out.append((error, finish, time.monotonic()))


def test_a_real_prometheus_scrapes_lws_series(cluster: LocalCluster,
                                               tmp_path: Any) -> None:
    """Debian's Prometheus server scrapes P's and D's vLLM /metrics; lw's series come back
    through its HTTP API with vLLM's labels (model_name, engine), one per server."""
    import shutil
    import subprocess
    from urllib.parse import urlsplit

    exe = shutil.which("prometheus")
    if exe is None:
        pytest.skip("Debian's prometheus is not installed (scripts/bootstrap.sh installs it)")
    assert judged(cluster, cluster.url("proxy"), make_prompt(40, seed=81)).same
    targets = [urlsplit(cluster.url(name)).netloc for name in ("prefill", "decode")]
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        "scrape_configs:\n  - job_name: lw\n    static_configs:\n"
        f"      - targets: {json.dumps(targets)}\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api = f"http://127.0.0.1:{port}/api/v1/query"
    with open(tmp_path / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(
            [exe, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        series: list[dict[str, Any]] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(series) < 2:
            time.sleep(0.5)
            try:
                r = httpx.get(api, params={"query": "lw_requests_done_total"}, timeout=5)
            except httpx.HTTPError:
                continue  # not listening yet
            if r.status_code == 200:
                series = r.json()["data"]["result"]
        assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
        by_instance = {x["metric"]["instance"]: x for x in series}
        assert set(by_instance) == set(targets), (series, targets)
        for x in series:
            assert x["metric"]["model_name"] == MODEL_NAME and "engine" in x["metric"], x
            assert float(x["value"][1]) >= 1, x  # the request above, at least, on each side
        r = httpx.get(api, params={"query": 'count by (__name__)({__name__=~"lw_.+"})'},
                      timeout=5)
        names = {x["metric"]["__name__"] for x in r.json()["data"]["result"]}
        assert {"lw_requests_done_total", "lw_live_requests"} <= names, names
    finally:
        proc.terminate()
        proc.wait(10)


def test_decode_server_killed_gives_errors_and_prefill_keeps_serving(
        cluster: LocalCluster) -> None:
    proxy = cluster.url("proxy")
    results: list[tuple[str, str | None, float]] = []
    # Few streams: on 2 cores the tiny model decodes faster than HTTP can relay many of them.
    decoding = [threading.Event() for _ in range(3)]
    threads = [threading.Thread(target=_stream, args=(proxy, make_prompt(12, seed=70 + i), 2000,
                                                      decoding[i], results), daemon=True)
               for i in range(3)]
    for t in threads:
        t.start()
    # Kill while the first stream is mid-decode (up to 2000 tokens to go): the others may
    # already have finished on a fast run, so only this one is sure to be cut.
    assert decoding[0].wait(60), "first stream never started decoding"
    # More requests: allocated on D, prefilling or pushing on P when D dies.
    p_before = metrics(cluster.url("prefill"))
    late = [threading.Thread(target=_stream, args=(proxy, make_prompt(700, seed=80 + i), 200,
                                                   threading.Event(), results), daemon=True)
            for i in range(3)]
    for t in late:
        t.start()
    deadline = time.monotonic() + 0.5  # kill once P works on one of them (if it gets there)
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline:
            if client.get(cluster.control_url + "/metrics-json").json()["prefill"][0][
                    "in_flight"] > 0:
                break
            time.sleep(0.01)
    killed_at = time.monotonic()
    os.killpg(cluster.servers["decode"].proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
    for t in threads + late:
        t.join(60)
    assert not any(t.is_alive() for t in threads + late), "a client hung after D died"
    # timing: every client got its answer or error within 60 s of D's death (a client that
    # hung would end only by its own 60 s read timeout)
    assert time.monotonic() - killed_at < 60
    # Every request either completed before D died or got an error: none was silently cut.
    assert len(results) == 6
    assert all(err or fin == "length" for err, fin, _ in results), results
    assert sum(bool(err) for err, _, end in results if end > killed_at) >= 1, results
    # New requests through the proxy fail fast with a clear error.
    t1 = time.monotonic()
    r = complete(proxy, make_prompt(12, seed=90), 4, stream=False, timeout=30)
    assert r.error and time.monotonic() - t1 < 30, r  # timing: fails fast, not by the timeout
    # The prefill server keeps serving and gives back every block it held for D.
    prompt = make_prompt(90, seed=91)
    assert (v := judged(cluster, cluster.url("prefill"), prompt, stream=False)).same, v
    deadline = time.monotonic() + P_EXTRA["request_timeout_s"] + 20
    while True:
        m = metrics(cluster.url("prefill"))
        p_held = blocks_in_use(cluster.url("prefill")), m.get("lw_live_requests", 0.0)
        if p_held == (0, 0.0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert p_held == (0, 0.0), p_held
    p_after = metrics(cluster.url("prefill"))
    gave_up = p_after.get("lw_requests_failed_total", 0) - p_before.get(
        "lw_requests_failed_total", 0)
    print(f"prefill pushes that failed with D gone: {gave_up:.0f}")
