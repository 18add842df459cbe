"""P's push that starts with a prompt's last chunk writes once that forward is done where lw's
threads share the forward's core and P's token goes to D first (lw.fsm.push_schedule
.writes_wait_for_forward): through vLLM's real scheduler and lw's real worker connectors in one
process (the in-process data plane); D's blocks hold exactly what P computed either way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("vllm")

import lw.vllm_adapter.worker_side as worker_side_mod  # noqa: E402

from .test_connector_scheduler import (  # noqa: E402
    LAYERS,
    Cluster,
    cluster_factory,  # noqa: F401  (fixture)
    fake_poster,  # noqa: F401  (autouse fixture: no metaserver thread)
    model_dir,  # noqa: F401  (fixture)
)


class AnyHost(dict):
    """A link measured to every decode host at ``rate`` bytes/s."""

    def __init__(self, rate: float) -> None:
        super().__init__()
        self.rate = rate

    def get(self, key: Any, default: Any = None) -> Any:
        return self.rate


def _events(c: Cluster) -> list[tuple[str, int]]:
    """P's layer hooks ("hook", i) and the layers it reports computed for pushes ("sent", i),
    in the order they happen; the forward measured slow and the link fast."""
    w = c.p.worker._worker
    assert w is not None and w.rates is not None
    w.rates.compute_s_per_token = 1.0
    c.p.loop.writes.link.goodput = AnyHost(1e12)
    out: list[tuple[str, int]] = []
    hook, report = c.p.worker.save_kv_layer, c.p.loop.layer_computed

    def save_kv_layer(name: str, kv: Any, attn: Any, **kw: Any) -> None:
        out.append(("hook", LAYERS.index(name)))
        hook(name, kv, attn, **kw)

    def layer_computed(layer: int, tids: Any) -> None:
        if tids:
            out.append(("sent", layer))
        report(layer, tids)

    c.p.worker.save_kv_layer = save_kv_layer  # type: ignore[method-assign]
    c.p.loop.layer_computed = layer_computed
    return out


@pytest.fixture
def cluster(cluster_factory: Callable[..., Cluster]) -> Cluster:  # noqa: F811
    return cluster_factory()


@pytest.fixture
def one_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every thread may run on CPU 0 only, as on a host whose forward and lw's threads share
    its core (the test process's own threads may have been pinned apart by earlier tests)."""
    monkeypatch.setattr(worker_side_mod.os, "sched_getaffinity", lambda tid: {0})


def _push_one(c: Cluster) -> None:
    c.add("one", list(range(1000, 1010)))  # one block, one chunk: the push's first and last
    c.run_until(lambda: len(c.d.finished) == 1 and c.idle())
    assert c.verified == {"one": True}


def test_on_the_forwards_core_the_writes_wait_for_its_last_layer(cluster: Cluster,
                                                                  one_core: None) -> None:
    c = cluster
    events = _events(c)
    _push_one(c)
    assert events == [("hook", 0), ("hook", 1), ("sent", 0), ("sent", 1)]


def test_with_a_core_of_their_own_the_writes_go_layer_by_layer(
        cluster_factory: Callable[..., Cluster],  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop thread may run on a CPU the forward's thread may not: writing during the
    forward costs it nothing."""
    real = worker_side_mod.os.sched_getaffinity
    monkeypatch.setattr(worker_side_mod.os, "sched_getaffinity",
                        lambda tid: set(real(tid)) | {10_000} if tid else {0})
    c = cluster_factory()
    events = _events(c)
    _push_one(c)
    assert events == [("hook", 0), ("sent", 0), ("hook", 1), ("sent", 1)]


def test_an_unmeasured_link_goes_layer_by_layer(cluster: Cluster, one_core: None) -> None:
    c = cluster
    events = _events(c)
    c.p.loop.writes.link.goodput = {}
    _push_one(c)
    assert events == [("hook", 0), ("sent", 0), ("hook", 1), ("sent", 1)]


def test_write_during_forward_keeps_writing_layer_by_layer(
        cluster_factory: Callable[..., Cluster], one_core: None) -> None:  # noqa: F811
    """The experimental switch the benchmark's ``lw-during`` set-up measures the default by."""
    c = cluster_factory(p_extra={"experimental": {"write_during_forward": True}})
    events = _events(c)
    _push_one(c)
    assert events == [("hook", 0), ("sent", 0), ("hook", 1), ("sent", 1)]


def test_a_forward_on_a_device_never_waits(cluster: Cluster, one_core: None) -> None:
    """A ready gate means the forward runs on a device: the host's CPUs do not run it, so
    writing during it costs it nothing, whatever the threads' affinity."""
    from lw.vllm_adapter.connector_meta import SendSpec

    c = cluster
    _events(c)  # the forward measured slow, the link fast: a shared core would wait
    w = c.p.worker._worker
    assert w is not None
    _push_one(c)  # the loop thread has said its kernel id by now
    assert w.rates is not None
    w.rates.compute_s_per_token = 1.0  # the push's own forward and writes were measured
    c.p.loop.writes.link.goodput = AnyHost(1e12)
    spec = SendSpec("t", "r", "127.0.0.1", 1, (1, 2), (3, 4))
    w._step_tokens = 10
    assert w._waits_for_forward(spec)
    w._gate = object()  # type: ignore[assignment]
    try:
        assert not w._waits_for_forward(spec)
    finally:
        w._gate = None


def test_a_loop_beside_a_cpu_forward_never_polls_through_it(cluster: Cluster) -> None:
    """A forward on the host's CPUs runs Python between its kernels: a loop polling every
    millisecond through it (its layers come closer than two polls on a short prompt) takes the
    interpreter's lock from it each time, wherever the loop's thread runs. P's and D's loops
    wake per (batched) layer event instead; the push still lands."""
    c = cluster
    for side in (c.p, c.d):
        assert side.loop.config.hot_poll_s == 0.0
        assert side.loop.inbox.hot_window_s == 0.0
    _push_one(c)
    assert c.verified == {"one": True}
    assert c.p.loop.inbox.hot_until == 0.0  # never entered
