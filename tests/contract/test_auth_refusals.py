"""Bounds of the control plane's signed calls (lw.contract.auth) that the refusal tests left
open: each call's nonce carries 128 random bits, and the verifier remembers 200,000 nonces by
default (docs/deployment.md, "Threat model"). Written to kill the survivors of
``tools/mutation.py --scope security``."""

from __future__ import annotations

import re

from lw.contract.auth import NONCE, CallVerifier, signed_call

KEY = b"control-auth-test-key-0123456789"


def test_a_calls_nonce_is_128_random_bits() -> None:
    nonces = {signed_call(KEY, {"x": 1}, now=100.0)[1][NONCE] for _ in range(8)}
    assert len(nonces) == 8
    assert all(re.fullmatch(r"[0-9a-f]{32}", n) for n in nonces)


def test_the_verifier_remembers_the_threat_models_nonces() -> None:
    v = CallVerifier(KEY)
    assert (v.max_nonces, v.window_s) == (200_000, 30.0)


def _headers(ts: str = "1700000000.5", nonce: str = "n" * 16) -> dict[str, str]:
    from lw.contract.auth import SIGNATURE, TIMESTAMP

    return {SIGNATURE: "a" * 64, TIMESTAMP: ts, NONCE: nonce}


def test_header_bounds_hold_at_their_edges() -> None:
    """The longest timestamp the pattern takes (22 characters) and a 64-character nonce pass
    the size checks; a 7-character nonce is refused for its length, before its pattern."""
    v = CallVerifier(KEY)
    assert v.header_problem(_headers(ts="123456789012.123456789")) == ""
    assert v.header_problem(_headers(nonce="n" * 64)) == ""
    assert v.header_problem(_headers(nonce="n" * 8)) == ""
    assert v.header_problem(_headers(nonce="n" * 7)).endswith("must have 8..64 characters")
    assert v.header_problem(_headers(nonce="n" * 65)).endswith("must have 8..64 characters")


def test_without_a_key_every_header_set_is_accepted_and_a_short_window_is_valid() -> None:
    assert CallVerifier(None).header_problem({}) == ""
    assert CallVerifier(KEY, window_s=0.5).window_s == 0.5


def test_a_nonce_is_remembered_until_its_window_has_passed_not_as_it_ends() -> None:
    """A replay exactly at the window's edge is still inside it (not stale) and must still be
    refused as a replay."""
    v = CallVerifier(KEY, window_s=30.0)
    content, headers = signed_call(KEY, {"x": 1}, now=100.0)
    assert v.check(headers, content, now=100.0) == ""
    assert v.check(headers, content, now=130.0).startswith("replayed call")
