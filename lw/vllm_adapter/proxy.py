"""The D-first proxy (``lw proxy``): routes OpenAI requests to a decode server first, then runs
the prefill when the decode server asks for it through the proxy's *metaserver* endpoint.

Contract (the KV connectors on both sides rely on it)
====================================================

1. Client -> proxy: ``POST /v1/completions`` or ``POST /v1/chat/completions`` (streaming SSE or
   not). The proxy assigns ``request_id`` (a uuid4 hex string) and picks the decode server with the
   fewest outstanding requests (ties: round robin).
2. Proxy -> decode server (D): the client's body, with ``kv_transfer_params`` replaced by::

       {"do_remote_prefill": true, "do_remote_decode": false,
        "metaserver": "http://<proxy host>:<port>/v1/metaserver", "transfer_id": <request_id>}

   and the header ``X-Request-Id: <request_id>`` (vLLM then names the request
   ``cmpl-<request_id>`` / ``chatcmpl-<request_id>``). A client-supplied ``kv_transfer_params`` is
   dropped.
3. One client request becomes several vLLM requests on D (``n`` > 1 children, each prompt of a
   ``prompt`` list), all carrying the proxy's ``transfer_id``; a *sub-transfer* is one of them.
   For each vLLM request whose prefill it wants, D's connector (scheduler side, once it has
   allocated the blocks) -> ``POST /v1/metaserver`` with::

       {"transfer_id": <request_id>, "sub_transfer_id": str, "prompt_token_ids": [int, ...],
        "kv_transfer_params": {...}}

   ``sub_transfer_id`` is unique per vLLM request (lw: ``<request_id>@<D's vLLM request id>``,
   at most 256 characters), ``prompt_token_ids`` are that request's prompt tokens, and the params
   are whatever P needs to push the KV (``remote_engine_id``, ``remote_host``, ``remote_port``,
   ``remote_block_ids``, ``remote_first_block``, ``remote_dp_rank``, ...). D posts nothing for a
   request it computes itself (e.g. a prefix-cache hit with a short tail): a client request may
   have zero, one or several sub-transfers. Replies:

   - ``202 {"status": "ok", "transfer_id", "sub_transfer_id", "prefill_url", "detail"}``: the
     prefill request of that sub-transfer was started (or had already been started: repeated
     posts for one sub-transfer are idempotent and start nothing new).
   - ``404 {"status": "error", ...}``: unknown transfer (the client request already ended).
   - ``400 {"status": "error", ...}``: malformed body.

   **The reply does not wait for the prefill.** The prefill request runs in a background task:
   the connector's scheduler-side call must stay short, and the outcome of the transfer reaches D
   through the KV connector itself (DONE from P, or D's own deadline), not through this reply.
4. Proxy -> prefill server (P), one request per sub-transfer, each picked by fewest outstanding
   requests: ``POST /v1/completions`` with ``{"model": <client's model>, "prompt":
   <prompt_token_ids>, "max_tokens": 1, "n": 1, "stream": false, "kv_transfer_params": ...}``
   (plus the client's ``cache_salt`` / ``priority`` if given), so P computes exactly D's tokens
   whatever the client's API (chat, ``n`` > 1, prompt lists); ``kv_transfer_params`` = D's params
   updated with ``{"do_remote_decode": true, "do_remote_prefill": false, "transfer_id":
   <sub_transfer_id>}``; header ``X-Request-Id: <request_id>``.
5. Streaming: the proxy sends the client its response head (200, D's SSE content type) as soon
   as D answers with its head (D accepted the request), not with the first token, which waits for
   the whole P/D round trip. From then on every error is sent in-band, as a final SSE event
   ``data: {"error": {...}}``.
6. Failures. If a prefill request fails (connection error, timeout, non-2xx) the proxy records
   it; if no byte of D's answer has been relayed yet, the proxy abandons the D request (closing
   the connection makes vLLM abort it) and reports the error naming the prefill server: HTTP 502
   (504 if the prefill timed out), or the final SSE event if the stream's head is already out.
   Once D's answer has started a prefill error is only logged: either that KV had arrived, or
   (another choice of the same answer streaming) D's own deadline fails the vLLM request whose KV
   never comes. D unreachable -> 502; D timing out -> 504; D answering 5xx -> 502; D answering
   4xx -> passed through unchanged. Every outgoing call has a timeout.
7. Client disconnect (streaming or not) -> the D request is closed (vLLM aborts it) and every
   in-flight prefill request of the client request is cancelled (closed, so P aborts it too).
   Prefills still running when D's answer completed normally are left to finish.

Other endpoints: ``GET /health`` (proxy alive + per-server reachability; always 200, ``status`` is
``ok`` or ``degraded``), ``GET /v1/models`` (passed through from a decode server),
``GET /metrics-json`` (counters: requests, errors, in-flight per server, ...).
Error bodies have the OpenAI shape ``{"error": {"message", "type", "stage", "server", ...}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import ipaddress
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lw.vllm_adapter.proxy_timeline import ProxyTimeline

__all__ = [
    "Backend",
    "ProxyState",
    "SubPrefill",
    "Transfer",
    "build_app",
    "build_decode_body",
    "build_prefill_body",
    "main",
    "validate_request",
]

log = logging.getLogger("lw.proxy")

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MAX_TRANSFER_ID = 256
"""Longest sub-transfer id accepted (the KV connectors' transfer id limit)."""
MAX_ERROR_BODY = 2000
"""Characters of an upstream error body quoted in our error messages."""

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BadRequest(ValueError):
    """A client request the proxy refuses (answered with 400)."""


# ---------------------------------------------------------------------------------------------
# Pure helpers


def normalize_url(url: str) -> str:
    """Base URL of a server: add ``http://`` if missing, strip a trailing ``/`` and ``/v1``."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def validate_request(api: str, body: Any) -> dict[str, Any]:
    """Check a client body for ``api``; return it or raise ``BadRequest`` with a clear message."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string")
    if api == COMPLETIONS:
        prompt = body.get("prompt")
        if prompt is None or prompt == "" or prompt == []:
            raise BadRequest("'prompt' is required for /v1/completions")
        if not isinstance(prompt, str | list):
            raise BadRequest("'prompt' must be a string or a list")
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' is required for /v1/chat/completions (non-empty list)")
    if not isinstance(body.get("stream", False), bool):
        raise BadRequest("'stream' must be a boolean")
    return body


