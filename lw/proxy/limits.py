"""The proxy's bounds on what a peer can make it hold: body sizes on both ports, P's answer
(size and time), the health probes' cache, and the questions it asks decode workers about
failed requests.

Each bound is stated here, in docs/deployment.md ("Threat model") and tried by a test.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request

__all__ = ["BodyAbandoned", "BodyTooLarge", "BodyTooSlow", "Limits", "read_body"]

BODY_READ_BUDGET = 1 << 30
"""What the public port's bodies being read may hold together by default (``max_body_reads``
is this over ``max_body_bytes``)."""


@dataclass
class PublicLoad:
    """What the public port holds now beyond its transfers."""

    reads: int = 0
    """Client bodies being read (bounded by ``Limits.body_reads``)."""
    relays: int = 0
    """Requests relayed to a decode server outside a transfer (counted as requests in flight)."""


@dataclass(frozen=True)
class Limits:
    """The proxy's bounds (``lw proxy`` flags set them)."""

    max_body_bytes: int = 8 << 20
    """A client body on the public port (a 128k-token prompt as token ids is ~1 MB)."""
    max_control_body_bytes: int = 8 << 20
    """A metaserver call (a prompt's token ids: ~7 bytes each; 8 MiB is a 1M-token prompt)."""
    max_control_reads: int = 32
    """Metaserver bodies read at once (each before its MAC is checked): with the size bound,
    what callers without the key can make the proxy hold (256 MiB at most)."""
    max_prefill_answer_bytes: int = 1 << 20
    """P's answer to a prefill (one token and lw's params: a few hundred bytes)."""
    prefill_total_s: float = 600.0
    """Whole prefill call, connect to last byte (httpx's timeouts bound each read, not this)."""
    health_cache_s: float = 1.0
    """A public ``/health`` answers from a probe at most this old (a flood probes no backend)."""
    max_concurrent_requests: int = 4096
    """Client requests in flight on the public port; more get 503 at once."""
    body_read_s: float = 60.0
    """A body must arrive whole within this (a client dripping one holds a connection and up
    to the size bound; 408 after it)."""
    max_body_reads: int | None = None
    """Client bodies read at once on the public port (503 beyond it): with the size bound, what
    clients dripping bodies can make the proxy hold. None: ``BODY_READ_BUDGET`` (1 GiB) over
    ``max_body_bytes``, at most ``max_concurrent_requests`` (128 by default)."""
    max_connections: int = 8192
    """Open connections per port (uvicorn's limit_concurrency: 503 beyond it)."""
    why_timeout_s: float = 0.5
    """How long a failed request's client waits while the proxy asks D's workers why it failed
    (lw.proxy.explain); past it, the error says the cause is unknown."""
    why_in_flight: int = 4
    """Such questions asked at once (each a thread and a side-channel socket)."""
    why_per_s: float = 20.0
    """Such questions asked per second, bursts included: each has D's worker scan its timeline
    (a few ms), so a storm of failures must not become a storm of scans."""

    ahead_wait_s: float = 2.0
    """admit-ahead: how long a prefill sent to P ahead of D waits for D's metaserver call (and
    D's call for P's fetch) before it is cancelled and the prefill started D first. Below the
    prefill engines' metaserver_timeout_s (their fetch's timeout)."""

    def __post_init__(self) -> None:
        if not self.ahead_wait_s > 0:
            raise ValueError(f"ahead_wait_s must be > 0, got {self.ahead_wait_s}")
        for name in ("max_body_bytes", "max_control_body_bytes", "max_prefill_answer_bytes",
                     "max_concurrent_requests", "max_control_reads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefill_total_s <= 0 or self.health_cache_s < 0 or self.body_read_s <= 0:
            raise ValueError("prefill_total_s and body_read_s must be > 0, health_cache_s >= 0")
        if self.max_body_reads is not None and self.max_body_reads < 1:
            raise ValueError(f"max_body_reads must be >= 1, got {self.max_body_reads}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.why_timeout_s < 0 or self.why_in_flight < 0 or self.why_per_s < 0:
            raise ValueError("why_timeout_s, why_in_flight and why_per_s must be >= 0 (0: the "
                             "proxy never asks why a request failed)")


    @property
    def body_reads(self) -> int:
        """``max_body_reads``, or its default derived from the other bounds."""
        if self.max_body_reads is not None:
            return self.max_body_reads
        return max(1, min(self.max_concurrent_requests, BODY_READ_BUDGET // self.max_body_bytes))


class BodyAbandoned(ValueError):
    """The client went away before its whole body arrived (nobody is left to answer)."""

    def __init__(self, size: int) -> None:
        super().__init__(f"the client disconnected after {size} bytes of its body")
        self.size = size


class BodyTooSlow(ValueError):
    """A body that did not arrive whole within ``body_read_s``."""

    def __init__(self, within_s: float) -> None:
        super().__init__(f"request body not received within {within_s:g} s")


class BodyTooLarge(ValueError):
    """A body over its bound; nothing past the bound was read."""

    def __init__(self, limit: int, declared: int | None = None) -> None:
        what = f"declares {declared} bytes" if declared is not None else "is larger"
        super().__init__(f"request body {what}; the limit is {limit} bytes")
        self.limit = limit


async def read_body(request: Request, limit: int, within_s: float = 60.0) -> bytes:
    """The request's body, read only up to ``limit`` bytes and ``within_s`` seconds: a
    ``Content-Length`` above the limit is refused before a byte is read, a longer stream as soon
    as it passes the limit, a slower one at the deadline (BodyTooSlow); a client that leaves
    first raises BodyAbandoned."""
    try:
        async with asyncio.timeout(within_s):
            return await _read_body(request, limit)
    except TimeoutError:
        raise BodyTooSlow(within_s) from None


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            n = -1
        if n > limit:
            raise BodyTooLarge(limit, n)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        # a client's own choice, not a fault: callers count it (uvicorn would log a traceback)
        raise BodyAbandoned(size) from None
    return b"".join(chunks)
