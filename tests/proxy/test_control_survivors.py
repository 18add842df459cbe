"""The proxy's control plane (lw.proxy.control) in process, through its ASGI app with no server:
each refusal's status, body, counter, ``connection: close`` and log line (naming the peer), the
bound on metaserver bodies read at once, the decode workers a first call teaches the proxy, and
the health cache's edge. Written to kill the survivors of ``tools/mutation.py --scope
security``; the same calls against real servers are in tests/proxy/test_proxy.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import pytest

from lw.contract.auth import CallVerifier, signed_call
from lw.contract.params import metaserver_call
from lw.proxy import control
from lw.proxy.backend import MAX_WORKERS
from lw.proxy.control import _call_problem, _metaserver_problem, build_control_app, cached_health
from lw.proxy.limits import Limits
from lw.proxy.state import ProxyState, SubPrefill, Transfer
from tests.proxy.test_control_refusals import Client
from tests.proxy.test_control_refusals import state as health_state
from tests.proxy.test_proxy import KEY, d_params

TID = "ab" * 16
SUB = TID + "@0"
PEER = ("10.9.8.7", 4321)
IDS = [5, 6, 7]


@dataclass
class Plane:
    """A control app over a fresh proxy state, and a client that calls it from ``PEER``."""

    state: ProxyState
    http: httpx.AsyncClient

    def transfer(self, **kw: Any) -> Transfer:
        """A client request in flight whose D may call the metaserver (known to the proxy)."""
        tr = Transfer(TID, "completions", {"model": "m", "prompt": "p"}, False, {}, "",
                      self.state.decodes[0], **kw)
        self.state.transfers[TID] = tr
        return tr

    async def call(self, body: dict[str, Any], content: Any = None) -> httpx.Response:
        """POST ``body`` signed with the cluster key (``content``: other bytes, same headers)."""
        raw, headers = signed_call(KEY, body)
        return await self.http.post("/v1/metaserver", content=raw if content is None
                                    else content, headers=headers)


@contextlib.asynccontextmanager
async def plane(limits: Limits | None = None,
                client: tuple[str, int] | None = PEER) -> AsyncIterator[Plane]:
    """A keyed proxy state (one prefill, one decode server that nobody calls) and its app."""
    state = ProxyState(["http://p:1"], ["http://d:1"], timeout_s=5.0, connect_timeout_s=1.0,
                       health_timeout_s=1.0, metaserver_url="http://control/v1/metaserver",
                       verifier=CallVerifier(KEY), limits=limits, start_mode="d-first")
    transport = httpx.ASGITransport(app=build_control_app(state), client=client)
    async with httpx.AsyncClient(transport=transport, base_url="http://control") as http:
        try:
            yield Plane(state, http)
        finally:
            await state.aclose()


def run(fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(fn())


@pytest.fixture(autouse=True)
def no_prefill_is_sent(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A started prefill is recorded, not sent (there is no prefill server)."""
    started: list[str] = []

    def recorded(state: Any, tr: Any, sub: Any, body: Any) -> Awaitable[None]:
        started.append(sub.sub_id)
        return asyncio.sleep(0)

    monkeypatch.setattr(control, "run_prefill", recorded)
    return started


def call(sub: str = SUB, grant: str = "", ids: list[int] = IDS, **kw: Any) -> dict[str, Any]:
    """A first (epoch 0) metaserver call for ``sub`` unless ``kw`` says otherwise."""
    params = kw.pop("kv_transfer_params", d_params(ids))
    return {"transfer_id": TID, "sub_transfer_id": sub, "grant": grant,
            "prompt_token_ids": ids, "kv_transfer_params": params, **kw}


