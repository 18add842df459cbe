"""A streaming reverse proxy of one path to the decode server (the sidecar's other paths:
``/metrics``, ``/tokenize``, ... answer as the pod's vLLM does), and the relay of requests the
proxy cannot route D first."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.types import Receive, Scope, Send

from lw.proxy.bodies import describe_exc
from lw.proxy.intake import (
    BadJson,
    client_bytes,
    decode_json,
    encode_json,
    refuse,
    screen,
    too_deep,
)
from lw.proxy.state import ProxyState, error_body

__all__ = ["Relay", "passthrough_handler", "relay_unroutable", "screened_body"]

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "te", "trailers", "transfer-encoding", "upgrade", "host",
                        "content-length"})
"""Headers that describe one connection, not the message (RFC 9110 7.6.1), and the ones the
HTTP client sets itself."""


def _json_media_type(request: Request) -> bool:
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                           and media.endswith("+json"))


async def screened_body(state: ProxyState, request: Request) -> bytes | Response:
    """A body for the decode server: JSON (whatever its content type or encoding) re-encoded
    without the client's transfer fields, other bytes as they came; at most
    ``limits.max_body_bytes`` either way."""
    raw = await client_bytes(state, request)
    if isinstance(raw, Response) or not raw:
        return raw
    try:
        # vLLM parses with json.loads (UTF-8/16/32, BOM or not) whatever the content type
        # says: every body it could read as JSON is read here first
        parsed = decode_json(raw)
    except BadJson as exc:
        if exc.path is not None or _json_media_type(request):
            return refuse(state, 400, str(exc), counter="bad_requests", param=exc.path,
                          vllm=exc.vllm)
        # not JSON: vLLM reads it as a form or bytes, where no transfer field is an object
        return raw
    deep = too_deep(state, parsed)
    if deep is not None:
        return deep
    if isinstance(parsed, dict):
        body = screen(state, parsed)
        if isinstance(body, Response):
            return body
        parsed = body
    elif isinstance(parsed, list):  # a batch: each object screened as a body is
        items = [screen(state, x) if isinstance(x, dict) else x for x in parsed]
        refused = next((x for x in items if isinstance(x, Response)), None)
        if refused is not None:
            return refused
        parsed = items
    return encode_json(parsed)  # decode_json checked that it encodes


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Relay(Response):
    """One request to a decode server, its answer streamed back; the client leaving (before
    or during the answer) closes the upstream request, which vLLM aborts."""

    def __init__(self, state: ProxyState, upstream: httpx.Request, what: str,
                 counted: bool = False) -> None:
        super().__init__()
        self.state, self.upstream, self.what, self.counted = state, upstream, what, counted
        if counted:  # a request in flight, against limits.max_concurrent_requests
            state.load.relays += 1

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._relay(scope, receive, send)
        finally:
            if self.counted:
                self.state.load.relays -= 1

    async def _relay(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state
        sending = asyncio.ensure_future(state.client.send(self.upstream, stream=True))
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not sending.done():
                sending.cancel()  # the client left first: the upstream connection closes
        if not sending.done() or sending.cancelled():
            state.counters["client_disconnects"] += 1
            return
        try:
            resp = sending.result()
        except httpx.HTTPError as exc:
            state.counters["errors"] += 1
            server = f"{self.upstream.url.scheme}://{self.upstream.url.netloc.decode()}"
            message = f"decode server {server} did not answer {self.what}: {describe_exc(exc)}"
            state.refusals.note("upstream_decode", "%s", message)
            answer: Response = JSONResponse(error_body(
                state.public(message), 502, stage="decode", server=state.label(server)),
                status_code=502)
            await answer(scope, receive, send)
            return
        if self.counted:  # vLLM's refusal of what the proxy could not route is the client's
            state.counters["bad_requests" if resp.status_code >= 400
                           else "relayed_unroutable"] += 1
        out = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP}
        # starlette stops the stream when the client disconnects; then aclose ends D's request
        answer = StreamingResponse(resp.aiter_raw(), status_code=resp.status_code, headers=out,
                                   background=BackgroundTask(resp.aclose))
        await answer(scope, receive, send)


def relay_unroutable(state: ProxyState, request: Request, api: str, body: dict[str, Any],
                     why: str) -> Response:
    """A JSON object the proxy cannot route D first (its transfer fields already dropped) goes
    to a decode server re-encoded, so the client gets vLLM's own answer (status, type and
    message), streamed; D serves it alone if vLLM accepts it. Counted as a request in flight."""
    try:
        content = encode_json(body)
    except (ValueError, RecursionError) as exc:  # parse_json refuses these: a second line
        return refuse(state, 400, f"request body cannot be relayed as JSON: {exc}",
                      counter="bad_requests")
    decode = state.pick(state.decodes)
    headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
    headers["content-type"] = "application/json"
    upstream = state.client.build_request("POST", decode.url + api, headers=headers,
                                          content=content)
    return Relay(state, upstream, f"POST {api} (request not routable D first: {why})", counted=True)


def passthrough_handler(state: ProxyState) -> Callable[[Request], Awaitable[Response]]:
    """A route handler relaying any request to the (one) decode server, body screened, answer
    streamed; an unreachable server is a 502 in vLLM's error shape."""

    async def relay(request: Request) -> Response:
        decode = state.decodes[0]
        url = decode.url + request.url.path + (
            f"?{request.url.query}" if request.url.query else "")
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        # every method's body is read and screened: a route of vLLM's may parse a JSON body
        # (transfer fields) whatever the method; bounded, re-encoded, other bodies as they are
        got = await screened_body(state, request)
        if isinstance(got, Response):
            return got
        upstream = state.client.build_request(request.method, url, headers=headers,
                                              content=got or None)
        return Relay(state, upstream, f"{request.method} {request.url.path}")

    return relay
