"""The contract's helpers at their edges: transfer ids at the length limit, sub-transfer ids
without a head, worker ports at 65535, P's params built from D's decoded type, and the size of
the sampling digest. Written to kill the survivors of ``tools/mutation.py --scope security``."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from lw.contract.params import (
    CONTRACT_VERSION,
    DecoderKV,
    MetaserverCall,
    prefill_params,
    prompt_digest,
)
from lw.contract.sampling import spec_digest
from lw.contract.transfer_ids import MAX_TRANSFER_ID, is_sub_transfer_of, sub_transfer_id
from lw.contract.worker_addrs import KnownWorkers, decode_workers

KV = {"remote_engine_id": "d0", "remote_host": "10.0.0.2", "remote_port": 5555,
      "remote_block_ids": [3, 4], "remote_tp_size": 1, "lw_geometry": "g",
      "lw_params_version": CONTRACT_VERSION, "lw_prompt_digest": prompt_digest([5, 6])}


def test_a_sub_transfer_id_of_256_characters_is_kept_whole() -> None:
    """The core's request id limit (lw.fsm.messages) is 256 characters."""
    assert MAX_TRANSFER_ID == 256
    tid = "t" * 250
    assert sub_transfer_id(tid, "r" * 5) == f"{tid}@rrrrr"  # 256 characters
    hashed = sub_transfer_id(tid, "r" * 6)
    assert hashed != f"{tid}@rrrrrr" and len(hashed) == 256 and is_sub_transfer_of(hashed, tid)


def test_an_id_without_a_head_is_no_sub_transfer() -> None:
    assert not is_sub_transfer_of("t1", "t1")  # no "@"
    assert not is_sub_transfer_of("@r", "")  # an empty head names no transfer
    assert is_sub_transfer_of("t1@r", "t1") and not is_sub_transfer_of("t2@r", "t1")


def test_a_decode_engine_on_the_last_port_is_learned() -> None:
    """Its TP ranks listen on port .. port + tp - 1, all within 65535."""
    params = {"remote_host": "10.0.0.2", "remote_port": 65535, "remote_tp_size": 1}
    assert decode_workers(params) == ["tcp://10.0.0.2:65535"]
    assert decode_workers({**params, "remote_port": 65534, "remote_tp_size": 2}) == [
        "tcp://10.0.0.2:65534", "tcp://10.0.0.2:65535"]
    assert decode_workers({**params, "remote_tp_size": 2}) == []
    k = KnownWorkers()
    assert k.learn("decode", ["tcp://h:65536", "tcp://h:65535"]) == 1
    assert k.snapshot()["decode"] == ["tcp://h:65535"]


def test_p_params_are_the_same_from_ds_decoded_type_and_from_its_json() -> None:
    kv = msgspec.convert(KV, DecoderKV)
    as_posted = {**KV, "remote_first_block": 0, "remote_dp_rank": 0}
    assert prefill_params(kv, "t1@r") == prefill_params(as_posted, "t1@r")
    assert "lw_seed" not in prefill_params(kv, "t1@r")  # None in the type: absent, as posted
    assert prefill_params({**KV, "lw_seed": 7}, "t1@r", 2)["lw_seed"] == 7
    assert prefill_params(KV, "t1@r", 2)["lw_epoch"] == 2
    assert "lw_epoch" not in prefill_params({**KV, "lw_epoch": 3}, "t1@r")