def build_decode_body(body: dict[str, Any], request_id: str, metaserver: str) -> dict[str, Any]:
    """The body sent to D: the client's, with the proxy's ``kv_transfer_params``."""
    out = dict(body)
    out["kv_transfer_params"] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "metaserver": metaserver,
        "transfer_id": request_id,
    }
    return out


PREFILL_KEPT = ("cache_salt", "priority")
"""Client fields that still matter to P's prefill of token ids (cache isolation, scheduling)."""


def build_prefill_body(
    body: dict[str, Any], decode_params: dict[str, Any], transfer_id: str,
    prompt_token_ids: list[int],
) -> dict[str, Any]:
    """The body P gets (``/v1/completions``): D's token ids, one token, not streamed, D's params."""
    out: dict[str, Any] = {"model": body["model"], "prompt": list(prompt_token_ids),
                           "max_tokens": 1, "n": 1, "stream": False}
    for key in PREFILL_KEPT:
        if key in body:
            out[key] = copy.deepcopy(body[key])
    params = dict(decode_params)
    params.update(do_remote_decode=True, do_remote_prefill=False, transfer_id=transfer_id)
    out["kv_transfer_params"] = params
    return out


def error_body(
    message: str,
    *,
    type_: str = "proxy_error",
    stage: str = "proxy",
    server: str | None = None,
    request_id: str | None = None,
) -> dict[str, Any]:
    """An OpenAI-shaped error object, plus the stage and server that failed."""
    err: dict[str, Any] = {"message": message, "type": type_, "stage": stage, "server": server}
    if request_id is not None:
        err["request_id"] = request_id
    return {"error": err}


