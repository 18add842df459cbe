"""Refusals and bounds of lw/contract that the full security mutation run found untested: the
direction flags each engine's params must carry, the sampling spec's parts that decide token 1,
the worker-address bounds. Each test names the refusal, not only the happy path."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lw.contract.params import (
    CONTRACT_VERSION,
    ContractError,
    decode_params_for_decoder,
    decode_params_for_prefiller,
    prompt_digest,
    sign_params,
)
from lw.contract.sampling import p_sampling_fields, sampling_spec, spec_digest
from lw.contract.transfer_ids import is_sub_transfer_of
from lw.contract.worker_addrs import KnownWorkers, decode_workers

D = {"do_remote_prefill": True, "metaserver": "http://10.0.0.1:9000/v1/meta",
     "transfer_id": "t1", "metaserver_grant": "g" * 16, "lw_contract": CONTRACT_VERSION,
     "lw_sig": "a" * 64}
P = {"remote_engine_id": "d0", "remote_host": "10.0.0.2", "remote_port": 5555,
     "remote_block_ids": [3], "remote_tp_size": 1, "lw_geometry": "g",
     "lw_params_version": CONTRACT_VERSION, "lw_prompt_digest": prompt_digest([5]),
     "transfer_id": "t1@r", "lw_contract": CONTRACT_VERSION}


def test_a_decode_engine_takes_only_params_that_say_prefill_remotely() -> None:
    assert decode_params_for_decoder(None, D).transfer_id == "t1"
    for bad in ({"do_remote_prefill": False}, {"do_remote_decode": True}):
        with pytest.raises(ContractError, match="do_remote_prefill"):
            decode_params_for_decoder(None, {**D, **bad})


def test_a_prefill_engine_takes_only_params_that_say_decode_remotely_with_an_id() -> None:
    assert decode_params_for_prefiller(None, P).transfer_id == "t1@r"
    for bad in ({"do_remote_decode": False}, {"do_remote_prefill": True}):
        with pytest.raises(ContractError, match="do_remote_decode"):
            decode_params_for_prefiller(None, {**P, **bad})
    without_id = {k: v for k, v in P.items() if k != "transfer_id"}  # the type's default ""
    with pytest.raises(ContractError, match="do_remote_decode"):
        decode_params_for_prefiller(None, without_id)


def _sp(**kw: Any) -> SimpleNamespace:
    base = dict(temperature=0.8, top_p=1.0, top_k=0, min_p=0.0, seed=None, presence_penalty=0.0,
                frequency_penalty=0.0, repetition_penalty=1.0, min_tokens=0,
                all_stop_token_ids=[2, 1], allowed_token_ids=None)
    return SimpleNamespace(**{**base, **kw})


def test_the_spec_tells_apart_what_decides_token_1_and_only_that() -> None:
    """min_tokens matters for token 1 as 0 against at least 1 (then the stop ids are masked,
    so which they are matters too); beyond 1 it does not."""
    spec = sampling_spec(_sp(min_tokens=3, allowed_token_ids=[9, 4]))
    assert spec["min_tokens"] == 1 and spec["stop_ids"] == [1, 2]
    assert spec["allowed_token_ids"] == [4, 9]
    assert "stop_ids" not in sampling_spec(_sp())
    assert sampling_spec(_sp(min_tokens=None))["min_tokens"] == 0
    assert spec_digest(_sp(min_tokens=1)) != spec_digest(_sp())
    assert spec_digest(_sp(min_tokens=1)) == spec_digest(_sp(min_tokens=5))
    assert spec_digest(_sp(min_tokens=1)) != spec_digest(_sp(min_tokens=1,
                                                              all_stop_token_ids=[3]))
    assert spec_digest(_sp()) == spec_digest(_sp(all_stop_token_ids=[3]))
    assert spec_digest(_sp(seed=1)) != spec_digest(_sp(seed=2))


def test_p_gets_min_tokens_capped_at_1_and_no_lower() -> None:
    assert p_sampling_fields({"min_tokens": 3})["min_tokens"] == 1
    assert p_sampling_fields({"min_tokens": 1})["min_tokens"] == 1
    assert p_sampling_fields({"min_tokens": 0})["min_tokens"] == 0


def test_worker_address_bounds() -> None:
    kv = {"remote_host": "h", "remote_port": 1000, "remote_tp_size": 1024}
    assert len(decode_workers(kv)) == 1024
    assert decode_workers({**kv, "remote_tp_size": 1025}) == []
    k = KnownWorkers()
    assert k.limit == 4096
    for i in range(5):
        k.learn("decode", [f"tcp://h{i}:{p}" for p in range(1, 1001)])
    assert len(k.snapshot()["decode"]) == 4096


def test_a_sub_transfer_test_answers_a_bool() -> None:
    assert is_sub_transfer_of("x", "t") is False
    assert is_sub_transfer_of("t@1", "t") is True


def test_a_first_attempt_is_epoch_0_and_a_spec_without_min_tokens_is_0() -> None:
    assert decode_params_for_prefiller(None, P).lw_epoch == 0
    sp = _sp()
    del sp.min_tokens
    assert sampling_spec(sp)["min_tokens"] == 0


def test_the_greedy_spec_digest_is_what_every_release_computes() -> None:
    """P and D of different builds must agree on a spec's digest: its canonical form is a wire
    fact (sorted keys, this value for the default greedy spec)."""
    greedy = SimpleNamespace(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None,
                             presence_penalty=0.0, frequency_penalty=0.0,
                             repetition_penalty=1.0)
    assert spec_digest(greedy) == "0e56a3a5671546144a8aa2728b6bf87e"


def test_signed_params_verify_whatever_order_their_keys_arrive_in() -> None:
    key = b"k" * 32
    signed = sign_params(key, "decode", {k: v for k, v in D.items() if k != "lw_sig"})
    reordered = dict(reversed(list(signed.items())))
    assert decode_params_for_decoder(key, reordered).transfer_id == "t1"
    with pytest.raises(ContractError, match="lw_sig"):
        decode_params_for_decoder(key, {**reordered, "transfer_id": "t2"})


def test_a_decode_engines_port_is_1_at_least_and_a_list_is_read_1024_at_a_time() -> None:
    kv = {"remote_host": "h", "remote_port": 1, "remote_tp_size": 1}
    assert decode_workers(kv) == ["tcp://h:1"]
    assert decode_workers({**kv, "remote_port": 0}) == []
    k = KnownWorkers()
    assert k.learn("decode", [f"tcp://h:{p}" for p in range(1, 1100)]) == 1024
