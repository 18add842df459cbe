"""The D-first proxy (``lw proxy``): routes OpenAI requests to a decode server first, then runs
the prefill when the decode server asks for it through the proxy's *metaserver* endpoint (the
default, ``--start-mode d-first``). With ``--start-mode compute-ahead`` (lw.proxy.ahead) the
prefill server starts computing the prompt at the same time, and its writes wait for what D's
call hands it.

Two planes on two ports. The **public** port serves only what a vLLM server serves a client:
``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` and ``GET /health``.
The **control** port (an internal address: loopback by default, or the cluster network) serves
the metaserver and lw's introspection (lw.proxy.control); nothing that can start a
prefill or name another user's request is reachable from the public port.

The contract between client, proxy, D and P (what each call carries, who signs it, how each
failure is answered) is lw.contract's docstring; its types are lw.contract.params.

Other public endpoints: ``GET /health`` (200 with an empty body while at least one prefill and
one decode server answer, 503 otherwise: no server URLs), ``GET /v1/models`` (passed through from
a decode server). Control endpoints: ``GET /lw/health`` (per-server reachability),
``GET /metrics-json`` (counters), ``GET /lw/timeline`` (milestones per transfer).
Errors. A body that is not a JSON object, nests deeper than 64 levels, passes the size bound
(lw.proxy.limits) or carries a transfer field of a wrong type is refused by the
proxy itself (400/413 in vLLM's shape, ``param`` naming the field): it goes nowhere. A JSON object
the proxy cannot route D first (no prompt or messages, ``"stream": null``, ...) goes to a decode
server re-encoded, without the client's transfer fields, so the client gets vLLM's own answer
(or D serves it alone); a body without ``model`` is served with the decode servers' model, as
vLLM serves its only one. The
proxy's own errors (upstream failures) have vLLM's shape, ``{"error": {"message", "type",
"param", "code"}}`` (type from the status: ``BadGatewayError``, ``GatewayTimeoutError``), with
lw's details at the end of the message: ``[lw proxy: stage=..., server=..., request=...]``,
the server named by role and place (``prefill#0``), its URL only in the proxy's log.
A request D fails with a 5xx (vLLM's bare "Internal server error", or that error as a stream's
event) is explained (lw.proxy.explain): the proxy asks D's workers, by transfer id and within
``--why-timeout`` (0.5 s), why; a failed KV transfer is answered 502 (bad transfer: checksum
mismatch, failed write), 503 (prefill worker lost, no prefill server) or 504 (prefill
deadline), ``stage=kv_transfer``, the message "KV transfer from prefill server prefill#0 to
decode server decode#0 failed: <D's reason>", counted per reason (``kv_transfer_failures`` on
``/metrics-json``) and logged once per reason every 5 s; D is not avoided for it. Otherwise the
answer is as before (502, ``stage=decode``, failover) with "cause unknown: <why>" at the end of
the message.

Sidecar mode (``--sidecar``, llm-d's decode-side routing sidecar; lw.proxy.sidecar): one
local decode server; the prefill server of each request is the one its ``x-prefiller-host-port``
header names (if the allowlist admits it: 403 otherwise, 400 if malformed), else the proxy's own
``--prefill`` choice, else none (D computes the prompt alone and gets no ``kv_transfer_params``);
``/health`` is the decode server's; every other path is relayed to it.

The client sees its transfer id (``x-request-id``, and inside D's response ids): knowing it is
not enough to address the control plane, which also needs the cluster key and the transfer's
grant, and listens where clients cannot reach.
"""


from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lw.contract.auth import CallVerifier
from lw.contract.client import TRACE_HEADERS
from lw.proxy.ahead import start as start_ahead
from lw.proxy.backend import Backend
from lw.proxy.control import build_control_app, cached_health
from lw.proxy.exchange import Exchange
from lw.proxy.intake import abandoned, client_bytes, parse_json, refuse, screen, too_deep
from lw.proxy.limits import BodyAbandoned, Limits
from lw.proxy.passthrough import passthrough_handler, relay_unroutable
from lw.proxy.sidecar import BadTarget, Sidecar, parse_allow
from lw.proxy.state import (
    CHAT,
    COMPLETIONS,
    DEFAULT_START_MODE,
    START_MODES,
    BadField,
    BadRequest,
    ProxyState,
    Transfer,
    build_decode_body,
    build_prefill_body,
    describe_exc,
    error_body,
    normalize_url,
    sub_transfer_allowance,
    url_host,
    validate_request,
)
from lw.transport.sidechannel import parse_cluster_key

