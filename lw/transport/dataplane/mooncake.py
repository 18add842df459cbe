"""The Mooncake data plane: real transfers through ``mooncake.engine.TransferEngine``.

:class:`MooncakeDataPlane` wraps ``mooncake.engine.TransferEngine`` (P2P handshake, TCP when
there is no RDMA card). Two ways to wait for Mooncake, both off the caller's thread:
``wait="poll"`` (default) submits each entry with ``transfer_submit_write`` and polls
``transfer_check_status`` with short sleeps, keeping up to ``max_batch_entries`` entries of
successive transfers in flight (layer k+1 is on the wire while layer k finishes);
``wait="spin"`` writes each batch with ``batch_transfer_sync_write``, which busy-waits a core
inside Mooncake. On a 2-core machine the spinning core starves Mooncake's own I/O threads (and
would starve a CPU forward pass): in benchmarks/data_plane.py poll mode keeps the layerwise tail
near one layer's transfer time where spin mode falls tens of layers behind.

Mooncake facts this module relies on (measured with mooncake-transfer-engine-non-cuda 0.3.13.post1
on loopback TCP): a batch of more than ~2048 entries fails (and can poison the next call), so
entries are coalesced and split into batches (spin) or in-flight windows (poll) of at most
``max_batch_entries`` (1024); an entry whose remote range spans two *separately registered* remote
regions fails even when they are adjacent, so when a transfer that contains merged entries fails
fast it is retried once uncoalesced (callers that know the remote layout can pass it to
:meth:`MooncakeDataPlane.hint_remote_regions` instead); in poll mode a transfer Mooncake failed
within half the transfer timeout (not timed out) is resent, a few times, while its request's
deadline allows (a receiver's fence resets every connection from this host, lane by lane); an
empty batch performs the first contact
with a peer (its ``openSegment``) and nothing else, which is what ``connect`` uses; Mooncake does
not check that local source addresses are registered on TCP, so the plane checks them itself;
``transfer_submit_write`` returns 0 when it cannot open the peer's segment.

Residual risks (honest list):

* Mooncake takes one engine-wide mutex while it opens a segment to a new peer, and every write
  takes the same mutex to look up its cached segment handle. If a peer is frozen (alive socket,
  no answers) when first contact happens, that contact blocks for the handshake timeout (60 s
  measured) and *every* write of this engine, to every peer, waits behind it. ``connect`` moves
  first contact off the forward pass and into the peer's own thread, but it cannot stop the lock
  from stalling other peers' sender threads. lw only calls ``connect`` after the side channel has
  proved the peer alive, which makes the window small, not zero. The same applies when Mooncake
  re-opens a segment after a failed write (it closes the segment when its status check fails).
* A write to a peer frozen *after* first contact fails only after ``MC_TRANSFER_TIMEOUT`` (30 s by
  default, 5 s minimum; see ``timeout_s``) plus 1 s per GiB; writes to other peers go on meanwhile
  (measured). Completions are reported only when Mooncake has resolved every entry or the deadline
  passed, never earlier, because an earlier report would let the caller free blocks that Mooncake
  may still be reading. After a timeout, though, Mooncake may still hold the entry (a poll-mode id
  is deliberately leaked, a spin-mode batch is freed by Mooncake with slices possibly in flight),
  and a peer that wakes up can still receive those bytes: a failed completion means "this engine
  gave up", not a proof that no byte will move later. The protocol above must treat the remote
  blocks of a failed transfer as tainted (quarantine on D), which lw's design already requires.
* ``close`` cannot interrupt a write that is inside Mooncake; it waits up to ``join_timeout_s`` and
  then leaves the engine alive (its thread reports the outcome when Mooncake returns).
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from lw.transport.dataplane.base import (
    DEFAULT_MAX_BATCH_ENTRIES,
    Entry,
    _fmt_range,
    _Job,
    _Peer,
    _QueuedDataPlane,
    coalesce,
    split_batches,
)
from lw.transport.dataplane.fence import fence_inbound, listening_ports
from lw.transport.dataplane.window import WINDOW_SPAN_AFTER_S, WINDOW_SPAN_S, ByteWindow

__all__ = ["MooncakeDataPlane"]

_FAST_FAIL_S = 2.0
"""A failed batch (spin mode) that returned faster than this was rejected up front, not timed
out (Mooncake's timeouts are >= 5 s)."""


def _resends() -> int:
    """How often a transfer Mooncake failed is resent (poll mode): a receiver's fence resets
    every cached connection from this host, one per lane (``MC_TCP_LANES_PER_PEER``, Mooncake's
    default 4), and each resend may meet another of them before Mooncake reconnected them all."""
    try:
        lanes = int(os.environ.get("MC_TCP_LANES_PER_PEER", "4"))
    except ValueError:
        lanes = 4
    return max(1, lanes) + 1


_MIN_NAP_S = 2e-5
"""First sleep of the poll-mode sender when nothing progressed (doubles up to the interval)."""

_MAX_NAP_S = 0.002
"""Longest sleep of the poll-mode sender (reached only for transfers in flight > 16 ms)."""

_BAD_BATCH_IDS = frozenset({0, -1, (1 << 64) - 1})
"""What Mooncake's transfer_submit_write returns when it could not submit."""

class _Flight:
    """A transfer in the pipelined (poll mode) sender: its plan and the Mooncake ids in flight."""

    __slots__ = (
        "job",
        "plan",
        "next",
        "pending",
        "failure",
        "started",
        "deadline",
        "retries",
        "first_failure",
        "unsent",
    )

    def __init__(self, job: _Job, plan: list[Entry]) -> None:
        self.job = job
        self.plan = plan
        self.next = 0
        self.unsent = _bytes(plan, 0, len(plan))  # bytes of the plan not yet submitted
        self.pending: list[int] = []
        self.failure = ""
        self.started = 0.0
        self.deadline = math.inf
        self.retries = 0
        self.first_failure = ""


class MooncakeDataPlane(_QueuedDataPlane):
    """Data plane over Mooncake's transfer engine (P2P handshake; TCP without an RDMA card).

    ``wait``: ``"poll"`` (default) pipelines per-entry submits and polls their status with sleeps
    of at most ``poll_interval_s``; ``"spin"`` writes batch by batch with the busy-waiting
    ``batch_transfer_sync_write`` (see the module docstring). ``timeout_s`` (if given) sets
    ``MC_TRANSFER_TIMEOUT`` (whole seconds, Mooncake's minimum 5, which bounds spin mode) and is
    the poll-mode deadline as given (plus 1 s per GiB, as Mooncake does; 30 s when not given);
    ``window_span_s`` bounds the bytes in flight to a peer by what its link moves in that long
    while it has more than ``window_span_after_s`` to carry (:data:`WINDOW_SPAN_S`,
    :data:`WINDOW_SPAN_AFTER_S`; 0: only by the transfer timeout). ``env`` sets other
    ``MC_*`` variables. Both are written to ``os.environ`` (process-wide) before the engine is
    created; with neither, the environment is left alone.
    """

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        timeout_s: float | None = None,
        *,
        wait: Literal["spin", "poll"] = "poll",
        env: Mapping[str, str] | None = None,
        max_batch_entries: int = DEFAULT_MAX_BATCH_ENTRIES,
        coalesce_entries: bool = True,
        poll_interval_s: float = 0.0002,
        window_span_s: float = WINDOW_SPAN_S,
        window_span_after_s: float = WINDOW_SPAN_AFTER_S,
        join_timeout_s: float = 5.0,
        metadata_server: str = "P2PHANDSHAKE",
        protocol: str = "tcp",
        device_name: str = "",
    ) -> None:
        super().__init__(max_batch_entries=max_batch_entries, join_timeout_s=join_timeout_s)
        if wait not in ("spin", "poll"):
            raise ValueError(f"wait must be 'spin' or 'poll', got {wait!r}")
        if not window_span_s >= 0 or not window_span_after_s >= 0:
            raise ValueError("window_span_s and window_span_after_s must be >= 0, got "
                             f"{window_span_s!r} and {window_span_after_s!r}")
        if timeout_s is not None:
            os.environ["MC_TRANSFER_TIMEOUT"] = str(max(5, math.ceil(timeout_s)))
            # Mooncake's TCP transport keeps a stalled write (and resends it on new
            # connections) past MC_TRANSFER_TIMEOUT until these give up: bound them by the same
            # timeout, so that what a receiver's fence at the end of D's lease cuts is the last
            # of it (benchmarks/late_landing.py --fence); an operator's own values stay.
            for key in ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC"):
                os.environ.setdefault(key, str(max(5, math.ceil(timeout_s))))
        for key, value in (env or {}).items():
            os.environ[key] = value
        if os.environ.get("MC_TCP_PROTO") == "1":
            # Measured (tests/transport/test_landed_at_completion.py): with Mooncake's legacy
            # TCP framing a write completes once it leaves the sender's socket buffer, and
            # lw's DONE, on another connection, can reach D before the last bytes do.
            raise ValueError(
                "MC_TCP_PROTO=1 (Mooncake's unacknowledged TCP framing) is set: a write would be "
                "reported complete before its bytes land at D, and lw's DONE could overtake "
                "them; unset it (every P and D node needs a Mooncake whose TCP transport "
                "acknowledges writes)")
        from mooncake.engine import TransferEngine  # deferred: optional dependency

        self.timeout_s = timeout_s
        self.wait = wait
        self._deadline_s = float(timeout_s) if timeout_s is not None else 30.0
        self._poll_interval_s = poll_interval_s
        self._window_span_s = window_span_s
        self._window_span_after_s = window_span_after_s
        self._coalesce = coalesce_entries
        self._remote_bounds: dict[str, frozenset[int]] = {}
        self._engine: Any = TransferEngine()
        before = listening_ports()
        rc = self._engine.initialize(hostname, metadata_server, protocol, device_name)
        # The ports Mooncake listens on (its RPC port and its TCP transport's data port, which
        # the Python API does not name): what a fence cuts inbound connections on.
        self._fence_ports = frozenset(listening_ports() - before)
        if rc != 0:
            raise RuntimeError(
                f"mooncake TransferEngine.initialize({hostname!r}, {metadata_server!r}, "
                f"{protocol!r}, {device_name!r}) returned {rc}"
            )
        self._session = f"{hostname}:{self._engine.get_rpc_port()}"
        # Over TCP (no RDMA card) a receiver can cut what peers still send it (fence.py). The
        # TCP transport opens exactly two listeners, its RPC port and its data port: anything
        # else means another thread listened meanwhile, and cutting its connections would be
        # wrong, so then this engine does not fence.
        self.can_fence = (protocol == "tcp" and not device_name and len(self._fence_ports) == 2
                          and self._engine.get_rpc_port() in self._fence_ports)

    @property
    def session(self) -> str:
        """``host:rpc_port`` of this engine, as peers pass it to their writes."""
        return self._session

    @property
    def engine(self) -> Any:
        """The underlying ``mooncake.engine.TransferEngine`` (for benchmarks and probes)."""
        return self._engine

    def _in_doubt(self, reason: str) -> bool:
        """A failure after entries reached Mooncake (timeout, peer error, close mid-write) may
        still deliver bytes later (measured: a resumed frozen peer receives them)."""
        return reason.startswith(("mooncake ", "closed after", "internal error"))

    def fence_inbound(self, hosts: Iterable[str], timeout_s: float) -> tuple[bool, str]:
        """Cut every inbound Mooncake connection from ``hosts`` and wait until Mooncake closed
        each (at most ``timeout_s``): then no byte those peers still had in flight to us can
        land. (ok, what was done or why not). Any thread."""
        if not self.can_fence:
            return False, "this Mooncake engine cannot fence (not TCP, or its ports unknown)"
        notes: list[str] = []
        ok = True
        deadline = time.monotonic() + timeout_s
        for host in hosts:
            try:
                ip = socket.gethostbyname(host)
            except OSError as exc:
                return False, f"cannot resolve peer host {host!r}: {exc}"
            r = fence_inbound(ip, self._fence_ports, max(0.0, deadline - time.monotonic()))
            ok = ok and r.ok
            notes.append(f"{ip}: {len(r.cut)} connection(s) cut in {r.elapsed_s * 1000:.0f} ms"
                         + ("" if r.closed else ", not all closed in time")
                         + "".join(f"; {e}" for e in r.errors[:3]))
        self._count(fences=1, fence_failures=0 if ok else 1)
        return ok, "; ".join(notes)

    def hint_remote_regions(self, session: str, regions: Iterable[tuple[int, int]]) -> None:
        """Tell the plane how ``session`` registered its memory ((addr, length) per region),
        so coalescing never merges entries across two remote registrations."""
        self._remote_bounds[session] = frozenset(addr for addr, _len in regions)

    # -- backend hooks -------------------------------------------------------------------------

    def _backend_register(self, addr: int, length: int) -> None:
        """Register with the engine; RuntimeError when Mooncake refuses."""
        rc = self._engine.register_memory(addr, length)
        if rc != 0:
            raise RuntimeError(f"mooncake register_memory({addr:#x}, {length}) returned {rc}")

    def _backend_connect(self, session: str) -> str:
        """An empty batch makes Mooncake open (handshake and cache) the peer's segment."""
        started = time.monotonic()
        rc = self._engine.batch_transfer_sync_write(session, [], [], [])
        if rc != 0:
            return (
                f"mooncake first contact (empty batch_transfer_sync_write) returned {rc} "
                f"to {session} after {time.monotonic() - started:.2f}s"
            )
        return ""

    def _backend_transfer(self, session: str, job: _Job) -> str:
        """Coalesce, check local ranges, write batch by batch; retry uncoalesced on fast failure."""
        if self._coalesce:
            plan = coalesce(job.entries, self._remote_bounds.get(session, ()))
        else:
            plan = job.entries
        reason = self._check_local(plan)
        if reason:
            return reason
        reason, fast = self._write_all(session, plan, job)
        if (reason and fast and len(plan) != len(job.entries) and not self._closed
                and not job.expired(time.monotonic())):
            # A merged entry may span two separately registered remote regions (Mooncake
            # rejects that at once); writes are idempotent, so resend the original entries.
            self._count(uncoalesced_retries=1)
            retry_reason, _ = self._write_all(session, job.entries, job)
            if not retry_reason:
                return ""
            reason = f"{retry_reason} (also failed coalesced: {reason})"
        return reason

    def _write_all(self, session: str, plan: list[Entry], job: _Job) -> tuple[str, bool]:
        """Write ``plan`` in batches; return (reason or "", whether a failure came back fast)."""
        batches = split_batches(plan, self._max_batch)
        write = self._write_spin
        for i, batch in enumerate(batches):
            if self._closed and i > 0:
                return f"closed after {i}/{len(batches)} batches", False
            late = job.expired(time.monotonic()) if i > 0 else ""
            if late:  # the batches before this one completed: nothing of it is in flight
                return f"{late} after {i}/{len(batches)} batches", False
            started = time.monotonic()
            what = write(session, batch)
            elapsed = time.monotonic() - started
            self._count(batches=1, entries_sent=len(batch))
            if what:
                return (
                    f"mooncake {what} to {session} after {elapsed:.2f}s (batch {i + 1}/"
                    f"{len(batches)}, {len(batch)} entries, {sum(e[2] for e in batch)} bytes)"
                ), elapsed < _FAST_FAIL_S
        return "", False

    def _write_spin(self, session: str, batch: list[Entry]) -> str:
        """One batch_transfer_sync_write (busy-waits inside Mooncake); "" or what failed."""
        rc = self._engine.batch_transfer_sync_write(
            session, [e[0] for e in batch], [e[1] for e in batch], [e[2] for e in batch]
        )
        return "" if rc == 0 else f"batch_transfer_sync_write returned {rc}"

    def _worker(self, peer: _Peer) -> None:
        """Sender thread for one destination: spin mode runs jobs one by one; poll mode
        pipelines them (see :meth:`_pipelined_worker`)."""
        if self.wait == "spin":
            super()._worker(peer)
            return
        flights: deque[_Flight] = deque()
        try:
            self._pipelined_worker(peer, flights)
        except Exception as exc:
            self._sender_crashed(peer, [f.job for f in flights], exc)
            raise

    def _pipelined_worker(self, peer: _Peer, flights: deque[_Flight]) -> None:
        """Poll mode: keep up to ``max_batch_entries`` entries of successive transfers in flight
        (so layer k+1 is on the wire while layer k finishes) and report transfers strictly in
        submission order, each only once Mooncake has resolved every one of its entries."""
        submit = self._engine.transfer_submit_write
        check = self._engine.transfer_check_status
        session = peer.session
        resends = _resends()
        inflight = 0
        nap = _MIN_NAP_S
        # Time between resolutions while entries are in flight (moving average): on a slow
        # link they come milliseconds apart, and polling from 20 us again after each one woke
        # this thread about eight times per entry on the core the forward pass runs on.
        gap = 0.0
        last_progress = 0.0
        window = ByteWindow(self._deadline_s, span_s=self._window_span_s,
                            span_after_s=self._window_span_after_s)
        while True:
            # 1. Take new jobs (block only when there is nothing in flight).
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
                    self._do_connect(peer)
                else:
                    flights.append(self._new_flight(session, job))
            # 2. Submit entries, oldest transfer first, while there is room.
            now = time.monotonic()
            window.queued = sum(f.unsent for f in flights if not f.failure)
            for f in flights:
                if inflight >= self._max_batch or (
                        f.next < len(f.plan) and not window.room(f.plan[f.next][2])):
                    break
                if f.failure or f.next >= len(f.plan) or self._closed:
                    continue
                late = f.job.expired(now)
                if late:  # after the request's deadline not one more entry goes to Mooncake
                    f.failure = late if f.next == 0 else f"{late} after {f.next}/{len(f.plan)}"
                    continue
                if f.next == 0:
                    f.started = now
                    f.deadline = now + self._deadline_s + f.job.nbytes / (1 << 30)
                    self._count(batches=1)
                first = f.next
                while (f.next < len(f.plan) and inflight < self._max_batch
                       and window.room(f.plan[f.next][2])):
                    s, d, n = f.plan[f.next]
                    bid = submit(session, s, d, n)
                    if bid in _BAD_BATCH_IDS:
                        f.failure = f"transfer_submit_write returned {bid} for {_fmt_range(d, n)}"
                        break
                    f.pending.append(bid)
                    f.next += 1
                    f.unsent -= n
                    inflight += 1
                    window.sent(n, now)
                self._count(entries_sent=f.next - first)
            # 3. Poll in submission order, stopping at the first entry still in flight: reports
            #    are FIFO anyway, and this keeps a poll round O(entries resolved + 1).
            progressed = False
            now = time.monotonic()
            for f in flights:
                resolved = 0
                for bid in f.pending:
                    rc = check(bid)
                    if rc == 0:
                        break
                    resolved += 1
                    if rc != 1 and not f.failure:
                        f.failure = f"transfer_check_status returned {rc}"
                if resolved:
                    progressed = True
                    inflight -= resolved
                    first = f.next - len(f.pending)  # plan index of the oldest in flight
                    window.resolved(_bytes(f.plan, first, first + resolved), now)
                    del f.pending[:resolved]
                if f.pending and now > f.deadline:
                    first = f.next - len(f.pending)
                    window.dropped(_bytes(f.plan, first, f.next))
                    # Mooncake still owns these ids; freeing them is unsafe: leaked on purpose.
                    f.failure = f.failure or (
                        f"timeout: {len(f.pending)} entries unfinished after "
                        f"{self._deadline_s:g}s (transfer_check_status polling)"
                    )
                    inflight -= len(f.pending)
                    f.pending = []
                    progressed = True
                if f.pending:
                    break
            # 4. Report finished transfers in submission order.
            while flights and not flights[0].pending:
                f = flights[0]
                if not f.failure and f.next < len(f.plan) and not self._closed:
                    break  # not fully submitted yet
                elapsed = time.monotonic() - f.started
                if (
                    f.failure
                    and f.started
                    and elapsed < self._deadline_s / 2  # so never one lw timed out
                    and f.retries < resends
                    and not self._closed
                    and not f.job.expired(time.monotonic())
                ):
                    # Mooncake failed an entry (not our timeout, nor its own give-up on a
                    # stalled connection, which takes its progress timeout: resending into a
                    # link that stalls only takes bandwidth from the writes behind): with merged
                    # entries maybe a merge spanned two remote registrations; else a cached
                    # connection the peer had cut (a receiver's fence resets every connection
                    # from this host, one per lane, and Mooncake reports each after up to a few
                    # seconds, then reconnects). Writes are idempotent and the request's
                    # deadline still bounds them (the lease's premise): resend the entries.
                    if len(f.plan) != len(f.job.entries):
                        self._count(uncoalesced_retries=1)
                    else:
                        self._count(resends=1)
                    f.first_failure = f.first_failure or f.failure
                    f.plan, f.next, f.failure = f.job.entries, 0, ""
                    f.unsent = _bytes(f.plan, 0, len(f.plan))
                    f.retries += 1
                    progressed = True
                    break
                if f.failure and f.started:
                    reason = (
                        f"mooncake {f.failure} to {session} after {elapsed:.2f}s "
                        f"({len(f.plan)} entries, {f.job.nbytes} bytes)"
                    )
                    if f.retries:
                        reason += (f" (resent {f.retries} time(s); at first: "
                                   f"{f.first_failure})")
                elif f.failure:
                    reason = f.failure  # rejected before anything was sent
                elif f.next < len(f.plan):
                    reason = f"closed after {f.next}/{len(f.plan)} entries were sent"
                else:
                    reason = ""
                flights.popleft()
                self._complete(f.job, reason)
            # What waits for the window counts too: the inbox batches layers behind it.
            peer.backlog_s = window.queue_s()
            # 5. Nothing moved: wait a little (a new submit wakes us at once).
            if progressed:
                t = time.monotonic()
                if last_progress:
                    gap = 0.7 * gap + 0.3 * (t - last_progress) if gap else t - last_progress
                last_progress = t if flights else 0.0
                nap = window.nap(min(max(_MIN_NAP_S, gap / 4), _MAX_NAP_S))
            elif flights:
                with peer.cond:
                    if not peer.queue:
                        peer.cond.wait(nap)
                # Poll at most every eighth of the oldest transfer's age (up to 2 ms): a write
                # that has crossed a slow link for 40 ms is not polled 5,000 times a second on
                # the core P computes on, and one on loopback still is, within microseconds.
                age = now - flights[0].started if flights[0].started else 0.0
                nap = window.nap(min(nap * 2, max(self._poll_interval_s,
                                                  min(age / 8, _MAX_NAP_S))))

    def _new_flight(self, session: str, job: _Job) -> _Flight:
        """Plan a transfer for the pipelined worker (coalesce, check local ranges)."""
        if not job.entries:
            return _Flight(job, [])
        if self._coalesce:
            plan = coalesce(job.entries, self._remote_bounds.get(session, ()))
        else:
            plan = job.entries
        flight = _Flight(job, plan)
        flight.failure = self._check_local(plan)
        return flight

    def _backend_close(self, all_joined: bool) -> None:
        """Drop the engine (frees its ports) unless a sender thread may still be inside it."""
        if all_joined:
            self._engine = None


def _bytes(plan: list[Entry], lo: int, hi: int) -> int:
    """Bytes of the plan's entries ``lo`` .. ``hi - 1``."""
    return sum(plan[i][2] for i in range(lo, hi))