def test_the_sampling_digest_is_128_bits() -> None:
    sp = SimpleNamespace(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None,
                         presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
    digest = spec_digest(sp)
    assert len(digest) == 32 and int(digest, 16) >= 0


def test_the_params_version_is_the_one_the_protocol_doc_names() -> None:
    """P refuses params of another version (params_fit): the number is a wire fact, named in
    docs/protocol.md, not a value a change may move silently."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
    assert f"the current version is {CONTRACT_VERSION}\n" in doc


def test_the_depth_check_answers_a_bool() -> None:
    from lw.contract.client import json_depth_exceeds

    assert json_depth_exceeds({"a": [1]}) is False
    assert json_depth_exceeds([[1]], limit=1) is True


def test_an_engine_id_of_256_characters_is_taken_and_257_refused() -> None:
    """Ids in params are bounded by the core's request id limit (256), no tighter."""
    assert msgspec.convert({**KV, "remote_engine_id": "e" * 256}, DecoderKV)
    try:
        msgspec.convert({**KV, "remote_engine_id": "e" * 257}, DecoderKV)
    except msgspec.ValidationError as exc:
        assert "remote_engine_id" in str(exc)
    else:
        raise AssertionError("a 257-character engine id was taken")


def test_d_may_name_up_to_2_to_the_20_blocks_not_one_more() -> None:
    """The block-list bound of D's params (MAX_BLOCKS), at its edge."""
    n = 1 << 20
    assert len(msgspec.convert({**KV, "remote_block_ids": [0] * n}, DecoderKV)
               .remote_block_ids) == n
    try:
        msgspec.convert({**KV, "remote_block_ids": [0] * (n + 1)}, DecoderKV)
    except msgspec.ValidationError as exc:
        assert "remote_block_ids" in str(exc)
    else:
        raise AssertionError(f"{n + 1} blocks were taken")


CALL = {"transfer_id": "t", "sub_transfer_id": "t"}
EDGES = [  # (type, base, field, the last value taken, the first refused)
    (DecoderKV, KV, "remote_host", "h" * 255, "h" * 256),
    (DecoderKV, KV, "remote_port", 65535, 65536),
    (DecoderKV, KV, "remote_port", 1, 0),
    (DecoderKV, KV, "remote_block_ids", [(1 << 40) - 1], [1 << 40]),
    (DecoderKV, KV, "remote_block_ids", [0], [-1]),
    (DecoderKV, KV, "remote_tp_size", 65536, 65537),
    (DecoderKV, KV, "remote_tp_size", 1, 0),
    (DecoderKV, KV, "lw_geometry", "g" * 4096, "g" * 4097),
    (DecoderKV, KV, "remote_first_block", (1 << 31) - 1, 1 << 31),
    (DecoderKV, KV, "remote_dp_rank", 0, -1),
    (DecoderKV, KV, "lw_seed", (1 << 63) - 1, 1 << 63),
    (DecoderKV, KV, "lw_seed", -(1 << 63), -(1 << 63) - 1),
    (MetaserverCall, CALL, "prompt_token_ids", [(1 << 40) - 1], [1 << 40]),
    (MetaserverCall, CALL, "retry_prefill", 64, 65),
    (MetaserverCall, CALL, "avoid", ["a"] * 256, ["a"] * 257),
    (MetaserverCall, CALL, "avoid", ["a" * 256], ["a" * 257]),
    (MetaserverCall, CALL, "grant", "g" * 128, "g" * 129),
    (MetaserverCall, CALL, "epoch", (1 << 31) - 1, 1 << 31),
]


@pytest.mark.parametrize(("typ", "base", "field", "ok", "bad"), EDGES,
                         ids=[f"{e[2]}={str(e[3])[:12]}" for e in EDGES])
def test_params_bounds_at_their_edges(typ: type, base: dict, field: str, ok: object,
                                      bad: object) -> None:
    """Each bound of the params' declared types takes its last value and refuses the next,
    naming the field."""
    assert getattr(msgspec.convert({**base, field: ok}, typ), field) == ok
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.convert({**base, field: bad}, typ)


def test_a_call_may_name_up_to_2_to_the_22_prompt_tokens_not_one_more() -> None:
    """MAX_PROMPT_TOKENS at its edge (a 4M-token prompt is the most a metaserver call names)."""
    n = 1 << 22
    assert len(msgspec.convert({**CALL, "prompt_token_ids": [0] * n}, MetaserverCall)
               .prompt_token_ids) == n
    with pytest.raises(msgspec.ValidationError, match="prompt_token_ids"):
        msgspec.convert({**CALL, "prompt_token_ids": [0] * (n + 1)}, MetaserverCall)
