"""What a client may send in the transfer fields of an OpenAI body: nothing lw acts on.

A client's ``kv_transfer_params`` (top level, where vLLM takes an object, or in ``vllm_xargs``,
whose values vLLM passes to the connector as they are) never reaches D or P: a well-typed one is
dropped (and counted by the caller); one of a type vLLM would not hand on as transfer
parameters is refused with a :class:`~lw.contract.params.ContractError` naming it, which the
proxy answers with vLLM's 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lw.contract.params import ContractError

__all__ = ["MAX_JSON_DEPTH", "TRACE_HEADERS", "ClientFields", "json_depth_exceeds",
           "screen_client_body"]

TRACE_HEADERS = ("traceparent", "tracestate")
"""W3C trace-context headers: what a request's trace is carried in (the proxy forwards them)."""

MAX_JSON_DEPTH = 64
"""Deepest nesting of a client body the proxy parses further (chat content parts are ~5)."""
TRANSFER_FIELDS = ("kv_transfer_params",)


@dataclass(frozen=True)
class ClientFields:
    """What :func:`screen_client_body` removed from a body: the field paths, for counting."""

    dropped: tuple[str, ...] = ()


def screen_client_body(body: dict[str, Any]) -> tuple[dict[str, Any], ClientFields]:
    """``body`` without any transfer field, and which were dropped; raises ContractError for a
    transfer field of a wrong type, or a ``vllm_xargs`` that is not an object."""
    out = dict(body)
    dropped: list[str] = []
    for key in TRANSFER_FIELDS:
        if key in out:
            value = out.pop(key)
            if value is not None and not isinstance(value, dict):
                raise ContractError(key, f"must be an object or null, got "
                                         f"{type(value).__name__} (and a client's transfer "
                                         "parameters are never used: the proxy sets them)")
            dropped.append(key)
    xargs = out.get("vllm_xargs")
    if xargs is not None:
        if not isinstance(xargs, dict):
            raise ContractError("vllm_xargs", f"must be an object, got {type(xargs).__name__}")
        kept = dict(xargs)
        for key in TRANSFER_FIELDS:
            if key in kept:
                value = kept.pop(key)
                if value is not None and not isinstance(value, dict):
                    raise ContractError(f"vllm_xargs.{key}",
                                        f"must not be set (got {type(value).__name__}): "
                                        "transfer parameters are the proxy's")
                dropped.append(f"vllm_xargs.{key}")
        out["vllm_xargs"] = kept
    return out, ClientFields(tuple(dropped))


def json_depth_exceeds(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``value`` (parsed JSON) nests deeper than ``limit`` (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth > limit:
                return True
            items = v.values() if isinstance(v, dict) else v
            stack.extend((x, depth + 1) for x in items if isinstance(x, dict | list))
    return False
