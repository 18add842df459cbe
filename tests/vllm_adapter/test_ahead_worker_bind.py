"""P's worker fetches D's params for a request computed ahead and binds it mid-step, as they
come (lw.vllm_adapter.worker_binds), through vLLM's real Scheduler and lw's real worker
connectors in one process (the in-process data plane): D's blocks then hold exactly what P
computed, every block comes back, the scheduler learns the answer from the worker's metadata,
and its copy of the bind changes nothing. The fetch thread is played by the test."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

import lw.vllm_adapter.worker_binds as binds_mod  # noqa: E402
from lw.contract.ahead import sign_ahead_params  # noqa: E402
from lw.vllm_adapter.config import LwConfig  # noqa: E402

from .test_connector_ahead import FakeFetcher  # noqa: E402
from .test_connector_scheduler import (  # noqa: E402
    BASELINE,
    LAYERS,
    PROGRESSIVE,
    Cluster,
    FakePoster,
    as_proxy,
    cluster_factory,  # noqa: F401  (fixture)
    fake_poster,  # noqa: F401  (autouse fixture: no metaserver thread)
    free_blocks,
    make_request,
    model_dir,  # noqa: F401  (fixture)
)

URL = "http://127.0.0.1:9/v1/ahead"


class HeldFetcher(FakeFetcher):
    """The worker's fetch thread, played by the test (the scheduler side's fake, which also
    keeps what the worker calls with the answer): it answers when the test says."""

    last: HeldFetcher | None = None

    def __init__(self, cfg: LwConfig) -> None:
        super().__init__(cfg)
        self.then: dict[str, Callable[[tuple[str, Any]], None] | None] = {}
        self.bodies: dict[str, dict[str, Any]] = {}
        HeldFetcher.last = self

    def fetch(self, rid: str, url: str, body: dict[str, Any],
              then: Callable[[tuple[str, Any]], None] | None = None) -> None:
        super().fetch(rid, url, body)
        self.then[rid] = then
        self.bodies[rid] = body

    def answer(self, rid: str, answer: tuple[str, Any]) -> None:
        then = self.then.pop(rid)
        assert then is not None, "the worker acts on its fetch's answer as it comes"
        then(answer)


@pytest.fixture(autouse=True)
def held_fetcher(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(binds_mod, "AheadFetcher", HeldFetcher)
    HeldFetcher.last = None
    yield


def _computing_cluster(make: Callable[..., Cluster], n: int) -> tuple[Cluster, list[int], Any]:
    """P computes ``n`` tokens ahead (its first chunk done), D allocated and posted its call."""
    c = make(p_extra=PROGRESSIVE)
    c.p.worker_meta = True  # the worker's answers reach the scheduler
    c.relay_enabled = False  # the proxy binds P's ahead request instead of a D-first prefill
    toks = list(range(3000, 3000 + n))
    c.prompts["r1"] = toks
    c.p.sched.add_request(make_request("p-r1", n, tokens=toks, params=sign_ahead_params(
        None, URL, "t1", "g" * 32, compute=True)))
    c.p.step()  # chunk 1 computed, under the proxy's transfer id, nothing sent
    f = HeldFetcher.last
    assert f is not None and f.bodies["p-r1"]["transfer_id"] == "t1"  # the worker asked
    c.add("r1", toks, tid="t1")
    c.run_until(lambda: bool(FakePoster.instances and FakePoster.instances[0].posts))
    (_rid, tid, _url, msg) = FakePoster.instances[0].posts[0]
    return c, toks, ("go", as_proxy(msg["kv_transfer_params"], tid))


def test_params_that_come_mid_step_bind_the_worker_before_the_step_ends(
        cluster_factory: Callable[..., Cluster]) -> None:  # noqa: F811
    c, _toks, answer = _computing_cluster(cluster_factory, 150)  # 10 blocks, 3 chunks
    f = HeldFetcher.last
    assert f is not None
    worker = c.p.worker._worker
    assert worker is not None
    save = c.p.worker.save_kv_layer
    bound_mid_step: list[bool] = []

    def save_kv_layer(name: str, kv: Any, attn: Any, **kw: Any) -> None:
        save(name, kv, attn, **kw)
        if name == LAYERS[0] and not bound_mid_step:  # between the step's two layers
            f.answer("p-r1", answer)
            bound_mid_step.append("t1" in worker._alias)

    c.p.worker.save_kv_layer = save_kv_layer  # type: ignore[method-assign]
    c.run_until(lambda: len(c.d.finished) == 1 and c.idle())
    assert bound_mid_step == [True]
    assert c.verified == {"r1": True}
    assert c.p.total("ahead_bound_early") == 1 and c.p.total("ahead_bound") == 1
    assert c.p.total("requests_done") == 1 and c.p.total("requests_failed") == 0
    assert not worker._alias and not worker._rid  # the ahead id forgotten with the request


def test_params_before_the_push_started_make_a_d_first_prefill(
        cluster_factory: Callable[..., Cluster]) -> None:  # noqa: F811
    """The worker does not hold the request yet (its push starts at a later chunk): it binds
    nothing; the scheduler, told by the worker's metadata, pushes it D first from there."""
    c = cluster_factory(p_extra={"push_mode": "last_chunk"})
    c.p.worker_meta = True
    c.relay_enabled = False
    toks = list(range(4000, 4150))
    c.prompts["r1"] = toks
    c.p.sched.add_request(make_request("p-r1", 150, tokens=toks, params=sign_ahead_params(
        None, URL, "t1", "g" * 32, compute=True)))
    c.p.step()  # chunk 1 computed; last_chunk: nothing pushed yet
    c.add("r1", toks, tid="t1")
    c.run_until(lambda: bool(FakePoster.instances and FakePoster.instances[0].posts))
    (_rid, tid, _url, msg) = FakePoster.instances[0].posts[0]
    f = HeldFetcher.last
    assert f is not None
    f.answer("p-r1", ("go", as_proxy(msg["kv_transfer_params"], tid)))
    c.run_until(lambda: len(c.d.finished) == 1 and c.idle())
    assert c.verified == {"r1": True}
    assert c.p.total("ahead_bound_early") == 0 and c.p.total("ahead_bound") == 1


