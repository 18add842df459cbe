"""P's connector in the REAL vLLM ``Scheduler`` with a request admitted ahead of D's params
(the proxy's admit-ahead, lw.contract.ahead): it is not scheduled, and holds no blocks, until
the fetched params are the proxy's for this prompt; anything else leaves it for the proxy to
cancel. The fetch thread is replaced by a fake the test answers."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

import lw.vllm_adapter.ahead_admission as ahead_mod  # noqa: E402
from lw.contract.ahead import sign_ahead_params  # noqa: E402
from lw.contract.params import prompt_digest, sign_params  # noqa: E402
from lw.transport.sidechannel import parse_cluster_key  # noqa: E402
from lw.vllm_adapter.config import LwConfig  # noqa: E402
from lw.vllm_adapter.connector_meta import LwWorkerMeta  # noqa: E402
from tests.vllm_adapter.test_connector_scheduler import (  # noqa: E402
    BASELINE,
    Driver,
    decoder_params,
    free_blocks,
    make_request,
    make_scheduler,
    model_dir,
)

__all__ = ["model_dir"]  # the module-scoped fixture, shared

URL = "http://127.0.0.1:9/v1/ahead"


class FakeFetcher:
    """Records fetches; the test sets the answers."""

    last: FakeFetcher | None = None

    def __init__(self, cfg: LwConfig) -> None:
        self.fetches: list[tuple[str, str, dict[str, Any]]] = []
        self.answers: dict[str, tuple[str, Any]] = {}
        self.forgotten: list[str] = []
        FakeFetcher.last = self

    def fetch(self, rid: str, url: str, body: dict[str, Any]) -> None:
        self.fetches.append((rid, url, body))

    def take(self, rid: str) -> tuple[str, Any] | None:
        return self.answers.pop(rid, None)

    def forget(self, rid: str) -> None:
        self.forgotten.append(rid)

    def close(self) -> None:
        pass


@pytest.fixture(autouse=True)
def fake_fetcher(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(ahead_mod, "AheadFetcher", FakeFetcher)
    FakeFetcher.last = None
    yield


def ahead(tid: str = "t1") -> dict[str, Any]:
    return sign_ahead_params(None, URL, tid, "g" * 32)


def test_an_ahead_request_waits_without_blocks_until_d_params_come(model_dir: str) -> None:
    s = make_scheduler(model_dir, "kv_producer", extra={"push_mode": "last_chunk"})
    d = Driver(s)
    before = sys.getswitchinterval()
    s.add_request(make_request("r1", 40, params=ahead()))
    f = FakeFetcher.last
    assert f is not None
    ((rid, url, body),) = f.fetches
    assert (rid, url, body["transfer_id"]) == ("r1", URL, "t1")
    assert body["prompt_digest"] == prompt_digest(list(range(10, 50)))
    for _ in range(3):
        so = d.step()
        assert not so.num_scheduled_tokens and free_blocks(s) == BASELINE
        # threads switch often while it waits: the fetch thread must not wait for the GIL
        assert sys.getswitchinterval() == pytest.approx(ahead_mod.AHEAD_SWITCH_S)
    f.answers["r1"] = ("go", decoder_params(tid="t1@r1", n=40))
    so = d.step()
    assert sys.getswitchinterval() == before != ahead_mod.AHEAD_SWITCH_S
    assert so.num_scheduled_tokens == {"r1": 40}
    (spec,) = d.meta.sends
    assert spec.transfer_id == "t1@r1" and spec.remote_blocks == (40, 41, 42)
    assert d.finished["r1"] is not None
    d.step(KVConnectorOutput(finished_sending={"r1"}))
    assert free_blocks(s) == BASELINE


@pytest.mark.parametrize("answer", [
    ("fallback", "P tokenized another prompt than D"),
    ("error", "POST: connection refused"),
    ("go", "not params"),
    ("go", "another prompt"),
    ("go", "another transfer"),
])
def test_an_ahead_request_without_its_params_waits_for_the_cancel(
        model_dir: str, answer: tuple[str, Any]) -> None:
    s = make_scheduler(model_dir, "kv_producer")
    d = Driver(s)
    s.add_request(make_request("r1", 40, params=ahead()))
    f = FakeFetcher.last
    assert f is not None
    status, val = answer
    if val == "another prompt":  # D allocated for other tokens: its blocks are not ours
        val = decoder_params(tid="t1@r1", n=40, start=11)
    elif val == "another transfer":
        val = decoder_params(tid="t2@r1", n=40)
    f.answers["r1"] = (status, val)
    for _ in range(3):
        so = d.step()
        assert not so.num_scheduled_tokens and free_blocks(s) == BASELINE
    s.finish_requests("r1", RequestStatus.FINISHED_ABORTED)  # the proxy closed the request
    d.step()
    assert f.forgotten == ["r1"] and free_blocks(s) == BASELINE
    assert sys.getswitchinterval() != ahead_mod.AHEAD_SWITCH_S  # restored
    assert not d.meta.sends


def test_an_ahead_request_never_cancelled_is_computed_plain_after_the_hold(
        model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ahead_mod, "AHEAD_HOLD_S", 0.0)
    s = make_scheduler(model_dir, "kv_producer")
    d = Driver(s)
    s.add_request(make_request("r1", 40, params=ahead()))
    assert FakeFetcher.last is not None
    FakeFetcher.last.answers["r1"] = ("fallback", "no decode engine's call within 2 s")
    assert not d.step().num_scheduled_tokens  # gives up
    so = d.step()  # past the hold: a plain request, nothing pushed
    assert so.num_scheduled_tokens == {"r1": 40} and not d.meta.sends
    assert d.finished["r1"] is not None and free_blocks(s) == BASELINE


@pytest.mark.parametrize("bad", ["url", "signature", "role"])
def test_ahead_params_that_are_not_the_proxy_s_are_refused(model_dir: str, bad: str) -> None:
    text = "ahead-test-cluster-key-0123456789"
    key = parse_cluster_key(text)
    s = make_scheduler(model_dir, "kv_producer", extra={"cluster_key": text})
    d = Driver(s)
    params = sign_ahead_params(key, URL, "t1", "g" * 32)
    if bad == "url":
        params = sign_ahead_params(key, "file:///etc/passwd", "t1", "g" * 32)
    elif bad == "signature":
        params = sign_ahead_params(b"another cluster's key 0123456789", URL, "t1", "g" * 32)
    else:  # a D-first prefill's signature is not an ahead one
        params = sign_params(key, "prefill", {k: v for k, v in params.items()
                                              if k not in ("lw_sig", "lw_contract")})
    s.add_request(make_request("r1", 40, params=params))
    assert FakeFetcher.last is None or not FakeFetcher.last.fetches
    so = d.step()  # computed as a plain request: nothing fetched, nothing pushed
    assert so.num_scheduled_tokens == {"r1": 40} and not d.meta.sends
    assert any(st.get("refused_params") for st in d.stats)


# --------------------------------------------------------------------------- compute-ahead
def computing(tid: str = "t1") -> dict[str, Any]:
    return sign_ahead_params(None, URL, tid, "g" * 32, compute=True)


def answered(rid: str, status: str, val: Any) -> KVConnectorOutput:
    """A step whose worker's fetch of ``rid``'s params answered (compute-ahead: P's worker
    fetches them and binds as they come; the scheduler hears it in the worker's metadata)."""
    return KVConnectorOutput(kv_connector_worker_meta=LwWorkerMeta(
        ahead_answers=[(rid, status, val)]))


def test_a_request_computed_ahead_is_scheduled_at_once_and_bound_later(model_dir: str) -> None:
    """compute-ahead: scheduled in its first step, added to the workers' core ahead (no
    decoder), its blocks held after it finished while the engine keeps stepping; the fetched
    params come as a bind (D's id, blocks and prefix hit), then the push ends as usual."""
    s = make_scheduler(model_dir, "kv_producer", extra={"push_mode": "last_chunk"})
    d = Driver(s)
    before = sys.getswitchinterval()
    s.add_request(make_request("r1", 40, params=computing()))
    assert FakeFetcher.last is None  # not fetched here: by the worker
    so = d.step()
    assert so.num_scheduled_tokens == {"r1": 40}
    assert sys.getswitchinterval() == before  # the engine is busy computing: nothing to spin
    (fetch,) = d.meta.fetches  # the worker asks for the params, and binds as they come
    assert (fetch.req_id, fetch.ahead_id, fetch.url, fetch.grant) == ("r1", "t1", URL, "g" * 32)
    assert fetch.prompt == prompt_digest(list(range(10, 50))) and fetch.num_prompt_tokens == 40
    (spec,) = d.meta.sends
    assert spec.ahead and spec.first and spec.final and spec.transfer_id == "t1"
    assert spec.prompt == prompt_digest(list(range(10, 50))) and len(spec.local_blocks) == 3
    assert d.finished["r1"] is not None  # its one token: P's POST ends before the bind
    assert free_blocks(s) < BASELINE  # ... and its blocks stay held for the bind
    assert s.connector.has_pending_push_work()
    d.step(answered("r1", "go", decoder_params(tid="t1@r1", n=40, first=1)))
    assert not d.meta.binds
    d.step()
    (b,) = d.meta.binds  # the step carries it (a worker that bound it already ignores it)
    assert (b.ahead_id, b.transfer_id, b.req_id) == ("t1", "t1@r1", "r1")
    assert b.remote_blocks == (40, 41) and b.first_block == 1
    d.step(KVConnectorOutput(finished_sending={"r1"}))
    assert free_blocks(s) == BASELINE and not s.connector.has_pending_push_work()
    assert any(st.get("ahead_computed") for st in d.stats)


def test_params_that_come_before_its_push_started_make_a_d_first_prefill(
        model_dir: str) -> None:
    """last_chunk: the first of two chunks pushes nothing; params that came meanwhile make the
    push that starts with the last chunk an ordinary D-first one (no bind)."""
    s = make_scheduler(model_dir, "kv_producer", extra={"push_mode": "last_chunk"})
    d = Driver(s)
    s.add_request(make_request("r1", 100, params=computing()))
    d.step(answered("r1", "go", decoder_params(tid="t1@r1", n=100)))
    assert d.meta.fetches and not d.meta.sends
    d.step()
    (spec,) = d.meta.sends
    assert not spec.ahead and spec.transfer_id == "t1@r1"
    assert spec.remote_blocks == tuple(range(40, 47))
    assert not d.meta.binds and not d.meta.aborts


def test_a_prompt_longer_than_the_cap_is_admitted_ahead_not_computed(model_dir: str) -> None:
    """ahead_compute_max_tokens (here one step's budget, 64 tokens): a longer prompt waits for
    D's params as an admit-ahead one, fetched by the scheduler side (the engine idles
    meanwhile: threads switch often, as for any request admitted ahead)."""
    s = make_scheduler(model_dir, "kv_producer", extra={
        "push_mode": "last_chunk", "experimental": {"ahead_compute_max_tokens": 64}})
    d = Driver(s)
    s.add_request(make_request("r1", 100, params=computing()))
    assert FakeFetcher.last is not None and len(FakeFetcher.last.fetches) == 1
    so = d.step()
    assert not so.num_scheduled_tokens and not d.meta.fetches
    assert sys.getswitchinterval() == pytest.approx(ahead_mod.AHEAD_SWITCH_S)
    assert any(st.get("ahead_admitted") for st in d.stats)
    s.finish_requests("r1", RequestStatus.FINISHED_ABORTED)  # (restores the interval)
    d.step()
    assert sys.getswitchinterval() != ahead_mod.AHEAD_SWITCH_S


@pytest.mark.parametrize("answer", [
    ("fallback", "no decode engine's call within 2 s"),
    ("go", "another prompt"),
])
def test_a_request_computed_ahead_whose_params_do_not_come_is_aborted(
        model_dir: str, answer: tuple[str, Any]) -> None:
    s = make_scheduler(model_dir, "kv_producer", extra={"push_mode": "last_chunk"})
    d = Driver(s)
    s.add_request(make_request("r1", 40, params=computing()))
    d.step()
    status, val = answer
    if val == "another prompt":
        val = decoder_params(tid="t1@r1", n=40, start=11)
    d.step(answered("r1", status, val))
    d.step()
    assert not d.meta.binds
    ((tid, rid, why),) = d.meta.aborts  # the core drops what it computed, frees the blocks
    assert (tid, rid) == ("t1", "r1") and "not bound" in why
    d.step(KVConnectorOutput(finished_sending={"r1"}))
    assert free_blocks(s) == BASELINE


def test_a_request_computed_ahead_starts_its_push_by_the_slowest_link_known(
        model_dir: str) -> None:
    """push_mode auto, D unknown: by the slowest link measured to any decode host (none
    measured: at the first chunk; a fast one: later, as a D-first push to it would)."""
    s = make_scheduler(model_dir, "kv_producer")
    side = s.connector._sched
    s.add_request(make_request("r1", 40, params=computing()))
    tr = side._p["r1"]
    req = s.requests["r1"]
    assert side._starts_now(tr, req, 16)  # nothing measured: at once
    side._compute_s_per_token = 0.001
    side._wire_s_per_block = {"d1": 1e-6, "d2": 2e-6}
    assert not side._starts_now(tr, req, 16)  # fast links: 24 tokens of compute cover it
    side._wire_s_per_block["d3"] = 1.0
    assert side._starts_now(tr, req, 16)  # one slow decode host: it might be that one
