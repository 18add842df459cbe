"""What the proxy reads from a client, on every route: a body within its bounds, parsed once, its
transfer fields screened (lw.contract.client); a refusal in vLLM's error shape, counted and
logged at a limited rate."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from lw.contract.client import screen_client_body
from lw.contract.params import ContractError
from lw.proxy.limits import BodyTooLarge, BodyTooSlow, read_body
from lw.proxy.state import ProxyState, error_body

__all__ = ["client_bytes", "parse_json", "refuse", "screen"]


def refuse(state: ProxyState, status: int, message: str, *, counter: str,
           param: str | None = None) -> JSONResponse:
    """A client body refused by the proxy itself, in vLLM's error shape; counted, and logged
    at most once per kind every few seconds."""
    state.counters[counter] += 1
    state.refusals.warning(counter, "client request refused (%d): %s", status, message)
    # closed after the answer: the rest of a refused body is not read (uvicorn would drain it)
    return JSONResponse(error_body(message, status, stage="proxy", param=param),
                        status_code=status, headers={"connection": "close"})


async def client_bytes(state: ProxyState, request: Request) -> bytes | JSONResponse:
    """The body, within ``limits.max_body_bytes`` and ``limits.body_read_s`` (413 / 408)."""
    try:
        return await read_body(request, state.limits.max_body_bytes, state.limits.body_read_s)
    except BodyTooLarge as exc:
        return refuse(state, 413, str(exc), counter="bodies_too_large")
    except BodyTooSlow as exc:
        return refuse(state, 408, str(exc), counter="bodies_too_slow")


def parse_json(state: ProxyState, raw: bytes) -> Any:
    """The parsed body, or a 400: what the proxy cannot parse it never relays (a parser more
    lenient than the proxy's must not see it)."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        return refuse(state, 400, f"request body is not valid JSON: {str(exc)[:200]}",
                      counter="bad_requests")


def screen(state: ProxyState, body: dict[str, Any]) -> dict[str, Any] | JSONResponse:
    """``body`` without the client's transfer fields (dropped, counted), or the 400 naming one
    of a wrong type."""
    try:
        out, fields = screen_client_body(body)
    except ContractError as exc:
        return refuse(state, 400, str(exc), counter="client_transfer_params_refused",
                      param=exc.field)
    if fields.dropped:
        state.counters["client_transfer_params_dropped"] += 1
        state.refusals.warning("client_transfer_params_dropped", "a client's %s dropped (the "
                               "proxy sets transfer parameters)", ", ".join(fields.dropped))
    return out