def _describe(exc: BaseException) -> str:
    """Short description of an httpx exception."""
    text = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {text}"


def _quote(data: bytes) -> str:
    """An upstream body shortened for an error message."""
    text = data.decode("utf-8", errors="replace")
    return text if len(text) <= MAX_ERROR_BODY else text[:MAX_ERROR_BODY] + "..."


def _url_host(host: str) -> str:
    """Host as written in a URL (IPv6 in brackets)."""
    try:
        if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address):
            return f"[{host}]"
    except ValueError:
        pass
    return host


# ---------------------------------------------------------------------------------------------
# State


@dataclass(eq=False)
class Backend:
    """A prefill or decode server and its counters."""

    url: str
    role: str
    in_flight: int = 0
    requests: int = 0
    errors: int = 0

    def snapshot(self) -> dict[str, Any]:
        """Counters as JSON."""
        return {"url": self.url, "in_flight": self.in_flight, "requests": self.requests,
                "errors": self.errors}


@dataclass(eq=False)
class SubPrefill:
    """The prefill of one vLLM request of a client request (one sub-transfer)."""

    sub_id: str
    backend: Backend
    task: asyncio.Task[None] | None = None
    state: str = "running"  # running -> done | failed | cancelled


@dataclass(eq=False)
class Transfer:
    """One client request in flight: its D request, and the prefills D asked for."""

    request_id: str
    api: str
    body: dict[str, Any]
    stream: bool
    headers: dict[str, str]
    metaserver: str
    decode: Backend
    prefills: dict[str, SubPrefill] = field(default_factory=dict)  # sub-transfer id -> prefill
    prefill_error: str | None = None  # the first failure
    prefill_error_status: int = 502
    prefill_error_server: str | None = None
    prefill_failed: asyncio.Event = field(default_factory=asyncio.Event)


