"""D's first token from P: which requests may take the token P sampled, and the counts of
what became of each token and each remote-prefill request.

A request takes P's token only when D can continue from it exactly as a single server would:
its sampling spec digest equals the one P drew the token with, nothing else reads token 1's
distribution (logprobs, structured output, logits processors, speculative decoding), and the
request still waits for its KV (no token was taken or computed for it yet). Everything else
takes vLLM's own path (D recomputes the last prompt token), counted by reason.
"""

from __future__ import annotations

from typing import Any

from lw.contract.sampling import spec_digest

__all__ = ["FALLBACK_REASONS", "ineligible", "token_problem"]

FALLBACK_REASONS = ("off", "spec_mismatch", "no_spec", "logprobs", "prompt_logprobs",
                    "structured_output", "logits_processors", "speculative", "lora",
                    "multimodal", "late", "pooling")
"""Why a remote-prefill request did not take P's token (a bounded label set for /metrics)."""


def ineligible(request: Any, *, spec_tokens: int = 0) -> str | None:
    """The reason ``request`` (a vLLM Request) cannot continue from a token sampled elsewhere,
    or None: token 1 must be the same draw a single server makes, and nothing may need more of
    it than the token itself."""
    sp = request.sampling_params
    if sp is None:
        return "pooling"
    if sp.logprobs is not None:
        return "logprobs"
    if sp.prompt_logprobs is not None:
        return "prompt_logprobs"
    if getattr(request, "use_structured_output", False) or getattr(
            sp, "structured_outputs", None) is not None:
        return "structured_output"
    if getattr(sp, "logits_processors", None):
        return "logits_processors"
    if spec_tokens:
        return "speculative"
    if getattr(request, "lora_request", None) is not None:
        return "lora"
    if getattr(request, "mm_features", None):
        return "multimodal"
    return None


def token_problem(request: Any, spec: str, *, spec_tokens: int = 0) -> str | None:
    """Why ``request`` may not take a token drawn under spec digest ``spec`` (None: it may)."""
    why = ineligible(request, spec_tokens=spec_tokens)
    if why is not None:
        return why
    if not spec:
        return "no_spec"  # a P without lw's scheduler half says nothing of how it sampled
    if spec != spec_digest(request.sampling_params):
        return "spec_mismatch"
    return None
