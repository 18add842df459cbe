"""What the proxy reads from a client, on every route: a body within its bounds, parsed once, its
transfer fields screened (lw.contract.client); a refusal in vLLM's error shape, counted and
logged at a limited rate."""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from lw.contract.client import MAX_JSON_DEPTH, json_depth_exceeds, screen_client_body
from lw.contract.params import ContractError
from lw.proxy.errors import json_invalid, not_an_object
from lw.proxy.limits import BodyAbandoned, BodyTooLarge, BodyTooSlow, read_body
from lw.proxy.state import ProxyState, error_body

__all__ = ["BadJson", "abandoned", "client_bytes", "decode_json", "encode_json", "parse_json",
           "refuse", "screen", "too_deep"]

def refuse(state: ProxyState, status: int, message: str, *, counter: str,
           param: str | None = None, vllm: dict[str, Any] | None = None) -> JSONResponse:
    """A client body refused by the proxy itself, in vLLM's error shape; counted, and logged
    at most twice per kind every few seconds (:mod:`lw.transport.ratelog`). ``vllm``: the
    very answer vLLM gives to this body (lw.proxy.errors), sent instead of lw's ``message``
    (which the log line keeps)."""
    state.counters[counter] += 1
    state.refusals.note(counter, "client request refused (%d): %s", status, message)
    body = vllm if vllm is not None else error_body(message, status, stage="proxy", param=param)
    # closed after the answer: the rest of a refused body is not read (uvicorn would drain it)
    return JSONResponse(body, status_code=status, headers={"connection": "close"})


def abandoned(state: ProxyState) -> Response:
    """The answer to a client that left mid-body: counted, not logged (nobody reads it)."""
    state.counters["bodies_abandoned"] += 1
    return Response(status_code=400, headers={"connection": "close"})


async def client_bytes(state: ProxyState, request: Request) -> bytes | Response:
    """The body, within ``limits.max_body_bytes`` and ``limits.body_read_s`` (413 / 408), read
    while fewer than ``limits.body_reads`` others are (503)."""
    now = state.load
    if now.reads >= state.limits.body_reads:
        # each body being read may grow to max_body_bytes: bound what clients can make us hold
        return refuse(state, 503, f"the proxy is reading {state.limits.body_reads} request "
                      "bodies; try again", counter="bodies_refused_busy")
    now.reads += 1
    try:
        return await read_body(request, state.limits.max_body_bytes, state.limits.body_read_s)
    except BodyTooLarge as exc:
        return refuse(state, 413, str(exc), counter="bodies_too_large")
    except BodyTooSlow as exc:
        return refuse(state, 408, str(exc), counter="bodies_too_slow")
    except BodyAbandoned:
        return abandoned(state)
    finally:
        now.reads -= 1


class BadJson(ValueError):
    """A body the proxy does not relay as JSON; ``path`` names the place (None: the whole);
    ``vllm``: the answer vLLM gives to it, where vLLM refuses it too (lw.proxy.errors)."""

    def __init__(self, message: str, path: str | None = None,
                 vllm: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.vllm = vllm


def decode_json(raw: bytes) -> Any:
    """``raw`` as JSON (UTF-8/16/32, BOM or not, as vLLM reads it) that can be encoded again:
    BadJson for what is not JSON, a number out of float range, NaN/Infinity, a lone surrogate."""
    if not raw:  # FastAPI reads no body as None: vLLM's "Field required"
        raise BadJson("request body is empty", vllm=not_an_object(None))
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:  # vLLM's answer names the character, as "body.28"
        raise BadJson(f"request body is not valid JSON: {str(exc)[:200]}",
                      vllm=json_invalid(exc)) from None
    except (ValueError, RecursionError) as exc:
        raise BadJson(f"request body is not valid JSON: {str(exc)[:200]}") from None
    try:
        encode_json(value)
    except (ValueError, RecursionError):
        path, why = _unencodable(value)
        path = path[:200]  # a key may be long: the message names it, it does not carry it
        raise BadJson(f"request body is not valid JSON at {path or 'its top level'}: {why}",
                      path or None) from None
    return value


def encode_json(value: Any) -> bytes:
    """``value`` as UTF-8 JSON; ValueError for what JSON cannot carry (see decode_json)."""
    return json.dumps(value, allow_nan=False, ensure_ascii=False).encode()


def _unencodable(value: Any) -> tuple[str, str]:
    """Where in ``value`` the first thing JSON cannot carry is, and what it is."""
    todo: list[tuple[str, Any]] = [("", value)]
    while todo:  # a loop, not recursion: the value may nest as deep as the parser allowed
        path, v = todo.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return path, (f"{v!r} is not a finite number (NaN, Infinity and numbers beyond "
                          "1.8e308 are not allowed)")
        if isinstance(v, str) and _lone_surrogate(v):
            return path, "a string holds a lone UTF-16 surrogate (\\ud800-\\udfff)"
        if isinstance(v, dict):
            for k, item in reversed(list(v.items())):
                if _lone_surrogate(k):
                    return path, "a key holds a lone UTF-16 surrogate (\\ud800-\\udfff)"
                todo.append((f"{path}.{k}" if path else k, item))
        elif isinstance(v, list):
            todo.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(v))))
    return "", "it nests too deep to encode"


def _lone_surrogate(s: str) -> bool:
    try:
        s.encode()
    except UnicodeEncodeError:
        return True
    return False


def parse_json(state: ProxyState, raw: bytes) -> dict[str, Any] | JSONResponse:
    """The parsed body, a JSON object, or a 400: what the proxy cannot parse (or encode again)
    it never relays (a parser more lenient than the proxy's must not see it). Bytes that are
    not JSON and JSON that is not an object get vLLM's very answer (lw.proxy.errors)."""
    try:
        parsed = decode_json(raw)
    except BadJson as exc:
        return refuse(state, 400, str(exc), counter="bad_requests", param=exc.path,
                      vllm=exc.vllm)
    if not isinstance(parsed, dict):  # before the depth: vLLM looks at the type first
        return refuse(state, 400, "request body must be a JSON object", counter="bad_requests",
                      vllm=not_an_object(parsed))
    return parsed


def too_deep(state: ProxyState, parsed: Any) -> JSONResponse | None:
    """The 400 for a parsed body nested deeper than MAX_JSON_DEPTH, or None."""
    if json_depth_exceeds(parsed):
        return refuse(state, 400, f"request body nests deeper than {MAX_JSON_DEPTH} levels",
                      counter="bad_requests")
    return None


def screen(state: ProxyState, body: dict[str, Any]) -> dict[str, Any] | JSONResponse:
    """``body`` without the client's transfer fields (dropped, counted), or the 400 naming one
    of a wrong type."""
    try:
        out, fields = screen_client_body(body)
    except ContractError as exc:
        return refuse(state, 400, str(exc), counter="client_transfer_params_refused",
                      param=exc.field)
    if fields.dropped:
        state.counters["client_transfer_params_dropped"] += 1
        state.refusals.note("client_transfer_params_dropped", "a client's %s dropped (the "
                            "proxy sets transfer parameters)", ", ".join(fields.dropped))
    return out
