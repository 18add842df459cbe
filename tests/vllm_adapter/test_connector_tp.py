"""Heterogeneous TP and MLA through vLLM's real Scheduler and lw's real worker connectors, in one
process: one scheduler per engine, one worker connector per TP rank holding its own KV heads (the
vLLM CPU layout ``(blocks, heads, block size, 2*head)``), real WorkerLoops over loopback ZMQ and
the in-process data plane. The test plays model runner and proxy, and checks at RecvDone that
every head of every block on every D rank holds exactly what P's forward pass wrote for it.

This is the proof for shapes a 2-core machine cannot run on real engines without starving them
(more busy-polling vLLM workers than cores), and it runs in seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

import lw.vllm_adapter.connector as conn_mod  # noqa: E402
from lw.lab.tiny_model import make_tiny_model  # noqa: E402
from lw.lab.vllm_demo import free_port_range  # noqa: E402

from .test_connector_scheduler import (  # noqa: E402
    BS,
    LAYERS,
    NUM_BLOCKS,
    TOKEN,
    Cluster,
    fake_poster,  # noqa: F401  (autouse fixture: no metaserver thread)
    make_vllm_config,
)

HEAD_ELEMS = 128  # K and V of one head, one token (head size 64)


def _value(tokens: list[int], layer: int, head: int) -> float:
    """What the fake model writes for one head of one block (exact in bf16)."""
    return float((sum(tokens) + 13 * layer + 37 * head) % 199)


class TPEngine:
    """One scheduler and ``tp`` worker connectors, one per TP rank, each with its heads' KV."""

    def __init__(self, model_dir: str, role: str, tp: int, peer_tp: int, heads: int,
                 head_elems: int) -> None:
        extra = {"data_plane": "inprocess", "peer_tp_size": peer_tp}
        self.vc = make_vllm_config(model_dir, role, extra=extra, tp=tp)
        self.vc.kv_transfer_config.kv_port = free_port_range(tp + 1)
        self.mla = self.vc.model_config.use_mla
        per = 1 if self.mla else max(1, heads // tp)
        self.sched = Scheduler(self.vc, kv_cache_config=self._kv_config(heads, head_elems),
                               structured_output_manager=StructuredOutputManager(self.vc),
                               block_size=BS, log_stats=True)
        self.workers: list[Any] = []
        self.kv: list[dict[str, torch.Tensor]] = []
        self.heads: list[tuple[int, int]] = []
        for rank in range(tp):
            w = conn_mod.LwConnector(self.vc, KVConnectorRole.WORKER,
                                     self._kv_config(per, head_elems))
            side = w._worker
            assert side is not None
            side.tp_rank = rank  # what get_tensor_model_parallel_rank() gives in a TP worker
            side.rank = rank
            kv = {n: torch.zeros(NUM_BLOCKS, per, BS, head_elems, dtype=torch.bfloat16)
                  for n in LAYERS}
            w.register_kv_caches(kv)
            self.workers.append(w)
            self.kv.append(kv)
            self.heads.append((side.fmt.head_lo, side.fmt.head_hi))
        self.finished: dict[str, str] = {}
        self.on_recv: Callable[[TPEngine, str], None] | None = None
        self._seen: dict[str, dict[str, int]] = {"send": {}, "recv": {}}

    @staticmethod
    def _kv_config(heads: int, head_elems: int) -> KVCacheConfig:
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=heads, head_size=head_elems // 2,
                                 dtype=torch.bfloat16)
        return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])

    def fill(self, rid: str) -> None:
        """The forward pass on every rank: each head of each block gets its own value."""
        req = self.sched.requests[rid]
        (blocks,) = self.sched.kv_cache_manager.get_block_ids(rid)
        toks = req.prompt_token_ids
        for kv, (lo, hi) in zip(self.kv, self.heads, strict=True):
            for i, b in enumerate(blocks[: -(-len(toks) // BS)]):
                for layer, name in enumerate(LAYERS):
                    for h in range(lo, hi):
                        kv[name][b, h - lo].fill_(_value(toks[i * BS:(i + 1) * BS], layer, h))

    def _all_ranks(self, kind: str, rids: set[str]) -> set[str]:
        """vLLM reports a transfer finished once every TP worker has reported it."""
        seen = self._seen[kind]
        done = set()
        for r in rids:
            seen[r] = seen.get(r, 0) + 1
            if seen[r] == len(self.workers):
                done.add(r)
                del seen[r]
        return done

    def step(self) -> None:
        so = self.sched.schedule()
        rids = list(so.num_scheduled_tokens)
        for w in self.workers:
            w.bind_connector_metadata(so.kv_connector_metadata)
        for rid in rids:
            self.fill(rid)
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        invalid: set[int] = set()
        stats = None
        for rank, w in enumerate(self.workers):
            if rids:
                for name in LAYERS:
                    w.save_kv_layer(name, self.kv[rank][name], None)
            w.wait_for_save()
            res = w.get_transfer_results(so.finished_req_ids)
            sending |= self._all_ranks("send", set(res.finished_sending))
            recving |= self._all_ranks("recv", set(res.finished_recving))
            failed |= set(res.failed_recving)
            invalid |= w.get_block_ids_with_load_errors()
            st = w.get_kv_connector_stats()
            stats = stats or st
            w.clear_connector_metadata()
        for rid in recving - failed:
            if self.on_recv is not None:
                self.on_recv(self, rid)
        kvo = KVConnectorOutput(finished_sending=sending or None,
                                finished_recving=recving or None, failed_recving=failed,
                                invalid_block_ids=invalid, kv_connector_stats=stats)
        toks = []
        for rid in rids:
            req = self.sched.requests[rid]
            toks.append([TOKEN] if req.num_computed_tokens >= req.num_tokens else [])
        out = ModelRunnerOutput(req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)},
                                sampled_token_ids=toks, kv_connector_output=kvo)
        for outs in self.sched.update_from_output(so, out).values():
            for o in outs.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = str(o.finish_reason)

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
        self.sched.shutdown()


class TPCluster(Cluster):
    """P (TP p) + D (TP d) + the proxy's relay; verifies every D rank's heads at RecvDone."""

    def __init__(self, model_dir: str, p_tp: int, d_tp: int, heads: int = 4,
                 head_elems: int = HEAD_ELEMS) -> None:
        self.p = TPEngine(model_dir, "kv_producer", p_tp, d_tp, heads, head_elems)  # type: ignore[assignment]
        self.d = TPEngine(model_dir, "kv_consumer", d_tp, p_tp, heads, head_elems)  # type: ignore[assignment]
        self.relayed = 0
        self.relay_enabled = True
        self.verified: dict[str, bool] = {}
        self.prompts: dict[str, list[int]] = {}
        self.d.on_recv = self._verify  # type: ignore[assignment]

    def _verify(self, d: TPEngine, rid: str) -> None:  # type: ignore[override]
        if d.sched.requests[rid].status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            return
        toks = self.prompts[rid]
        (blocks,) = d.sched.kv_cache_manager.get_block_ids(rid)
        ok = True
        for kv, (lo, hi) in zip(d.kv, d.heads, strict=True):
            for i, b in enumerate(blocks[: -(-len(toks) // BS)]):
                for layer, name in enumerate(LAYERS):
                    for h in range(lo, hi):
                        want = _value(toks[i * BS:(i + 1) * BS], layer, h)
                        ok &= bool((kv[name][b, h - lo] == want).all())
        self.verified[rid] = ok


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-mla"), kind="mla"))


@pytest.fixture
def tp_cluster() -> Iterator[Callable[..., TPCluster]]:
    made: list[TPCluster] = []

    def make(*args: Any, **kw: Any) -> TPCluster:
        c = TPCluster(*args, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (4, 2), (2, 4)])
def test_heterogeneous_tp_moves_every_head_to_its_rank(
        llama_dir: str, tp_cluster: Callable[..., TPCluster], p_tp: int, d_tp: int) -> None:
    c = tp_cluster(llama_dir, p_tp, d_tp)
    lengths = {"one": 10, "many": 100, "long": 200}  # 1 block; 7 (chunked); 13 (chunked)
    for i, (rid, n) in enumerate(lengths.items()):
        c.add(rid, list(range(1000 * (i + 1), 1000 * (i + 1) + n)))
    c.run_until(lambda: len(c.d.finished) == 3 and c.idle(), timeout=30)
    assert c.verified == {rid: True for rid in lengths}
    assert set(c.d.finished.values()) == {"length"}


def test_mla_one_writer_per_decode_rank(mla_dir: str,
                                        tp_cluster: Callable[..., TPCluster]) -> None:
    c = tp_cluster(mla_dir, 2, 1, heads=1, head_elems=576)
    assert c.p.mla and c.d.mla
    c.add("r", list(range(3000, 3100)))
    c.run_until(lambda: len(c.d.finished) == 1 and c.idle(), timeout=30)
    assert c.verified == {"r": True}
    p_loops = [w._worker.loop for w in c.p.workers]
    # P rank 1 holds the same latent KV but D's only rank takes it from P rank 0.
    assert [lp.stats().get("core.no_target", 0) for lp in p_loops] == [0, 1]
