"""The workers' half of the first token, through lw's real worker connectors in one process (real
WorkerLoops over loopback ZMQ, the in-process data plane; the test plays both schedulers with
hand-made metadata): P's ``FirstTokenSpec`` reaches D's scheduler as a ``FirstTokenIn`` under D's
vLLM request id, also once the KV landed and both sides released the request, and the timelines
say where it went."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

import lw.vllm_adapter.connector as conn_mod  # noqa: E402
from lw.lab.vllm_demo import free_port_range  # noqa: E402
from lw.vllm_adapter.connector_meta import (  # noqa: E402
    FirstTokenIn,
    FirstTokenSpec,
    LwConnectorMetadata,
    RecvSpec,
    SendSpec,
)

from .test_connector_scheduler import (  # noqa: E402
    BS,
    LAYERS,
    NUM_BLOCKS,
    fake_poster,  # noqa: F401  (autouse fixture: no metaserver thread)
    kv_cache_config,
    make_vllm_config,
    model_dir,  # noqa: F401  (fixture)
)
from .test_push_waits_for_forward import AnyHost  # noqa: E402


class Worker:
    """One engine's worker connector with its KV tensors, driven step by step by the test."""

    def __init__(self, model: str, role: str, extra: dict[str, Any]) -> None:
        vc = make_vllm_config(model, role, extra={"data_plane": "inprocess", **extra})
        vc.kv_transfer_config.kv_port = free_port_range(2)
        self.conn = conn_mod.LwConnector(vc, KVConnectorRole.WORKER, kv_cache_config())
        self.kv = {n: torch.zeros(NUM_BLOCKS, 4, BS, 128, dtype=torch.bfloat16) for n in LAYERS}
        self.conn.register_kv_caches(self.kv)
        self.side = self.conn._worker
        assert self.side is not None

    def step(self, meta: LwConnectorMetadata, finished: frozenset[str] = frozenset(),
             forward: bool = False) -> tuple[Any, Any]:
        """One step: bind ``meta``, run the layer hooks if ``forward``, collect results."""
        c = self.conn
        c.bind_connector_metadata(meta)
        if forward:
            for name in LAYERS:
                c.save_kv_layer(name, self.kv[name], None)
        c.wait_for_save()
        res = c.get_transfer_results(set(finished))
        wm = c.build_connector_worker_meta()
        c.clear_connector_metadata()
        return res, wm

    def timeline(self, rid: str) -> list[tuple[str, str, str]]:
        loop = self.side.loop
        return loop.run(lambda lp: [(e[2], e[3], str(e[5])) for e in
                                    lp.endpoint.timeline.of(rid)]).result(5)

    def close(self) -> None:
        self.conn.shutdown()


@pytest.fixture
def workers(model_dir: str) -> Iterator[Callable[..., tuple[Worker, Worker]]]:  # noqa: F811
    made: list[Worker] = []

    def make(extra: dict[str, Any] | None = None) -> tuple[Worker, Worker]:
        p = Worker(model_dir, "kv_producer", extra or {})
        d = Worker(model_dir, "kv_consumer", extra or {})
        made.extend((p, d))
        return p, d

    yield make
    for w in made:
        w.close()


