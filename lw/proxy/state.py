"""The D-first proxy's shared state: servers, transfers in flight and their sub-prefills,
prefills sent ahead, the budget of "why" answers (the contract is in lw.proxy.server).

The pure helpers (a client body checked, the bodies for D and P, errors in vLLM's shape) are
:mod:`lw.proxy.bodies`'s; their names are re-exported here.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from lw.contract.ahead import HELD_KEY
from lw.contract.auth import CallVerifier
from lw.contract.worker_addrs import KnownWorkers
from lw.proxy.backend import Backend
from lw.proxy.bodies import (
    CHAT,
    COMPLETIONS,
    MAX_ERROR_BODY,
    PREFILL_KEPT,
    BadField,
    BadRequest,
    ahead_fallback,
    build_decode_body,
    build_prefill_body,
    describe_exc,
    error_body,
    error_type,
    normalize_url,
    prefill_answer_params,
    quote_body,
    server_url,
    sub_transfer_allowance,
    url_host,
    validate_request,
)
from lw.proxy.limits import Limits, PublicLoad
from lw.proxy.timeline import ProxyTimeline
from lw.transport.ratelog import RateLog, call_later

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "DEFAULT_START_MODE",
    "MAX_ERROR_BODY",
    "PREFILL_KEPT",
    "START_MODES",
    "AheadPrefill",
    "BadField",
    "BadRequest",
    "Backend",
    "ProxyState",
    "SubPrefill",
    "Transfer",
    "WhyBudget",
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

log = logging.getLogger("lw.proxy")


Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


START_MODES = ("d-first", "admit-ahead", "compute-ahead")
# With P's sampled token streamed from D (first_token_from_p), d-first's TTFT p50 was at or
# below compute-ahead's on every link row, 0.87-0.97x (docs/benchmarks.md, "The first token from
# P"): a request's first token waits for P's prefill, not for the KV, and compute-ahead's P
# computes its prompt slower while it also fetches D's params
DEFAULT_START_MODE = "d-first"

_URL = re.compile(r"https?://[^\s,'\"\])]+")
_WORKER = re.compile(r"tcp://[^\s,'\"\])]+")


@dataclass(eq=False)
class AheadPrefill:
    """One request's prefill sent to P ahead of D's params, until D's call binds it."""

    backend: Backend
    grant: str = field(default_factory=lambda: secrets.token_hex(16))
    task: asyncio.Task[tuple[int, bytes]] | None = None  # P's POST
    state: str = "waiting"  # -> bound | fallback
    digest: str | None = None  # of the prompt P tokenized (its fetch names it)
    fetched: asyncio.Event = field(default_factory=asyncio.Event)
    answer: asyncio.Future[dict[str, Any]] | None = None  # what P's fetch is answered
    compute: bool = False  # compute-ahead: P computes at once; its POST may end before the bind
    sub: SubPrefill | None = None  # what D's call bound it to (a refused bind restarts it)
    restarted: bool = False  # P refused the bind and the prefill was started D first

    def release(self, state: str) -> None:
        """Leave "waiting" (its slot on P is free again) for ``state``."""
        if self.state == "waiting":
            self.backend.ahead_waiting -= 1
        self.state = state

    def usable(self) -> bool:
        """Whether P's ahead request can still be bound: its POST is on (admit-ahead) or, when P
        computes ahead, also when it ended with HTTP 200 saying P holds the KV for the bind."""
        t = self.task
        if t is None:
            return False
        if not t.done():
            return True
        if not self.compute or t.cancelled() or t.exception() is not None:
            return False
        code, content = t.result()
        # P says it holds the KV (a P that computed it plainly does not)
        return code == 200 and prefill_answer_params(content).get(HELD_KEY) is True

    def cancel(self, why: str) -> None:
        """The request ended or moved before D's call bound it: P's fetch is told, its POST
        cancelled (P aborts the waiting request)."""
        if self.state != "waiting":
            return
        self.release("fallback")
        self.resolve(ahead_fallback(why))
        if self.task is not None:
            self.task.cancel()

    def resolve(self, answer: dict[str, Any]) -> None:
        """Answer P's fetch (now, or when it arrives); the first answer stands."""
        if self.answer is not None and not self.answer.done():
            self.answer.set_result(answer)


