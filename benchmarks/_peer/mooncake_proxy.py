"""Minimal proxy for vLLM's in-tree MooncakeConnector P/D, as vLLM's example proxy drives it.

One client request becomes, under one ``transfer_id``: a prefill request to P
(``do_remote_decode``, ``max_tokens`` 1, not streamed) started in the background, and the
client's request to D (``do_remote_prefill`` with P's bootstrap address and engine id), whose
response is relayed as it comes. D pulls P's KV once P has computed it. P's engine id is read
from P's Mooncake bootstrap server (``GET /query``) at start-up.

``python benchmarks/_peer/mooncake_proxy.py --prefill URL --bootstrap URL --decode URL --port N``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


def prefill_body(body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """P's copy of the request: prefill only, keep the KV for D to pull."""
    out = dict(body, stream=False, max_tokens=1)
    out.pop("stream_options", None)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                 "transfer_id": transfer_id}
    return out


def decode_body(body: dict[str, Any], transfer_id: str, bootstrap: str,
                engine_id: str) -> dict[str, Any]:
    """D's copy of the request: pull the prompt's KV from P, then decode."""
    return dict(body, kv_transfer_params={
        "do_remote_decode": False, "do_remote_prefill": True, "transfer_id": transfer_id,
        "remote_bootstrap_addr": bootstrap, "remote_engine_id": engine_id})


async def query_engine_id(bootstrap: str, timeout: float) -> str:
    """P's engine id (DP rank 0) from its bootstrap server, retried until ``timeout``."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            try:
                r = await client.get(bootstrap + "/query")
                data = r.json() if r.status_code == 200 else {}
                if data:
                    entry = data.get("0") or next(iter(data.values()))
                    return str(entry["engine_id"])
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"no engine registered at {bootstrap}/query")
            await asyncio.sleep(0.5)


def build_app(prefill: str, decode: str, bootstrap: str) -> Starlette:
    """The proxy app: /v1/completions, /v1/chat/completions, /health."""
    state: dict[str, Any] = {}
    background: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits)
        state["engine_id"] = await query_engine_id(bootstrap, 60.0)
        yield
        await state["client"].aclose()

    async def run_prefill(api: str, body: dict[str, Any], rid: str) -> None:
        try:
            r = await state["client"].post(prefill + api, json=body,
                                           headers={"X-Request-Id": rid})
            if r.status_code != 200:
                print(f"prefill {rid}: HTTP {r.status_code} {r.text[:200]}", flush=True)
        except httpx.HTTPError as exc:
            print(f"prefill {rid}: {type(exc).__name__}: {exc}", flush=True)

    async def handle(request: Request, api: str) -> Response:
        body = await request.json()
        rid = str(uuid.uuid4())
        tid = f"xfer-{rid}"
        task = asyncio.create_task(run_prefill(api, prefill_body(body, tid), rid))
        background.add(task)
        task.add_done_callback(background.discard)
        client: httpx.AsyncClient = state["client"]
        req = client.build_request("POST", decode + api,
                                   json=decode_body(body, tid, bootstrap, state["engine_id"]),
                                   headers={"X-Request-Id": rid})
        resp = await client.send(req, stream=True)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()

        return StreamingResponse(relay(), status_code=resp.status_code,
                                 media_type=resp.headers.get("content-type"))

    async def completions(request: Request) -> Response:
        return await handle(request, "/v1/completions")

    async def chat(request: Request) -> Response:
        return await handle(request, "/v1/chat/completions")

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "engine_id": state.get("engine_id")})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/health", health)], lifespan=lifespan)


def main() -> None:
    """Parse the command line and serve."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", required=True, help="P's base URL")
    ap.add_argument("--bootstrap", required=True, help="P's Mooncake bootstrap URL")
    ap.add_argument("--decode", required=True, help="D's base URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    app = build_app(args.prefill.rstrip("/"), args.decode.rstrip("/"), args.bootstrap.rstrip("/"))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
