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
