"""The proxy's admit-ahead start mode against fakes (no vLLM): P gets the request with D, fetches
D's params from the control plane, and anything but a timely, matching fetch falls back to the
D-first order. The fake D is test_proxy's; the fake P here acts as lw's P does with ahead params.
Prompt keywords steer it: ``pother`` (P tokenized another prompt), ``pnofetch`` (P never asks for
D's params), ``local`` (D computes the prompt itself), ``prefused`` (compute-ahead: P's core
refuses the bind, having dropped the request), ``pplain`` (P of a release without compute-ahead:
it computes plainly and fetches nothing), ``pbad`` (P refuses the request, 400)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lw.contract.ahead import HELD_KEY, decode_ahead_params, is_ahead_request
from lw.contract.auth import signed_call
from lw.contract.params import decode_params_for_prefiller, prompt_digest
from lw.proxy.backend import AHEAD_MISSES, AHEAD_OFF_MAX_S, AHEAD_OFF_S, Backend
from lw.proxy.limits import Limits
from lw.proxy.server import build_apps
from lw.proxy.sidecar import Sidecar
from lw.proxy.state import DEFAULT_START_MODE
from tests.proxy.test_proxy import (
    KEY,
    Cluster,
    ServerThread,
    World,
    _poll_until,
    _prompt,
    cluster,
    completion,
    wait_for,
)


def ahead_prefill(world: World) -> FastAPI:
    """A prefill server taking ahead params as lw's connector does (fetch, then compute)."""
    app = FastAPI()

    async def serve(request: Request) -> Response:
        body = await request.json()
        params = body["kv_transfer_params"]
        prompt = _prompt(body)
        if not is_ahead_request(params):  # a D-first prefill (the fallback)
            tid = decode_params_for_prefiller(KEY, params).transfer_id
            world.record("p_request", "p0", tid)
            with world.lock:
                world.prefill_done.add(tid)
            return JSONResponse({"choices": [{"index": 0, "text": "x"}]})
        ap = decode_ahead_params(KEY, params)
        with world.lock:
            world.bodies[("p_ahead", ap.transfer_id)] = body
        world.record("p_ahead", "p0", ap.transfer_id)
        if "pnofetch" in prompt:
            await _poll_until(request, lambda: False, 30)
            world.record("p_ahead_cancelled", "p0", ap.transfer_id)
            return Response(status_code=499)
        text = prompt + ("!" if "pother" in prompt else "")
        call = {"transfer_id": ap.transfer_id, "grant": ap.lw_ahead_grant,
                "prompt_digest": prompt_digest([ord(ch) for ch in text])}
        content, headers = signed_call(KEY, call)

        async def fetch() -> dict[str, Any]:
            async with httpx.AsyncClient(timeout=10) as client:
                r = await client.post(ap.lw_ahead_url, content=content, headers=headers)
            with world.lock:
                world.meta_replies.setdefault("fetch:" + ap.transfer_id, []).append(
                    (r.status_code, r.json()))
            return r.json()

        if "pbad" in prompt:  # P refuses this request (its own validation)
            return JSONResponse({"error": {"message": "bad", "code": 400}}, status_code=400)
        if "pplain" in prompt:  # a P of a release without compute-ahead: computed plainly
            await asyncio.sleep(0.3)  # (after D's call bound it: D's fake calls at once)
            return JSONResponse({"choices": [{"index": 0, "text": "x"}]})
        if ap.lw_ahead_compute:  # computed at once: the answer ends before D's params come
            async def bind_later() -> None:
                answer = await fetch()
                if answer["status"] != "go":
                    world.record("p_ahead_dropped", "p0", ap.transfer_id)
                    return
                pp = decode_params_for_prefiller(KEY, answer["kv_transfer_params"])
                if "prefused" in prompt:  # P's core had dropped it: the bind is refused
                    for _ in range(2):  # (told twice: the proxy restarts it once)
                        refused = dict(call, refused="P had dropped it")
                        rc, rh = signed_call(KEY, refused)
                        async with httpx.AsyncClient(timeout=10) as client:
                            r = await client.post(ap.lw_ahead_url, content=rc, headers=rh)
                        with world.lock:
                            world.meta_replies.setdefault("refused:" + ap.transfer_id, []
                                                          ).append((r.status_code, r.json()))
                    return
                world.record("p_ahead_go", "p0", pp.transfer_id)
                with world.lock:
                    world.prefill_done.add(pp.transfer_id)

            world.tasks.append(asyncio.ensure_future(bind_later()))
            return JSONResponse({"choices": [{"index": 0, "text": "x"}],
                                 "kv_transfer_params": {HELD_KEY: True}})
        answer = await fetch()
        if answer["status"] != "go":
            await _poll_until(request, lambda: False, 30)  # the proxy cancels it
            world.record("p_ahead_cancelled", "p0", ap.transfer_id)
            return Response(status_code=499)
        pp = decode_params_for_prefiller(KEY, answer["kv_transfer_params"])
        world.record("p_ahead_go", "p0", pp.transfer_id)
        await asyncio.sleep(0.05)  # the compute
        with world.lock:
            world.prefill_done.add(pp.transfer_id)
        return JSONResponse({"choices": [{"index": 0, "text": "x"}]})

    app.post("/v1/completions")(serve)
    app.post("/v1/chat/completions")(serve)
    return app


