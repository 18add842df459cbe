"""The world's TP shapes: D TP workers per engine, MLA, replicated heads, D prefix-cache hits."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from lw.sim.explorer import drain, explore
from lw.sim.proxy import Proxy
from lw.sim.world import World, WorldConfig


@pytest.mark.parametrize("kw", [
    dict(dp=2, tp=2, requests=2, layers=2),  # done-when: two P TP ranks write one D worker
    dict(dp=2, d_tp=2, requests=2, layers=2),  # done-when: one P rank writes two D workers
    dict(dp=1, tp=3, d_tp=2, requests=1, layers=1),  # heads split unevenly: 2 writers per D rank
    dict(dp=1, tp=2, mla=True, requests=2, layers=1),  # MLA: P rank 1 has nothing to send
    dict(dp=1, d_tp=2, mla=True, requests=2, layers=1),
    dict(dp=1, tp=2, heads=1, requests=2, layers=1),  # a replicated head: one writer
    dict(dp=2, prefix_hits=(1, 0), requests=2, layers=2),  # r0 is a full hit on D
    dict(dp=1, d_tp=2, requests=2, layers=1, blocks_per_request=2, d_blocks=2, p_blocks=2,
         prefix_hits=(1, 2)),  # r0 half cached, r1 fully cached
])
def test_d_first_holds_on_the_new_shapes(kw: dict) -> None:
    res = explore(WorldConfig(design="d-first", **kw), check_cycles=True)
    assert res.counterexample is None, res.counterexample
    assert res.complete and res.acyclic and "done" in res.seen


def test_d_tp_every_d_worker_gets_every_layer() -> None:
    w = World(WorldConfig(dp=1, tp=1, d_tp=2, requests=1, layers=2))
    assert w.s.plan.targets == ((0, 1),) and w.s.plan.senders == (frozenset({0}),) * 2
    drain(w)
    q = w.reqs[0]
    assert q.d_stage == "done" and q.recv_reports == (1, 1) and q.recv_ok == (True, True)
    assert q.landed == {(0, v, k, 0) for v in (0, 1) for k in (0, 1)}  # (P, D, layer, block)
    assert all(b is None for b in w.s.d_pool[0])


def test_mla_idle_p_rank_finishes_at_once() -> None:
    w = World(WorldConfig(dp=1, tp=2, mla=True, requests=1, layers=1))
    assert w.s.plan.targets == ((0,), ())
    drain(w)
    assert w.p[1].counters["no_target"] == 1 and w.p[1].counters["layer_writes"] == 0
    assert w.reqs[0].send_ok == (True, True) and w.reqs[0].d_stage == "done"


def test_full_prefix_hit_transfers_nothing_and_finishes() -> None:
    w = World(WorldConfig(dp=1, requests=1, layers=1, prefix_hits=(1,)))
    drain(w)
    assert w.d[0].counters["requests"] == 0 and w.p[0].counters["layer_writes"] == 0
    assert w.reqs[0].d_stage == "done" and w.reqs[0].send_ok == (True,)


def test_partial_prefix_hit_never_writes_the_cached_block() -> None:
    w = World(WorldConfig(dp=1, requests=1, layers=1, blocks_per_request=2, d_blocks=2,
                          p_blocks=2, prefix_hits=(1,)))
    drain(w)
    q = w.reqs[0]
    assert q.d_cached == (0,) and q.d_remote == (1,) and q.d_stage == "done"


def _strand_full_hits(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM #56640's shape: D registers a fully cached request as if it had KV to receive."""
    alloc: Callable[[Proxy, int], None] = Proxy.do_alloc

    def stranding_alloc(self: Proxy, d: int) -> None:
        s = self.s
        q = s.reqs[s.d_queue[d][0]]
        alloc(self, d)
        if not q.loads():
            q.d_stage = "allocated"
            for v in s.d_workers_of(d):
                self.ports.run(("d", v), s.d[v].add_request(
                    q.rid, q.d_blocks or (), s.plan.senders[v % s.d_tp], s.now))

    monkeypatch.setattr(Proxy, "do_alloc", stranding_alloc)


def test_a_stranded_full_hit_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checker that cannot fail proves nothing: the request waits for KV that never comes."""
    _strand_full_hits(monkeypatch)
    res = explore(WorldConfig(dp=1, requests=1, layers=1, prefix_hits=(1,)))
    ce = res.counterexample
    assert ce is not None and ce.violation.prop == "no-deadline-without-faults"
    assert "deadline(r0)" in ce.violation.message


def test_p_first_and_eager_free_still_caught_with_d_tp() -> None:
    pf = explore(WorldConfig(design="p-first", dp=2, d_tp=2, requests=2, layers=2))
    assert pf.counterexample is not None and pf.counterexample.violation.prop == "deadlock"
    ef = explore(WorldConfig(design="eager-free", dp=2, d_tp=2, requests=2, layers=2))
    assert ef.counterexample is not None
    assert ef.counterexample.violation.prop == "use-after-free"


def test_faults_on_p_tp_2_x_d_tp_2_shallow() -> None:
    """Every P rank writes one D rank here (core finding 3 needs a P rank with two targets);
    the full space is large, so the first 1,500 states (breadth first: every short run)."""
    cfg = WorldConfig(dp=1, tp=2, d_tp=2, requests=1, layers=1, faults=True,
                      p_loss_detection=False)
    res = explore(cfg, max_states=1500)
    assert res.counterexample is None, res.counterexample
    assert res.states >= 1500


@pytest.mark.parametrize("kw, msg", [
    (dict(prefix_hits=(2,)), "prefix hit"),
    (dict(prefix_hits=(0, 0, 0)), "prefix hits given"),
    (dict(tp=2, heads=3), "P TP 2"),
    (dict(d_tp=0), "d_tp must be >= 1"),
])
def test_bad_shapes_are_refused(kw: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        WorldConfig(**kw)
