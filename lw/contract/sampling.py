"""What decides a request's first sampled token, as P and D agree on it: the client fields the
proxy hands P, and the digest of the sampling spec both engines' vLLM derived from them.

D takes the token P sampled as its own first token only when P's digest of the spec P drew it
with equals D's digest of its own: the same temperature, top-p/k, min-p, seed, penalties, bias,
allowed and bad ids, and (where min_tokens masks them) stop ids. A field left out here that
changes token 1 would let D stream a token a single server could not have sampled: add it to
:func:`sampling_spec` (the digest then differs and D falls back, never the reverse).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

__all__ = ["SAMPLING_FIELDS", "p_sampling_fields", "sampling_spec", "spec_digest"]

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids",
                   "bad_words", "stop_token_ids", "ignore_eos", "min_tokens")
"""The client body fields (OpenAI and vLLM's extensions) that act on token 1, which the proxy
copies into P's body so that P's vLLM derives the sampling parameters D's derives."""


def p_sampling_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling fields of a client's body as P gets them: P computes one token, and vLLM
    refuses ``min_tokens`` above ``max_tokens``, so ``min_tokens`` is capped at 1 (for token 1
    only "at least one" matters: the stop ids are masked)."""
    out = {k: body[k] for k in SAMPLING_FIELDS if k in body}
    mt = out.get("min_tokens")
    if isinstance(mt, int) and not isinstance(mt, bool) and mt > 1:
        out["min_tokens"] = 1
    return out


def _ids(value: Any) -> list[int] | None:
    return None if value is None else sorted(int(t) for t in value)


def sampling_spec(sp: Any) -> dict[str, Any]:
    """The fields of a vLLM ``SamplingParams`` that decide token 1, in a canonical form."""
    bias = getattr(sp, "logit_bias", None) or {}
    min_tokens = int(getattr(sp, "min_tokens", 0) or 0)
    spec: dict[str, Any] = {
        "temperature": float(sp.temperature),
        "top_p": float(sp.top_p),
        "top_k": int(sp.top_k),
        "min_p": float(sp.min_p),
        "seed": sp.seed,
        "presence_penalty": float(sp.presence_penalty),
        "frequency_penalty": float(sp.frequency_penalty),
        "repetition_penalty": float(sp.repetition_penalty),
        "logit_bias": sorted((int(k), float(v)) for k, v in bias.items()),
        "allowed_token_ids": _ids(getattr(sp, "allowed_token_ids", None)),
        "bad_words": [list(w) for w in getattr(sp, "bad_words_token_ids", None) or ()],
        "min_tokens": min(min_tokens, 1),
    }
    if min_tokens:  # masked for token 1: which ids are stop ids matters
        spec["stop_ids"] = _ids(getattr(sp, "all_stop_token_ids", None) or ())
    return spec


def spec_digest(sp: Any) -> str:
    """128 bits of BLAKE2b over :func:`sampling_spec` (what travels with P's token)."""
    canon = json.dumps(sampling_spec(sp), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canon.encode(), digest_size=16, person=b"lw-spec").hexdigest()