class ProxyState:
    """Everything the proxy app shares: servers, transfers in flight, HTTP client, counters."""

    def __init__(
        self,
        prefill_urls: Iterable[str],
        decode_urls: Iterable[str],
        *,
        timeout_s: float,
        connect_timeout_s: float,
        health_timeout_s: float,
        metaserver_url: str | None,
    ) -> None:
        self.prefills = [Backend(normalize_url(u), "prefill") for u in prefill_urls]
        self.decodes = [Backend(normalize_url(u), "decode") for u in decode_urls]
        if not self.prefills or not self.decodes:
            raise ValueError("the proxy needs at least one prefill and one decode server")
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self.health_timeout = httpx.Timeout(health_timeout_s)
        self.short_timeout = httpx.Timeout(min(timeout_s, 30.0), connect=connect_timeout_s)
        self.metaserver_url = metaserver_url
        self.client = httpx.AsyncClient(
            timeout=self.timeout,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self.transfers: dict[str, Transfer] = {}
        self.timeline = ProxyTimeline()
        self.tasks: set[asyncio.Task[None]] = set()
        self._rr = {"prefill": 0, "decode": 0}
        self.counters = {
            "requests": 0,
            "errors": 0,
            "bad_requests": 0,
            "client_disconnects": 0,
            "metaserver_calls": 0,
            "prefills": 0,
            "prefill_failures": 0,
        }

    def pick(self, backends: list[Backend]) -> Backend:
        """The backend with the fewest outstanding requests; ties broken round robin."""
        role = backends[0].role
        start = self._rr[role] % len(backends)
        self._rr[role] += 1
        rotated = backends[start:] + backends[:start]
        return min(rotated, key=lambda b: b.in_flight)

    def spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        """Run ``coro`` as a background task kept referenced until it ends."""
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def metrics(self) -> dict[str, Any]:
        """Counters as JSON."""
        return {
            **self.counters,
            "in_flight": len(self.transfers),
            "prefill": [b.snapshot() for b in self.prefills],
            "decode": [b.snapshot() for b in self.decodes],
        }

    async def aclose(self) -> None:
        """Cancel background tasks and close the HTTP client."""
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.client.aclose()


# ---------------------------------------------------------------------------------------------
# Prefill (started by the metaserver)


async def _run_prefill(state: ProxyState, tr: Transfer, sub: SubPrefill, body: dict[str, Any]
                       ) -> None:
    """POST one sub-transfer's prefill request; record success or failure on ``tr``."""
    backend = sub.backend
    url = backend.url + COMPLETIONS
    headers = {**tr.headers, "X-Request-Id": tr.request_id}
    backend.in_flight += 1
    backend.requests += 1
    status = 502
    state.timeline.mark(sub.sub_id, "p_sent")
    try:
        try:
            resp = await state.client.post(url, json=body, headers=headers)
            state.timeline.mark(sub.sub_id, "p_done")
        except httpx.TimeoutException as exc:
            status = 504
            error = f"prefill server {backend.url} timed out on {COMPLETIONS}: {_describe(exc)}"
        except httpx.HTTPError as exc:
            error = f"prefill server {backend.url} failed on {COMPLETIONS}: {_describe(exc)}"
        else:
            if resp.is_success:
                sub.state = "done"
                return
            error = (f"prefill server {backend.url} returned HTTP {resp.status_code} on "
                     f"{COMPLETIONS}: {_quote(resp.content)}")
        backend.errors += 1
        state.counters["prefill_failures"] += 1
        sub.state = "failed"
        if tr.prefill_error is None:
            tr.prefill_error = error
            tr.prefill_error_status = status
            tr.prefill_error_server = backend.url
        tr.prefill_failed.set()
        log.warning("request %s (sub-transfer %s): %s", tr.request_id, sub.sub_id, error)
    except asyncio.CancelledError:
        sub.state = "cancelled"
        raise
    finally:
        backend.in_flight -= 1


def _cancel_prefills(tr: Transfer) -> None:
    """Cancel every prefill request of ``tr`` still running (closes their connections)."""
    for sub in tr.prefills.values():
        if sub.task is not None and not sub.task.done():
            sub.task.cancel()


# ---------------------------------------------------------------------------------------------
# One client exchange


async def _wait_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (the request body has already been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class _Exchange(Response):
    """ASGI response that runs one client request against D until it ends.

    Three things race: the D request (``_run``), the client disconnecting, and the prefill failing
    before D's answer has started. The first decides; the others are cancelled.
    """

    def __init__(self, state: ProxyState, tr: Transfer) -> None:
        super().__init__()
        self.state = state
        self.tr = tr
        self.started = False  # response start sent to the client
        self.relayed = False  # a byte of D's answer was sent to the client
        self.ok = False  # D's answer was relayed completely
        self._upstream: httpx.Response | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tr, state = self.tr, self.state
        run = asyncio.ensure_future(self._run(send))
        disconnect = asyncio.ensure_future(_wait_disconnect(receive))
        prefill_failed = asyncio.ensure_future(tr.prefill_failed.wait())
        waiting: set[asyncio.Future[Any]] = {run, disconnect, prefill_failed}
        try:
            while True:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if run in done:
                    run.result()
                    break
                if disconnect in done:
                    state.counters["client_disconnects"] += 1
                    log.info("request %s: client disconnected; cancelling", tr.request_id)
                    await _cancel_and_wait(run)
                    break
                if prefill_failed in done:
                    waiting.discard(prefill_failed)
                    if not self.relayed:  # headers may be out; then the error goes in-band
                        await _cancel_and_wait(run)
                        await self._error(send, tr.prefill_error_status,
                                          tr.prefill_error or "prefill failed", stage="prefill",
                                          server=tr.prefill_error_server)
                        break
        finally:
            for task in (run, disconnect, prefill_failed):
                task.cancel()
            self._finish()

    def _finish(self) -> None:
        """Release the transfer: counters, transfer table, and the prefill unless D succeeded."""
        tr = self.tr
        tr.decode.in_flight -= 1
        self.state.transfers.pop(tr.request_id, None)
        if not self.ok:
            _cancel_prefills(tr)

    async def _start(self, send: Send, status: int, content_type: str) -> None:
        """Send the response head to the client."""
        self.started = True
        headers = [(b"content-type", content_type.encode("latin-1")),
                   (b"x-request-id", self.tr.request_id.encode())]
        if self.tr.stream and status == 200:
            headers.append((b"cache-control", b"no-cache"))
        await send({"type": "http.response.start", "status": status, "headers": headers})

    async def _error(self, send: Send, status: int, message: str, *, stage: str,
                     server: str | None) -> None:
        """Report an error to the client: a JSON response, or a final SSE event mid-stream."""
        self.state.counters["errors"] += 1
        type_ = "timeout" if status == 504 else "upstream_error"
        body = error_body(message, type_=type_, stage=stage, server=server,
                          request_id=self.tr.request_id)
        data = json.dumps(body).encode()
        if not self.started:
            await self._start(send, status, "application/json")
            await send({"type": "http.response.body", "body": data})
        else:
            event = b"data: " + data + b"\n\n" if self.tr.stream else b""
            await send({"type": "http.response.body", "body": event})

    async def _run(self, send: Send) -> None:
        """Send the request to D and relay its answer; failures become client errors."""
        tr, state = self.tr, self.state
        server = tr.decode.url
        try:
            body = build_decode_body(tr.body, tr.request_id, tr.metaserver)
            headers = {**tr.headers, "X-Request-Id": tr.request_id}
            request = state.client.build_request("POST", server + tr.api, json=body,
                                                 headers=headers)
            state.timeline.mark(tr.request_id, "d_sent")
            resp = await state.client.send(request, stream=True)
            self._upstream = resp
            if resp.status_code != 200:
                data = await resp.aread()
                await self._upstream_status(send, resp, data)
                return
            content_type = resp.headers.get("content-type", "application/json")
            if not tr.stream:
                data = await resp.aread()
                state.timeline.mark(tr.request_id, "first_token")
                await self._start(send, 200, content_type)
                self.relayed = True
                await send({"type": "http.response.body", "body": data})
            else:
                # D accepted the request: the client gets its headers now, not with the first
                # token (which waits for the whole P/D round trip); later errors go in-band.
                await self._start(send, 200, content_type)
                async for chunk in resp.aiter_bytes():
                    if not chunk:
                        continue
                    if not self.relayed:
                        state.timeline.mark(tr.request_id, "first_token")
                    self.relayed = True
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
            self.ok = True
            state.timeline.mark(tr.request_id, "end")
        except httpx.TimeoutException as exc:
            tr.decode.errors += 1
            await self._error(send, 504, f"decode server {server} timed out on {tr.api}: "
                              f"{_describe(exc)}", stage="decode", server=server)
        except httpx.HTTPError as exc:
            tr.decode.errors += 1
            what = "unreachable" if isinstance(exc, httpx.ConnectError) else "failed"
            await self._error(send, 502, f"decode server {server} {what} on {tr.api}: "
                              f"{_describe(exc)}", stage="decode", server=server)
        except (asyncio.CancelledError, OSError):
            raise
        except Exception as exc:  # a bug here must still answer the client
            log.exception("request %s: proxy failure", tr.request_id)
            with contextlib.suppress(Exception):  # in-band if the head is already out
                await self._error(send, 500, f"proxy failure: {_describe(exc)}", stage="proxy",
                                  server=None)
        finally:
            if self._upstream is not None:
                await self._upstream.aclose()

    async def _upstream_status(self, send: Send, resp: httpx.Response, data: bytes) -> None:
        """Relay a non-200 answer of D: 4xx unchanged, anything else as 502."""
        tr = self.tr
        if 400 <= resp.status_code < 500:
            self.state.counters["errors"] += 1
            await self._start(send, resp.status_code,
                              resp.headers.get("content-type", "application/json"))
            await send({"type": "http.response.body", "body": data})
            return
        tr.decode.errors += 1
        await self._error(send, 502, f"decode server {tr.decode.url} returned HTTP "
                          f"{resp.status_code} on {tr.api}: {_quote(data)}", stage="decode",
                          server=tr.decode.url)


def _metaserver_problem(msg: Any) -> str:
    """Why a metaserver body is malformed, or "" if it is well formed."""
    if not isinstance(msg, dict):
        return "body must be a JSON object"
    for key in ("transfer_id", "sub_transfer_id"):
        value = msg.get(key)
        if not isinstance(value, str) or not value or len(value) > MAX_TRANSFER_ID:
            return f"'{key}' (string of 1..{MAX_TRANSFER_ID} characters) required"
    ids = msg.get("prompt_token_ids")
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
        return "'prompt_token_ids' (non-empty list of token ids) required"
    if not isinstance(msg.get("kv_transfer_params", {}), dict):
        return "'kv_transfer_params' must be an object"
    return ""


async def _cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it has finished its cleanup."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


# ---------------------------------------------------------------------------------------------
# The app


def _bad_request(state: ProxyState, message: str) -> JSONResponse:
    """A 400 answer."""
    state.counters["bad_requests"] += 1
    return JSONResponse(error_body(message, type_="invalid_request_error", stage="proxy"),
                        status_code=400)


def build_app(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    *,
    timeout_s: float = 300.0,
    connect_timeout_s: float = 5.0,
    health_timeout_s: float = 2.0,
    metaserver_url: str | None = None,
) -> FastAPI:
    """Build the proxy app for these servers (base URLs such as ``http://10.0.0.1:8100``).

    ``timeout_s`` bounds every read/write/pool wait of an outgoing call, ``connect_timeout_s``
    every connect. ``metaserver_url`` is what D is told to call; by default it is derived from
    the URL each client request reached the proxy at.
    """
    state = ProxyState(prefill_urls, decode_urls, timeout_s=timeout_s,
                       connect_timeout_s=connect_timeout_s, health_timeout_s=health_timeout_s,
                       metaserver_url=metaserver_url)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await state.aclose()

    app = FastAPI(title="lw D-first proxy", lifespan=lifespan)
    app.state.proxy = state

    async def handle(request: Request, api: str) -> Response:
        raw = await request.body()
        try:
            body = validate_request(api, json.loads(raw))
        except (ValueError, UnicodeDecodeError) as exc:
            msg = str(exc) if isinstance(exc, BadRequest) else f"request body is not JSON: {exc}"
            return _bad_request(state, msg)
        body = dict(body)
        body.pop("kv_transfer_params", None)
        forwarded = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        metaserver = state.metaserver_url or str(request.url_for("metaserver"))
        decode = state.pick(state.decodes)
        tr = Transfer(request_id=uuid.uuid4().hex, api=api, body=body,
                      stream=bool(body.get("stream", False)), headers=forwarded,
                      metaserver=metaserver, decode=decode)
        decode.in_flight += 1
        decode.requests += 1
        state.counters["requests"] += 1
        state.timeline.mark(tr.request_id, "received")
        state.transfers[tr.request_id] = tr
        return _Exchange(state, tr)

    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        """OpenAI completions, routed D first."""
        return await handle(request, COMPLETIONS)

    @app.post(CHAT)
    async def chat_completions(request: Request) -> Response:
        """OpenAI chat completions, routed D first."""
        return await handle(request, CHAT)

    @app.post("/v1/metaserver", name="metaserver")
    async def metaserver(request: Request) -> JSONResponse:
        """Called by D's connector once a vLLM request's blocks are allocated: start its prefill."""
        state.counters["metaserver_calls"] += 1
        try:
            msg = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            return JSONResponse({"status": "error", "detail": f"body is not JSON: {exc}"}, 400)
        problem = _metaserver_problem(msg)
        if problem:
            return JSONResponse({"status": "error", "detail": problem}, 400)
        tid, sub_id = msg["transfer_id"], msg["sub_transfer_id"]
        tr = state.transfers.get(tid)
        if tr is None:
            return JSONResponse({"status": "error", "transfer_id": tid,
                                 "sub_transfer_id": sub_id, "prefill_url": None,
                                 "detail": "unknown transfer_id (request finished or never "
                                           "seen)"}, 404)
        sub = tr.prefills.get(sub_id)
        if sub is not None:
            return JSONResponse({"status": "ok", "transfer_id": tid, "sub_transfer_id": sub_id,
                                 "prefill_url": sub.backend.url,
                                 "detail": f"prefill already {sub.state}"}, 202)
        sub = SubPrefill(sub_id, state.pick(state.prefills))
        tr.prefills[sub_id] = sub
        state.counters["prefills"] += 1
        state.timeline.mark(sub_id, "meta_posted")
        body = build_prefill_body(tr.body, msg.get("kv_transfer_params", {}), sub_id,
                                  msg["prompt_token_ids"])
        sub.task = state.spawn(_run_prefill(state, tr, sub, body))
        return JSONResponse({"status": "ok", "transfer_id": tid, "sub_transfer_id": sub_id,
                             "prefill_url": sub.backend.url, "detail": "prefill started"}, 202)

    @app.get("/lw/timeline")
    async def timeline() -> JSONResponse:
        """What the proxy saw of recent transfers: id -> milestone -> wall time (see
        lw.vllm_adapter.proxy_timeline); with lw status timelines, lw.ops.phases."""
        return JSONResponse(state.timeline.snapshot())

    @app.get("/health")
    async def health() -> JSONResponse:
        """Proxy alive, plus whether each server answers its /health."""

        async def probe(b: Backend) -> dict[str, Any]:
            try:
                r = await state.client.get(b.url + "/health", timeout=state.health_timeout)
                return {"url": b.url, "reachable": True, "healthy": r.is_success,
                        "status_code": r.status_code}
            except httpx.HTTPError as exc:
                return {"url": b.url, "reachable": False, "healthy": False,
                        "error": _describe(exc)}

        results = await asyncio.gather(*(probe(b) for b in state.prefills + state.decodes))
        pre, dec = results[: len(state.prefills)], results[len(state.prefills):]
        ok = all(r["healthy"] for r in results)
        return JSONResponse({"status": "ok" if ok else "degraded", "prefill": pre, "decode": dec})

    @app.get("/v1/models")
    async def models() -> Response:
        """Passed through from the first decode server that answers."""
        errors = []
        for b in sorted(state.decodes, key=lambda b: b.in_flight):
            try:
                r = await state.client.get(b.url + "/v1/models", timeout=state.short_timeout)
            except httpx.HTTPError as exc:
                errors.append(f"{b.url}: {_describe(exc)}")
                continue
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type", "application/json"))
        state.counters["errors"] += 1
        return JSONResponse(error_body("no decode server answered /v1/models: "
                                       + "; ".join(errors), type_="upstream_error",
                                       stage="decode"), status_code=502)

    @app.get("/metrics-json")
    async def metrics() -> JSONResponse:
        """Counters: requests, errors, in-flight per server."""
        return JSONResponse(state.metrics())

    return app


def main(argv: Sequence[str] | None = None) -> int:
    """``lw proxy``: parse ``--prefill``/``--decode`` URLs (repeatable), ``--host``, ``--port``."""
    ap = argparse.ArgumentParser(prog="lw proxy", description="D-first proxy for lw.")
    ap.add_argument("--prefill", action="append", required=True, metavar="URL",
                    help="prefill server base URL (repeatable)")
    ap.add_argument("--decode", action="append", required=True, metavar="URL",
                    help="decode server base URL (repeatable)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--metaserver-url", default=None,
                    help="URL decode servers call back (default http://HOST:PORT/v1/metaserver)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="read/write timeout of every outgoing call, seconds")
    ap.add_argument("--connect-timeout", type=float, default=5.0)
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    metaserver_url = args.metaserver_url
    if metaserver_url is None:
        if args.host in ("0.0.0.0", "::", ""):
            ap.error("with a wildcard --host, give --metaserver-url (an address D can reach)")
        metaserver_url = f"http://{_url_host(args.host)}:{args.port}/v1/metaserver"
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(args.prefill, args.decode, timeout_s=args.timeout,
                    connect_timeout_s=args.connect_timeout, metaserver_url=metaserver_url)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
