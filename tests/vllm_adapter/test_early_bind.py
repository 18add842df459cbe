"""P's worker binds a request computed ahead mid-step, from the scheduler's fetch thread
(lw.vllm_adapter.early_bind), through vLLM's real Scheduler and lw's real worker connectors in
one process (the in-process data plane): D's blocks then hold exactly what P computed, every
block comes back, and the step's metadata copy of the bind changes nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

import lw.vllm_adapter.ahead_admission as ahead_mod  # noqa: E402
from lw.contract.ahead import sign_ahead_params  # noqa: E402
from lw.vllm_adapter import early_bind  # noqa: E402
from lw.vllm_adapter.config import LwConfig  # noqa: E402
from lw.vllm_adapter.connector_meta import BindSpec  # noqa: E402

from .test_connector_scheduler import (  # noqa: E402
    LAYERS,
    PROGRESSIVE,
    Cluster,
    FakePoster,
    as_proxy,
    cluster_factory,  # noqa: F401  (fixture)
    fake_poster,  # noqa: F401  (autouse fixture: no metaserver thread)
    make_request,
    model_dir,  # noqa: F401  (fixture)
)

URL = "http://127.0.0.1:9/v1/ahead"


class HeldFetcher:
    """The fetch thread, played by the test: it answers when the test says, ``then`` first
    (as the real fetcher does on its thread), the answer kept for the scheduler's step."""

    last: HeldFetcher | None = None

    def __init__(self, cfg: LwConfig) -> None:
        self.then: dict[str, Callable[[tuple[str, Any]], None] | None] = {}
        self.answers: dict[str, tuple[str, Any]] = {}
        HeldFetcher.last = self

    def fetch(self, rid: str, url: str, body: dict[str, Any],
              then: Callable[[tuple[str, Any]], None] | None = None) -> None:
        self.then[rid] = then

    def answer(self, rid: str, answer: tuple[str, Any]) -> None:
        self.answers[rid] = answer
        then = self.then[rid]
        assert then is not None, "a request computed ahead is bound as its params come"
        then(answer)

    def take(self, rid: str) -> tuple[str, Any] | None:
        return self.answers.pop(rid, None)

    def forget(self, rid: str) -> None:
        self.answers.pop(rid, None)

    def close(self) -> None:
        pass


@pytest.fixture(autouse=True)
def held_fetcher(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(ahead_mod, "AheadFetcher", HeldFetcher)
    HeldFetcher.last = None
    yield


def _computing_cluster(make: Callable[..., Cluster], n: int) -> tuple[Cluster, list[int], Any]:
    """P computes ``n`` tokens ahead (its first chunk done), D allocated and posted its call."""
    c = make(p_extra=PROGRESSIVE)
    c.relay_enabled = False  # the proxy binds P's ahead request instead of a D-first prefill
    toks = list(range(3000, 3000 + n))
    c.prompts["r1"] = toks
    c.p.sched.add_request(make_request("p-r1", n, tokens=toks, params=sign_ahead_params(
        None, URL, "t1", "g" * 32, compute=True)))
    c.p.step()  # chunk 1 computed, under the proxy's transfer id, nothing sent
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


def test_params_before_this_worker_holds_the_request_wait_for_the_step(
        cluster_factory: Callable[..., Cluster]) -> None:  # noqa: F811
    """A worker that does not hold the request (not pushed yet, another engine's) is not
    bound early: the step's metadata binds it."""
    c, _toks, answer = _computing_cluster(cluster_factory, 150)
    worker = c.p.worker._worker
    assert worker is not None
    spec = BindSpec("t-other", "t-other@r9", "p-r9", "127.0.0.1", 1, (1,), 0)
    assert not early_bind.deliver(early_bind.engine_key(worker.cfg.engine_id, 0), spec)
    assert HeldFetcher.last is not None
    HeldFetcher.last.answers["p-r1"] = answer  # the step finds it; nothing binds early
    c.run_until(lambda: len(c.d.finished) == 1 and c.idle())
    assert c.verified == {"r1": True}
    assert c.p.total("ahead_bound_early") == 0 and c.p.total("ahead_bound") == 1
