"""Prefill failover in lw's connector, inside the REAL vLLM ``Scheduler`` (no engine): the config
keys, D's re-prefill call when its core reports ``Reprefill`` (and only then), the proxy's
routes reaching the core, P taking the claim epoch, and a P that dies holding an unclaimed
prefill replaced by another P through real schedulers and worker loops (in-process data plane).
A three-engine run on real vLLM servers is not part of this file (see the issue's notes)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

from lw.vllm_adapter.serve import install_version_shim  # noqa: E402

install_version_shim()

from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from lw.contract.worker_addrs import PREFILL_ENGINE_KEY  # noqa: E402
from lw.vllm_adapter.config import ConfigError  # noqa: E402
from lw.vllm_adapter.connector_meta import LwWorkerMeta, Reprefill, Route  # noqa: E402
from lw.vllm_adapter.metaserver_client import route_of  # noqa: E402
from tests.vllm_adapter.test_connector_scheduler import (  # noqa: E402
    BASELINE,
    BS,
    LAYERS,
    Driver,
    Engine,
    FakePoster,
    _build,
    _value,
    as_proxy,
    decoder_params,
    fake_poster,
    free_blocks,
    make_request,
    make_scheduler,
    model_dir,
    remote_prefill_params,
)

__all__ = ["fake_poster", "model_dir"]  # fixtures, used by name

RETRY = {"retry_prefill": 2}


# ------------------------------------------------------------------------------------ config
@pytest.mark.parametrize(("over", "needle"), [
    ({"extra": {"retry_prefill": -1}}, "retry_prefill must be in 0..64"),
    ({"extra": {"retry_prefill": 65}}, "retry_prefill must be in 0..64"),
    ({"extra": {"retry_prefill": "two"}}, "retry_prefill must be a int"),
    ({"extra": {"retry_prefill_avoid": "all"}}, "retry_prefill_avoid must be 'lost' or 'none', "
                                                "got 'all'"),
    ({"tp_size": 2, "extra": {"retry_prefill": 1}}, "needs the decode engine's "
                                                    "tensor_parallel_size 1, got 2"),
])
def test_config_refuses_bad_failover_keys(over: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        _build(**over)
    assert needle in str(exc.value)


def test_config_passes_the_failover_keys_to_the_core() -> None:
    cfg = _build(extra={"host": "127.0.0.1", "retry_prefill": 3, "retry_prefill_avoid": "none"})
    dec = cfg.decode_config()
    assert (dec.retry_prefill, dec.retry_prefill_avoid) == (3, "none")
    assert _build().decode_config().retry_prefill == 0  # the default: no failover
    # P ignores D's keys, whatever its TP
    assert _build(role="kv_producer", tp_size=2, extra={"retry_prefill": 1}).retry_prefill == 1


@pytest.mark.parametrize("role", ["kv_consumer", "kv_producer"])
def test_fresh_blocks_are_refused_at_start(role: str) -> None:
    """vLLM's scheduler owns the blocks, so a worker can never grant fresh ones: the setting is
    fixed false, and the key given at all fails at start, saying why and what D does instead."""
    import inspect

    from lw.vllm_adapter import worker_side, worker_start

    for value in (True, False):  # no longer a key: fixed false, and said so
        with pytest.raises(ConfigError) as exc:
            _build(role=role, extra={"host": "127.0.0.1", "retry_prefill": 1,
                                     "retry_fresh_blocks": value})
        why = str(exc.value)
        assert "retry_fresh_blocks is no longer a setting: fixed" in why
        assert "vLLM's scheduler owns block allocation" in why
        assert "D fences instead" in why and "Prefill failover: claim epochs" in why
    on = _build(extra={"host": "127.0.0.1", "retry_prefill": 1})
    assert on.decode_config().retry_fresh_blocks is False
    assert _build().decode_config().retry_fresh_blocks is False
    for mod in (worker_side, worker_start):  # no allocator to hand the loop
        assert "fresh_blocks=" not in inspect.getsource(mod)


# ------------------------------------------------------------------------------------ decode
def _waiting(s: Any, d: Driver, extra: dict[str, Any] | None = None) -> None:
    s.add_request(make_request("r1", 100, params=remote_prefill_params(), max_tokens=2))
    d.step()
    assert s.requests["r1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS


def _reprefill(epoch: int = 1, avoid: tuple[str, ...] = ("p-dead",), rid: str = "r1"
               ) -> KVConnectorOutput:
    rp = Reprefill(f"t1@{rid}", rid, epoch, avoid, "prefill engine p-dead lost: silent")
    return KVConnectorOutput(kv_connector_worker_meta=LwWorkerMeta(reprefills=[rp]))


def test_d_reprefill_is_one_more_metaserver_call_with_epoch_and_avoid(
        model_dir: str, fake_poster: type[FakePoster]) -> None:
    s = make_scheduler(model_dir, "kv_consumer", extra=RETRY)
    d = Driver(s)
    _waiting(s, d)
    (poster,) = fake_poster.instances
    ((_, _, url, first),) = poster.posts
    assert first["retry_prefill"] == 2  # the proxy leaves a lost P's failure to D
    d.step(_reprefill())
    d.step()
    assert len(poster.posts) == 2
    rid, tid, url2, again = poster.posts[1]
    assert (rid, tid, url2) == ("r1", "t1@r1", url)
    assert again == {"transfer_id": "t1", "sub_transfer_id": "t1@r1", "grant": "g" * 32,
                     "epoch": 1, "avoid": ["p-dead"],
                     "reason": "prefill engine p-dead lost: silent"}
    # D keeps the request and its blocks: nothing aborted, nothing registered twice
    assert s.requests["r1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert free_blocks(s) == BASELINE - 7
    assert all(not m.aborts for m in d.metas) and sum(len(m.recvs) for m in d.metas) == 1
    assert sum(st.get("prefill_retries", 0) for st in d.stats) == 1
    d.step(KVConnectorOutput(finished_recving={"r1"}))  # the retry's KV arrived
    while "r1" not in d.finished:
        d.step()
    assert str(d.finished["r1"]) == "length" and free_blocks(s) == BASELINE


def test_d_reprefill_of_an_ended_request_posts_nothing(
        model_dir: str, fake_poster: type[FakePoster]) -> None:
    s = make_scheduler(model_dir, "kv_consumer", extra=RETRY)
    d = Driver(s)
    _waiting(s, d)
    s.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    d.step(_reprefill())  # the core's report crossed the abort
    d.step(_reprefill(rid="other"))  # a request this scheduler never had
    d.step()
    assert len(fake_poster.instances[0].posts) == 1


def test_d_failed_reprefill_call_fails_the_request_at_once(
        model_dir: str, fake_poster: type[FakePoster]) -> None:
    s = make_scheduler(model_dir, "kv_consumer", extra=RETRY)
    d = Driver(s)
    _waiting(s, d)
    d.step(_reprefill())
    d.step()
    poster = fake_poster.instances[0]
    poster.failures.append(("r1", "t1@r1", "metaserver: POST answered 503: no prefill server"))
    d.step()
    assert d.meta.aborts == [("t1@r1", "r1", "metaserver: POST answered 503: no prefill server")]


def test_d_routes_from_the_proxy_reach_the_workers(
        model_dir: str, fake_poster: type[FakePoster]) -> None:
    s = make_scheduler(model_dir, "kv_consumer", extra=RETRY)
    d = Driver(s)
    _waiting(s, d)
    poster = fake_poster.instances[0]
    route = Route("t1@r1", "r1", "p0", "tcp://127.0.0.1:7000", 0)
    poster.routes += [route, Route("t1@gone", "gone", "p0", "tcp://127.0.0.1:7000", 0)]
    d.step()
    assert d.meta.routes == [route]  # a route of a request D does not hold is dropped


def test_d_without_a_budget_keeps_the_old_behaviour(
        model_dir: str, fake_poster: type[FakePoster]) -> None:
    s = make_scheduler(model_dir, "kv_consumer")
    d = Driver(s)
    _waiting(s, d)
    poster = fake_poster.instances[0]
    assert "retry_prefill" not in poster.posts[0][3]
    poster.routes.append(Route("t1@r1", "r1", "p0", "tcp://127.0.0.1:7000", 0))
    d.step(_reprefill())  # not emitted by a core without a budget; ignored if it were
    d.step()
    assert len(poster.posts) == 1 and all(not m.routes for m in d.metas)
    assert sum(st.get("prefill_retries", 0) for st in d.stats) == 0


def test_route_of_reads_the_proxy_answer() -> None:
    body = {"epoch": 1}
    ok = {"status": "ok", "epoch": 1, "prefill_engine_id": "p0",
          "prefill_worker": "tcp://h:7000"}
    assert route_of("r", "t", body, ok) == Route("t", "r", "p0", "tcp://h:7000", 1)
    assert route_of("r", "t", body, {**ok, "epoch": 0}) is None  # another attempt's answer
    assert route_of("r", "t", {}, {"status": "ok", "epoch": 0}) is None  # P not known yet
    assert route_of("r", "t", body, {**ok, "prefill_worker": "h:7000"}) is None
    assert route_of("r", "t", body, None) is None


# ------------------------------------------------------------------------------------ prefill
def test_p_takes_the_claim_epoch_and_names_its_engine(model_dir: str) -> None:
    s = make_scheduler(model_dir, "kv_producer", extra={"push_mode": "last_chunk"})
    d = Driver(s)
    s.add_request(make_request("p1", 100, params=decoder_params(lw_epoch=2)))
    s.add_request(make_request("p2", 100, start=500, params=decoder_params(tid="t2", start=500)))
    s.add_request(make_request("bad", 100, start=900,
                               params=decoder_params(tid="t3", lw_epoch=-1)))
    while len(d.finished) < 3:
        d.step()
    epochs = {spec.req_id: spec.epoch for m in d.metas for spec in m.sends}
    assert epochs == {"p1": 2, "p2": 0}  # "bad" is never pushed
    assert d.params["p1"][PREFILL_ENGINE_KEY] == "kv_producer"


# ------------------------------------------------------------------------------- real cores
# Two P engines and one D, real schedulers and worker loops; the test plays the proxy. P "a"
# takes the prefill and dies before it claims it (an orphan): D's core, told where the prefill
# went, finds P "a" silent by heartbeats and asks again; P "b" serves the retry.
# D's prefill deadline is far (30 s): the orphan is found by heartbeats (0.4 s), and the
# retry need not finish within a few seconds on a slow machine
FAST = {"heartbeat_s": 0.1, "prefill_timeout_s": 30.0}


class TwoPrefills:
    def __init__(self, model_dir: str, d_extra: dict[str, Any]) -> None:
        self.a = Engine(model_dir, "kv_producer", engine_id="p-a")
        self.b = Engine(model_dir, "kv_producer", engine_id="p-b")
        self.d = Engine(model_dir, "kv_consumer", {**FAST, **d_extra}, worker_meta=True)
        self.a_alive = True
        self.relayed = 0
        self.sent_to: list[tuple[str, int, list[str]]] = []
        self.engines: list[Engine] = [self.a, self.b, self.d]

    def relay(self) -> None:
        """The proxy: the first attempt to P a (named in the answer), a retry to P b."""
        posts = FakePoster.instances[0].posts
        while self.relayed < len(posts):
            rid, tid, _url, msg = posts[self.relayed]
            self.relayed += 1
            epoch = msg.get("epoch", 0)
            if epoch == 0:
                self.first = msg
                p, name = self.a, "p-a"
            else:
                p, name = self.b, "p-b"
            self.sent_to.append((name, epoch, list(msg.get("avoid", []))))
            body = as_proxy(self.first["kv_transfer_params"], tid, epoch)
            toks = self.first["prompt_token_ids"]
            p.sched.add_request(make_request(f"{name}-{rid}-{epoch}", len(toks),
                                             tokens=list(toks), params=body))
            # the proxy's answer names the P (D's scheduler drops it without a budget)
            FakePoster.instances[0].routes.append(Route(tid, rid, name, p.loop.addr, epoch))

    def kill_a(self) -> None:
        self.a_alive = False
        self.a.worker.shutdown()  # its side channel closes: no claim, no heartbeat answer

    def run_until(self, cond: Callable[[], bool], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "timed out"
            self.relay()
            if self.a_alive:
                self.a.step()
            self.b.step()
            self.d.step()
            time.sleep(0.002)

    def d_kv_is(self, rid: str, toks: list[int]) -> bool:
        (blocks,) = self.d.sched.kv_cache_manager.get_block_ids(rid)
        return all(bool((self.d.kv[name][b] == _value(toks[i * BS:(i + 1) * BS], layer)).all())
                   for i, b in enumerate(blocks[: -(-len(toks) // BS)])
                   for layer, name in enumerate(LAYERS))

    def close(self) -> None:
        for e in self.engines:
            if e is not self.a or self.a_alive:
                e.worker.shutdown()
            e.sched.shutdown()


@pytest.fixture
def two_prefills(model_dir: str) -> Iterator[Callable[..., TwoPrefills]]:
    made: list[TwoPrefills] = []

    def make(**d_extra: Any) -> TwoPrefills:
        made.append(TwoPrefills(model_dir, d_extra))
        return made[-1]

    yield make
    for c in made:
        c.close()


def test_cluster_orphan_of_a_dead_prefill_is_prefilled_again_on_another(
        two_prefills: Callable[..., TwoPrefills]) -> None:
    c = two_prefills(retry_prefill=1)
    toks = list(range(7000, 7100))
    kv_ok: dict[str, bool] = {}
    c.d.on_recv = lambda e, rid: kv_ok.setdefault(rid, c.d_kv_is(rid, toks))
    c.d.sched.add_request(make_request("r1", len(toks), tokens=toks, max_tokens=2,
                                       params=remote_prefill_params("t1")))
    c.d.step()
    c.relay()  # P a has the request in its queue ...
    c.kill_a()  # ... and dies before it ever steps
    c.run_until(lambda: "r1" in c.d.finished and free_blocks(c.d.sched) == BASELINE)
    assert c.sent_to == [("p-a", 0, []), ("p-b", 1, ["p-a"])]
    assert c.d.finished["r1"] == "length" and kv_ok == {"r1": True}
    assert c.d.total("prefill_retries") == 1 and c.d.total("deadlines_fired") == 0


def test_cluster_without_a_budget_the_orphan_fails_on_the_deadline(
        two_prefills: Callable[..., TwoPrefills]) -> None:
    c = two_prefills(prefill_timeout_s=0.5, request_timeout_s=1)
    toks = list(range(8000, 8050))
    c.d.sched.add_request(make_request("r1", len(toks), tokens=toks, max_tokens=2,
                                       params=remote_prefill_params("t1")))
    c.d.step()
    c.relay()
    c.kill_a()
    c.run_until(lambda: "r1" in c.d.finished and free_blocks(c.d.sched) == BASELINE)
    assert c.sent_to == [("p-a", 0, [])]  # never asked again
    assert c.d.finished["r1"] == "error" and c.d.total("deadlines_fired") == 1