def _until(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _transfer(p: Worker, d: Worker) -> None:
    """D allocates "t1" for its request "d-r1"; P pushes it as "p-r1"; both release it."""
    d.step(LwConnectorMetadata(recvs=[RecvSpec("t1", "d-r1", (1, 2, 3))]))
    cfg = d.side.cfg
    p.step(LwConnectorMetadata(sends=[SendSpec("t1", "p-r1", cfg.host, cfg.port(0), (4, 5, 6),
                                               (1, 2, 3))]), forward=True)
    got: dict[str, set[str]] = {"sent": set(), "recv": set()}

    def both_done() -> bool:
        got["sent"] |= p.step(LwConnectorMetadata(), frozenset({"p-r1"}))[0].finished_sending \
            or set()
        got["recv"] |= d.step(LwConnectorMetadata())[0].finished_recving or set()
        return got == {"sent": {"p-r1"}, "recv": {"d-r1"}}

    _until(both_done)


def _first_tokens_at(d: Worker) -> list[FirstTokenIn]:
    """D's scheduler's first tokens, stepping D until some come."""
    seen: list[FirstTokenIn] = []

    def arrived() -> bool:
        wm = d.step(LwConnectorMetadata())[1]
        seen.extend(wm.first_tokens if wm is not None else ())
        return bool(seen)

    _until(arrived)
    return seen


def test_p_token_reaches_d_scheduler_after_the_kv_landed(
        workers: Callable[..., tuple[Worker, Worker]]) -> None:
    p, d = workers()
    _transfer(p, d)
    p.step(LwConnectorMetadata(first_tokens=[FirstTokenSpec("t1", "p-r1", 42, "spec-a")]))
    seen = _first_tokens_at(d)
    assert seen == [FirstTokenIn("t1", "d-r1", 42, "spec-a", 0)]
    assert ("first_token", "DONE", "token 42 of epoch 0 from P kv_producer") in d.timeline("t1")
    assert any(e[0] == "first_token" and e[2].startswith("token 42 to ")
               for e in p.timeline("t1"))
    # P's scheduler names it once: a repeat is refused by P's core, nothing more reaches D
    p.step(LwConnectorMetadata(first_tokens=[FirstTokenSpec("t1", "p-r1", 42, "spec-a")]))
    time.sleep(0.2)
    wm = d.step(LwConnectorMetadata())[1]
    assert wm is None or wm.first_tokens == []


def test_with_first_tokens_off_nothing_reaches_d(
        workers: Callable[..., tuple[Worker, Worker]]) -> None:
    p, d = workers({"first_token_from_p": False})
    _transfer(p, d)
    p.step(LwConnectorMetadata(first_tokens=[FirstTokenSpec("t1", "p-r1", 42, "spec-a")]))
    time.sleep(0.2)
    wm = d.step(LwConnectorMetadata())[1]
    assert wm is None or wm.first_tokens == []
    assert p.side.loop.stats()["core.first_tokens_refused"] == 1


class Params:
    """What spec_digest reads of a vLLM SamplingParams: greedy, nothing else."""

    temperature, top_p, top_k, min_p, seed = 0.0, 1.0, 0, 0.0, None
    presence_penalty = frequency_penalty = 0.0
    repetition_penalty = 1.0
    logit_bias = allowed_token_ids = bad_words_token_ids = None
    min_tokens = 0


def test_a_token_handed_over_as_sampled_goes_at_once_and_the_schedulers_copy_is_skipped(
        workers: Callable[..., tuple[Worker, Worker]]) -> None:
    """P's runner hands the step's sampled tokens over (lw_worker.hand_sampled_tokens): the
    prompt this step completed sends its token before the next step's metadata, under the spec
    digest of the request's SamplingParams; the scheduler's copy of it a step later sends
    nothing more, and a request this step did not complete sends nothing."""
    from lw.contract.sampling import spec_digest

    p, d = workers()
    d.step(LwConnectorMetadata(recvs=[RecvSpec("t1", "d-r1", (1, 2, 3))]))
    cfg = d.side.cfg
    c = p.conn
    c.bind_connector_metadata(LwConnectorMetadata(sends=[SendSpec(
        "t1", "p-r1", cfg.host, cfg.port(0), (4, 5, 6), (1, 2, 3))]))
    for name in LAYERS:
        c.save_kv_layer(name, p.kv[name], None)
    c.wait_for_save()
    c.tokens_sampled(["p-r1", "p-other"], [[42], [7]], lambda rid: Params())
    c.get_transfer_results(set())
    c.clear_connector_metadata()
    seen = _first_tokens_at(d)
    spec = spec_digest(Params())
    assert seen == [FirstTokenIn("t1", "d-r1", 42, spec, 0)]
    p.step(LwConnectorMetadata(first_tokens=[FirstTokenSpec("t1", "p-r1", 42, spec)]))
    time.sleep(0.2)
    wm = d.step(LwConnectorMetadata())[1]
    assert wm is None or wm.first_tokens == []
    stats = p.side.loop.stats()
    assert (stats["core.first_tokens_sent"], stats["core.first_tokens_refused"]) == (1, 0)
    # a step that completes no prompt hands nothing over
    c.bind_connector_metadata(LwConnectorMetadata())
    c.tokens_sampled(["p-r1"], [[43]], lambda rid: Params())
    c.clear_connector_metadata()
    assert p.side.loop.stats()["core.first_tokens_refused"] == 0


def _order(p: Worker) -> list[tuple[Any, ...]]:
    """What P's worker hands its loop, in order: ("call", method) and ("layer", i, t)."""
    loop, out = p.side.loop, []
    call, layer = loop.call, loop.layer_computed

    def calls(method: str, *a: Any, **kw: Any) -> Any:
        out.append(("call", method))
        return call(method, *a, **kw)

    def layers(i: int, tids: Any, t: float | None = None) -> None:
        out.append(("layer", i, time.monotonic() if t is None else t))
        layer(i, tids, t)

    loop.call, loop.layer_computed = calls, layers
    return out


def _push_sampled(p: Worker, d: Worker, rate: float, hand: bool = True,
                  sample_s: float | None = 0.001) -> tuple[list[tuple[Any, ...]], float]:
    """D allocates; P, whose runner has handed tokens over ``sample_s`` after a forward's last
    hook before and whose link to D is measured at ``rate`` bytes/s, computes the whole prompt
    in one step and (``hand``) hands its sampled token over after the forward. What P's worker
    handed its loop, and when the last layer's hook ran."""
    d.step(LwConnectorMetadata(recvs=[RecvSpec("t1", "d-r1", (1, 2, 3))]))
    cfg = d.side.cfg
    p.side._hands_tokens = True
    p.side._sample_s = sample_s
    p.side.loop.writes.link.goodput = AnyHost(rate)
    out = _order(p)
    c = p.conn
    c.bind_connector_metadata(LwConnectorMetadata(sends=[SendSpec(
        "t1", "p-r1", cfg.host, cfg.port(0), (4, 5, 6), (1, 2, 3))]))
    for name in LAYERS:
        c.save_kv_layer(name, p.kv[name], None)
    t_last = time.monotonic()
    c.wait_for_save()
    if hand:
        c.tokens_sampled(["p-r1"], [[42]], lambda rid: Params())
    c.get_transfer_results(set())
    c.clear_connector_metadata()
    return out, t_last


def _lands(p: Worker, d: Worker) -> None:
    """Both engines step until D's core has every DONE of "t1" (its whole KV landed)."""
    def landed() -> bool:
        p.step(LwConnectorMetadata())
        d.step(LwConnectorMetadata())
        return any(ev == "all_done" for ev, _state, _detail in d.timeline("t1"))

    _until(landed)


def test_on_a_slow_link_the_last_layer_waits_for_the_token_and_both_land(
        workers: Callable[..., tuple[Worker, Worker]]) -> None:
    """The last layer's bytes would still be on the wire when the token leaves: its report
    waits until the token is handed over, goes after it, and keeps the time it was computed;
    D gets the token and the whole KV."""
    p, d = workers()
    out, t_last = _push_sampled(p, d, rate=1e3)
    last = len(LAYERS) - 1
    kinds = [e[:2] for e in out]
    assert kinds.index(("call", "first_token")) < kinds.index(("layer", last))
    (t,) = [e[2] for e in out if e[:2] == ("layer", last)]
    assert t <= t_last
    assert [ft.token for ft in _first_tokens_at(d)] == [42]
    _lands(p, d)


@pytest.mark.parametrize("rate,sample_s", [(1e12, 0.001), (1e3, None)],
                         ids=["fast-link", "sampling-unmeasured"])
def test_the_last_layer_goes_at_its_hook_where_the_token_would_not_queue_behind_it(
        workers: Callable[..., tuple[Worker, Worker]], rate: float,
        sample_s: float | None) -> None:
    """Its bytes gone before the token leaves, or the sampling never timed yet (the step
    times it)."""
    p, d = workers()
    out, _ = _push_sampled(p, d, rate=rate, sample_s=sample_s)
    kinds = [e[:2] for e in out]
    assert kinds.index(("layer", len(LAYERS) - 1)) < kinds.index(("call", "first_token"))
    assert p.side._sample_s is not None and p.side._sample_s >= 0


def test_a_token_never_handed_over_releases_the_last_layer_at_the_next_step(
        workers: Callable[..., tuple[Worker, Worker]]) -> None:
    """The runner did not hand the step's tokens over (it never happens with lw's runner, which
    the hold requires): the held report goes with the next step's metadata, and the KV lands."""
    p, d = workers()
    out, _ = _push_sampled(p, d, rate=1e3, hand=False)
    last = len(LAYERS) - 1
    assert ("layer", last) not in [e[:2] for e in out]
    p.step(LwConnectorMetadata())
    assert ("layer", last) in [e[:2] for e in out]
    _lands(p, d)


def test_a_runner_that_never_handed_tokens_over_holds_nothing(
        workers: Callable[..., tuple[Worker, Worker]]) -> None:
    """An asynchronous runner (or not lw's) never calls tokens_sampled: nothing is held."""
    p, d = workers()
    p.side._hands_tokens = False
    d.step(LwConnectorMetadata(recvs=[RecvSpec("t1", "d-r1", (1, 2, 3))]))
    p.side.loop.writes.link.goodput = AnyHost(1e3)
    out = _order(p)
    cfg = d.side.cfg
    p.step(LwConnectorMetadata(sends=[SendSpec("t1", "p-r1", cfg.host, cfg.port(0), (4, 5, 6),
                                               (1, 2, 3))]), forward=True)
    assert ("layer", len(LAYERS) - 1) in [e[:2] for e in out]
