"""The HTTP client the cases and the probes send with: POST a body (whole, or streamed in
chunks) and read what came back as an :class:`~lw.lab.hostile.table.Answer`."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from lw.lab.hostile.table import (
    MB,
    MESSAGE_CHARS,
    Answer,
    answer_message,
    answer_param,
    clip,
)


def _answer(r: Any, sent: int | None = None) -> Answer:
    return Answer(r.status_code, answer_message(r.status_code, r.content), sent,
                  answer_param(r.content))


def post(url: str, body: bytes | dict[str, Any], headers: Any = None,
         timeout: float = 60.0) -> Answer:
    """POST a JSON object (or raw bytes); the answer, or None and the client's error."""
    import httpx

    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs: list[tuple[bytes, bytes]] = [(b"content-type", b"application/json")]
    pairs = list(headers.items()) if isinstance(headers, dict) else list(headers or ())
    for k, v in pairs:
        hdrs.append((k if isinstance(k, bytes) else k.encode(),
                     v if isinstance(v, bytes) else v.encode()))
    try:
        with httpx.Client(timeout=httpx.Timeout(timeout, connect=5.0)) as c:
            return _answer(c.post(url, content=content, headers=hdrs))
    except httpx.HTTPError as exc:
        return Answer(None, clip(f"{type(exc).__name__}: {exc}", MESSAGE_CHARS))


def post_stream(url: str, total: int, *, declare: bool, headers: dict[str, str] | None = None,
                chunk: int = MB, time_limit: float = 60.0) -> Answer:
    """POST ``total`` bytes in ``chunk``-sized pieces (with a Content-Length when ``declare``,
    chunked otherwise), stopping early once ``time_limit`` passes; the answer and how many
    bytes the client handed to its socket."""
    import httpx

    sent = 0
    deadline = time.monotonic() + time_limit
    block = b" " * chunk

    def body() -> Iterator[bytes]:
        nonlocal sent
        while sent < total and time.monotonic() < deadline:
            n = min(chunk, total - sent)
            sent += n
            yield block if n == chunk else block[:n]

    hdrs = {"content-type": "application/json", **(headers or {})}
    if declare:
        hdrs["content-length"] = str(total)
    try:
        with httpx.Client(timeout=httpx.Timeout(30.0, connect=5.0)) as c:
            return _answer(c.post(url, content=body(), headers=hdrs), sent)
    except httpx.HTTPError as exc:
        return Answer(None, clip(f"{type(exc).__name__}: {exc}", MESSAGE_CHARS), sent)
