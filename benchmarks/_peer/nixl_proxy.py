"""Minimal proxy for vLLM's NIXL P/D connectors, in the two flows vLLM documents.

``pull`` (``NixlConnector``: D reads P's blocks): P first, with ``max_tokens`` 1, not streamed,
and ``kv_transfer_params`` ``{"do_remote_decode": true}``; P answers with the parameters D needs
(P's engine id, side-channel host and port, block ids, ...), which go unchanged into the
client's request to D, whose response is relayed as it comes.

``push`` (``NixlPushConnector``: P writes into blocks D allocated): D and P together. D's request
carries P's coordinates preset (engine id, side-channel host and port, TP size: what
``push_scheduler.py`` reads to register D's blocks with P) and the request id; P's is the
same prefill-only copy as in ``pull``, run in the background. Both carry the same
``X-Request-Id``, by which P's worker matches D's registration to its finished request.

``python benchmarks/_peer/nixl_proxy.py --mode pull --prefill URL --decode URL --port N``
(``--mode push`` also needs ``--p-engine-id``, ``--p-host``, ``--p-port``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODES = ("pull", "push")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """P's copy of a client request: compute the prompt, answer one token, keep the KV for D."""
    out = dict(body, stream=False, max_tokens=1)
    out.pop("stream_options", None)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """D's copy of a client request: the client's request with ``params`` as its
    ``kv_transfer_params`` (P's answer in ``pull``, P's preset coordinates in ``push``)."""
    return dict(body, kv_transfer_params=dict(params))


def push_params(engine_id: str, host: str, port: int, tp_size: int) -> dict[str, Any]:
    """D's ``kv_transfer_params`` in ``push``: where P is, before P has seen the request."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
            "remote_host": host, "remote_port": port, "tp_size": tp_size}


class PeerProxy:
    """The proxy's state: P's and D's base URLs, the flow, and (``push``) P's coordinates."""

    def __init__(self, prefill: str, decode: str, mode: str,
                 p_params: dict[str, Any] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "push" and not p_params:
            raise ValueError("push needs P's coordinates (push_params)")
        self.prefill, self.decode, self.mode = prefill, decode, mode
        self.p_params = p_params or {}
        self.client: httpx.AsyncClient | None = None
        self.background: set[asyncio.Task[None]] = set()

    async def run_prefill(self, api: str, body: dict[str, Any],
                          rid: str) -> tuple[int, dict[str, Any] | str]:
        """P's request: its status and its JSON answer (or the start of its error text)."""
        assert self.client is not None
        r = await self.client.post(self.prefill + api, json=prefill_body(body),
                                   headers={"X-Request-Id": rid})
        if r.status_code != 200:
            return r.status_code, r.text[:500]
        return 200, r.json()

    async def _prefill_in_background(self, api: str, body: dict[str, Any], rid: str) -> None:
        try:
            status, answer = await self.run_prefill(api, body, rid)
            if status != 200:
                print(f"prefill {rid}: HTTP {status} {answer}", flush=True)
        except httpx.HTTPError as exc:
            print(f"prefill {rid}: {type(exc).__name__}: {exc}", flush=True)

    async def handle(self, request: Request, api: str) -> Response:
        """One client request through P and D, D's answer relayed as it comes."""
        assert self.client is not None
        body = await request.json()
        rid = str(uuid.uuid4())
        if self.mode == "pull":
            try:
                status, answer = await self.run_prefill(api, body, rid)
            except httpx.HTTPError as exc:
                return JSONResponse({"error": f"prefill: {type(exc).__name__}: {exc}"}, 502)
            if status != 200 or not isinstance(answer, dict):
                return JSONResponse({"error": f"prefill: HTTP {status}: {answer}"}, 502)
            params = answer.get("kv_transfer_params")
            if not params:
                return JSONResponse({"error": "prefill answered no kv_transfer_params"}, 502)
        else:
            task = asyncio.create_task(self._prefill_in_background(api, body, rid))
            self.background.add(task)
            task.add_done_callback(self.background.discard)
            # D's scheduler needs a remote request id (it logs it and sends it in heartbeats);
            # P's own id is the header's plus a suffix vLLM draws, unknown here, so P keeps
            # its default lease (heartbeats naming another id are ignored)
            params = dict(self.p_params, remote_request_id=rid)
        req = self.client.build_request("POST", self.decode + api,
                                        json=decode_body(body, params),
                                        headers={"X-Request-Id": rid})
        resp = await self.client.send(req, stream=True)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()

        return StreamingResponse(relay(), status_code=resp.status_code,
                                 media_type=resp.headers.get("content-type"))


def build_app(proxy: PeerProxy) -> Starlette:
    """The proxy app: /v1/completions, /v1/chat/completions, /health."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        proxy.client = httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits)
        yield
        await proxy.client.aclose()

    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/completions")

    async def chat(request: Request) -> Response:
        return await proxy.handle(request, "/v1/chat/completions")

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "mode": proxy.mode})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/health", health)], lifespan=lifespan)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``push`` refused without P's engine id, host and port)."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=MODES, required=True)
    ap.add_argument("--prefill", required=True, help="P's base URL")
    ap.add_argument("--decode", required=True, help="D's base URL")
    ap.add_argument("--p-engine-id", help="push: P's kv_transfer_config engine_id")
    ap.add_argument("--p-host", help="push: P's NIXL side-channel host")
    ap.add_argument("--p-port", type=int, help="push: P's NIXL side-channel port")
    ap.add_argument("--p-tp-size", type=int, default=1, help="push: P's tensor-parallel size")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args(argv)
    if args.mode == "push" and None in (args.p_engine_id, args.p_host, args.p_port):
        ap.error("--mode push needs --p-engine-id, --p-host and --p-port")
    return args


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and serve."""
    args = parse_args(argv)
    p_params = (push_params(args.p_engine_id, args.p_host, args.p_port, args.p_tp_size)
                if args.mode == "push" else None)
    proxy = PeerProxy(args.prefill.rstrip("/"), args.decode.rstrip("/"), args.mode, p_params)
    uvicorn.run(build_app(proxy), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