__all__ = [
    "ProxyApps",
    "build_apps",
    "build_decode_body",
    "build_prefill_body",
    "main",
    "normalize_url",
    "validate_request",
]

log = logging.getLogger("lw.proxy")


async def client_body(state: ProxyState, request: Request) -> dict[str, Any] | Response:
    """The client's body as a JSON object without transfer fields, or the refusal to send:
    413 over the size bound, 408 too slow, 400 not JSON / too deep / not an object / a transfer
    field of a wrong type (``param`` names it). The raw bytes never go anywhere."""
    raw = await client_bytes(state, request)
    if isinstance(raw, Response):
        return raw
    parsed = parse_json(state, raw)
    if isinstance(parsed, Response):
        return parsed
    deep = too_deep(state, parsed)
    if deep is not None:
        return deep
    if not isinstance(parsed, dict):
        return refuse(state, 400, "request body must be a JSON object", counter="bad_requests")
    return screen(state, parsed)


async def _served_model(state: ProxyState) -> str | None:
    """The model a decode server serves (for a body without ``model``, as vLLM serves its
    only one); None if none answers."""
    if state.default_model is None:
        for b in state.decodes:
            try:
                r = await state.client.get(b.url + "/v1/models", timeout=state.short_timeout)
                state.default_model = str(r.json()["data"][0]["id"])
                break
            except (httpx.HTTPError, ValueError, LookupError, TypeError):
                continue
    return state.default_model


@dataclass(frozen=True)
class ProxyApps:
    """The proxy's two apps over one shared state: serve ``public`` to clients and ``control``
    on an internal address D can reach."""

    public: FastAPI
    control: FastAPI
    state: ProxyState


