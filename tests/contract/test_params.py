"""The contract's types and the proxy's signature: what D and P accept, and every way a
client-written or altered parameter set is refused (naming the field, never another error)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lw.contract.client import json_depth_exceeds, screen_client_body
from lw.contract.params import (
    CONTRACT_VERSION,
    ContractError,
    decode_params_for_decoder,
    decode_params_for_prefiller,
    decoder_params,
    metaserver_call,
    prefill_params,
    prompt_digest,
    sign_params,
)

KEY = b"contract-test-key-0123456789abcdef"
IDS = [5, 6, 7]
KV = {"remote_engine_id": "d0", "remote_host": "10.0.0.2", "remote_port": 5555,
      "remote_block_ids": [3, 4], "remote_tp_size": 1, "lw_geometry": "g",
      "lw_params_version": CONTRACT_VERSION, "lw_prompt_digest": prompt_digest(IDS)}


def signed_decode(**kw: Any) -> dict[str, Any]:
    return sign_params(KEY, "decode", {**decoder_params("http://10.0.0.1:8001/v1/metaserver",
                                                        "t1", "g" * 32), **kw})


def signed_prefill(**kw: Any) -> dict[str, Any]:
    return sign_params(KEY, "prefill", {**prefill_params(KV, "t1@r", 0), **kw})


def test_the_proxys_params_are_accepted_by_their_role() -> None:
    d = decode_params_for_decoder(KEY, signed_decode())
    assert d.metaserver.endswith("/v1/metaserver") and d.transfer_id == "t1"
    p = decode_params_for_prefiller(KEY, signed_prefill())
    assert p.remote_block_ids == [3, 4] and p.transfer_id == "t1@r" and p.lw_epoch == 0
    p2 = decode_params_for_prefiller(KEY, sign_params(KEY, "prefill",
                                                      prefill_params(KV, "t1@r", 2)))
    assert p2.lw_epoch == 2


@pytest.mark.parametrize("change", [
    {"metaserver": "http://127.0.0.1:9/steal"},  # the SSRF, with the proxy's signature
    {"transfer_id": "evil"},
    {"metaserver_grant": "h" * 32},
])
def test_any_altered_field_breaks_the_decode_signature(change: dict[str, Any]) -> None:
    with pytest.raises(ContractError) as err:
        decode_params_for_decoder(KEY, {**signed_decode(), **change})
    assert err.value.field == "kv_transfer_params.lw_sig"


@pytest.mark.parametrize("change", [
    {"remote_block_ids": [0, 1]}, {"remote_host": "10.6.6.6"}, {"lw_epoch": 1},
    {"transfer_id": "t2@r"}, {"lw_prompt_digest": "0" * 32},
])
def test_any_altered_field_breaks_the_prefill_signature(change: dict[str, Any]) -> None:
    with pytest.raises(ContractError, match="lw_sig"):
        decode_params_for_prefiller(KEY, {**signed_prefill(), **change})


def test_unsigned_other_key_other_role_and_other_version_are_refused() -> None:
    unsigned = decoder_params("http://10.0.0.1:8001/v1/metaserver", "t1", "g" * 32)
    with pytest.raises(ContractError, match="lw_contract|lw_sig"):
        decode_params_for_decoder(KEY, unsigned)
    with pytest.raises(ContractError, match="lw_sig"):
        decode_params_for_decoder(KEY, sign_params(b"another-key-0123456789abcdef", "decode",
                                                   unsigned))
    # a decode signature is never a prefill one (domain separation by role)
    as_prefill = sign_params(KEY, "decode", prefill_params(KV, "t1@r"))
    with pytest.raises(ContractError, match="lw_sig"):
        decode_params_for_prefiller(KEY, as_prefill)
    with pytest.raises(ContractError, match="contract version"):
        decode_params_for_decoder(KEY, {**signed_decode(), "lw_contract": 2})
    # keyless engines (trusted network) still check shapes and versions
    assert decode_params_for_decoder(None, sign_params(None, "decode", unsigned)).transfer_id


@pytest.mark.parametrize("params,field", [
    ("x", "kv_transfer_params"),
    ([1], "kv_transfer_params"),
    ({"do_remote_prefill": True}, "kv_transfer_params"),
    ({**decoder_params("ftp://x/y", "t", "g" * 32)}, "kv_transfer_params.metaserver"),
    ({**decoder_params("http://u@evil/y", "t", "g" * 32)}, "kv_transfer_params.metaserver"),
    ({**decoder_params("http://x/y", "", "g" * 32)}, "kv_transfer_params.transfer_id"),
    ({**decoder_params("http://x/y", "t", "g" * 32), "extra": 1}, "kv_transfer_params"),
])
def test_malformed_decode_params_name_the_field(params: Any, field: str) -> None:
    """Signed (a proxy's bug, not a client: the signature is checked first, so an unsigned
    caller learns no field names) yet malformed: refused naming the field."""
    if isinstance(params, dict):
        params = sign_params(KEY, "decode", params)
    with pytest.raises(ContractError) as err:
        decode_params_for_decoder(KEY, params)
    assert err.value.field.startswith(field), err.value


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=20), c,
                                                                        max_size=6),
                    max_leaves=20))
def test_any_json_is_accepted_or_a_contract_error_never_another_exception(value: Any) -> None:
    for decode in (decode_params_for_decoder, decode_params_for_prefiller):
        try:
            decode(KEY, value)
        except ContractError:
            pass
    if isinstance(value, dict):
        try:
            screen_client_body(value)
        except ContractError:
            pass


def test_a_metaserver_call_binds_the_blocks_to_the_prompt() -> None:
    import json
    call = {"transfer_id": "t1", "sub_transfer_id": "t1@r", "grant": "g" * 32,
            "prompt_token_ids": IDS, "kv_transfer_params": KV}
    assert metaserver_call(json.dumps(call).encode()).kv_transfer_params is not None
    with pytest.raises(ContractError, match="lw_prompt_digest"):
        metaserver_call(json.dumps({**call, "prompt_token_ids": [5, 6, 8]}).encode())
    with pytest.raises(ContractError, match="lw_params_version"):
        metaserver_call(json.dumps({**call, "kv_transfer_params": {
            **KV, "lw_params_version": 2}}).encode())
    with pytest.raises(ContractError, match="body"):
        metaserver_call(b"\xff{")


def test_prompt_digest_is_of_the_ids_and_refuses_what_is_no_token_id() -> None:
    assert prompt_digest([1, 2]) != prompt_digest([2, 1]) and len(prompt_digest([])) == 32
    with pytest.raises(ContractError):
        prompt_digest([1 << 70])


def test_client_bodies_lose_their_transfer_fields_or_are_refused_naming_them() -> None:
    body, fields = screen_client_body({"prompt": "p", "kv_transfer_params": {"a": 1},
                                       "vllm_xargs": {"kv_transfer_params": {}, "k": 1}})
    assert body == {"prompt": "p", "vllm_xargs": {"k": 1}}
    assert fields.dropped == ("kv_transfer_params", "vllm_xargs.kv_transfer_params")
    for bad, field in [({"kv_transfer_params": "x"}, "kv_transfer_params"),
                       ({"vllm_xargs": {"kv_transfer_params": "x"}},
                        "vllm_xargs.kv_transfer_params"),
                       ({"vllm_xargs": []}, "vllm_xargs")]:
        with pytest.raises(ContractError) as err:
            screen_client_body(bad)
        assert err.value.field == field


def test_json_depth_is_measured_without_recursion() -> None:
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    assert json_depth_exceeds(deep) and not json_depth_exceeds({"a": [[{"b": 1}]]})


def test_the_transfer_params_are_spelled_in_the_contract_only() -> None:
    """One module speaks the params' keys; every other reads them through its types."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "lw"
    spelled = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if '"do_remote_prefill"' in p.read_text())
    assert spelled == ["contract/params.py"], spelled
