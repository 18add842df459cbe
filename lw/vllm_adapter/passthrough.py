"""A streaming reverse proxy of one path to the decode server (the sidecar's other paths:
``/metrics``, ``/tokenize``, ... answer as the pod's vLLM does)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from lw.vllm_adapter.proxy_state import ProxyState, _describe, error_body

__all__ = ["passthrough_handler"]

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "te", "trailers", "transfer-encoding", "upgrade", "host",
                        "content-length"})
"""Headers that describe one connection, not the message (RFC 9110 7.6.1), and the ones the
HTTP client sets itself."""


def passthrough_handler(state: ProxyState) -> Callable[[Request], Awaitable[Response]]:
    """A route handler relaying any request to the (one) decode server, body streamed both
    ways; an unreachable server is a 502 in vLLM's error shape."""

    async def relay(request: Request) -> Response:
        decode = state.decodes[0]
        url = decode.url + request.url.path + (
            f"?{request.url.query}" if request.url.query else "")
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        upstream = state.client.build_request(request.method, url, headers=headers,
                                              content=request.stream())
        try:
            resp = await state.client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            state.counters["errors"] += 1
            return JSONResponse(error_body(f"decode server {decode.url} did not answer "
                                           f"{request.method} {request.url.path}: "
                                           f"{_describe(exc)}", 502, stage="decode",
                                           server=decode.url), status_code=502)
        out = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP}
        return StreamingResponse(resp.aiter_raw(), status_code=resp.status_code, headers=out,
                                 background=BackgroundTask(resp.aclose))

    return relay
