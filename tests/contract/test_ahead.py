"""The admit-ahead contract (lw.contract.ahead): its signature is its own role, and each of its
messages decodes into its type or is refused naming the field."""

from __future__ import annotations

import pytest

from lw.contract.ahead import (
    ahead_answer,
    ahead_fetch,
    decode_ahead_params,
    is_ahead_request,
    sign_ahead_params,
)
from lw.contract.params import (
    ContractError,
    decode_params_for_decoder,
    decode_params_for_prefiller,
    is_prefill_request,
    is_remote_prefill_request,
)

KEY = b"ahead-contract-test-key-0123456789"
URL = "http://10.0.0.1:8001/v1/ahead"


def test_signed_ahead_params_decode_and_are_a_prefill_request() -> None:
    p = sign_ahead_params(KEY, URL, "t1", "g" * 32)
    assert is_ahead_request(p) and is_prefill_request(p) and not is_remote_prefill_request(p)
    ap = decode_ahead_params(KEY, p)
    assert (ap.transfer_id, ap.lw_ahead_url, ap.lw_ahead_grant) == ("t1", URL, "g" * 32)


@pytest.mark.parametrize("change", ["key", "url", "transfer", "as_prefill", "as_decode"])
def test_an_ahead_signature_is_valid_for_its_role_and_fields_only(change: str) -> None:
    p = sign_ahead_params(KEY, URL, "t1", "g" * 32)
    with pytest.raises(ContractError) as err:
        if change == "key":
            decode_ahead_params(b"another cluster key 0123456789", p)
        elif change == "url":
            decode_ahead_params(KEY, {**p, "lw_ahead_url": "http://10.9.9.9:1/v1/ahead"})
        elif change == "transfer":
            decode_ahead_params(KEY, {**p, "transfer_id": "t2"})
        elif change == "as_prefill":
            decode_params_for_prefiller(KEY, p)
        else:
            decode_params_for_decoder(KEY, p)
    assert err.value.field == "kv_transfer_params.lw_sig"


@pytest.mark.parametrize(("raw", "field"), [
    (b"{", "body"),
    (b'{"transfer_id": "t", "grant": "short", "prompt_digest": "' + b"0" * 32 + b'"}', "grant"),
    (b'{"transfer_id": "t", "grant": "' + b"g" * 32 + b'", "prompt_digest": "x"}',
     "prompt_digest"),
    (b'{"transfer_id": "t", "grant": "' + b"g" * 32 + b'", "prompt_digest": "' + b"0" * 32
     + b'", "blocks": [1]}', "body"),
])
def test_malformed_fetches_are_refused_naming_the_field(raw: bytes, field: str) -> None:
    with pytest.raises(ContractError) as err:
        ahead_fetch(raw)
    assert err.value.field == field


def test_an_answer_is_go_or_fallback() -> None:
    assert ahead_answer({"status": "fallback", "detail": "late"}).status == "fallback"
    with pytest.raises(ContractError):
        ahead_answer({"status": "maybe"})
    with pytest.raises(ContractError):
        ahead_answer(["go"])
