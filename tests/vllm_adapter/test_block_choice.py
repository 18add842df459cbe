"""Which blocks the connector hands its cores, inside vLLM's real Scheduler, judged by oracles
that do not ask the connector: token t of a prompt lives in block t // BS of vLLM's own block
table, D's prefix cache is the blocks vLLM shares with an earlier request, and in a cluster the
values P's forward wrote for each block's tokens (Cluster._verify). Each check is shown to
catch a slip planted in the core's choice functions (lw.fsm.block_choice, which P's push cursor
calls), slips that passed every earlier adapter test: D front-trimming or shifting its blocks
after a prefix hit, and P handing on a block whose last tokens a later chunk computes. Also: D
never loads a request twice after vLLM preempted it (earlier tests pinned that rule only on the
recompute-after-failure path).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import pytest

pytest.importorskip("vllm")

from vllm.v1.outputs import KVConnectorOutput  # noqa: E402

import lw.fsm.block_choice as block_choice  # noqa: E402
import lw.vllm_adapter.scheduler_decode as decode_mod  # noqa: E402
import lw.vllm_adapter.scheduler_side as sched_mod  # noqa: E402
from lw.fsm.block_choice import blocks_to_push, blocks_to_receive  # noqa: E402

from . import test_connector_scheduler as tcs  # noqa: E402
from .test_connector_scheduler import (  # noqa: E402
    BS,
    PROGRESSIVE,
    Cluster,
    Driver,
    FakePoster,
    decoder_params,
    make_request,
    make_scheduler,
    remote_prefill_params,
)

# that module's fixtures, here too (fake_poster is autouse: no metaserver thread)
model_dir, fake_poster, cluster_factory = tcs.model_dir, tcs.fake_poster, tcs.cluster_factory

SHARED = list(range(10, 74))  # 64 tokens: four whole blocks D's prefix cache holds for r2
R1 = SHARED + list(range(200, 236))  # 100 tokens, 7 blocks
R2 = SHARED + list(range(500, 536))  # the same first 4 blocks, 3 blocks D misses


def _blocks_of_tokens(table: Sequence[int], tokens: range) -> tuple[int, ...]:
    """The blocks of ``table`` holding ``tokens``, in token order (the oracle's one rule)."""
    return tuple(dict.fromkeys(table[t // BS] for t in tokens))


# ------------------------------------------------------------------- D: a prefix hit, in vLLM
def _d_hit_problem(model_dir: str, poster_cls: type[FakePoster]) -> str:
    """Run r1 then r2 through D; what D registered for r2 that the tokens do not say."""
    s = make_scheduler(model_dir, "kv_consumer")
    d = Driver(s)
    s.add_request(make_request("r1", len(R1), params=remote_prefill_params("t1"), tokens=R1))
    d.step()
    (r1_table,) = s.kv_cache_manager.get_block_ids("r1")
    d.step(KVConnectorOutput(finished_recving={"r1"}))
    while "r1" not in d.finished:
        d.step()
    s.add_request(make_request("r2", len(R2), params=remote_prefill_params("t2"), tokens=R2))
    d.step()
    (table,) = s.kv_cache_manager.get_block_ids("r2")
    assert tuple(table[:4]) == tuple(r1_table[:4])  # vLLM's own hit: r1's first four blocks
    want = _blocks_of_tokens(table, range(len(SHARED), len(R2)))
    (spec,) = d.meta.recvs
    params = poster_cls.instances[0].posts[-1][3]["kv_transfer_params"]
    got = (spec.block_ids, tuple(params["remote_block_ids"]), params["remote_first_block"])
    if got != (want, want, 4):
        return f"registered {spec.block_ids}, named {got[1:]} to P; the tokens say {want}, 4"
    return ""


def test_d_registers_exactly_the_blocks_of_the_tokens_its_cache_misses(
        model_dir: str, fake_poster: type[FakePoster]) -> None:
    assert _d_hit_problem(model_dir, fake_poster) == ""


def _d_front_trim(table: Sequence[int], prompt: int, cached: int, bs: int
                  ) -> tuple[int, tuple[int, ...]]:
    first, remote = blocks_to_receive(table, prompt, cached, bs)
    return first, tuple(table[:len(remote)])  # vllm #48633 C3: the first n, not the last n


def _d_shifted(table: Sequence[int], prompt: int, cached: int, bs: int
               ) -> tuple[int, tuple[int, ...]]:
    first, remote = blocks_to_receive(table, prompt, cached, bs)
    lo = max(0, first - 1)  # after a hit, one block early: D's last cached block in
    return first, tuple(table[lo:lo + len(remote)])


@pytest.mark.parametrize("plant", [_d_front_trim, _d_shifted])
def test_a_wrong_d_registration_after_a_hit_is_caught(
        model_dir: str, fake_poster: type[FakePoster], monkeypatch: pytest.MonkeyPatch,
        plant: Callable[..., tuple[int, tuple[int, ...]]]) -> None:
    monkeypatch.setattr(decode_mod, "blocks_to_receive", plant)
    assert "the tokens say" in _d_hit_problem(model_dir, fake_poster)


# --------------------------------------------------------- P: chunks that end inside a block
def _p_chunk_problem(model_dir: str) -> str:
    """A 10-token request ahead of r1 in P's first step leaves r1 a 54-token chunk, which ends
    inside block 3: each push must hand on exactly the blocks whose tokens are all computed."""
    s = make_scheduler(model_dir, "kv_producer", extra=PROGRESSIVE)
    d = Driver(s)
    s.add_request(make_request("plain", 10, start=900))
    s.add_request(make_request("r1", 100, params=decoder_params()))
    pushed: list[int] = []
    end = 0  # r1's tokens computed so far (P holds none of them in its cache)
    for _ in range(3):
        so = d.step()
        if "r1" not in so.num_scheduled_tokens:
            continue
        end += so.num_scheduled_tokens["r1"]
        (table,) = s.kv_cache_manager.get_block_ids("r1")
        # block i holds tokens i*BS .. min(100, (i+1)*BS) - 1: complete once the last is done
        want = tuple(table[i] for i in range(7)
                     if min(100, (i + 1) * BS) - 1 < end and table[i] not in pushed)
        (spec,) = d.meta.sends
        if spec.local_blocks != want:
            return f"after {end} tokens P pushed {spec.local_blocks}, the tokens say {want}"
        pushed += spec.local_blocks
    return "" if len(pushed) == 7 else f"pushed {len(pushed)} of 7 blocks"


def test_p_pushes_a_block_only_once_its_last_token_is_computed(model_dir: str) -> None:
    assert _p_chunk_problem(model_dir) == ""


def _p_partial_block_early(table: Sequence[int], prompt: int, done: int, first: int,
                           pushed: int, bs: int) -> tuple[int, ...]:
    lo = first + pushed  # ceil instead of floor: a block whose tail is still to be computed
    return tuple(table[lo:max(lo, min(-(-done // bs), len(table)))])


def test_a_block_pushed_before_its_last_token_is_caught(
        model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_choice, "blocks_to_push", _p_partial_block_early)
    assert "the tokens say" in _p_chunk_problem(model_dir)


# ------------------------------------------------------------ the bytes, end to end, with a hit
def _cluster_hit_verified(make: Callable[..., Cluster]) -> dict[str, bool]:
    c = make()
    c.add("r1", list(R1))
    c.run_until(lambda: "r1" in c.d.finished and c.idle())
    c.add("r2", list(R2))  # D holds four blocks (and so does P: its own hit on p-r1)
    c.run_until(lambda: "r2" in c.d.finished and c.idle())
    assert c.d.total("prefix_hit_blocks") == 4
    return c.verified


def test_cluster_a_d_prefix_hit_gets_ps_kv_in_the_blocks_it_misses(
        cluster_factory: Callable[..., Cluster]) -> None:
    assert _cluster_hit_verified(cluster_factory) == {"r1": True, "r2": True}


@pytest.mark.parametrize("plant", [_d_front_trim, _d_shifted])
def test_cluster_catches_a_wrong_d_registration_by_the_bytes(
        cluster_factory: Callable[..., Cluster], monkeypatch: pytest.MonkeyPatch,
        plant: Callable[..., tuple[int, tuple[int, ...]]]) -> None:
    monkeypatch.setattr(decode_mod, "blocks_to_receive", plant)
    assert _cluster_hit_verified(cluster_factory)["r2"] is False


def _p_ignores_the_hit(table: Sequence[int], prompt: int, done: int, first: int, pushed: int,
                       bs: int) -> tuple[int, ...]:
    local = blocks_to_push(table, prompt, done, first, pushed, bs)
    return tuple(table[pushed:pushed + len(local)])  # P's blocks from the prompt's start


def test_cluster_catches_p_writing_from_the_prompts_start(
        cluster_factory: Callable[..., Cluster], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_choice, "blocks_to_push", _p_ignores_the_hit)
    assert _cluster_hit_verified(cluster_factory)["r2"] is False


# ------------------------------------------------------------- D: preempted after its load
def _d_preempted_loads(model_dir: str, poster_cls: type[FakePoster]) -> tuple[int, int]:
    """(registrations, metaserver posts) D makes for a request vLLM preempted after its KV
    arrived: it must be recomputed locally (P released its blocks, the proxy its grant)."""
    s = make_scheduler(model_dir, "kv_consumer", prefix_caching=False)  # nothing cached
    d = Driver(s)
    s.add_request(make_request("r1", 100, params=remote_prefill_params(), max_tokens=6))
    d.step()
    d.step(KVConnectorOutput(finished_recving={"r1"}))
    d.step()  # decoding
    req = s.requests["r1"]
    s.running.remove(req)  # what schedule() does under memory pressure, then:
    s._preempt_request(req, time.monotonic())
    for _ in range(10):
        d.step(KVConnectorOutput(finished_recving={"r1"}) if d.meta.recvs else None)
        if "r1" in d.finished:
            break
    assert "r1" in d.finished
    return sum(len(m.recvs) for m in d.metas), len(poster_cls.instances[0].posts)


def test_d_never_loads_a_preempted_request_twice(
        model_dir: str, fake_poster: type[FakePoster]) -> None:
    assert _d_preempted_loads(model_dir, fake_poster) == (1, 1)


def test_a_d_that_forgets_it_loaded_a_preempted_request_is_caught(
        model_dir: str, fake_poster: type[FakePoster], monkeypatch: pytest.MonkeyPatch) -> None:
    real = sched_mod.SchedulerSide._remote_prefill

    def forgetful(self: sched_mod.SchedulerSide, request: object) -> object:
        self._d_seen.discard(request.request_id)  # type: ignore[attr-defined]
        return real(self, request)  # type: ignore[arg-type]

    monkeypatch.setattr(sched_mod.SchedulerSide, "_remote_prefill", forgetful)
    assert _d_preempted_loads(model_dir, fake_poster) != (1, 1)
