"""An admission check for P's and D's vLLM API servers: transfer parameters lw would refuse are
answered 400 (vLLM's error shape, ``param`` naming the field) before the request reaches the
engine, where the connector could only serve it as a plain request.

Mounted with ``vllm serve ... --middleware lw.vllm_adapter.admission.TransferParamsGuard``. It
reads the cluster key from ``LW_CLUSTER_KEY`` (as the connector can); with none it checks shapes
only. The connector checks again (lw.vllm_adapter.scheduler_side): this is for the client's
answer, not the only line. A UTF-8 body without the text ``kv_transfer_params`` (or a JSON escape
that could spell it) is passed on unparsed: ordinary requests pay a byte search. Others
(UTF-16/32, which vLLM's json.loads reads too) are always parsed.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from lw.contract.ahead import decode_ahead_params, is_ahead_request
from lw.contract.params import (
    ContractError,
    decode_params_for_decoder,
    decode_params_for_prefiller,
    is_prefill_request,
    is_remote_prefill_request,
)
from lw.transport.sidechannel import parse_cluster_key

__all__ = ["MAX_BODY_BYTES", "TransferParamsGuard", "transfer_params_problem"]

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BODY_BYTES = 64 << 20
"""Largest body the guard buffers; a larger one is answered 413."""
FIELD = "kv_transfer_params"


def transfer_params_problem(body: Any, key: bytes | None) -> ContractError | None:
    """Why a request body's transfer parameters must be refused, or None."""
    if not isinstance(body, dict):
        return None  # vLLM answers it
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and FIELD in xargs:
        return ContractError(f"vllm_xargs.{FIELD}", "transfer parameters are set by lw's proxy "
                             "in kv_transfer_params, never in vllm_xargs")
    params = body.get(FIELD)
    if params is None:
        return None
    if not isinstance(params, dict):
        return ContractError(FIELD, f"must be an object, got {type(params).__name__}")
    try:
        if is_prefill_request(params) and is_ahead_request(params):
            decode_ahead_params(key, params)
        elif is_prefill_request(params):
            decode_params_for_prefiller(key, params)
        elif is_remote_prefill_request(params):
            decode_params_for_decoder(key, params)
    except ContractError as exc:
        return exc
    return None


def _error(status: int, message: str, param: str | None) -> bytes:
    kind = "BadRequestError" if status == 400 else "RequestEntityTooLargeError"
    return json.dumps({"error": {"message": message, "type": kind, "param": param,
                                 "code": status}}).encode()


class TransferParamsGuard:
    """ASGI middleware refusing bad transfer parameters on POSTs (see the module docstring)."""

    def __init__(self, app: App) -> None:
        self.app = app
        try:
            self.key = parse_cluster_key(os.environ.get("LW_CLUSTER_KEY") or None)
        except ValueError as exc:
            raise ValueError(f"TransferParamsGuard: environment variable LW_CLUSTER_KEY: {exc}"
                             ) from None
        if self.key is None:
            # The connector may hold the key in kv_connector_extra_config, which a middleware
            # cannot read: forged parameters then pass here and are refused only there.
            log.warning("TransferParamsGuard: LW_CLUSTER_KEY is not set, so it checks the shape "
                        "of transfer parameters only, not the proxy's signature (the connector "
                        "still does); set LW_CLUSTER_KEY to refuse forged ones here")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:  # refused unread
            await _answer(send, 413, _error(413, f"request body declares {int(declared)} "
                                                 f"bytes; the limit is {MAX_BODY_BYTES}", None))
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":  # the client went away: vLLM sees it so
                await self.app(scope, _replay(b"".join(chunks), receive, msg), send)
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                await _answer(send, 413, _error(413, f"request body is larger than "
                                                     f"{MAX_BODY_BYTES} bytes", None))
                return
            chunks.append(chunk)
            more = msg.get("more_body", False)
        raw = b"".join(chunks)
        if FIELD.encode() in raw or b"\\u" in raw or _not_utf8_json(raw):
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError, RecursionError):
                body = None  # vLLM answers what is not JSON
            problem = transfer_params_problem(body, self.key)
            if problem is not None:
                await _answer(send, 400, _error(400, str(problem), problem.field))
                return
        await self.app(scope, _replay(raw, receive), send)


def _not_utf8_json(raw: bytes) -> bool:
    """Whether json.loads would decode ``raw`` as UTF-16/32 (its BOM, or a NUL in the first two
    bytes: json.detect_encoding), where the byte search for the field's name sees nothing."""
    return b"\x00" in raw[:2] or raw.startswith((b"\xff\xfe", b"\xfe\xff"))


def _replay(raw: bytes, receive: Receive, first: Message | None = None) -> Receive:
    """A ``receive`` that hands the buffered body on, then what the client sends next (its
    disconnect, which vLLM watches to abort a request)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return first if first is not None else await receive()

    return replay


async def _answer(send: Send, status: int, body: bytes) -> None:
    # the connection closes: a client that sent a body it was refused for sends no more
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