@dataclass(eq=False)
class SubPrefill:
    """The prefill of one vLLM request of a client request (one sub-transfer)."""

    sub_id: str
    backend: Backend
    task: asyncio.Task[None] | None = None
    state: str = "running"  # running -> done | failed | cancelled
    epoch: int = 0  # D's claim epoch of this attempt (a re-prefill replaces the attempt)
    budget: int = 0  # re-prefills D may ask for (its retry_prefill, from its first call)
    body: dict[str, Any] = field(default_factory=dict)  # what P was sent (a retry resends it)
    tried: tuple[Backend, ...] = ()  # servers of the earlier attempts


@dataclass(eq=False)
class Transfer:
    """One client request in flight: its D request, and the prefills D asked for."""

    request_id: str
    api: str
    body: dict[str, Any]
    stream: bool
    headers: dict[str, str]
    metaserver: str
    decode: Backend
    allowance: int = 1  # sub-transfers D may create (sub_transfer_allowance)
    # Sidecar mode: the prefill server the request's header named (None: the proxy picks), and
    # whether D computes the prompt alone (no header and no prefill server of our own).
    prefill_target: Backend | None = None
    local: bool = False
    # The transfer's secret for D's metaserver calls: sent to D only, never to the client.
    grant: str = field(default_factory=lambda: secrets.token_hex(16))
    prefills: dict[str, SubPrefill] = field(default_factory=dict)  # sub-transfer id -> prefill
    prefill_error: str | None = None  # the first failure
    prefill_error_status: int = 502
    prefill_error_server: str | None = None
    prefill_failed: asyncio.Event = field(default_factory=asyncio.Event)
    ahead: AheadPrefill | None = None  # its prefill sent to P ahead of D (lw.proxy.ahead)
    # The side channels of the D workers that asked for this transfer's prefills (its
    # metaserver calls name them): whom the proxy asks if D fails the request.
    decode_workers: dict[str, None] = field(default_factory=dict)
    answering: bool = False  # D's answer began (its first token): it allocated, if it had to

    def unallocated(self) -> bool:
        """Whether D has shown no sign yet of having allocated for it: no metaserver call,
        no token (D, short of free blocks, keeps such requests queued)."""
        return not (self.local or self.prefills or self.answering)


class PrefillTargets(Protocol):
    """Where a request's prefill goes when the request names it (lw.proxy.sidecar)."""

    backends: Mapping[str, Backend]

    def target(self, headers: Iterable[tuple[str, str]], known: Iterable[Backend] = ()
               ) -> Backend | None:
        """The prefill server a request's headers name (None: none); raises on a refused one."""
        ...


