"""The D-first proxy (``lw proxy``): routes OpenAI requests to a decode server first, then runs
the prefill when the decode server asks for it through the proxy's *metaserver* endpoint.

Two planes on two ports. The **public** port serves only what a vLLM server serves a client:
``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` and ``GET /health``.
The **control** port (an internal address: loopback by default, or the cluster network) serves
the metaserver and lw's introspection (lw.vllm_adapter.proxy_control); nothing that can start a
prefill or name another user's request is reachable from the public port.

Contract (the KV connectors on both sides rely on it)
====================================================

1. Client -> proxy: ``POST /v1/completions`` or ``POST /v1/chat/completions`` (streaming SSE or
   not). The proxy assigns ``request_id`` (a uuid4 hex string) and picks the decode server with the
   fewest outstanding requests (ties: round robin).
2. Proxy -> decode server (D): the client's body, with ``kv_transfer_params`` replaced by::

       {"do_remote_prefill": true, "do_remote_decode": false,
        "metaserver": "http://<control host>:<control port>/v1/metaserver",
        "transfer_id": <request_id>, "metaserver_grant": <random secret of this transfer>}

   and the header ``X-Request-Id: <request_id>`` (vLLM then names the request
   ``cmpl-<request_id>`` / ``chatcmpl-<request_id>``), plus the client's ``Authorization``,
   ``traceparent`` and ``tracestate`` (so vLLM's spans and lw's join the client's trace; also
   on P's requests). A client-supplied ``kv_transfer_params`` is dropped.
3. One client request becomes several vLLM requests on D (``n`` > 1 children, each prompt of a
   ``prompt`` list), all carrying the proxy's ``transfer_id``; a *sub-transfer* is one of them.
   For each vLLM request whose prefill it wants, D's connector (scheduler side, once it has
   allocated the blocks) -> ``POST /v1/metaserver`` with::

       {"transfer_id": <request_id>, "sub_transfer_id": str, "prompt_token_ids": [int, ...],
        "kv_transfer_params": {...}, "grant": <metaserver_grant>}

   signed with the cluster key (headers of lw.vllm_adapter.control_auth: timestamp, nonce,
   HMAC-SHA256 over them and the body). The proxy refuses an unsigned, forged, stale or replayed
   call (401), and a call without the transfer's grant, for a sub-transfer id not of the form
   ``<request_id>@...``, or beyond the sub-transfers the client request allows (``n`` x prompts)
   (403); refusals are counted (``metaserver_refused``) and logged. Without a cluster key the
   proxy starts only with ``--insecure-trusted-network`` (calls then go unsigned; the grant is
   still required).

   ``sub_transfer_id`` is unique per vLLM request (lw: ``<request_id>@<D's vLLM request id>``,
   at most 256 characters), ``prompt_token_ids`` are that request's prompt tokens, and the params
   are whatever P needs to push the KV (``remote_engine_id``, ``remote_host``, ``remote_port``,
   ``remote_block_ids``, ``remote_first_block``, ``remote_dp_rank``, ...). D posts nothing for a
   request it computes itself (e.g. a prefix-cache hit with a short tail): a client request may
   have zero, one or several sub-transfers. A decode engine with a prefill retry budget adds
   ``"retry_prefill": n`` (0..64): it may ask for up to n re-prefills of that sub-transfer
   (see *Re-prefill* below). Replies:

   - ``202 {"status": "ok", "transfer_id", "sub_transfer_id", "prefill_url", "detail",
     "epoch"}``: the prefill request of that sub-transfer was started (or had already been
     started: repeated posts for one sub-transfer and epoch are idempotent and start nothing
     new); once the proxy has learned that prefill server's lw engine id and TP rank 0 side
     channel (from its earlier prefill responses) the reply also names them
     (``"prefill_engine_id"``, ``"prefill_worker"``), and D's core watches that P before it
     claims the request (``prefill_routed``).
   - ``404 {"status": "error", ...}``: unknown transfer (the client request already ended).
   - ``400 {"status": "error", ...}``: malformed body.
   - ``401`` / ``403 {"status": "error", ...}``: refused (see above); D fails the request.

   *Re-prefill* (prefill failover, D's ``retry_prefill``): when D's core lost the P of a
   sub-transfer and keeps its blocks, D posts, signed and with the same grant,
   ``{"transfer_id", "sub_transfer_id", "grant", "epoch": e, "avoid": [engine id, ...],
   "reason": str}`` with claim epoch e > 0. The proxy starts the same prefill (the first call's
   token ids and params, plus ``"lw_epoch": e``) on a prefill server none of whose engines is in
   ``avoid`` (and, when ``avoid`` is not empty, not an earlier attempt's server whose engine id
   it never learned), closes the old attempt's request and ignores its outcome, counts it
   (``prefill_failovers``) and answers 202 as above. Refused: a sub-transfer it never started
   (404), an epoch lower than the current one (409), an epoch beyond the first call's
   ``retry_prefill`` (403); no server left outside ``avoid``: 503 (D retries, then fails the
   request). The same epoch again is idempotent (202, nothing new).

   **The reply does not wait for the prefill.** The prefill request runs in a background task:
   the connector's scheduler-side call must stay short, and the outcome of the transfer reaches D
   through the KV connector itself (DONE from P, or D's own deadline), not through this reply.
4. Proxy -> prefill server (P), one request per sub-transfer, each picked by fewest outstanding
   requests: ``POST /v1/completions`` with ``{"model": <client's model>, "prompt":
   <prompt_token_ids>, "max_tokens": 1, "n": 1, "stream": false, "kv_transfer_params": ...}``
   (plus the client's ``cache_salt`` / ``priority`` if given), so P computes exactly D's tokens
   whatever the client's API (chat, ``n`` > 1, prompt lists); ``kv_transfer_params`` = D's params
   updated with ``{"do_remote_decode": true, "do_remote_prefill": false, "transfer_id":
   <sub_transfer_id>}`` (and ``"lw_epoch": e`` for a re-prefill); header
   ``X-Request-Id: <request_id>``. P names its workers and engine id in its answer's
   ``kv_transfer_params`` (``lw_prefill_workers``, ``lw_prefill_engine_id``).
5. Streaming: the proxy sends the client its response head (200, D's SSE content type) as soon
   as D answers with its head (D accepted the request), not with the first token, which waits for
   the whole P/D round trip. From then on every error is sent in-band, as a final SSE event
   ``data: {"error": {...}}``.
6. Failures. If a prefill request fails (connection error, timeout, non-2xx) the proxy records it;
   if no byte of D's answer has been relayed yet, the proxy abandons the D request (closing the
   connection makes vLLM abort it) and reports the error naming the prefill server: HTTP 502 (504
   if the prefill timed out), or the final SSE event if the stream's head is already out. Once D's
   answer has started a prefill error is only logged: either that KV had arrived, or (another
   choice of the same answer streaming) D's own deadline fails the vLLM request whose KV never
   comes. A sub-transfer whose D declared a retry budget not yet spent (its epoch below
   ``retry_prefill``) is left to D when its P did not answer, timed out or answered 5xx (P may be
   gone: D's core finds that out and re-prefills, or fails the request itself), counted in
   ``prefill_failures_left_to_decode``; a 4xx from P ends the request as above. A failed attempt a
   re-prefill replaced is only logged. D unreachable, dropping the connection or answering 5xx
   before any byte of its answer reached the client -> the request starts afresh on another decode
   server (a new transfer id and grant; the old one's prefills cancelled), at most
   ``--decode-failovers`` times, then 502 naming the servers tried; after a byte was relayed -> 502
   (in-band). D timing out -> 504 (not retried: D may still be computing); D answering 4xx ->
   passed through unchanged. A server that failed so is avoided for new requests for 1 s, doubling
   per consecutive failure up to 30 s (jittered), unless every server is. Every outgoing call has a
   timeout.
7. Client disconnect (streaming or not) -> the D request is closed (vLLM aborts it) and every
   in-flight prefill request of the client request is cancelled (closed, so P aborts it too).
   Prefills still running when D's answer completed normally are left to finish.

Other public endpoints: ``GET /health`` (200 with an empty body while at least one prefill and
one decode server answer, 503 otherwise: no server URLs), ``GET /v1/models`` (passed through from
a decode server). Control endpoints: ``GET /lw/health`` (per-server reachability),
``GET /metrics-json`` (counters), ``GET /lw/timeline`` (milestones per transfer).
Errors. A client body the proxy cannot route D first (not JSON, not an object, no prompt or
messages, ...) goes to a decode server unchanged, so the client gets vLLM's own answer; a body
without ``model`` is served with the decode servers' model, as vLLM serves its only one. The
proxy's own errors (upstream failures) have vLLM's shape, ``{"error": {"message", "type",
"param", "code"}}`` (type from the status: ``BadGatewayError``, ``GatewayTimeoutError``), with
lw's details at the end of the message: ``[lw proxy: stage=..., server=..., request=...]``.

Sidecar mode (``--sidecar``, llm-d's decode-side routing sidecar; lw.vllm_adapter.sidecar): one
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
import json
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lw.transport.sidechannel import parse_cluster_key
from lw.vllm_adapter.control_auth import CallVerifier
from lw.vllm_adapter.passthrough import passthrough_handler
from lw.vllm_adapter.proxy_control import build_control_app, health_report
from lw.vllm_adapter.proxy_exchange import Exchange
from lw.vllm_adapter.proxy_state import (
    CHAT,
    COMPLETIONS,
    Backend,
    BadRequest,
    ProxyState,
    Transfer,
    _describe,
    _url_host,
    build_decode_body,
    build_prefill_body,
    error_body,
    normalize_url,
    sub_transfer_allowance,
    validate_request,
)
from lw.vllm_adapter.sidecar import BadTarget, Sidecar, parse_allow
from lw.vllm_adapter.tracing import TRACE_HEADERS

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


async def _relay_unroutable(state: ProxyState, request: Request, api: str, raw: bytes,
                            why: str) -> Response:
    """A body the proxy cannot route D first goes to a decode server as it is, so the client
    gets vLLM's own answer (its error status, type and message: clients parse them)."""
    decode = state.pick(state.decodes)
    headers = {k: v for k, v in request.headers.items()
               if k.lower() in ("content-type", "authorization")}
    try:
        # If vLLM accepts what the proxy could not route, D serves it alone (no P/D): the
        # whole answer, within the proxy's ordinary timeout.
        r = await state.client.post(decode.url + api, content=raw, headers=headers)
    except httpx.HTTPError as exc:
        state.counters["errors"] += 1
        return JSONResponse(error_body(f"request refused ({why}), and decode server "
                                       f"{decode.url} did not answer: {_describe(exc)}", 502,
                                       stage="decode", server=decode.url), status_code=502)
    state.counters["bad_requests" if r.status_code >= 400 else "relayed_unroutable"] += 1
    return Response(r.content, status_code=r.status_code,
                    media_type=r.headers.get("content-type", "application/json"))


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
) -> ProxyApps:
    """Build the proxy for these servers (base URLs such as ``http://10.0.0.1:8100``).

    ``metaserver_url`` is what D is told to call: the control app's ``/v1/metaserver`` at an
    address D reaches. ``cluster_key`` signs D's calls; None is refused unless
    ``insecure_trusted_network``. ``timeout_s`` bounds every read/write/pool wait of an outgoing
    call, ``connect_timeout_s`` every connect. ``sidecar``: run as llm-d's decode-side routing
    sidecar (lw.vllm_adapter.sidecar) in front of the one decode server. ``decode_failovers``:
    other decode servers a request may move to when its D fails before a byte of its answer
    reached the client.
    """
    if cluster_key is None and not insecure_trusted_network:
        raise ValueError("no cluster key: the metaserver would start a prefill for anyone who "
                         "can reach it. Give the decode servers' cluster key (--cluster-key or "
                         "LW_CLUSTER_KEY), or --insecure-trusted-network on a network only the "
                         "cluster can reach")
    state = ProxyState(prefill_urls, decode_urls, timeout_s=timeout_s,
                       connect_timeout_s=connect_timeout_s, health_timeout_s=health_timeout_s,
                       metaserver_url=metaserver_url,
                       verifier=CallVerifier(cluster_key, signature_window_s), sidecar=sidecar,
                       decode_failovers=decode_failovers)

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
            why = str(exc) if isinstance(exc, BadRequest) else f"request body is not JSON: {exc}"
            return await _relay_unroutable(state, request, api, raw, why)
        body = dict(body)
        if "model" not in body:
            model = await _served_model(state)
            if model is None:
                return await _relay_unroutable(state, request, api, raw, "no model named")
            body["model"] = model
        body.pop("kv_transfer_params", None)
        target: Backend | None = None
        if state.sidecar is not None:
            try:
                target = state.sidecar.target(request.headers.items(), state.prefills)
            except BadTarget as exc:
                state.counters["errors"] += 1
                log.warning("request refused (%d): %s", exc.status, exc)
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
        return Exchange(state, tr)

    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        """OpenAI completions, routed D first."""
        return await handle(request, COMPLETIONS)

    @app.post(CHAT)
    async def chat_completions(request: Request) -> Response:
        """OpenAI chat completions, routed D first."""
        return await handle(request, CHAT)

    @app.get("/health")
    async def health() -> Response:
        """As vLLM's: 200 with no body while the proxy can serve (a prefill and a decode server
        answer), 503 otherwise; the details are on the control port (/lw/health)."""
        report = await health_report(state)
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
                errors.append(f"{b.url}: {_describe(exc)}")
                continue
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type", "application/json"))
        state.counters["errors"] += 1
        return JSONResponse(error_body("no decode server answered /v1/models: "
                                       + "; ".join(errors), 502, stage="decode"),
                            status_code=502)

    if sidecar is not None:
        # As llm-d's sidecar: every other path of the pod's port is its decode server's
        # (/metrics, /tokenize, ...); lw's control plane stays on its own port.
        app.add_api_route("/{path:path}", passthrough_handler(state),
                          methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"],
                          include_in_schema=False)
    return ProxyApps(app, build_control_app(state), state)