def decoded(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` as the metaserver reads it: decoded into the contract's type, as builtins."""
    return msgspec.to_builtins(metaserver_call(json.dumps(body).encode()))


def refusal_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lw.proxy"]


def test_a_call_for_a_transfer_d_computes_alone_is_refused_403(
        no_prefill_is_sent: list[str]) -> None:
    """A transfer D computes alone (no prefill server) gets no prefill, even with its grant."""
    async def go() -> None:
        async with plane() as p:
            tr = p.transfer(local=True)
            r = await p.call(call(grant=tr.grant))
            assert r.status_code == 403, r.text
            assert "computed by the decode server alone" in r.json()["detail"]
            assert p.state.counters["metaserver_refused"] == 1 and not tr.prefills

    run(go)
    assert no_prefill_is_sent == []


@pytest.mark.parametrize(("extra", "fragment"), [
    ({"epoch": 65}, "'epoch' must be an integer in 0..64"),
    ({"epoch": 1, "avoid": ["e"] * 65}, "'avoid' must be a list of at most 64"),
    ({"retry_prefill": 3, "epoch": 1, "reason": "x", "avoid": [""]}, "'avoid'")])
def test_a_re_prefill_with_failover_fields_out_of_bounds_is_a_400(
        extra: dict[str, Any], fragment: str) -> None:
    """A re-prefill (epoch > 0) whose failover fields the contract lets through but the proxy's
    bounds do not is refused 400 naming the field, before its transfer is even looked up."""
    async def go() -> None:
        async with plane() as p:
            tr = p.transfer(allowance=1)
            tr.prefills[SUB] = SubPrefill(SUB, p.state.prefills[0], budget=64)
            r = await p.call(call(grant=tr.grant, **extra))
            assert r.status_code == 400 and fragment in r.json()["detail"], r.text
            assert p.state.counters["metaserver_refused"] == 1
            assert p.state.counters["prefill_failovers"] == 0

    run(go)


def test_the_problem_helpers_answer_empty_text_for_an_acceptable_call() -> None:
    """Both checks say "" (a str, as documented) when a call may start or restart a prefill."""
    async def go() -> None:
        async with plane() as p:
            tr = p.transfer()
            first = decoded(call(grant=tr.grant))
            assert _metaserver_problem(first) == "" and _call_problem(tr, first) == ""
            again = decoded({"transfer_id": TID, "sub_transfer_id": SUB, "epoch": 1})
            assert _metaserver_problem(again) == ""
            assert _metaserver_problem({**first, "prompt_token_ids": []}).startswith(
                "'prompt_token_ids'")

    run(go)


def test_a_stale_re_prefill_is_refused_409_counted_and_closed(
        caplog: pytest.LogCaptureFixture) -> None:
    """A re-prefill below the sub-transfer's epoch is a refusal like any other: 409 with the
    call's ids, counted in metaserver_refused, logged with its peer, the connection closed."""
    async def go() -> None:
        async with plane() as p:
            tr = p.transfer()
            tr.prefills[SUB] = SubPrefill(SUB, p.state.prefills[0], epoch=2, budget=3)
            r = await p.call(call(grant=tr.grant, epoch=1))
            assert r.status_code == 409, r.text
            assert r.json() == {"status": "error", "transfer_id": TID, "sub_transfer_id": SUB,
                                "detail": "stale epoch 1: the sub-transfer is at epoch 2"}
            assert r.headers["connection"] == "close"
            assert p.state.counters["metaserver_refused"] == 1
            assert tr.prefills[SUB].epoch == 2

    with caplog.at_level(logging.WARNING, "lw.proxy"):
        run(go)
    [line] = refusal_lines(caplog)
    assert "[metaserver_409]" in line and "stale epoch 1" in line and "'10.9.8.7'" in line


def test_a_body_slower_than_its_bound_is_refused_408_and_logged_with_its_peer(
        caplog: pytest.LogCaptureFixture) -> None:
    """A control body not whole within body_read_s: 408, counted, logged (kind and peer),
    closed, and its place among the bodies being read given back."""
    async def go() -> None:
        async with plane(Limits(body_read_s=0.05)) as p:
            never = asyncio.Event()

            async def drip() -> AsyncIterator[bytes]:
                yield b'{"transfer_id": '
                await never.wait()

            r = await p.call(call(), content=drip())
            assert r.status_code == 408, r.text
            assert r.json() == {"status": "error",
                                "detail": "request body not received within 0.05 s"}
            assert r.headers["connection"] == "close"
            assert p.state.counters["metaserver_refused"] == 1
            assert p.state.control_reads == 0

    with caplog.at_level(logging.WARNING, "lw.proxy"):
        run(go)
    [line] = refusal_lines(caplog)
    assert line.startswith("lw proxy [metaserver_408]: metaserver call refused (408): "
                           "request body not received within 0.05 s")
    assert line.endswith("(from '10.9.8.7')")


def test_a_refusal_of_a_caller_without_an_address_is_logged_from_a_question_mark(
        caplog: pytest.LogCaptureFixture) -> None:
    """A refused call whose connection has no client address (a UNIX socket) is still
    answered 401 and logged, its peer shown as "?"."""
    async def go() -> None:
        async with plane(client=None) as p:
            r = await p.http.post("/v1/metaserver", json=call())
            assert r.status_code == 401 and "unsigned" in r.json()["detail"]

    with caplog.at_level(logging.WARNING, "lw.proxy"):
        run(go)
    [line] = refusal_lines(caplog)
    assert "[metaserver_401]" in line and line.endswith("(from '?')")


def test_a_finished_read_frees_exactly_its_place_under_max_control_reads() -> None:
    """max_control_reads 1: after a call was read and answered, one slow caller holds the only
    place and the next is refused 503; once it is done, the count is back to 0."""
    async def go() -> None:
        async with plane(Limits(max_control_reads=1)) as p:
            for _ in range(2):  # read whole and answered: each gives its place back
                assert (await p.call(call())).status_code == 404
            started, release = asyncio.Event(), asyncio.Event()

            async def slow() -> AsyncIterator[bytes]:
                started.set()
                await release.wait()
                yield b"{}"

            holder = asyncio.ensure_future(p.call(call(), content=slow()))
            await started.wait()
            assert p.state.control_reads == 1
            busy = await p.call(call())
            assert busy.status_code == 503 and "1 calls are being read" in busy.json()["detail"]
            release.set()
            assert (await holder).status_code == 401  # the MAC was made for other bytes
            assert p.state.control_reads == 0
            assert p.state.counters["metaserver_refused"] == 2

    run(go)


def test_a_first_call_teaches_the_proxy_its_decode_workers_bounded_per_transfer(
        no_prefill_is_sent: list[str]) -> None:
    """D's workers named by a first call are learnt by the proxy (lw status), by the decode
    server and by the transfer (whom to ask if D fails it); a transfer keeps at most
    MAX_WORKERS of them, however many its later calls name."""
    many = [f"tcp://10.0.0.5:{7000 + j}" for j in range(MAX_WORKERS)]

    async def go() -> None:
        async with plane() as p:
            tr = p.transfer(allowance=2)
            r = await p.call(call(grant=tr.grant, kv_transfer_params=d_params(
                IDS, remote_host="10.0.0.5", remote_port=7000, remote_tp_size=MAX_WORKERS)))
            assert r.status_code == 202 and r.json()["detail"] == "prefill started", r.text
            assert list(tr.decode_workers) == many == list(p.state.decodes[0].workers)
            assert p.state.workers.snapshot()["decode"] == many
            r = await p.call(call(sub=TID + "@1", grant=tr.grant, kv_transfer_params=d_params(
                IDS, remote_host="10.0.0.6", remote_port=7000, remote_tp_size=2)))
            assert r.status_code == 202, r.text
            assert list(tr.decode_workers) == many  # full: the second engine's are not kept
            assert p.state.workers.snapshot()["decode"] == [
                *many, "tcp://10.0.0.6:7000", "tcp://10.0.0.6:7001"]

    run(go)
    assert no_prefill_is_sent == [SUB, TID + "@1"]


def test_health_is_probed_again_once_the_cache_is_exactly_its_bound_old() -> None:
    """The cached report serves calls younger than health_cache_s; at exactly that age the
    backends are probed again (the bound is exclusive)."""
    clock = [100.0]
    loop = asyncio.new_event_loop()
    loop.time = lambda: clock[0]
    client = Client(200)
    s = health_state(client)  # health_cache_s 1.0
    try:
        first = loop.run_until_complete(cached_health(s))
        assert client.calls == 2
        clock[0] = 100.75
        assert loop.run_until_complete(cached_health(s)) is first and client.calls == 2
        clock[0] = 101.0
        again = loop.run_until_complete(cached_health(s))
        assert again is not first and client.calls == 4 and s.health_cache[0] == 101.0
    finally:
        loop.close()