class WhyBudget:
    """The proxy's questions to decode workers about failed requests (lw.proxy.explain): at
    most ``in_flight`` at once (a thread each) and ``per_s`` a second (a token bucket)."""

    def __init__(self, in_flight: int, per_s: float) -> None:
        self.in_flight = in_flight
        self.per_s = per_s
        self.running = 0
        self._tokens = per_s
        self._at = 0.0
        self._pool: ThreadPoolExecutor | None = None

    def take(self, now: float) -> str:
        """"" and a question counted as running, or why none may be asked now."""
        if not self.in_flight or not self.per_s:
            return "the proxy is set to never ask (why_in_flight or why_per_s is 0)"
        self._tokens = min(self.per_s, self._tokens + (now - self._at) * self.per_s)
        self._at = now
        if self.running >= self.in_flight:
            return f"the proxy was already asking about {self.running} other failures"
        if self._tokens < 1:
            return f"more failures than the proxy asks about ({self.per_s:g} a second)"
        self._tokens -= 1
        self.running += 1
        return ""

    def pool(self) -> ThreadPoolExecutor:
        """The threads questions run in (the side channel's client blocks)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.in_flight, thread_name_prefix="lw-why")
        return self._pool

    def close(self) -> None:
        """Let the threads end on their own (each within its question's timeout)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)


class ProxyState:
    """Everything the proxy app shares: servers, transfers in flight, HTTP client, counters."""

    def __init__(
        self,
        prefill_urls: Iterable[str],
        decode_urls: Iterable[str],
        *,
        timeout_s: float,
        connect_timeout_s: float,
        health_timeout_s: float,
        metaserver_url: str,
        verifier: CallVerifier,
        sidecar: PrefillTargets | None = None,
        decode_failovers: int = 2,
        limits: Limits | None = None,
        start_mode: str = DEFAULT_START_MODE,
        ahead_limit: int = 4,
        ahead_d_backlog: int = 4,
        ahead_p_busy: int = 1,
    ) -> None:
        self.limits = limits or Limits()
        for name, value in (("timeout_s", timeout_s), ("connect_timeout_s", connect_timeout_s),
                            ("health_timeout_s", health_timeout_s)):
            # nan and inf pass "> 0" checks and make every outgoing call wait for ever or fail
            if not 0 < value < float("inf"):
                raise ValueError(f"{name} must be > 0 seconds and finite, got {value}")
        if (start_mode not in START_MODES or ahead_limit < 1
                or ahead_d_backlog < 1 or ahead_p_busy < 1):
            raise ValueError(f"start_mode {start_mode!r} (d-first, admit-ahead or "
                             f"compute-ahead), ahead_limit {ahead_limit}, ahead_d_backlog "
                             f"{ahead_d_backlog} and ahead_p_busy {ahead_p_busy} (>= 1)")
        # admit-ahead: a request's prefill goes to P with its D request, at most ahead_limit
        # per prefill server waiting for D's params (lw.proxy.ahead)
        self.start_mode = start_mode
        self.ahead_limit = ahead_limit
        # ... and none while the request's D has this many requests it has not allocated for
        # (D-first's backpressure: a D short of free blocks must not have P compute for it)
        self.ahead_d_backlog = ahead_d_backlog
        # ... and none while its P has this many prefills queued or computing: it would only
        # wait in P's queue, ahead of requests that came before it and went D first
        self.ahead_p_busy = ahead_p_busy
        self.refusals = RateLog(log, "lw proxy", 5.0, timer=call_later)  # 2 lines/kind/5 s
        self.health_cache: tuple[float, dict[str, Any]] | None = None  # (when, report)
        self.health_task: asyncio.Future[dict[str, Any]] | None = None  # the probe running
        self.control_reads = 0  # metaserver bodies being read (limits.max_control_reads)
        self.prefills = [Backend(server_url(u), "prefill") for u in prefill_urls]
        self.decodes = [Backend(server_url(u), "decode") for u in decode_urls]
        both = {b.url for b in self.prefills} & {b.url for b in self.decodes}
        if both:
            # one engine is a producer or a consumer (kv_role), never both
            raise ValueError(f"{', '.join(sorted(both))} given as both a prefill and a decode "
                             "server")
        # as llm-d's routing sidecar: one local D; the prefill server comes with each request
        self.sidecar = sidecar
        # other decode servers a request may move to when its D fails before a token was sent
        self.decode_failovers = decode_failovers
        if sidecar is not None and len(self.decodes) != 1:
            raise ValueError(f"a sidecar serves exactly one (its local) decode server, "
                             f"got {len(self.decodes)}")
        if not self.decodes or (not self.prefills and sidecar is None):
            raise ValueError("the proxy needs at least one prefill and one decode server")
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self.health_timeout = httpx.Timeout(health_timeout_s)
        self.short_timeout = httpx.Timeout(min(timeout_s, 30.0), connect=connect_timeout_s)
        self.metaserver_url = metaserver_url
        self.verifier = verifier
        self.default_model: str | None = None  # served when a body names none (as vLLM)
        self.client = httpx.AsyncClient(
            timeout=self.timeout,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self.transfers: dict[str, Transfer] = {}
        self.load = PublicLoad()  # bodies being read, relays outside a transfer
        self.timeline = ProxyTimeline()
        self.workers = KnownWorkers()  # side channels seen in traffic (lw status --proxy)
        self.tasks: set[asyncio.Task[None]] = set()
        self.why = WhyBudget(self.limits.why_in_flight, self.limits.why_per_s)
        # requests failed by their KV transfer, per failure kind (lw.fsm.status.FAILURE_KINDS)
        self.transfer_failures: dict[str, int] = {}
        self._rr = {"prefill": 0, "decode": 0}
        self.counters = {
            "requests": 0,
            "errors": 0,
            "bad_requests": 0,
            "relayed_unroutable": 0,
            "client_disconnects": 0,
            "metaserver_calls": 0,
            "metaserver_refused": 0,
            "prefills": 0,
            "prefill_failures": 0,
            "prefill_failovers": 0,
            "prefill_failures_left_to_decode": 0,
            "decode_failovers": 0,
            "client_transfer_params_dropped": 0,
            "client_transfer_params_refused": 0,
            "bodies_too_large": 0,
            "bodies_too_slow": 0,
            "bodies_refused_busy": 0,
            "bodies_abandoned": 0,
            "prefiller_refused": 0,
            "overloaded": 0,
            "decode_errors_explained": 0,
            "decode_errors_unexplained": 0,
            "ahead_started": 0,
            "ahead_bound": 0,
            "ahead_fallbacks": 0,
            "ahead_expired": 0,
            "ahead_unbound": 0,
            "ahead_skipped_full": 0,
            "ahead_skipped_d_backlog": 0,
            "ahead_skipped_p_busy": 0,
            "ahead_skipped_p_off": 0,
            "ahead_switched_off": 0,
            "ahead_fetches_refused": 0,
            "ahead_refused_binds": 0,
        }

    def label(self, url: str | None) -> str | None:
        """How a public error names a server: its role and place in the proxy's list
        (``prefill#0``, ``decode#1``), never its URL (that goes to the log)."""
        if url is None:
            return None
        for role, backends in (("prefill", self.prefills), ("decode", self.decodes)):
            for i, b in enumerate(backends):
                if b.url == url:
                    return f"{role}#{i}"
        # a prefill server a sidecar request's header named: the client knows it already
        return url if self.sidecar is not None else "server"

    def public(self, text: str) -> str:
        """``text`` with every server URL in it replaced by its :meth:`label`, and every
        worker's side channel (``tcp://``, in a worker's failure reason) by "a worker"."""
        text = _URL.sub(lambda m: self.label(m.group(0).rstrip(".:;")) or "server", text)
        return _WORKER.sub("a worker", text)

    def pick(self, backends: list[Backend], exclude: Iterable[Backend] = ()) -> Backend:
        """The backend with the fewest outstanding requests, ties broken round robin, among
        those not avoided after a failure (all of them if every one is); never one of
        ``exclude`` (ValueError if nothing else is left)."""
        skip = set(exclude)
        cands = [b for b in backends if b not in skip]
        if not cands:
            raise ValueError("no server left to try")
        now = asyncio.get_running_loop().time()  # every caller is a request handler
        live = [b for b in cands if b.up(now)] or cands
        role = live[0].role
        start = self._rr[role] % len(live)
        self._rr[role] += 1
        rotated = live[start:] + live[:start]
        return min(rotated, key=lambda b: b.load)

    def spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        """Run ``coro`` as a background task kept referenced until it ends."""
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def metrics(self) -> dict[str, Any]:
        """Counters as JSON."""
        return {
            **self.counters,
            "in_flight": len(self.transfers),
            "prefill": [b.snapshot() for b in self.prefills] + (
                [b.snapshot() for b in self.sidecar.backends.values()
                 if b.url not in {p.url for p in self.prefills}] if self.sidecar else []),
            "decode": [b.snapshot() for b in self.decodes],
            "kv_transfer_failures": dict(self.transfer_failures),
        }

    async def aclose(self) -> None:
        """Cancel background tasks and close the HTTP client."""
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        self.why.close()
        await self.client.aclose()


