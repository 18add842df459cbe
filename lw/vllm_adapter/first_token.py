"""D's first token from P: which requests may take the token P sampled, and the counts of
what became of each token and each remote-prefill request.

A request takes P's token only when D can continue from it exactly as a single server would:
its sampling spec digest equals the one P drew the token with, nothing else reads token 1's
distribution (logprobs, structured output, logits processors, speculative decoding), and the
request still waits for its KV (no token was taken or computed for it yet). Everything else
takes vLLM's own path (D recomputes the last prompt token), counted by reason.
"""

from __future__ import annotations

import sys
from typing import Any

import msgspec

from lw.contract.sampling import spec_digest
from lw.fsm.messages import FirstTokenStatus

__all__ = ["COUNTS", "FALLBACK_REASONS", "LW_SCHEDULER_MODULE", "checked_status", "ineligible",
           "scheduler_is_lws", "side_off_reason", "token_problem"]

FALLBACK_REASONS = ("off", "spec_mismatch", "no_spec", "logprobs", "prompt_logprobs",
                    "structured_output", "logits_processors", "speculative", "lora",
                    "multimodal", "late", "pooling")
"""Why a remote-prefill request did not take P's token (a bounded label set for /metrics)."""

COUNTS = ("first_token_from_p", "last_token_recomputed", "ended_at_first_token",
          "first_token_discarded", "first_token_waits_expired")
"""D's first-token counters (lw.vllm_adapter.metrics.COUNTERS), as ``lw status`` shows them."""

LW_SCHEDULER_MODULE = "lw.vllm_adapter.lw_scheduler"


def scheduler_is_lws(scheduler_cls: Any) -> bool:
    """Whether vLLM's ``scheduler_config.scheduler_cls`` (None: vLLM's own; a qualified name;
    a class) is lw's scheduler or a subclass of one of its classes. A name is looked up only
    where its module is imported already (vLLM built the scheduler before its connector)."""
    if isinstance(scheduler_cls, str):
        if scheduler_cls.startswith(LW_SCHEDULER_MODULE + "."):
            return True
        mod, _, name = scheduler_cls.rpartition(".")
        scheduler_cls = getattr(sys.modules.get(mod), name, None)
    if not isinstance(scheduler_cls, type):
        return False
    return any(c.__module__ == LW_SCHEDULER_MODULE for c in scheduler_cls.__mro__)


def side_off_reason(cfg: Any, vllm_config: Any) -> str | None:
    """Why this engine cannot send (P) or take (D) first tokens, as far as its connector's
    scheduler side can tell without lw's scheduler class (None: on, or for lw's scheduler
    class to decide: lw.vllm_adapter.lw_scheduler.first_token_off_reason). P needs none of
    lw's classes: its connector hands the token to its worker when the request finishes."""
    if not cfg.first_token_from_p:
        return "first_token_from_p is false"
    if cfg.is_producer:
        return None
    sched = getattr(vllm_config.scheduler_config, "scheduler_cls", None)
    if not scheduler_is_lws(sched):
        name = sched if isinstance(sched, str) else getattr(sched, "__qualname__", None)
        name = name or "vLLM's own"
        return (f"the engine's scheduler is {name}, not lw's: start it with "
                f"python -m lw.vllm_adapter.serve, or --scheduler-cls "
                f"{LW_SCHEDULER_MODULE}.LwScheduler")
    return None


def checked_status(snap: Any) -> FirstTokenStatus:
    """``snap`` (a FirstTokenStatus from the scheduler process, made in Python and so never
    validated) as one that holds to its declared bounds, or ValueError: what a status reply
    carries is decoded once, here, where it enters the worker."""
    if not isinstance(snap, FirstTokenStatus):
        raise ValueError(f"not a FirstTokenStatus: {type(snap).__name__}")
    try:
        return msgspec.msgpack.decode(msgspec.msgpack.encode(snap), type=FirstTokenStatus)
    except (msgspec.ValidationError, msgspec.DecodeError, OverflowError, TypeError) as exc:
        raise ValueError(f"first-token status refused: {exc}") from None


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