def build_apps(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    *,
    metaserver_url: str,
    cluster_key: bytes | None,
    insecure_trusted_network: bool = False,
    signature_window_s: float = 30.0,
    timeout_s: float = 300.0,
    connect_timeout_s: float = 5.0,
    health_timeout_s: float = 2.0,
    sidecar: Sidecar | None = None,
    decode_failovers: int = 2,
    limits: Limits | None = None,
    start_mode: str | None = None,
    ahead_limit: int = 4,
    ahead_d_backlog: int = 4,
    ahead_p_busy: int = 1,
) -> ProxyApps:
    """Build the proxy for these servers (base URLs such as ``http://10.0.0.1:8100``).

    ``metaserver_url`` is what D is told to call: the control app's ``/v1/metaserver`` at an
    address D reaches. ``cluster_key`` signs D's calls; None is refused unless
    ``insecure_trusted_network``. ``timeout_s`` bounds every read/write/pool wait of an outgoing
    call, ``connect_timeout_s`` every connect. ``sidecar``: run as llm-d's decode-side routing
    sidecar (lw.proxy.sidecar) in front of the one decode server. ``decode_failovers``:
    other decode servers a request may move to when its D fails before a byte of its answer
    reached the client. ``start_mode``: None is DEFAULT_START_MODE, d-first for a sidecar.
    """
    if start_mode is None:
        # a sidecar's metaserver is its decode pod's, which prefill pods need not reach
        start_mode = "d-first" if sidecar is not None else DEFAULT_START_MODE
    if cluster_key is None and not insecure_trusted_network:
        raise ValueError("no cluster key: the metaserver would start a prefill for anyone who "
                         "can reach it. Give the decode servers' cluster key (--cluster-key or "
                         "LW_CLUSTER_KEY), or --insecure-trusted-network on a network only the "
                         "cluster can reach")
    state = ProxyState(prefill_urls, decode_urls, timeout_s=timeout_s,
                       connect_timeout_s=connect_timeout_s, health_timeout_s=health_timeout_s,
                       metaserver_url=metaserver_url,
                       verifier=CallVerifier(cluster_key, signature_window_s), sidecar=sidecar,
                       decode_failovers=decode_failovers, limits=limits,
                       start_mode=start_mode, ahead_limit=ahead_limit,
                       ahead_d_backlog=ahead_d_backlog, ahead_p_busy=ahead_p_busy)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await state.aclose()

    app = FastAPI(title="lw D-first proxy", lifespan=lifespan)
    app.state.proxy = state

    async def body_abandoned(request: Request, exc: Exception) -> Response:
        """A client gone mid-body (either port): counted, no traceback (lw.proxy.limits)."""
        return abandoned(state)

    async def handle(request: Request, api: str) -> Response:
        # relays of requests not routable D first are requests in flight too
        if len(state.transfers) + state.load.relays >= state.limits.max_concurrent_requests:
            return refuse(state, 503, f"the proxy is serving "
                           f"{state.limits.max_concurrent_requests} requests; try again",
                           counter="overloaded")
        got = await client_body(state, request)
        if isinstance(got, Response):
            return got
        try:
            body = validate_request(api, got)
        except BadField as exc:  # a type vLLM would coerce: the proxy does not guess
            return refuse(state, 400, str(exc), counter="bad_requests", param=exc.field)
        except BadRequest as exc:
            return relay_unroutable(state, request, api, got, str(exc))
        body = dict(body)
        if "model" not in body:
            model = await _served_model(state)
            if model is None:
                return relay_unroutable(state, request, api, body, "no model named")
            body["model"] = model
        target: Backend | None = None
        if state.sidecar is not None:
            try:
                target = state.sidecar.target(request.headers.items(), state.prefills)
            except BadTarget as exc:  # the client's fault, not a backend's: its own counter
                state.counters["prefiller_refused"] += 1
                state.refusals.note("prefiller_refused", "request refused (%d): %s",
                                    exc.status, exc)
                return JSONResponse(error_body(str(exc), exc.status, stage="sidecar"),
                                    status_code=exc.status)
        # the client's credentials, and its trace context (vLLM's spans and lw's join its trace)
        forwarded = {k: v for k, v in request.headers.items()
                     if k.lower() in ("authorization", *TRACE_HEADERS)}
        decode = state.pick(state.decodes)
        tr = Transfer(request_id=uuid.uuid4().hex, api=api, body=body,
                      stream=bool(body.get("stream", False)), headers=forwarded,
                      metaserver=state.metaserver_url, decode=decode,
                      allowance=sub_transfer_allowance(api, body), prefill_target=target,
                      local=target is None and not state.prefills)
        decode.in_flight += 1
        decode.requests += 1
        state.counters["requests"] += 1
        state.timeline.mark(tr.request_id, "received")
        state.transfers[tr.request_id] = tr
        # admit-ahead: P admits it while D does (lw.proxy.ahead)
        ahead = (lambda t: start_ahead(state, t)) if state.start_mode != "d-first" else None
        return Exchange(state, tr, ahead)

    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        """OpenAI completions, routed D first (P computing ahead: the start mode)."""
        return await handle(request, COMPLETIONS)

    @app.post(CHAT)
    async def chat_completions(request: Request) -> Response:
        """OpenAI chat completions, routed as completions are."""
        return await handle(request, CHAT)

    @app.get("/health")
    async def health() -> Response:
        """As vLLM's: 200 with no body while the proxy can serve (a prefill and a decode server
        answer), 503 otherwise; the details are on the control port (/lw/health)."""
        report = await cached_health(state)
        # a sidecar's prefill servers come with the requests: its decode server is what it needs
        sides = ("decode",) if state.sidecar is not None else ("prefill", "decode")
        up = all(any(r["healthy"] for r in report[side]) for side in sides)
        return Response(status_code=200 if up else 503)

    @app.get("/v1/models")
    async def models() -> Response:
        """Passed through from the first decode server that answers."""
        errors = []
        for b in sorted(state.decodes, key=lambda b: b.in_flight):
            try:
                r = await state.client.get(b.url + "/v1/models", timeout=state.short_timeout)
            except httpx.HTTPError as exc:
                errors.append(f"{b.url}: {describe_exc(exc)}")
                continue
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type", "application/json"))
        state.counters["errors"] += 1
        message = "no decode server answered /v1/models: " + "; ".join(errors)
        state.refusals.note("upstream_decode", "%s", message)
        return JSONResponse(error_body(state.public(message), 502, stage="decode"),
                            status_code=502)

    if sidecar is not None:
        # As llm-d's sidecar: every other path of the pod's port is its decode server's
        # (/metrics, /tokenize, ...); lw's control plane stays on its own port.
        app.add_api_route("/{path:path}", passthrough_handler(state),
                          methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"],
                          include_in_schema=False)
    control = build_control_app(state)
    for each in (app, control):
        each.add_exception_handler(BodyAbandoned, body_abandoned)
    return ProxyApps(app, control, state)


