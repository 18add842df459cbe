"""Prefill failover in the proxy (fakes of test_proxy, no vLLM): a decode server that declared a
retry budget re-calls the metaserver with a higher claim epoch after losing its P; the proxy
starts the same prefill, with ``lw_epoch``, on a server outside the engines to avoid, drops the
old attempt, and refuses stale, over-budget and unknown calls. Without a budget a failed
prefill ends the request as before. The fake D follows a script of metaserver calls."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import httpx  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, Response  # noqa: E402

from lw.contract.auth import CallVerifier, signed_call  # noqa: E402
from lw.contract.worker_addrs import PREFILL_ENGINE_KEY, PREFILL_WORKERS_KEY  # noqa: E402
from lw.proxy.failover import _choose, failover_problem  # noqa: E402
from lw.proxy.server import build_apps  # noqa: E402
from lw.proxy.state import (  # noqa: E402
    Backend,
    ProxyState,
    SubPrefill,
    Transfer,
    build_prefill_body,
)
from tests.proxy.test_proxy import (  # noqa: E402
    D_PARAMS,
    KEY,
    TOKENS,
    ServerThread,
    closed_port_url,
    completion,
    d_params,
    lw_detail,
    wait_for,
)


@dataclass
class Seen:
    """What the fakes saw, and the fake D's script: the extra fields of its first metaserver call
    and of each later one (``_after_failures``: wait until the proxy counted that many failed
    prefills, i.e. D's core found its P lost)."""

    first: dict[str, Any] = field(default_factory=dict)
    then: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    replies: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    p_bodies: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    done: dict[str, int] = field(default_factory=dict)  # sub-transfer -> epoch P served


def fake_p(name: str, seen: Seen) -> FastAPI:
    """A prefill server naming its engine (``eng-<name>``) and worker in its answer; it hangs
    until cancelled on a prompt containing ``<name>hang``."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def serve(request: Request) -> Response:
        body = await request.json()
        params = body["kv_transfer_params"]
        with seen.lock:
            seen.p_bodies.append((name, body))
        if f"{name}hang" in "".join(chr(t) for t in body["prompt"]):
            while not await request.is_disconnected():
                await asyncio.sleep(0.01)
            with seen.lock:
                seen.cancelled.append(name)
            return Response(status_code=499)
        with seen.lock:
            seen.done[params["transfer_id"]] = params.get("lw_epoch", 0)
        return JSONResponse({"choices": [{"index": 0, "text": "x"}], "kv_transfer_params": {
            PREFILL_WORKERS_KEY: [f"tcp://127.0.0.1:{6000 + int(name[1:])}"],
            PREFILL_ENGINE_KEY: f"eng-{name}"}})

    return app


def fake_d(seen: Seen) -> FastAPI:
    """A decode server: its scripted metaserver calls for sub-transfer ``<id>@0``, then it
    answers once a P served that sub-transfer at the last epoch the proxy accepted."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def serve(request: Request) -> Response:
        body = await request.json()
        params = body["kv_transfer_params"]
        tid = params["transfer_id"]
        sub = f"{tid}@0"
        base = {"transfer_id": tid, "sub_transfer_id": sub, "grant": params["metaserver_grant"]}
        ids = [ord(c) for c in body["prompt"]]
        calls = [{**base, "prompt_token_ids": ids, "kv_transfer_params": d_params(ids),
                  **seen.first}]
        calls += [{**base, **c} for c in seen.then]
        control = params["metaserver"].removesuffix("/v1/metaserver")
        epoch = -1
        async with httpx.AsyncClient(timeout=5) as client:
            for msg in calls:
                wait = msg.pop("_after_failures", 0)
                while (await client.get(control + "/metrics-json")).json()[
                        "prefill_failures"] < wait:
                    await asyncio.sleep(0.01)
                content, headers = signed_call(KEY, msg)
                r = await client.post(params["metaserver"], content=content, headers=headers)
                with seen.lock:
                    seen.replies.append((r.status_code, r.json()))
                if r.status_code == 202:
                    epoch = max(epoch, r.json()["epoch"])
        end = time.monotonic() + (5 if seen.replies[-1][0] < 500 else 0)  # 5xx: D gives up
        while time.monotonic() < end:
            with seen.lock:
                if seen.done.get(sub) == epoch:
                    return JSONResponse({"choices": [{"index": 0, "text": "".join(TOKENS)}]})
            if await request.is_disconnected():
                return Response(status_code=499)
            await asyncio.sleep(0.01)
        return JSONResponse({"error": {"message": "prefill never arrived"}}, 400)

    return app


@dataclass
class Proxy:
    url: str
    control: str
    prefill_urls: list[str]

    def metrics(self) -> dict[str, Any]:
        return httpx.get(self.control + "/metrics-json", timeout=5).json()

    def post(self, prompt: str) -> httpx.Response:
        return httpx.post(self.url + "/v1/completions", json=completion(prompt), timeout=10)


@contextlib.contextmanager
def proxy(seen: Seen, prefills: list[str]) -> Iterator[Proxy]:
    """The proxy before prefill servers ``prefills`` (a name, or "dead": nobody listens) and
    one scripted decode server."""
    servers: list[ServerThread] = []
    try:
        urls = []
        for name in prefills:
            if name == "dead":
                urls.append(closed_port_url())
                continue
            servers.append(ServerThread(fake_p(name, seen)).start())
            urls.append(servers[-1].url)
        servers.append(ServerThread(fake_d(seen)).start())
        control = ServerThread(None)
        apps = build_apps(urls, [servers[-1].url], timeout_s=10.0, cluster_key=KEY,
                          metaserver_url=control.url + "/v1/metaserver",
                          start_mode="d-first")  # (D-first fakes)
        servers.append(ServerThread(apps.public, also=(control, apps.control)).start())
        yield Proxy(servers[-1].url, control.url, urls)
    finally:
        for s in servers:
            s.stop()


def test_a_lost_prefill_moves_to_another_server_with_the_new_epoch() -> None:
    seen = Seen(first={"retry_prefill": 1}, then=[
        {"_after_failures": 1, "epoch": 1, "avoid": ["eng-dead"], "reason": "P lost"},
        {"epoch": 1},  # D's poster repeating a call whose answer it lost: idempotent
        {"epoch": 0, "prompt_token_ids": [104], "kv_transfer_params": d_params([104])},  # stale
        {"epoch": 2},  # beyond the budget D declared
    ])
    with proxy(seen, ["dead", "p1"]) as px:  # the first pick is the dead server
        r = px.post("hi")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "".join(TOKENS)
        m = px.metrics()
    assert [s for s, _ in seen.replies] == [202, 202, 202, 409, 403]
    first, moved, again = (a for _, a in seen.replies[:3])
    assert first["prefill_url"] == px.prefill_urls[0] and first["epoch"] == 0
    assert moved["prefill_url"] == px.prefill_urls[1] and moved["epoch"] == 1
    assert again["detail"].startswith("prefill already") and again["epoch"] == 1
    assert "stale epoch 0" in seen.replies[3][1]["detail"]
    assert "beyond the decode engine's retry budget 1" in seen.replies[4][1]["detail"]
    ((name, body),) = seen.p_bodies
    assert name == "p1" and body["prompt"] == [ord("h"), ord("i")]
    assert body["kv_transfer_params"]["lw_epoch"] == 1
    assert body["kv_transfer_params"]["remote_block_ids"] == D_PARAMS["remote_block_ids"]
    assert (m["prefill_failovers"], m["prefill_failures"]) == (1, 1)
    assert m["prefill_failures_left_to_decode"] == 1 and m["errors"] == 0
    assert m["metaserver_refused"] == 2 and m["in_flight"] == 0


def test_without_a_budget_a_failed_prefill_ends_the_request_as_before() -> None:
    seen = Seen()
    with proxy(seen, ["dead", "p1"]) as px:
        r = px.post("hi")
        assert r.status_code == 502, r.text
        detail = lw_detail(r.json()["error"])
        assert detail["stage"] == "prefill" and detail["server"] == "prefill#0"
        m = px.metrics()
    assert m["prefill_failovers"] == 0 and m["prefill_failures_left_to_decode"] == 0
    assert not seen.p_bodies


def test_the_retry_avoids_a_live_engine_d_lost_and_drops_its_old_attempt() -> None:
    seen = Seen(first={"retry_prefill": 2})
    with proxy(seen, ["p0", "p1"]) as px:
        for _ in range(2):  # each server answers once: the proxy learns both engines
            assert px.post("warm").status_code == 200
        seen.then = [{"epoch": 1, "avoid": ["eng-p0"]}]
        r = px.post("p0hang")  # the round robin is back at p0, which holds it
        assert r.status_code == 200, r.text
        m = px.metrics()
    first, moved = (a for _, a in seen.replies[-2:])
    assert (first["prefill_engine_id"], first["prefill_worker"]) == ("eng-p0",
                                                                      "tcp://127.0.0.1:6000")
    assert (moved["prefill_engine_id"], moved["epoch"]) == ("eng-p1", 1)
    wait_for(lambda: seen.cancelled == ["p0"])  # its request closed: P aborts the old attempt
    assert m["prefill_failovers"] == 1 and m["errors"] == 0 and m["prefill_failures"] == 0


def test_no_server_outside_the_avoid_list_is_a_503() -> None:
    seen = Seen(first={"retry_prefill": 1},
                then=[{"_after_failures": 1, "epoch": 1, "avoid": ["eng-dead"]}])
    with proxy(seen, ["dead"]) as px:
        r = px.post("hi")
        assert r.status_code == 400  # the fake D gives up: nothing was prefilled
    status, answer = seen.replies[-1]
    assert status == 503 and "no prefill server left outside" in answer["detail"]


def test_a_reprefill_of_an_unknown_transfer_is_a_404() -> None:
    seen = Seen()
    with proxy(seen, ["p0"]) as px:
        msg = {"transfer_id": "f" * 32, "sub_transfer_id": "f" * 32 + "@0", "grant": "g",
               "epoch": 1}
        content, headers = signed_call(KEY, msg)
        r = httpx.post(px.control + "/v1/metaserver", content=content, headers=headers)
        assert r.status_code == 404, r.text


@pytest.mark.parametrize(("fields", "needle"), [
    ({"epoch": -1}, "'epoch' must be an integer"),
    ({"epoch": True}, "'epoch' must be an integer"),
    ({"retry_prefill": 65}, "'retry_prefill' must be an integer in 0..64"),
    ({"avoid": "eng"}, "'avoid' must be a list"),
    ({"avoid": [""]}, "'avoid' must be a list"),
    ({"reason": 3}, "'reason' must be a string"),
])
def test_malformed_failover_fields_are_named(fields: dict[str, Any], needle: str) -> None:
    assert needle in failover_problem(fields)
    assert failover_problem({"epoch": 2, "avoid": ["a"], "retry_prefill": 2}) == ""


def test_prefill_body_carries_the_epoch_only_for_a_retry() -> None:
    body = {"model": "m", "prompt": "p"}
    assert "lw_epoch" not in build_prefill_body(body, {"lw_epoch": 5}, "t@0", [1])[
        "kv_transfer_params"]
    assert build_prefill_body(body, {}, "t@0", [1], epoch=2)["kv_transfer_params"][
        "lw_epoch"] == 2


def test_choose_skips_avoided_engines_and_earlier_servers_of_unknown_engine() -> None:
    async def run() -> None:
        state = ProxyState(["http://a", "http://b", "http://c"], ["http://d"], timeout_s=1,
                           connect_timeout_s=1, health_timeout_s=1, metaserver_url="http://m",
                           verifier=CallVerifier(None))
        a, b, c = state.prefills
        a.engines["eng-a"] = "tcp://h:1"
        tr = Transfer("t", "/v1/completions", {}, False, {}, "http://m", state.decodes[0])
        sub = SubPrefill("t@0", b, tried=(a,))  # epoch 0 on a, epoch 1 on b (engine unknown)
        a.in_flight = b.in_flight = 0
        c.in_flight = 9  # the usual pick would never take c
        assert _choose(state, tr, sub, {"eng-a"}) is c
        # avoid "none": an untried server first (the last one may still hold its attempt and
        # refuse the transfer id), then an earlier one, the last attempt's server last
        assert _choose(state, tr, sub, set()) is c
        assert _choose(state, tr, SubPrefill("t@0", b, tried=(a, c)), set()) is a
        state.prefills[:] = [b]
        assert _choose(state, tr, SubPrefill("t@0", b, tried=()), set()) is b
        state.prefills[:] = [a, b, c]
        with pytest.raises(ValueError):
            _choose(state, tr, SubPrefill("t@0", c, tried=(a, b)), {"eng-a"})
        await state.aclose()

    asyncio.run(run())


def test_the_connectors_poster_and_the_proxy_agree_on_the_failover_calls() -> None:
    """D's real MetaserverPoster against the real proxy: the first call, the re-prefill call
    and the route the answers name (once the proxy learned the P's engine)."""
    pytest.importorskip("vllm")
    import queue

    from lw.vllm_adapter.config import LwConfig
    from lw.vllm_adapter.connector_meta import Route
    from lw.vllm_adapter.metaserver_client import MetaserverPoster

    asked: queue.Queue[dict[str, Any]] = queue.Queue()
    seen = Seen()
    app = FastAPI()

    @app.post("/v1/completions")
    async def serve(request: Request) -> Response:  # D: the test posts for it
        body = await request.json()
        sub = body["kv_transfer_params"]["transfer_id"] + "@r"
        asked.put(body)
        while not await request.is_disconnected():
            with seen.lock:
                if sub in seen.done:
                    return JSONResponse({"choices": [{"index": 0, "text": "ok"}]})
            await asyncio.sleep(0.01)
        return Response(status_code=499)

    cfg = LwConfig.build(role="kv_consumer", engine_id="d", kv_port=15000, tp_size=1, pp_size=1,
                         dp_size=1, dp_rank=0, load_failure_policy="fail",
                         extra={"host": "127.0.0.1", "cluster_key": KEY.decode(),
                                "retry_prefill": 1})
    poster = MetaserverPoster(cfg)
    servers = [ServerThread(fake_p("p1", seen)).start(), ServerThread(app).start()]
    control = ServerThread(None)
    urls = [servers[0].url, closed_port_url()]  # picked in this order: p1, then the dead one
    apps = build_apps(urls, [servers[1].url], timeout_s=10.0, cluster_key=KEY,
                      metaserver_url=control.url + "/v1/metaserver", start_mode="d-first")
    servers.append(ServerThread(apps.public, also=(control, apps.control)).start())
    results: list[httpx.Response] = []
    try:
        for n in range(2):
            t = threading.Thread(target=lambda: results.append(httpx.post(
                servers[-1].url + "/v1/completions", json=completion("hi"), timeout=10)))
            t.start()
            params = asked.get(timeout=5)["kv_transfer_params"]
            tid, sub, url = params["transfer_id"], params["transfer_id"] + "@r", params[
                "metaserver"]
            base = {"transfer_id": tid, "sub_transfer_id": sub,
                    "grant": params["metaserver_grant"]}
            poster.post("r", sub, url, {**base, "prompt_token_ids": [104, 105],
                                        "kv_transfer_params": d_params([104, 105]),
                                        "retry_prefill": 1})
            if n == 1:  # the dead server took it: D's core lost it and asks again
                wait_for(lambda: httpx.get(control.url + "/metrics-json").json()[
                    "prefill_failures"] == 1)
                poster.post("r", sub, url, {**base, "epoch": 1, "avoid": [], "reason": "lost"})
            t.join(timeout=10)
        assert [r.status_code for r in results] == [200, 200]
        assert poster.take_failures() == []
        # the first answer named no engine (not yet learned), nor the dead server's
        routes: list[Route] = []  # the poster's thread reads the answer after D's came back
        wait_for(lambda: bool(routes.extend(poster.take_routes()) or routes))
        assert routes == [Route(sub, "r", "eng-p1", "tcp://127.0.0.1:6001", 1)]
        assert [b["kv_transfer_params"].get("lw_epoch") for _, b in seen.p_bodies] == [None, 1]
    finally:
        poster.close()
        for s in servers:
            s.stop()


def test_a_server_is_named_to_d_only_while_it_has_shown_one_engine() -> None:
    b = Backend("http://p", "prefill")
    for engine, workers in ((None, ["tcp://h:1"]), ("", ["tcp://h:1"]), ("e", []),
                            ("e", "tcp://h:1"), ("e", [7])):
        b.learn_engine(engine, workers)  # malformed: ignored
    assert b.identity() is None
    b.learn_engine("e0", ["tcp://h:1", "tcp://h:2"])
    assert b.identity() == ("e0", "tcp://h:1")  # TP rank 0's side channel
    b.learn_engine("e0_dp1", ["tcp://h:3"])  # a second DP engine behind the same address
    assert b.identity() is None and b.engines.keys() == {"e0", "e0_dp1"}
