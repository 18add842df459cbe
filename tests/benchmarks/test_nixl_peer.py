"""The NIXL peers' pure parts: the proxy's requests to P and D in each flow, its command line,
the engines' connector configs and UCX settings per placement, the output check and the ratio
lines; no engines."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks import serving
from benchmarks._link import Link
from benchmarks._peer import nixl_proxy
from benchmarks._plan import LABELS, PEERS, SETUPS, Bench, LinkRow, Shape
from benchmarks._report import COMPARISONS, print_table
from lw.lab.demo_client import Result

BODY: dict[str, Any] = {"model": "m", "prompt": "a b c", "max_tokens": 32, "stream": True,
                        "stream_options": {"include_usage": True}, "temperature": 0.0}


def test_prefill_body_asks_one_unstreamed_token_and_keeps_the_kv() -> None:
    out = nixl_proxy.prefill_body(dict(BODY, max_completion_tokens=32))
    assert out["max_tokens"] == 1 and out["max_completion_tokens"] == 1
    assert out["stream"] is False and "stream_options" not in out
    assert out["kv_transfer_params"] == {"do_remote_decode": True}
    assert out["prompt"] == BODY["prompt"] and BODY["max_tokens"] == 32  # the client's intact


def test_decode_body_is_the_clients_request_with_the_params() -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_block_ids": [[1, 2]]}
    out = nixl_proxy.decode_body(BODY, params)
    assert out["kv_transfer_params"] == params and out["kv_transfer_params"] is not params
    assert {k: v for k, v in out.items() if k != "kv_transfer_params"} == BODY


def test_push_params_name_what_the_push_scheduler_reads() -> None:
    p = nixl_proxy.push_params("eng-p", "10.78.1.1", 5601, 1)
    # push_scheduler.update_state_after_alloc: remote_engine_id, remote_host, remote_port,
    # tp_size; get_num_new_matched_tokens: do_remote_prefill
    assert p == {"do_remote_prefill": True, "do_remote_decode": False,
                 "remote_engine_id": "eng-p", "remote_host": "10.78.1.1", "remote_port": 5601,
                 "tp_size": 1}


def test_push_needs_ps_coordinates() -> None:
    with pytest.raises(SystemExit):
        nixl_proxy.parse_args(["--mode", "push", "--prefill", "http://p", "--decode", "http://d"])
    with pytest.raises(ValueError):
        nixl_proxy.PeerProxy("http://p", "http://d", "push")
    with pytest.raises(ValueError):
        nixl_proxy.PeerProxy("http://p", "http://d", "sideways")
    args = nixl_proxy.parse_args(["--mode", "push", "--prefill", "http://p", "--decode",
                                  "http://d", "--p-engine-id", "e", "--p-host", "h",
                                  "--p-port", "7"])
    assert (args.p_engine_id, args.p_host, args.p_port, args.p_tp_size) == ("e", "h", 7, 1)


def _through_proxy(mode: str, p_answer: dict[str, Any] | None) -> list[tuple[str, Any, str]]:
    """One client request through a proxy whose P and D are a mock transport; the requests
    they got, in order: (host, JSON body, X-Request-Id)."""
    seen: list[tuple[str, Any, str]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, json.loads(request.content),
                     request.headers["x-request-id"]))
        if request.url.host == "p":
            return httpx.Response(200, json=p_answer or {})
        return httpx.Response(200, stream=httpx.ByteStream(b"data: D\n\n"))

    p_params = nixl_proxy.push_params("eng-p", "h", 9, 1) if mode == "push" else None
    proxy = nixl_proxy.PeerProxy("http://p", "http://d", mode, p_params)

    async def go() -> int:
        proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        app = nixl_proxy.build_app(proxy)
        app.router.lifespan_context = None  # type: ignore[assignment]  # the client is set
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://proxy") as c:
            r = await c.post("/v1/completions", json=BODY)
            await asyncio.gather(*proxy.background)
            return r.status_code

    assert asyncio.run(go()) == 200
    return seen


def test_pull_sends_p_first_then_ps_params_to_d() -> None:
    p_params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e",
                "remote_block_ids": [[3]], "remote_host": "h", "remote_port": 1, "tp_size": 1}
    seen = _through_proxy("pull", {"choices": [], "kv_transfer_params": p_params})
    assert [s[0] for s in seen] == ["p", "d"]
    assert seen[0][1]["kv_transfer_params"] == {"do_remote_decode": True}
    assert seen[1][1]["kv_transfer_params"] == p_params
    assert seen[0][2] == seen[1][2]


def test_push_sends_d_the_preset_params_and_p_the_same_request_id() -> None:
    seen = _through_proxy("push", {"choices": []})
    by_host = {s[0]: s for s in seen}
    assert set(by_host) == {"p", "d"}
    d_params = by_host["d"][1]["kv_transfer_params"]
    assert d_params["remote_engine_id"] == "eng-p"
    # metadata.add_new_req_to_recv reads remote_request_id: a push without it kills D's engine
    assert d_params["remote_request_id"] == by_host["d"][2]
    assert by_host["p"][1]["kv_transfer_params"] == {"do_remote_decode": True}
    # P's worker matches D's registration to its request by the request id's base
    assert by_host["p"][2] == by_host["d"][2]


def test_ucx_runs_tcp_on_the_links_interface_each_side_sees() -> None:
    link = Link(ns="lwlink-1-0", root_dev="lwr10", ns_dev="lwn10", root_addr="10.78.1.1",
                ns_addr="10.78.1.2", closed=True)
    assert serving.ucx_env(None, "prefill") == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
    assert serving.ucx_env(None, "decode") == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
    assert serving.ucx_env(link, "prefill")["UCX_NET_DEVICES"] == "lwr10"
    assert serving.ucx_env(link, "decode") == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lwn10"}


def test_nixl_configs_name_the_connector_and_host_memory() -> None:
    pull = serving.nixl_kv_config("kv_producer", "e", push=False)
    push = serving.nixl_kv_config("kv_consumer", "f", push=True)
    assert pull["kv_connector"] == "NixlConnector"
    assert push["kv_connector"] == "NixlPushConnector"
    assert pull["kv_buffer_device"] == push["kv_buffer_device"] == "cpu"
    assert (pull["kv_role"], push["engine_id"]) == ("kv_producer", "f")


def test_every_peer_is_a_setup_with_a_starter_and_a_ratio_line() -> None:
    for s in PEERS:
        assert s in SETUPS and s in LABELS and s in serving.STARTERS
        assert any(a == "lw" and b == s for _suffix, a, b in COMPARISONS)


def _completion(tokens: list[str], text: str = "x") -> Result:
    return Result(text=text, tokens=tokens,
                  top_logprobs=[{t: -0.1, "token_id:99": -3.0} for t in tokens])


def test_the_output_check_fails_a_peer_that_answers_otherwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    bench = Bench("m", Path("/nonexistent"), Path("/tmp"), [], [], 0, 1.0)
    run = serving.Running("peer-nixl", url="http://proxy")
    with pytest.raises(RuntimeError, match="no single-server answer"):
        serving.check_output(bench, run)
    bench.reference = _completion(["token_id:1", "token_id:2"])
    monkeypatch.setattr(serving, "check_request",
                        lambda url: _completion(["token_id:1", "token_id:2"]))
    assert serving.check_output(bench, run) == "equal"
    monkeypatch.setattr(serving, "check_request",
                        lambda url: _completion(["token_id:1", "token_id:7"], "y"))
    with pytest.raises(RuntimeError, match="output check: mismatched"):
        serving.check_output(bench, run)


def test_the_report_prints_lw_over_each_nixl_peer(capsys: pytest.CaptureFixture[str]) -> None:
    shape, row = Shape(1024, 1, 6), LinkRow("uncapped")
    bench = Bench("llama 32 layers", Path("/nonexistent/tiny-32l"), Path("/tmp"), [shape], [row],
                  0, 1.0)

    def res(ttft: float) -> dict[str, Any]:
        return {"rep": 0, "median_ttft_ms": ttft, "p99_ttft_ms": ttft, "median_tpot_ms": 30.0,
                "request_throughput": 1.0, "output_throughput": 30.0, "failed": 0}

    bench.results = {(shape.key, row.key, "lw"): [res(100.0)],
                     (shape.key, row.key, "peer-nixl"): [res(200.0)],
                     (shape.key, row.key, "peer-nixl-push"): [{"error": "output mismatch",
                                                               "rep": 0}]}
    print_table(bench, shape, row, link_mode=True)
    out = capsys.readouterr().out
    assert "ttft_p50_ratio_vs_peer_nixl: 0.50" in out
    assert "| vLLM NixlPushConnector P/D (P writes) | - |" in out and "output mismatch" in out
    assert "ttft_p50_ratio_vs_peer_nixl_push: n/a" in out  # a peer that was not timed


def test_the_peer_shim_resolves_nixl_to_the_cu12_wheel() -> None:
    """vLLM imports ``nixl._api``; with only ``nixl-cu12`` installed the shim aliases it, and
    the wheel's extension module is loaded once (twice fails: pybind's types registered)."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("nixl_cu12") is None:
        pytest.skip("nixl-cu12 is not installed")
    code = ("import sys; from nixl._api import nixl_agent; import nixl._bindings; "
            "print(nixl_agent.__module__, sys.modules['nixl._bindings'] is "
            "sys.modules['nixl_cu12._bindings'])")
    peer = Path(serving.__file__).parent / "_peer"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={"PYTHONPATH": str(peer), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["nixl_cu12._api", "True"]


def test_off_core_names_the_threads_not_on_their_engines_core() -> None:
    """A process bound to core 0 is on its core as the single server or P, off it as D (what
    vLLM's NIXL worker does to a thread it moves to the last core shows the same way)."""
    import os
    import subprocess
    from types import SimpleNamespace

    from benchmarks._pin import off_core

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    child = subprocess.Popen(["sleep", "30"])
    try:
        os.sched_setaffinity(child.pid, {0})
        run = serving.Running("x", {"prefill": SimpleNamespace(proc=child),
                                    "decode": SimpleNamespace(proc=child)})
        assert off_core(run) == {"prefill": [], "decode": [child.pid]}
        line = serving._affinity_line(run, "forward-core")
        assert line.startswith("threads: prefill 0 off its core; decode 1 off its core "
                               f"({child.pid}:")
        assert line.endswith(":0)")  # tid:comm:cores
    finally:
        child.kill()
        child.wait()


def test_lw_on_nixl_is_lw_with_the_peers_ucx_and_a_ratio_to_lw(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``lw-nixl``: lw d-first with ``data_plane`` nixl on P and D, UCX as ``ucx_env`` gives the
    NIXL peers (the link's interface each side sees), and ``..._nixl_vs_mooncake`` is lw-nixl
    over lw."""
    link = Link(ns="lwlink-1-0", root_dev="lwr10", ns_dev="lwn10", root_addr="10.78.1.1",
                ns_addr="10.78.1.2", closed=True)
    built: dict[str, serving.LocalCluster] = {}

    def start(self: serving.LocalCluster, timeout: float = 0.0) -> None:
        built[self.data_plane] = self
        raise RuntimeError("not started")

    monkeypatch.setattr(serving.LocalCluster, "start", start)
    for setup in ("lw", "lw-nixl"):
        assert setup in SETUPS and setup in LABELS and setup in serving.STARTERS
        with pytest.raises(RuntimeError, match="not started"):
            serving.STARTERS[setup](Path("/m"), Path("/logs"), 1.0, serving.Placement((), link))
    nixl, mooncake = built["nixl"], built["mooncake"]
    assert nixl.server_env == {"prefill": serving.ucx_env(link, "prefill"),
                               "decode": serving.ucx_env(link, "decode")}
    assert mooncake.server_env == {}
    assert nixl.proxy_args == mooncake.proxy_args == ["--start-mode", "d-first"]
    assert nixl.d_extra == mooncake.d_extra and "data_plane" not in nixl.p_extra
    assert nixl.netns == {"decode": link.ns}

    shape, row = Shape(1024, 1, 6), LinkRow("uncapped")
    bench = Bench("m", Path("/nonexistent/tiny"), Path("/tmp"), [shape], [row], 0, 1.0)
    res = {"rep": 0, "p99_ttft_ms": 1.0, "median_tpot_ms": 30.0, "request_throughput": 1.0,
           "output_throughput": 30.0, "failed": 0}
    tail = "transfer tail (last layer computed -> written)"
    bench.results = {(shape.key, row.key, "lw"): [dict(res, median_ttft_ms=100.0,
                                                       lw_phases_ms={tail: 6.6})],
                     (shape.key, row.key, "lw-nixl"): [dict(res, median_ttft_ms=110.0,
                                                            lw_phases_ms={tail: 4.8})]}
    print_table(bench, shape, row, link_mode=True)
    out = capsys.readouterr().out
    assert "ttft_p50_ratio_nixl_vs_mooncake: 1.10" in out
    assert "lw_transfer_tail_ms: auto 6.6, lw-nixl 4.8  (" in out  # one auto set-up by name
