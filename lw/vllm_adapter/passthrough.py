"""A streaming reverse proxy of one path to the decode server (the sidecar's other paths:
``/metrics``, ``/tokenize``, ... answer as the pod's vLLM does)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from lw.contract.client import screen_client_body
from lw.contract.params import ContractError
from lw.vllm_adapter.proxy_limits import BodyTooLarge, BodyTooSlow, read_body
from lw.vllm_adapter.proxy_state import ProxyState, _describe, error_body

__all__ = ["passthrough_handler"]

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "te", "trailers", "transfer-encoding", "upgrade", "host",
                        "content-length"})
"""Headers that describe one connection, not the message (RFC 9110 7.6.1), and the ones the
HTTP client sets itself."""


async def screened_body(state: ProxyState, request: Request) -> bytes | Response:
    """A body for the decode server: a JSON object without the client's transfer fields
    (re-encoded), other bytes as they came; at most ``limits.max_body_bytes`` either way."""
    try:
        raw = await read_body(request, state.limits.max_body_bytes, state.limits.body_read_s)
    except BodyTooSlow as exc:
        state.counters["bodies_too_slow"] += 1
        return JSONResponse(error_body(str(exc), 408, stage="proxy"), status_code=408,
                            headers={"connection": "close"})
    except BodyTooLarge as exc:
        state.counters["bodies_too_large"] += 1
        return JSONResponse(error_body(str(exc), 413, stage="proxy"), status_code=413,
                            headers={"connection": "close"})  # the rest is not read
    looks_json = raw.lstrip()[:1] in (b"{", b"[") or "json" in request.headers.get(
        "content-type", "")
    if not looks_json:
        return raw  # a form or plain text: no JSON parser downstream reads transfer fields
    try:
        parsed = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        # refused rather than relayed: a parser more lenient than ours must not see it
        return JSONResponse(error_body(f"request body is not valid JSON: {str(exc)[:200]}",
                                       400, stage="proxy"), status_code=400)
    if not isinstance(parsed, dict):
        return raw
    try:
        body, fields = screen_client_body(parsed)
    except ContractError as exc:
        state.counters["client_transfer_params_refused"] += 1
        return JSONResponse(error_body(str(exc), 400, stage="proxy", param=exc.field),
                            status_code=400)
    if fields.dropped:
        state.counters["client_transfer_params_dropped"] += 1
    return json.dumps(body).encode()


def passthrough_handler(state: ProxyState) -> Callable[[Request], Awaitable[Response]]:
    """A route handler relaying any request to the (one) decode server, body streamed both
    ways; an unreachable server is a 502 in vLLM's error shape."""

    async def relay(request: Request) -> Response:
        decode = state.decodes[0]
        url = decode.url + request.url.path + (
            f"?{request.url.query}" if request.url.query else "")
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        content: Any = request.stream()
        if request.method in ("POST", "PUT", "PATCH"):
            # any route of vLLM's may take transfer fields in a JSON body: screened as on the
            # OpenAI routes (bounded, re-encoded; other bodies go as they are, bounded)
            got = await screened_body(state, request)
            if isinstance(got, Response):
                return got
            content = got
        upstream = state.client.build_request(request.method, url, headers=headers,
                                              content=content)
        try:
            resp = await state.client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            state.counters["errors"] += 1
            message = (f"decode server {decode.url} did not answer {request.method} "
                       f"{request.url.path}: {_describe(exc)}")
            state.refusals.warning("upstream_decode", "%s", message)
            return JSONResponse(error_body(state.public(message), 502, stage="decode",
                                           server=state.label(decode.url)), status_code=502)
        out = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP}
        return StreamingResponse(resp.aiter_raw(), status_code=resp.status_code, headers=out,
                                 background=BackgroundTask(resp.aclose))

    return relay
