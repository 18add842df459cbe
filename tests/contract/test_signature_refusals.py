"""Refusals of the proxy's params signature that a right version alone must not get past: no
signature at all, one that is not a string, not ASCII, or of the other role; and the ahead
params' own checks. Written to kill the survivors of ``tools/mutation.py --scope security``."""

from __future__ import annotations

from typing import Any

import pytest

from lw.contract.ahead import (
    AHEAD_ROLE,
    ahead_params,
    ahead_url,
    decode_ahead_params,
    is_ahead_request,
    sign_ahead_params,
)
from lw.contract.params import (
    CONTRACT_VERSION,
    ContractError,
    decode_params_for_decoder,
    decode_params_for_prefiller,
    decoder_params,
    prefill_params,
    prompt_digest,
    sign_params,
)

KEY = b"contract-test-key-0123456789abcdef"
KV = {"remote_engine_id": "d0", "remote_host": "10.0.0.2", "remote_port": 5555,
      "remote_block_ids": [3, 4], "remote_tp_size": 1, "lw_geometry": "g",
      "lw_params_version": CONTRACT_VERSION, "lw_prompt_digest": prompt_digest([5, 6])}
AHEAD_URL = "http://10.0.0.1:8001/v1/ahead"


def prefill(**kw: Any) -> dict[str, Any]:
    """P's params at this contract version, unsigned."""
    return {**prefill_params(KV, "t1@r"), "lw_contract": CONTRACT_VERSION, **kw}


def decode(**kw: Any) -> dict[str, Any]:
    """D's params at this contract version, unsigned."""
    return {**decoder_params("http://10.0.0.1:8001/v1/metaserver", "t1", "g" * 32),
            "lw_contract": CONTRACT_VERSION, **kw}


@pytest.mark.parametrize("sig", [None, "", 7, "0" * 64, "é" * 64])
def test_prefill_params_without_the_proxys_signature_are_refused_on_a_keyed_cluster(
        sig: Any) -> None:
    """PrefillParams' ``lw_sig`` has a default (""), so only the signature check stops params
    a client wrote straight at P's port: absent, empty, not a string or not ASCII."""
    params = prefill() if sig is None else prefill(lw_sig=sig)
    with pytest.raises(ContractError) as err:
        decode_params_for_prefiller(KEY, params)
    assert err.value.field == "kv_transfer_params.lw_sig"


@pytest.mark.parametrize("sig", [None, "", 7, "0" * 64])
def test_decode_params_without_the_proxys_signature_name_the_signature(sig: Any) -> None:
    params = decode() if sig is None else decode(lw_sig=sig)
    with pytest.raises(ContractError) as err:
        decode_params_for_decoder(KEY, params)
    assert err.value.field == "kv_transfer_params.lw_sig"  # not the missing field's name


def test_without_a_key_the_same_params_pass_on_shape_and_version() -> None:
    assert decode_params_for_prefiller(None, prefill()).transfer_id == "t1@r"
    assert decode_params_for_decoder(None, decode(lw_sig="0" * 64)).transfer_id == "t1"


def test_each_role_accepts_only_its_own_signature() -> None:
    p = sign_params(KEY, "prefill", prefill_params(KV, "t1@r"))
    assert decode_params_for_prefiller(KEY, p).transfer_id == "t1@r"
    d = sign_params(KEY, "decode", decode())
    assert decode_params_for_decoder(KEY, d).transfer_id == "t1"
    as_decode = sign_params(KEY, "prefill", decode())
    with pytest.raises(ContractError, match="lw_sig"):
        decode_params_for_decoder(KEY, as_decode)


def test_ahead_params_with_a_right_signature_but_the_wrong_direction_are_refused() -> None:
    """The flags are checked after the signature: a proxy's bug, never a client's."""
    for flags in ({"do_remote_decode": False}, {"do_remote_prefill": True}):
        p = sign_params(KEY, AHEAD_ROLE, {**ahead_params(AHEAD_URL, "t1", "g" * 32), **flags})
        with pytest.raises(ContractError) as err:
            decode_ahead_params(KEY, p)
        assert err.value.field == "kv_transfer_params.do_remote_decode"


def test_ahead_params_say_compute_only_when_asked() -> None:
    assert "lw_ahead_compute" not in ahead_params(AHEAD_URL, "t1", "g" * 32)
    assert "lw_ahead_compute" not in sign_ahead_params(KEY, AHEAD_URL, "t1", "g" * 32)
    assert ahead_params(AHEAD_URL, "t1", "g" * 32, compute=True)["lw_ahead_compute"] is True
    signed = sign_ahead_params(KEY, AHEAD_URL, "t1", "g" * 32, compute=True)
    assert decode_ahead_params(KEY, signed).lw_ahead_compute is True
    assert decode_ahead_params(KEY, sign_ahead_params(KEY, AHEAD_URL, "t1", "g" * 32)
                               ).lw_ahead_compute is False


def test_the_ahead_url_is_beside_the_metaserver_and_only_a_mapping_asks_for_it() -> None:
    assert ahead_url("http://10.0.0.1:8001/v1/metaserver") == AHEAD_URL
    assert not is_ahead_request(["lw_ahead_url"]) and not is_ahead_request("lw_ahead_url")
    assert not is_ahead_request({"do_remote_decode": True})
    assert is_ahead_request({"lw_ahead_url": 1})


def test_a_refusal_says_where_and_why() -> None:
    err = ContractError("kv_transfer_params.lw_sig", "not signed")
    assert str(err) == "kv_transfer_params.lw_sig: not signed" and err.field.endswith("lw_sig")