async def _serve(apps: ProxyApps, public: socket.socket, control: socket.socket,
                 log_level: str, head_timeout_s: float = 5.0,
                 max_head_bytes: int = 64 << 10) -> None:
    """Serve both apps until either stops (Ctrl-C stops both). A connection whose request head
    is not complete ``head_timeout_s`` after it opened (or after its last answer) is closed;
    a head over ``max_head_bytes`` is answered 400."""
    import h11
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadDeadline(H11Protocol):
        """uvicorn's h11 protocol with a deadline on each request head. uvicorn has no such
        option: it arms its keep-alive timer only after a response, and its first byte of data
        cancels it, so a silent or dripping client held a connection (of max_connections) for
        ever."""

        head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # type: ignore[arg-type]
            self.arm_head_timer()

        def arm_head_timer(self) -> None:
            self.cancel_head_timer()
            self.head_timer = self.loop.call_later(head_timeout_s, self.head_too_late)

        def cancel_head_timer(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def head_too_late(self) -> None:
            self.head_timer = None
            # IDLE: no complete request head since the connection opened or its last answer
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # a head came (or the connection ended)
                self.cancel_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self.arm_head_timer()  # the next request's head gets the same deadline

        def connection_lost(self, exc: Exception | None) -> None:
            self.cancel_head_timer()
            super().connection_lost(exc)

    # connections per port bounded (503 beyond); idle keep-alive connections close after 5 s;
    # h11 rather than httptools: h11 bounds a request head (httptools buffers any size)
    servers = [uvicorn.Server(uvicorn.Config(
        app, log_level=log_level, lifespan=lifespan, timeout_keep_alive=5,
        limit_concurrency=apps.state.limits.max_connections, http=HeadDeadline,
        h11_max_incomplete_event_size=max_head_bytes))
        for app, lifespan in ((apps.public, "on"), (apps.control, "off"))]
    tasks = [asyncio.ensure_future(s.serve(sockets=[sock]))
             for s, sock in zip(servers, (public, control), strict=True)]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for s in servers:
            s.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket (bound before serving, so a taken port fails at start)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _sidecar_from_args(ap: argparse.ArgumentParser, args: argparse.Namespace
                       ) -> Sidecar | None:
    """The sidecar mode's settings, or None without --sidecar; bad ones end in ap.error."""
    if not args.sidecar:
        if args.allow_prefiller or args.allow_any_prefiller:
            ap.error("--allow-prefiller / --allow-any-prefiller apply only with --sidecar")
        return None
    if len(args.decode) != 1:
        ap.error(f"--sidecar serves exactly one (its local) decode server; got "
                 f"{len(args.decode)} --decode")
    try:
        allow = [parse_allow(spec) for spec in args.allow_prefiller]
    except ValueError as exc:
        ap.error(f"--allow-prefiller: {exc}")
    if not allow and not args.allow_any_prefiller and not args.prefill:
        ap.error("--sidecar: say which prefill servers a request's header may name "
                 "(--allow-prefiller SPEC, e.g. the prefill pods' network 10.0.0.0/16:8000) "
                 "or --allow-any-prefiller; otherwise every named server would be refused")
    if args.allow_any_prefiller:
        log.warning("--allow-any-prefiller: the sidecar posts prompts to any server a "
                    "request's header names")
    return Sidecar(allow, allow_any=args.allow_any_prefiller)


def main(argv: Sequence[str] | None = None) -> int:
    """``lw proxy``: parse ``--prefill``/``--decode`` URLs (repeatable), the public and control
    addresses and the cluster key; serve both planes."""
    import math

    import msgspec

    from lw.contract.params import Url
    from lw.proxy.state import server_url

    def port(text: str) -> int:
        """A TCP port for argparse (0: any free one)."""
        value = int(text)
        if not 0 <= value <= 65535:
            raise ValueError
        return value

    def seconds(text: str) -> float:
        """A positive, finite number for argparse (nan and inf would disable the bound)."""
        value = float(text)
        if not 0 < value < math.inf:
            raise ValueError
        return value

    # argparse names the flag and the value when a type raises ValueError; the __name__ says
    # what was expected
    port.__name__ = "port (0..65535)"
    seconds.__name__ = "positive finite number"
    ap = argparse.ArgumentParser(prog="lw proxy", description="D-first proxy for lw.")
    ap.add_argument("--prefill", action="append", default=[], metavar="URL",
                    help="prefill server base URL (repeatable; with --sidecar optional: the "
                         "servers used when a request names none)")
    ap.add_argument("--decode", action="append", required=True, metavar="URL",
                    help="decode server base URL (repeatable; with --sidecar exactly one)")
    ap.add_argument("--sidecar", action="store_true",
                    help="run as llm-d's decode-side routing sidecar: the prefill server is "
                         "the one each request's x-prefiller-host-port header names")
    ap.add_argument("--allow-prefiller", action="append", default=[], metavar="SPEC",
                    help="with --sidecar: a prefill server a header may name (HOST, "
                         "HOST:PORT, CIDR, CIDR:PORT, [V6]:PORT; repeatable); --prefill "
                         "servers are always allowed")
    ap.add_argument("--allow-any-prefiller", action="store_true",
                    help="with --sidecar: accept any prefill server a header names (only "
                         "where nothing but the scheduler reaches the public port)")
    ap.add_argument("--host", default="127.0.0.1", help="public (OpenAI API) address")
    ap.add_argument("--port", type=port, default=8000, help="public (OpenAI API) port")
    ap.add_argument("--control-host", default="127.0.0.1",
                    help="control-plane address (metaserver, introspection): one the decode "
                         "servers reach and clients do not")
    ap.add_argument("--control-port", type=port, default=None,
                    help="control-plane port (default: --port + 1)")
    ap.add_argument("--metaserver-url", default=None,
                    help="URL decode servers call back (default "
                         "http://CONTROL_HOST:CONTROL_PORT/v1/metaserver)")
    ap.add_argument("--cluster-key", default=None,
                    help="key D's connector signs metaserver calls with (its cluster_key; "
                         "default $LW_CLUSTER_KEY, which keeps it off the command line); text "
                         "or hex:...")
    ap.add_argument("--insecure-trusted-network", action="store_true",
                    help="run without a cluster key: unsigned metaserver calls are accepted "
                         "(only where nothing but the cluster reaches the control port)")
    ap.add_argument("--signature-window", type=seconds, default=30.0, metavar="S",
                    help="accepted clock difference of a signed call, seconds (replays are "
                         "refused within it)")
    ap.add_argument("--timeout", type=seconds, default=300.0,
                    help="read/write timeout of every outgoing call, seconds")
    ap.add_argument("--connect-timeout", type=seconds, default=5.0,
                    help="connect timeout of every outgoing call, seconds")
    ap.add_argument("--decode-failovers", type=int, default=2, metavar="N",
                    help="a request whose decode server fails (refused, dropped, 5xx) before a "
                         "byte of its answer reached the client moves to another one, at most "
                         "N times (0: never)")
    ap.add_argument("--start-mode", choices=START_MODES, default=None,
                    help="d-first: a request's prefill is sent to P once D has allocated its "
                         "blocks; admit-ahead: it is sent to P together with the request to D, "
                         "and P admits it but computes nothing until D's params reach it "
                         "(lw.proxy.ahead; P's admission overlaps D's); compute-ahead: the "
                         "same, but P computes at once into its own blocks and writes once "
                         "D's params bind it (docs/protocol.md, 'Computing ahead'); with "
                         "either ahead mode the prefill servers must reach the control port. "
                         f"Default: {DEFAULT_START_MODE}, with --sidecar d-first")
    ap.add_argument("--ahead-limit", type=int, default=4, metavar="N",
                    help="admit-/compute-ahead: prefills one prefill server holds waiting for D's "
                         "params; a request beyond it starts D first")
    ap.add_argument("--ahead-d-backlog", type=int, default=4, metavar="N",
                    help="admit-/compute-ahead: none goes ahead while its decode server has N "
                         "requests it has not allocated for (no metaserver call, no token yet): "
                         "a decode server short of free blocks queues them, and P must not "
                         "compute for it (D-first's backpressure)")
    ap.add_argument("--ahead-p-busy", type=int, default=1, metavar="N",
                    help="admit-/compute-ahead: none goes ahead while its prefill server has N "
                         "prefills queued or computing (there it would only wait, ahead of "
                         "requests that came first and went D first)")
    ap.add_argument("--ahead-wait", type=seconds, default=2.0, metavar="S",
                    help="admit-/compute-ahead: how long a prefill sent ahead waits for D's "
                         "call before it is cancelled and started D first (below the prefill "
                         "engines' metaserver_timeout_s)")
    ap.add_argument("--why-timeout", type=seconds, default=Limits.why_timeout_s, metavar="S",
                    help="how long a failed request's client waits while the proxy asks D's "
                         "workers why (then: cause unknown); raise it where D's host is loaded")
    ap.add_argument("--max-body-mb", type=seconds, default=8.0, metavar="MB",
                    help="largest client body on the public port (413 above it)")
    ap.add_argument("--max-concurrent-requests", type=int, default=4096, metavar="N",
                    help="client requests in flight; more are answered 503 at once")
    ap.add_argument("--log-level", default="info", type=str.lower,
                    choices=("critical", "error", "warning", "info", "debug"))
    args = ap.parse_args(argv)
    for flag, urls in (("--prefill", args.prefill), ("--decode", args.decode)):
        for url in urls:
            try:
                server_url(url)
            except ValueError as exc:
                ap.error(f"{flag}: {exc}")
    both = ({server_url(u) for u in args.prefill} & {server_url(u) for u in args.decode})
    if both:
        ap.error(f"{', '.join(sorted(both))} is given as --prefill and as --decode: an engine "
                 "is a prefill (kv_producer) or a decode (kv_consumer) server, not both")
    if args.max_body_mb * (1 << 20) < 1:
        ap.error(f"--max-body-mb {args.max_body_mb} is under one byte")
    sidecar = _sidecar_from_args(ap, args)
    if args.decode_failovers < 0:
        ap.error(f"--decode-failovers must be >= 0, got {args.decode_failovers}")
    if sidecar is None and not args.prefill:
        ap.error("at least one --prefill server is needed (or --sidecar, where each request "
                 "names its prefill server)")
    control_port = args.port + 1 if args.control_port is None else args.control_port
    if control_port > 65535:
        ap.error(f"--port {args.port} leaves no default control port ({control_port}): give "
                 "--control-port")
    if (args.control_host, control_port) == (args.host, args.port):
        ap.error("the control plane needs its own address or port (--control-host/"
                 "--control-port): it must not be reachable on the public port")
    metaserver_url = args.metaserver_url
    if metaserver_url is None:
        if args.control_host in ("0.0.0.0", "::", ""):
            ap.error("with a wildcard --control-host, give --metaserver-url (an address D can "
                     "reach)")
        metaserver_url = f"http://{url_host(args.control_host)}:{control_port}/v1/metaserver"
    try:
        # D refuses, on every request, a metaserver URL outside the contract's pattern
        msgspec.convert(metaserver_url, Url)
        server_url(metaserver_url)
    except (msgspec.ValidationError, ValueError) as exc:
        given = ("--metaserver-url" if args.metaserver_url is not None
                 else "the metaserver URL made of --control-host and the control port")
        ap.error(f"{given} {metaserver_url!r}: not an http(s) URL D accepts "
                 f"(lw.contract.params.Url: no user part, query or fragment): {exc}")
    raw_key = args.cluster_key if args.cluster_key is not None else os.environ.get(
        "LW_CLUSTER_KEY") or None
    try:
        key = parse_cluster_key(raw_key)
    except ValueError as exc:
        ap.error(f"--cluster-key / LW_CLUSTER_KEY: {exc}")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        apps = build_apps(args.prefill, args.decode, metaserver_url=metaserver_url,
                          cluster_key=key, insecure_trusted_network=args.insecure_trusted_network,
                          signature_window_s=args.signature_window, timeout_s=args.timeout,
                          connect_timeout_s=args.connect_timeout, sidecar=sidecar,
                          decode_failovers=args.decode_failovers,
                          start_mode=args.start_mode, ahead_limit=args.ahead_limit,
                          ahead_d_backlog=args.ahead_d_backlog, ahead_p_busy=args.ahead_p_busy,
                          limits=Limits(max_body_bytes=int(args.max_body_mb * (1 << 20)),
                                        max_concurrent_requests=args.max_concurrent_requests,
                                        ahead_wait_s=args.ahead_wait,
                                        why_timeout_s=args.why_timeout))
    except ValueError as exc:
        ap.error(str(exc))
    if key is None:
        log.warning("no cluster key (--insecure-trusted-network): metaserver calls are not "
                    "authenticated; anyone who reaches %s:%d can start prefills",
                    args.control_host, control_port)
    try:
        public = _listen(args.host, args.port)
        control = _listen(args.control_host, control_port)
    except OSError as exc:
        ap.error(f"cannot listen: {exc}")
    log.info("public API on %s:%d, control plane on %s:%d (metaserver %s)", args.host,
             args.port, args.control_host, control_port, metaserver_url)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(apps, public, control, args.log_level))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