@contextlib.contextmanager
def ahead_cluster(wait_s: float = 1.0, mode: str = "admit-ahead", **kw: Any
                  ) -> Iterator[Cluster]:
    world = World(key=KEY)
    world.tasks = []  # the fake P's background fetches (compute-ahead)
    p = ServerThread(ahead_prefill(world)).start()
    try:
        with cluster(prefill_urls=[p.url], start_mode=mode,
                     limits=Limits(ahead_wait_s=wait_s), **kw) as c:
            c.world.__dict__.update(world.__dict__)  # the fakes share one world
            yield c
    finally:
        p.stop()


def post(c: Cluster, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(c.url + "/v1/completions", json=body, timeout=15)


def test_ahead_prefill_is_bound_to_d_call_and_sent_once() -> None:
    """... and P gets only what decides the prompt's tokens (and cache_salt, priority) and
    token 1 (the sampling fields: P samples it for D), as a D-first prefill does: none of the
    client's output or unknown fields."""
    with ahead_cluster() as c:
        r = post(c, completion("hello there", temperature=0.7, seed=3, logit_bias={"5": 9},
                               user="u", x_unknown={"a": 1}, stop=["z"], cache_salt="s",
                               add_special_tokens=False))
        assert r.status_code == 200, r.text
        m = c.metrics()
        assert (m["ahead_started"], m["ahead_bound"], m["ahead_fallbacks"]) == (1, 1, 0)
        w = c.world
        assert len(w.tids("p_ahead")) == 1 and not w.tids("p_request")  # P got it once
        (tid,) = w.tids("p_ahead")
        (sub,) = w.tids("p_ahead_go")
        assert sub.startswith(tid + "@")
        body = w.bodies[("p_ahead", tid)]
        assert (body["max_tokens"], body["n"], body["stream"]) == (1, 1, False)
        assert body["prompt"] == "hello there"
        assert set(body) == {"model", "prompt", "max_tokens", "n", "stream", "cache_salt",
                             "add_special_tokens", "kv_transfer_params", "temperature", "seed",
                             "logit_bias"}, body
        assert (body["temperature"], body["seed"], body["logit_bias"]) == (0.7, 3, {"5": 9})


def test_another_prompt_on_p_falls_back_to_d_first() -> None:
    with ahead_cluster() as c:
        r = post(c, completion("pother prompt"))
        assert r.status_code == 200, r.text
        m = c.metrics()
        assert (m["ahead_bound"], m["ahead_fallbacks"]) == (0, 1)
        w = c.world
        wait_for(lambda: bool(w.tids("p_ahead_cancelled")))
        assert len(w.tids("p_request")) == 1  # the D-first prefill
        ((status, answer),) = next(v for k, v in w.meta_replies.items()
                                   if k.startswith("fetch:"))
        assert status == 200 and answer["status"] == "fallback"
        assert "another prompt" in answer["detail"]


def test_p_that_never_fetches_is_cancelled_and_started_d_first() -> None:
    with ahead_cluster(wait_s=0.3) as c:
        r = post(c, completion("pnofetch please"))
        assert r.status_code == 200, r.text
        assert c.metrics()["ahead_fallbacks"] == 1
        wait_for(lambda: bool(c.world.tids("p_ahead_cancelled")))
        assert len(c.world.tids("p_request")) == 1


def test_d_computing_alone_cancels_the_ahead_prefill() -> None:
    with ahead_cluster(wait_s=0.5) as c:
        r = post(c, completion("local only"))
        assert r.status_code == 200, r.text
        wait_for(lambda: bool(c.world.tids("p_ahead_cancelled")))
        m = c.metrics()
        assert m["ahead_bound"] == 0 and m["prefills"] == 0


def test_requests_of_several_sub_transfers_start_d_first() -> None:
    with ahead_cluster() as c:
        r = post(c, completion("two choices", n=2))
        assert r.status_code == 200, r.text
        m = c.metrics()
        assert m["ahead_started"] == 0 and len(c.world.tids("p_request")) == 2


@pytest.mark.parametrize("case", ["unsigned", "unknown", "malformed"])
def test_fetches_that_are_not_the_transfer_s_are_refused(case: str) -> None:
    with ahead_cluster() as c:
        call: dict[str, Any] = {"transfer_id": "f" * 32, "grant": "g" * 32,
                                "prompt_digest": "0" * 32}
        if case == "malformed":
            call["prompt_digest"] = "not hex"
        content, headers = signed_call(None if case == "unsigned" else KEY, call)
        r = httpx.post(c.control + "/v1/ahead", content=content, headers=headers, timeout=5)
        assert r.status_code == {"unsigned": 401, "unknown": 404, "malformed": 400}[case], r.text
        assert c.metrics()["ahead_fetches_refused"] == 1


def test_a_fetch_without_the_transfer_s_grant_learns_nothing() -> None:
    with ahead_cluster(wait_s=0.5) as c:
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(post, c, completion("pnofetch grant"))
            wait_for(lambda: bool(c.world.tids("p_ahead")))
            (tid,) = c.world.tids("p_ahead")
            call = {"transfer_id": tid, "grant": "g" * 32, "prompt_digest": "0" * 32}
            content, headers = signed_call(KEY, call)
            r = httpx.post(c.control + "/v1/ahead", content=content, headers=headers,
                           timeout=5)
            assert r.status_code == 403 and r.json()["status"] == "fallback", r.text
            assert "kv_transfer_params" not in r.json()
            assert fut.result().status_code == 200


def test_compute_ahead_binds_a_prefill_whose_answer_ended_first() -> None:
    """compute-ahead: P answers its POST once computed, before D's call; that is no fallback:
    D's call binds it, P's fetch gets D's params (P then writes what it holds)."""
    with ahead_cluster(mode="compute-ahead") as c:
        r = post(c, completion("hello there"))
        assert r.status_code == 200, r.text
        m = c.metrics()
        assert (m["ahead_started"], m["ahead_bound"], m["ahead_fallbacks"]) == (1, 1, 0)
        w = c.world
        (tid,) = w.tids("p_ahead")
        assert decode_ahead_params(KEY, w.bodies[("p_ahead", tid)]["kv_transfer_params"]
                                   ).lw_ahead_compute
        (sub,) = w.tids("p_ahead_go")
        assert sub.startswith(tid + "@") and not w.tids("p_request")


def test_compute_ahead_for_another_prompt_drops_p_work_and_starts_d_first() -> None:
    with ahead_cluster(mode="compute-ahead") as c:
        r = post(c, completion("pother prompt"))
        assert r.status_code == 200, r.text
        w = c.world
        wait_for(lambda: bool(w.tids("p_ahead_dropped")))
        assert len(w.tids("p_request")) == 1 and not w.tids("p_ahead_go")
        assert c.metrics()["ahead_fallbacks"] == 1


def test_compute_ahead_on_a_p_that_did_not_hold_the_kv_starts_d_first() -> None:
    """A P that answers without saying it holds the KV (it computed the prompt plainly, e.g. a
    P of another release, and fetches nothing) is not bound: D's call starts the prefill D
    first as soon as P's answer ends, without waiting out the proxy's ahead wait (5 s here)."""
    with ahead_cluster(wait_s=5.0, mode="compute-ahead") as c:
        t0 = time.monotonic()
        r = post(c, completion("pplain prompt"))
        assert r.status_code == 200, r.text
        assert time.monotonic() - t0 < 3.0
        w = c.world
        assert len(w.tids("p_request")) == 1 and not w.tids("p_ahead_go")
        m = c.metrics()
        assert m["ahead_bound"] == 0 and m["ahead_unbound"] + m["ahead_fallbacks"] == 1, m


def test_a_bind_p_refused_starts_the_prefill_d_first_once() -> None:
    """compute-ahead: P's core had dropped the request when D's params came and refused the
    bind (no decoder claimed): told so, the proxy starts the prefill D first on the same P,
    once, and the client's request completes."""
    with ahead_cluster(mode="compute-ahead") as c:
        r = post(c, completion("prefused prompt"))
        assert r.status_code == 200, r.text
        w = c.world
        (tid,) = w.tids("p_ahead")
        (sub,) = w.tids("p_request")  # the D-first prefill, on the same P
        assert sub.startswith(tid + "@") and not w.tids("p_ahead_go")
        wait_for(lambda: len(w.meta_replies.get("refused:" + tid, [])) == 2)
        first, again = w.meta_replies["refused:" + tid]
        assert first == (200, {"status": "fallback", "detail": "started D first"}), first
        # (or the request had ended by then: an unknown transfer)
        assert again in ((200, {"status": "fallback", "detail": "started D first already"}),
                         (404, {"status": "fallback",
                                "detail": "unknown transfer (ended, or not sent ahead)"})), again
        m = c.metrics()
        assert (m["ahead_bound"], m["ahead_refused_binds"], m["prefills"]) == (1, 1, 1), m


def test_a_refused_bind_before_any_params_were_handed_is_refused() -> None:
    """A refusal for a transfer whose params were never handed (D has not called) changes
    nothing: 409; one without the transfer's grant: 403."""
    with ahead_cluster(mode="compute-ahead", wait_s=3.0) as c, ThreadPoolExecutor(1) as pool:
        fut = pool.submit(post, c, completion("pnofetch prompt"))
        wait_for(lambda: bool(c.world.tids("p_ahead")))
        (tid,) = c.world.tids("p_ahead")
        ap = decode_ahead_params(KEY, c.world.bodies[("p_ahead", tid)]["kv_transfer_params"])
        for grant, code in ((ap.lw_ahead_grant, 409), ("x" * 32, 403)):
            call = {"transfer_id": tid, "grant": grant, "prompt_digest": "0" * 32,
                    "refused": "P had dropped it"}
            content, headers = signed_call(KEY, call)
            r = httpx.post(c.control + "/v1/ahead", content=content, headers=headers,
                           timeout=5)
            assert r.status_code == code and r.json()["status"] == "fallback", r.text
        assert c.metrics()["ahead_refused_binds"] == 0
        assert fut.result().status_code == 200


def _second_one_goes_d_first(first_seen: str, **bounds: Any) -> dict[str, Any]:
    """A request D never allocates (so its prefill, when ahead, stays on P unbound), then one
    more: the proxy's counters, once the second was served D first."""
    with ThreadPoolExecutor(1) as pool, ahead_cluster(
            wait_s=0.3, mode="compute-ahead", **bounds) as c:
        pool.submit(post, c, completion("dhang queued on D"))
        wait_for(lambda: bool(c.world.tids(first_seen)))
        r = post(c, completion("hello there"))
        assert r.status_code == 200, r.text
        assert len(c.world.tids("p_request")) == 1  # the second one: D first
        return c.metrics()


def test_none_goes_ahead_while_its_d_has_requests_it_has_not_allocated_for() -> None:
    """D-first's backpressure kept: a D short of free blocks queues requests (no metaserver
    call, no token); while it holds ``ahead_d_backlog`` of them, no prefill goes to P ahead."""
    m = _second_one_goes_d_first("d_request", ahead_d_backlog=1, ahead_p_busy=2)
    assert (m["ahead_started"], m["ahead_skipped_d_backlog"]) == (1, 1), m


def test_none_goes_ahead_while_its_p_is_busy() -> None:
    """A request that would only wait in P's queue goes D first: going ahead it would gain
    nothing and be computed before requests that came first (``ahead_p_busy``)."""
    m = _second_one_goes_d_first("p_ahead")
    assert (m["ahead_started"], m["ahead_skipped_p_busy"]) == (1, 1), m
    assert m["ahead_skipped_d_backlog"] == 0


def test_none_goes_ahead_beyond_the_ahead_limit_of_its_p() -> None:
    """At most ``ahead_limit`` prefills wait on one P for D's params; one more starts D first."""
    m = _second_one_goes_d_first("p_ahead", ahead_limit=1, ahead_p_busy=4)
    assert (m["ahead_started"], m["ahead_skipped_full"]) == (1, 1), m
    assert m["ahead_skipped_p_busy"] == m["ahead_skipped_d_backlog"] == 0


@pytest.mark.parametrize("bound", ["ahead_limit", "ahead_d_backlog", "ahead_p_busy"])
def test_an_ahead_bound_below_one_is_refused(bound: str) -> None:
    with pytest.raises(ValueError, match=f"{bound} 0"):
        with ahead_cluster(mode="compute-ahead", **{bound: 0}):
            pass


def _post_to_idle_p(c: Cluster, prompt: str) -> None:
    """One request, once P has nothing in flight (D may answer before the proxy read P's
    answer to the last one: a busy P would make this one start D first)."""
    wait_for(lambda: c.metrics()["prefill"][0]["in_flight"] == 0)
    r = post(c, completion(prompt))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("prompt", ["pplain prompt", "pnofetch please", "pother prompt"])
def test_a_p_whose_ahead_prefills_keep_missing_gets_none_for_a_while(prompt: str) -> None:
    """A P of another release (it computes plainly), one that cannot reach the control port
    (it never fetches) or one tokenizing otherwise: after three misses in a row its prefills
    start D first, with no wait and no prefill computed for nothing."""
    with ahead_cluster(wait_s=0.3, mode="compute-ahead") as c:
        for _ in range(4):
            _post_to_idle_p(c, prompt)
        m = c.metrics()
        assert (m["ahead_started"], m["ahead_switched_off"], m["ahead_skipped_p_off"]) == (
            3, 1, 1), m
        assert len(c.world.tids("p_ahead")) == 3 and len(c.world.tids("p_request")) == 4


def test_a_bound_ahead_prefill_starts_the_misses_again() -> None:
    with ahead_cluster(wait_s=0.3, mode="compute-ahead") as c:
        for prompt in ("pplain one", "pplain two", "hello there", "pplain three", "pplain four"):
            _post_to_idle_p(c, prompt)
        m = c.metrics()
        assert (m["ahead_started"], m["ahead_bound"], m["ahead_switched_off"]) == (5, 1, 0), m


def test_the_default_start_mode_is_d_first_and_a_sidecar_goes_d_first() -> None:
    """Measured the faster one with P's first token streamed from D, d-first is the default; a
    sidecar's metaserver sits on its decode pod, which prefill pods need not reach, so there D
    first is the default too."""
    kw: dict[str, Any] = dict(metaserver_url="http://c/v1/metaserver", cluster_key=KEY)
    assert DEFAULT_START_MODE == "d-first"
    assert build_apps(["http://p"], ["http://d"], **kw).state.start_mode == "d-first"
    sidecar = Sidecar([], allow_any=True)
    assert build_apps([], ["http://d"], sidecar=sidecar, **kw).state.start_mode == "d-first"
    assert build_apps([], ["http://d"], sidecar=sidecar, start_mode="compute-ahead",
                      **kw).state.start_mode == "compute-ahead"


def test_requests_p_refuses_do_not_switch_going_ahead_off() -> None:
    """A 4xx from P is that request's (a client could send such requests on purpose): however
    many in a row, P's prefills keep going ahead."""
    with ahead_cluster(wait_s=0.3, mode="compute-ahead") as c:
        for _ in range(4):
            _post_to_idle_p(c, "pbad prompt")
        m = c.metrics()
        assert (m["ahead_started"], m["ahead_switched_off"]) == (4, 0), m


def test_a_p_switched_off_again_before_a_bind_waits_twice_as_long() -> None:
    """A P that never takes part (its control port unreachable, say) would cost AHEAD_MISSES
    requests a wait every AHEAD_OFF_S: each switch-off without a bound prefill between doubles
    the next one, up to AHEAD_OFF_MAX_S; a bound prefill starts it over."""
    b = Backend("http://p", "prefill")
    offs = []
    now = 0.0
    for _ in range(8):
        assert [b.ahead_missed(now) for _ in range(AHEAD_MISSES)][:-1] == [0.0] * (
            AHEAD_MISSES - 1)
        offs.append(b.ahead_off_until - now)
        assert not b.ahead_on(now) and b.ahead_on(b.ahead_off_until)
        now = b.ahead_off_until
    assert offs[:3] == [AHEAD_OFF_S, 2 * AHEAD_OFF_S, 4 * AHEAD_OFF_S]
    assert max(offs) == AHEAD_OFF_MAX_S
    b.ahead_used()
    for _ in range(AHEAD_MISSES):
        off = b.ahead_missed(now)
    assert off == AHEAD_OFF_S