async def _serve(apps: ProxyApps, public: socket.socket, control: socket.socket,
                 log_level: str) -> None:
    """Serve both apps until either stops (Ctrl-C stops both)."""
    import uvicorn

    servers = [uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan=lifespan))
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
    ap.add_argument("--port", type=int, default=8000, help="public (OpenAI API) port")
    ap.add_argument("--control-host", default="127.0.0.1",
                    help="control-plane address (metaserver, introspection): one the decode "
                         "servers reach and clients do not")
    ap.add_argument("--control-port", type=int, default=None,
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
    ap.add_argument("--signature-window", type=float, default=30.0, metavar="S",
                    help="accepted clock difference of a signed call, seconds (replays are "
                         "refused within it)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="read/write timeout of every outgoing call, seconds")
    ap.add_argument("--connect-timeout", type=float, default=5.0)
    ap.add_argument("--decode-failovers", type=int, default=2, metavar="N",
                    help="a request whose decode server fails (refused, dropped, 5xx) before a "
                         "byte of its answer reached the client moves to another one, at most "
                         "N times (0: never)")
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    sidecar = _sidecar_from_args(ap, args)
    if args.decode_failovers < 0:
        ap.error(f"--decode-failovers must be >= 0, got {args.decode_failovers}")
    if sidecar is None and not args.prefill:
        ap.error("at least one --prefill server is needed (or --sidecar, where each request "
                 "names its prefill server)")
    control_port = args.port + 1 if args.control_port is None else args.control_port
    if (args.control_host, control_port) == (args.host, args.port):
        ap.error("the control plane needs its own address or port (--control-host/"
                 "--control-port): it must not be reachable on the public port")
    metaserver_url = args.metaserver_url
    if metaserver_url is None:
        if args.control_host in ("0.0.0.0", "::", ""):
            ap.error("with a wildcard --control-host, give --metaserver-url (an address D can "
                     "reach)")
        metaserver_url = f"http://{_url_host(args.control_host)}:{control_port}/v1/metaserver"
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
                          decode_failovers=args.decode_failovers)
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
