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

from lw.proxy.intake import client_bytes, parse_json, screen
from lw.proxy.state import ProxyState, _describe, error_body

__all__ = ["passthrough_handler"]

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "te", "trailers", "transfer-encoding", "upgrade", "host",
                        "content-length"})
"""Headers that describe one connection, not the message (RFC 9110 7.6.1), and the ones the
HTTP client sets itself."""


async def screened_body(state: ProxyState, request: Request) -> bytes | Response:
    """A body for the decode server: a JSON object without the client's transfer fields
    (re-encoded), other bytes as they came; at most ``limits.max_body_bytes`` either way."""
    raw = await client_bytes(state, request)
    if isinstance(raw, Response):
        return raw
    looks_json = raw.lstrip()[:1] in (b"{", b"[") or "json" in request.headers.get(
        "content-type", "")
    if not looks_json:
        return raw  # a form or plain text: no JSON parser downstream reads transfer fields
    parsed = parse_json(state, raw)
    if isinstance(parsed, Response):
        return parsed
    if not isinstance(parsed, dict):
        return raw
    body = screen(state, parsed)
    return body if isinstance(body, Response) else json.dumps(body).encode()


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
