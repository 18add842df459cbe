"""The D-first proxy's pure helpers: a client body checked, the bodies sent to D and P built
(signed ``kv_transfer_params``), errors in vLLM's shape, server URLs, a prefill answer's params.

No state and no I/O: :mod:`lw.proxy.state` holds the servers and transfers in flight and
re-exports these names.
"""

from __future__ import annotations

import copy
import ipaddress
import json
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

import httpx

from lw.contract.params import decoder_params, prefill_params, sign_params
from lw.contract.sampling import p_sampling_fields

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "MAX_ERROR_BODY",
    "PREFILL_KEPT",
    "BadField",
    "BadRequest",
    "ahead_fallback",
    "build_decode_body",
    "build_prefill_body",
    "describe_exc",
    "error_body",
    "error_type",
    "normalize_url",
    "prefill_answer_params",
    "quote_body",
    "server_url",
    "sub_transfer_allowance",
    "url_host",
    "validate_request",
]


COMPLETIONS = "/v1/completions"


CHAT = "/v1/chat/completions"


MAX_ERROR_BODY = 2000
"""Characters of an upstream error body quoted in our error messages."""


class BadRequest(ValueError):
    """A client body the proxy cannot route D first (relayed to a decode server as it is, which
    answers it as vLLM does)."""


def normalize_url(url: str) -> str:
    """Base URL of a server: add ``http://`` if missing, strip a trailing ``/`` and ``/v1``."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def server_url(url: str) -> str:
    """:func:`normalize_url` of a configured server, checked: http(s), a host, a port in
    1..65535, no query or fragment; raises ValueError saying what is wrong."""
    # Checked once at start: httpx.InvalidURL is no httpx.HTTPError, so a URL httpx cannot
    # use would otherwise fail every request with a 500. (normalize_url itself stays lenient:
    # lw.proxy.sidecar turns what it returns into a 400 for a header's value.)
    from urllib.parse import urlsplit

    base = normalize_url(url)
    if not base.isascii() or not base.isprintable() or " " in base:
        raise ValueError(f"{url!r}: only printable ASCII without spaces")
    try:
        parts = urlsplit(base)
        port = parts.port
    except ValueError as exc:  # "Invalid IPv6 URL", "Port out of range 0-65535", letters
        raise ValueError(f"{url!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{url!r}: scheme {parts.scheme!r} (expected http or https)")
    if not parts.hostname:
        raise ValueError(f"{url!r}: no host")
    if port == 0:
        raise ValueError(f"{url!r}: port 0 (expected 1..65535)")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r}: a base URL has no query or fragment")
    try:
        httpx.URL(base)
    except httpx.InvalidURL as exc:
        raise ValueError(f"{url!r} is not a URL: {exc}") from None
    return base


def validate_request(api: str, body: Any) -> dict[str, Any]:
    """Check that the proxy can route a client body for ``api`` (D first); return it or raise
    ``BadRequest`` saying why. ``model`` may be absent (vLLM then serves its only model)."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise BadRequest("'model' must be a non-empty string")
    stream = body.get("stream", False)
    if stream is None:
        raise BadRequest("'stream' is null")  # vLLM reads it as false: D serves it alone
    if not isinstance(stream, bool):
        # vLLM reads 1 or "true" as true: refused, not guessed
        raise BadField("stream", f"'stream' must be true or false, got {_shown(stream)}")
    n = body.get("n")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool)):
        # vLLM reads "2" or 2.0 as 2 requests: the allowance of sub-transfers must count the same
        raise BadField("n", f"'n' must be an integer, got {_shown(n)}")
    if api == COMPLETIONS:
        prompt = body.get("prompt")
        if prompt is None or prompt == "" or prompt == []:
            raise BadRequest("'prompt' is required for /v1/completions")
        if not isinstance(prompt, str | list):
            raise BadRequest("'prompt' must be a string or a list")
        if isinstance(prompt, list) and not _one_prompt_kind(prompt):
            # vLLM reads [1.0, 2.0] as one prompt of token ids: the allowance of sub-transfers
            # (one per prompt) must count what vLLM will, so only its exact shapes pass
            raise BadField("prompt", "'prompt' must be a list of token ids (integers), of "
                           f"strings or of token-id lists, got {_shown(prompt)}")
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' is required for /v1/chat/completions (non-empty list)")
    return body