@pytest.mark.parametrize("answer", ["another prompt", "fallback"])
def test_params_that_do_not_fit_or_do_not_come_bind_nothing_and_free_the_blocks(
        cluster_factory: Callable[..., Cluster], answer: str) -> None:  # noqa: F811
    c, _toks, (_go, params) = _computing_cluster(cluster_factory, 150)
    f = HeldFetcher.last
    assert f is not None
    if answer == "another prompt":
        params = {**params, "lw_prompt_digest": "0" * 64}  # D allocated for another prompt
        f.answer("p-r1", ("go", params))
    else:
        f.answer("p-r1", ("fallback", "no decode engine's call within 2 s"))
    worker = c.p.worker._worker
    assert worker is not None and not worker._alias
    for _ in range(20):
        c.p.step()
    assert c.p.total("ahead_bound") == 0 and c.p.total("ahead_bound_early") == 0
    assert free_blocks(c.p.sched) == BASELINE and not worker._rid


def test_params_after_p_dropped_the_request_are_reported_refused(
        cluster_factory: Callable[..., Cluster]) -> None:  # noqa: F811
    """P dropped the request at its ahead deadline (its worker stalled) before D's params came:
    the worker binds nothing and tells the proxy the bind was refused, with the transfer's
    grant, so that the proxy starts it D first (D was claimed by no one)."""
    c = cluster_factory(p_extra={**PROGRESSIVE, "experimental": {"ahead_wait_s": 0.2}})
    c.p.worker_meta = True
    c.relay_enabled = False
    toks = list(range(5000, 5150))
    c.p.sched.add_request(make_request("p-r1", 150, tokens=toks, params=sign_ahead_params(
        None, URL, "t1", "g" * 32, compute=True)))
    c.p.step()  # chunk 1 computed under the proxy's id, ahead
    worker = c.p.worker._worker
    assert worker is not None
    for _ in range(500):  # its ahead deadline passes: the core drops it, the blocks come back
        if not worker._rid and not c.p.sched.requests:
            break
        c.p.step()
        time.sleep(0.002)
    assert not worker._rid and free_blocks(c.p.sched) == BASELINE
    f = HeldFetcher.last
    assert f is not None
    c.prompts["r1"] = toks
    c.add("r1", toks, tid="t1")
    c.run_until(lambda: bool(FakePoster.instances and FakePoster.instances[0].posts))
    (_rid, tid, _url, msg) = FakePoster.instances[0].posts[0]
    f.answer("p-r1", ("go", as_proxy(msg["kv_transfer_params"], tid)))
    for _ in range(500):  # P's core answers whether it refuses the bind on its loop thread
        if "refused:t1" in f.bodies:
            break
        time.sleep(0.002)
    body = f.bodies.get("refused:t1")
    assert body is not None, f.bodies
    assert (body["transfer_id"], body["grant"]) == ("t1", "g" * 32)
    assert "dropped" in body["refused"], body
    assert c.p.total("ahead_bound_early") == 0 and not worker._alias
    assert not worker._fetches  # reported once, then forgotten
