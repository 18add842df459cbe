"""The proxy's control plane: the metaserver D calls and lw's introspection, served on an
internal address of its own, never on the public OpenAI port (docs/deployment.md).

``POST /v1/metaserver`` starts a prefill only for a call that is signed with the cluster key
(lw.contract.auth), carries the grant the proxy gave the decode server it sent that
transfer to, names a sub-transfer of that transfer and stays within the sub-transfers the client
request allows (``n`` x prompts). ``POST /v1/ahead`` (``--start-mode admit-ahead``) hands a
prefill engine D's params for a request sent to it ahead of them, under the same signature and
the transfer's ahead grant (lw.proxy.ahead). ``GET /lw/timeline``, ``GET /metrics-json``,
``GET /lw/health`` and ``GET /lw/workers`` tell what the proxy saw (request ids, timings,
server URLs, the workers' side channels): internal only.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from lw.contract.ahead import ahead_fetch
from lw.contract.params import ContractError, metaserver_call
from lw.contract.transfer_ids import is_sub_transfer_of
from lw.contract.worker_addrs import decode_workers
from lw.proxy.ahead import bind as bind_ahead
from lw.proxy.ahead import fetch as fetch_ahead
from lw.proxy.backend import MAX_WORKERS, Backend
from lw.proxy.exchange import run_prefill
from lw.proxy.failover import failover_problem, reprefill, route_fields
from lw.proxy.limits import BodyTooLarge, BodyTooSlow, read_body
from lw.proxy.state import (
    ProxyState,
    SubPrefill,
    Transfer,
    build_prefill_body,
    describe_exc,
)

__all__ = ["build_control_app", "cached_health", "health_report"]


def _metaserver_problem(msg: dict[str, Any]) -> str:
    """Why a metaserver call (decoded into the contract's type) is malformed, or ""."""
    problem = failover_problem(msg)
    if problem or msg.get("epoch", 0):
        return problem  # a re-prefill resends what the first call of its sub-transfer gave
    if not msg.get("prompt_token_ids"):
        return "'prompt_token_ids' (non-empty list of token ids) required"
    if msg.get("kv_transfer_params") is None:
        return "'kv_transfer_params' (the decode engine's blocks) required"
    return ""


def _call_problem(tr: Transfer, msg: dict[str, Any]) -> str:
    """Why this well-formed, signed call may not start a prefill of ``tr`` ("" if it may)."""
    if tr.local:
        return (f"transfer {tr.request_id} is computed by the decode server alone (no prefill "
                "server named or configured)")
    if not hmac.compare_digest(str(msg.get("grant", "")).encode(), tr.grant.encode()):
        return ("the call does not carry this transfer's grant: only the decode server the "
                "proxy sent the request to may ask for its prefill")
    if not is_sub_transfer_of(msg["sub_transfer_id"], tr.request_id):
        return (f"sub_transfer_id {msg['sub_transfer_id'][:80]!r} is not a sub-transfer of "
                f"transfer {tr.request_id} (<transfer_id>@<request>)")
    if msg["sub_transfer_id"] not in tr.prefills and len(tr.prefills) >= tr.allowance:
        return (f"transfer {tr.request_id} already has the {tr.allowance} sub-transfer(s) its "
                "client request allows (one per prompt and choice)")
    return ""


async def health_report(state: ProxyState) -> dict[str, Any]:
    """Whether each prefill and decode server answers its /health."""

    async def probe(b: Backend) -> dict[str, Any]:
        try:
            r = await state.client.get(b.url + "/health", timeout=state.health_timeout)
            return {"url": b.url, "reachable": True, "healthy": r.is_success,
                    "status_code": r.status_code}
        except httpx.HTTPError as exc:
            return {"url": b.url, "reachable": False, "healthy": False,
                    "error": describe_exc(exc)}

    results = await asyncio.gather(*(probe(b) for b in state.prefills + state.decodes))
    pre, dec = results[: len(state.prefills)], results[len(state.prefills):]
    ok = all(r["healthy"] for r in results)
    return {"status": "ok" if ok else "degraded", "prefill": pre, "decode": dec}


async def cached_health(state: ProxyState) -> dict[str, Any]:
    """:func:`health_report`, probed at most once per ``limits.health_cache_s``: the public
    ``/health`` answers a flood without sending one probe per call to every backend."""
    now = asyncio.get_running_loop().time()
    cached = state.health_cache
    if cached is not None and now - cached[0] < state.limits.health_cache_s:
        return cached[1]
    task = state.health_task
    if task is None or task.done():  # concurrent callers share one probe
        task = state.health_task = asyncio.ensure_future(_probe(state))
    return await asyncio.shield(task)


async def _probe(state: ProxyState) -> dict[str, Any]:
    """One probe of every backend, cached before its task ends (so no caller can find the
    task done and the cache unset, and probe again)."""
    report = await health_report(state)
    state.health_cache = (asyncio.get_running_loop().time(), report)
    return report


def build_control_app(state: ProxyState) -> FastAPI:
    """The control-plane app over ``state`` (shared with the public app)."""
    app = FastAPI(title="lw D-first proxy: control plane")

    def refuse(status: int, detail: str, request: Request, msg: Any = None,
               what: str = "metaserver") -> JSONResponse:
        """Count and log a refused control call (``what``: "metaserver" or "ahead")."""
        state.counters["metaserver_refused" if what == "metaserver"
                       else "ahead_fetches_refused"] += 1
        peer = request.client.host if request.client else "?"
        ids = {k: msg.get(k) for k in ("transfer_id", "sub_transfer_id")} if isinstance(
            msg, dict) else {}
        state.refusals.note(f"{what}_{status}", "%s call refused (%d): %s %s", what, status,
                            detail, ids, peer=peer)
        # closed after the answer: the rest of a refused body is not read
        return JSONResponse({"status": "error", **ids, "detail": detail}, status,
                            headers={"connection": "close"})

    async def signed_body(request: Request, what: str) -> bytes | JSONResponse:
        """A control call's body, its signature checked, or the refusal to answer."""
        why = state.verifier.header_problem(request.headers) if state.verifier.key else ""
        if why:  # before reading the body: an unsigned caller makes the proxy hold nothing
            return refuse(401, why, request, what=what)
        if state.control_reads >= state.limits.max_control_reads:
            # bodies are read before their MAC can be checked: bound what callers can hold
            return refuse(503, f"{state.limits.max_control_reads} calls are being read; "
                          "try again", request, what=what)
        state.control_reads += 1
        try:
            raw = await read_body(request, state.limits.max_control_body_bytes,
                                  state.limits.body_read_s)
        except BodyTooLarge as exc:
            return refuse(413, str(exc), request, what=what)
        except BodyTooSlow as exc:
            return refuse(408, str(exc), request, what=what)
        finally:
            state.control_reads -= 1
        why = state.verifier.check(request.headers, raw)
        return refuse(401, why, request, what=what) if why else raw

    @app.post("/v1/ahead", name="ahead")
    async def ahead(request: Request) -> JSONResponse:
        """Called by P's connector for a prefill sent to it ahead of D: D's params, once D's
        metaserver call arrives (lw.proxy.ahead)."""
        raw = await signed_body(request, "ahead")
        if isinstance(raw, JSONResponse):
            return raw
        try:
            call = ahead_fetch(raw)
        except ContractError as exc:
            return refuse(400, str(exc), request, what="ahead")
        status, answer = await fetch_ahead(state, call)
        if status != 200:
            state.counters["ahead_fetches_refused"] += 1
        return JSONResponse(answer, status)

    @app.post("/v1/metaserver", name="metaserver")
    async def metaserver(request: Request) -> JSONResponse:
        """Called by D's connector once a vLLM request's blocks are allocated: start its prefill."""
        state.counters["metaserver_calls"] += 1
        raw = await signed_body(request, "metaserver")
        if isinstance(raw, JSONResponse):
            return raw
        try:
            msg = msgspec.to_builtins(metaserver_call(raw))
        except ContractError as exc:
            return refuse(400, str(exc), request)
        problem = _metaserver_problem(msg)
        if problem:
            return refuse(400, problem, request, msg)
        tid, sub_id = msg["transfer_id"], msg["sub_transfer_id"]
        tr = state.transfers.get(tid)
        if tr is None:
            return JSONResponse({"status": "error", "transfer_id": tid,
                                 "sub_transfer_id": sub_id, "prefill_url": None,
                                 "detail": "unknown transfer_id (request finished or never "
                                           "seen)"}, 404)
        why = _call_problem(tr, msg)
        if why:
            return refuse(403, why, request, msg)
        if msg.get("epoch", 0):  # a re-prefill: D's core lost this sub-transfer's P
            status, answer = reprefill(state, tr, msg)
            if status in (403, 409):
                return refuse(status, answer["detail"], request, msg)
            return JSONResponse(answer, status)
        workers = decode_workers(msg.get("kv_transfer_params"))
        state.workers.learn("decode", workers)
        # whom to ask if this D fails the request (the call is signed and carries the grant)
        tr.decode.learn_workers(workers)
        for a in workers[:MAX_WORKERS - len(tr.decode_workers)]:
            tr.decode_workers[a] = None
        sub = tr.prefills.get(sub_id)
        if sub is not None and sub.epoch > 0:  # D's first call, after a re-prefill of it
            return refuse(409, f"stale epoch 0: the sub-transfer is at epoch {sub.epoch}",
                          request, msg)
        if sub is not None:
            return JSONResponse({"status": "ok", "transfer_id": tid, "sub_transfer_id": sub_id,
                                 "prefill_url": sub.backend.url,
                                 "detail": f"prefill already {sub.state}",
                                 **route_fields(sub)}, 202)
        body = build_prefill_body(tr.body, msg["kv_transfer_params"], sub_id,
                                  msg["prompt_token_ids"], key=state.verifier.key)
        state.timeline.mark(sub_id, "meta_posted")
        sub = bind_ahead(state, tr, msg, body)  # P has it already (admit-ahead)
        if sub is None:
            sub = SubPrefill(sub_id, tr.prefill_target or state.pick(state.prefills),
                             budget=msg.get("retry_prefill", 0), body=body)
            sub.task = state.spawn(run_prefill(state, tr, sub, body))
        tr.prefills[sub_id] = sub
        state.counters["prefills"] += 1
        return JSONResponse({"status": "ok", "transfer_id": tid, "sub_transfer_id": sub_id,
                             "prefill_url": sub.backend.url, "detail": "prefill started",
                             **route_fields(sub)}, 202)

    @app.get("/lw/timeline")
    async def timeline() -> JSONResponse:
        """What the proxy saw of recent transfers: id -> milestone -> wall time (see
        lw.proxy.timeline); with lw status timelines, lw.ops.phases."""
        return JSONResponse(state.timeline.snapshot())

    @app.get("/lw/workers")
    async def workers() -> JSONResponse:
        """The P and D workers' side-channel addresses seen in traffic: D's in its signed
        metaserver calls, P's in its prefill responses (what ``lw status --proxy`` asks)."""
        return JSONResponse(state.workers.snapshot())

    @app.get("/metrics-json")
    async def metrics() -> JSONResponse:
        """Counters: requests, errors, refused metaserver calls, in-flight per server."""
        return JSONResponse(state.metrics())

    @app.get("/lw/health")
    async def health() -> JSONResponse:
        """Proxy alive, plus whether each server answers its /health (always 200)."""
        return JSONResponse(await health_report(state))

    return app