def _one_prompt_kind(prompt: list[Any]) -> bool:
    """Whether ``prompt`` is one of the shapes vLLM reads without coercion: token ids, strings,
    or lists of token ids."""
    def token(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    return (all(map(token, prompt)) or all(isinstance(x, str) for x in prompt)
            or all(isinstance(x, list) and all(map(token, x)) for x in prompt))


class BadField(BadRequest):
    """A field of a type vLLM would coerce (``"stream": 1``, ``"n": "2"``): refused (400,
    ``param`` naming it), not relayed."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _shown(value: Any) -> str:
    """A client's value for an error message: its JSON, cut short, and its JSON type."""
    kind = {str: "string", float: "number", int: "number", bool: "boolean", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)
    text = json.dumps(value, ensure_ascii=True)
    return f"{text[:40]}{'...' if len(text) > 40 else ''} (a {kind})"


def build_decode_body(body: dict[str, Any], request_id: str, metaserver: str,
                      grant: str, key: bytes | None = None) -> dict[str, Any]:
    """The body sent to D: the client's (its transfer fields already dropped), with the
    proxy's ``kv_transfer_params`` signed with the cluster ``key`` (``grant``: the transfer's
    secret that D's metaserver calls must carry; only D and the proxy see it)."""
    out = dict(body)
    out["kv_transfer_params"] = sign_params(key, "decode",
                                            decoder_params(metaserver, request_id, grant))
    return out


def sub_transfer_allowance(api: str, body: dict[str, Any]) -> int:
    """How many sub-transfers D may create for a client request: one per prompt and choice.

    vLLM makes one request per prompt of a completions ``prompt`` list (a list of token ids is
    one prompt) and ``n`` children of each; D posts at most one metaserver call per request.
    """
    n = body.get("n", 1)
    n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
    prompt = body.get("prompt") if api == COMPLETIONS else None
    prompts = 1
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompts = len(prompt)
    return n * prompts


PREFILL_KEPT = ("cache_salt", "priority")
"""Client fields that still matter to P's prefill of token ids (cache isolation, scheduling)."""


def build_prefill_body(
    body: dict[str, Any], decode_params: Mapping[str, Any], transfer_id: str,
    prompt_token_ids: list[int], epoch: int = 0, key: bytes | None = None,
) -> dict[str, Any]:
    """The body P gets (``/v1/completions``): D's token ids, the client's sampling fields (P
    samples token 1 for D), one token, not streamed, D's params
    (with a re-prefill's claim epoch ``lw_epoch``; absent for the first attempt), signed with
    the cluster ``key``."""
    out: dict[str, Any] = {"model": body["model"], "prompt": list(prompt_token_ids),
                           **copy.deepcopy(p_sampling_fields(body)),
                           "max_tokens": 1, "n": 1, "stream": False}
    for k in PREFILL_KEPT:
        if k in body:
            out[k] = copy.deepcopy(body[k])
    out["kv_transfer_params"] = sign_params(key, "prefill",
                                            prefill_params(decode_params, transfer_id, epoch))
    return out


def error_type(status: int) -> str:
    """vLLM's error ``type`` for an HTTP status: its phrase as one word ending in "Error"
    (400 BadRequestError, 502 BadGatewayError, 504 GatewayTimeoutError, ...)."""
    try:
        word = "".join(HTTPStatus(status).phrase.split())
    except ValueError:
        word = "Unknown"
    return word if word.endswith("Error") else word + "Error"


def error_body(message: str, status: int, *, stage: str = "proxy",
               server: str | None = None, request_id: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    """An error in vLLM's shape (``{"error": {"message", "type", "param", "code"}}``, what a
    client of vLLM parses); lw's details (stage, server, request) go at the end of the message."""
    where = f"stage={stage}" + (f", server={server}" if server else "") + (
        f", request={request_id}" if request_id else "")
    return {"error": {"message": f"{message} [lw proxy: {where}]", "type": error_type(status),
                      "param": param, "code": status}}


def describe_exc(exc: BaseException) -> str:
    """Short description of an httpx exception."""
    text = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {text}"


def quote_body(data: bytes) -> str:
    """An upstream body shortened for an error message."""
    text = data.decode("utf-8", errors="replace")
    return text if len(text) <= MAX_ERROR_BODY else text[:MAX_ERROR_BODY] + "..."


def url_host(host: str) -> str:
    """Host as written in a URL (IPv6 in brackets)."""
    try:
        if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address):
            return f"[{host}]"
    except ValueError:
        pass
    return host


def prefill_answer_params(content: bytes) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a prefill response ({} if none)."""
    try:
        params = json.loads(content).get("kv_transfer_params")
    except (ValueError, AttributeError, RecursionError):
        return {}
    return params if isinstance(params, dict) else {}


def ahead_fallback(why: str) -> dict[str, Any]:
    """The answer to P's ahead fetch that tells it D's params will not come."""
    return {"status": "fallback", "detail": why[:1000]}
