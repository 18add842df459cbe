"""Why a decode server failed a request, for its client: D's workers remember each request's
failure kind and reason (the ``fail`` event of their timelines, kept after the request ended;
the kind is data their core set, never read from the reason's words); when D
answers a 5xx, or a stream's error event, the proxy asks them by transfer id, within a bound, and
the client's error names the stage, the server and the reason (contract: lw.proxy.server).

vLLM answers a request whose KV load failed (``kv_load_failure_policy`` "fail") with a bare 500
"Internal server error", in-band for a stream; only lw's core knows the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any

from lw.fsm.failures import FailureKind
from lw.ops.client import Snapshot, query
from lw.proxy.state import ProxyState, Transfer, describe_exc

__all__ = ["ERROR_EVENT", "TRANSFER_STATUS", "Failure", "Why", "ask", "error_code", "explain",
           "split_error_event"]

TRANSFER_STATUS: dict[FailureKind, int] = {
    FailureKind.CHECKSUM_MISMATCH: 502,
    FailureKind.BAD_DONE: 502,
    FailureKind.PREFILL_FAILED: 502,
    FailureKind.PREFILL_LOST: 503,
    FailureKind.METASERVER: 503,
    FailureKind.PREFILL_DEADLINE: 504,
}
"""The client's status for a request its KV transfer failed, by failure kind: a bad transfer
from P (502), no prefill server left to do it (503), no KV in time (504)."""

HISTORY = 64
"""Timeline entries asked of each worker: a transfer's own events are a handful per attempt."""

ERROR_EVENT = b'data: {"error"'
"""How vLLM's in-band error of a stream begins (``data: {"error": {...}}``)."""
MAX_ERROR_EVENT = 64 << 10
"""Bytes held while an error event is incomplete; past them they are relayed unjudged."""


@dataclass(frozen=True)
class Why:
    """What D's workers said about a failed request (or why they said nothing)."""

    kind: FailureKind | None = None  # the failure's kind, as D's core set it; None: nobody said
    reason: str = ""  # the worker's words
    prefill: str | None = None  # URL of the prefill server of the failed sub-transfer
    retries: int = 0  # new prefills D asked for before it failed (retry_prefill)
    unknown: str = ""  # why nobody said ("" when a worker did)

    @property
    def transfer(self) -> bool:
        """The request failed because its KV transfer did."""
        return self.kind in TRANSFER_STATUS


@dataclass(frozen=True)
class Failure:
    """A failed try on a decode server, as its client would be told (if it is the last)."""

    status: int
    message: str
    stage: str = "decode"
    server: str | None = None  # URL (made a public label when answered)
    log_kind: str | None = None  # rate-limited log bucket (None: per stage)


async def ask(state: ProxyState, tr: Transfer) -> Why:
    """Ask the workers of ``tr``'s decode server what they remember of its failure, within
    ``limits.why_timeout_s`` (none when the budget of questions is spent: lw.proxy.state)."""
    addrs = list(tr.decode_workers or tr.decode.workers)
    if not addrs:
        return Why(unknown="the proxy knows none of the decode server's workers (their "
                           "metaserver calls name them)")
    loop = asyncio.get_running_loop()
    busy = state.why.take(loop.time())
    if busy:
        return Why(unknown=busy)
    budget = state.limits.why_timeout_s
    try:
        done = state.why.pool().submit(query, addrs, state.verifier.key, req_id=tr.request_id,
                                       timeline=HISTORY, timeout_s=budget)
    except RuntimeError as exc:  # the pool shut down: the proxy is stopping
        state.why.running -= 1
        return Why(unknown=f"the proxy is stopping ({exc})")

    def ended(_: Any) -> None:  # counted free when the thread is, even if the client left
        state.why.running -= 1

    def on_thread(f: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody counts any more
            loop.call_soon_threadsafe(ended, f)

    done.add_done_callback(on_thread)
    try:
        snap = await asyncio.wrap_future(done)
    except Exception as exc:  # zmq or a bad key: the cause stays unknown, the answer goes out
        return Why(unknown=f"asking the decode server's workers failed: {describe_exc(exc)}")
    return read(snap, tr, budget)


def read(snap: Snapshot, tr: Transfer, budget: float) -> Why:
    """The most telling failure the workers' timelines hold for ``tr``: a transfer's own over
    a local abort (another TP rank's scheduler ends a request one rank failed)."""
    fails: list[tuple[str, str, FailureKind]] = []  # (sub-transfer, reason, kind)
    retries: dict[str, int] = {}
    for r in snap.replies:
        for e in r.timeline:
            for rid in e.req_ids:
                if e.event == "retry":
                    retries[rid] = retries.get(rid, 0) + 1
                elif e.event == "fail" and e.detail:
                    fails.append((rid, e.detail, e.failure or FailureKind.OTHER))
    if not fails:
        if not snap.replies:
            return Why(unknown=f"the decode server's workers did not answer within {budget:g} s")
        return Why(unknown="the decode server's workers remember no failed transfer of this "
                           "request")
    rid, reason, kind = min(fails, key=lambda f: f[2] not in TRANSFER_STATUS)
    sub = tr.prefills.get(rid)
    return Why(kind, reason, sub.backend.url if sub is not None else None, retries.get(rid, 0))


def explain(state: ProxyState, tr: Transfer, why: Why, what: str) -> Failure:
    """The client's error for a try whose D failed (``what``: what D answered), counted."""
    if why.kind is None:
        state.counters["decode_errors_unexplained"] += 1
        return Failure(502, f"{what}; cause unknown: {why.unknown}", server=tr.decode.url)
    state.counters["decode_errors_explained"] += 1
    if not why.transfer:  # the workers said, but not that the transfer failed
        return Failure(502, f"{what}; its workers say: {why.reason}", server=tr.decode.url)
    kind = why.kind.value
    state.transfer_failures[kind] = state.transfer_failures.get(kind, 0) + 1
    src = f" from prefill server {why.prefill}" if why.prefill else ""
    again = ""
    if why.retries and "retr" not in why.reason:
        again = f" after {why.retries} retr{'y' if why.retries == 1 else 'ies'}"
    return Failure(TRANSFER_STATUS[why.kind],
                   f"KV transfer{src} to decode server {tr.decode.url} failed{again}: "
                   f"{why.reason}", stage="kv_transfer",
                   server=why.prefill or tr.decode.url, log_kind=f"kv_transfer_{kind}")


def split_error_event(buf: bytes) -> tuple[bytes, bytes | None, bytes]:
    """(the bytes to relay now, the first error event or None, the bytes after it) of a
    stream's bytes: with no whole event, the bytes after the relayed ones are an error event's
    start (or a last line that may become one) to hold until more come."""
    at = buf.find(ERROR_EVENT)
    if at < 0:
        line = buf.rfind(b"\n") + 1
        if ERROR_EVENT.startswith(buf[line:]) and line < len(buf):
            return buf[:line], None, buf[line:]  # "data: {\"er" so far
        return buf, None, b""
    end = buf.find(b"\n\n", at)
    if end < 0:
        return buf[:at], None, buf[at:]
    return buf[:at], buf[at:end + 2], buf[end + 2:]


def error_code(event: bytes) -> int | None:
    """The ``code`` of an SSE error event in vLLM's shape, or None if it is not one."""
    try:
        err = json.loads(event[len(b"data: "):])["error"]
        code = err["code"]
    except (ValueError, TypeError, KeyError, RecursionError):
        return None
    return code if isinstance(code, int) and not isinstance(code, bool) else None
