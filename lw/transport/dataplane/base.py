"""The data-plane contract, its pure helpers, and the queueing base both data planes share.

A data plane writes ``(local_src_addr, remote_dst_addr, length)`` entries into memory a peer has
registered, and reports each submitted transfer exactly once as a :class:`Completion`.
``submit`` never blocks and never raises for transport failures; ``poll`` / ``fileno`` hand the
completions to an event loop. Each destination session has its own FIFO queue and sender thread,
so completions for one destination come back in submission order and a stuck peer stalls only
its own queue (see the Mooncake caveat in :mod:`lw.transport.dataplane.mooncake`).
"""

from __future__ import annotations

import bisect
import math
import operator
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Self, runtime_checkable

from lw.transport.osthread import name_os_thread

__all__ = [
    "DEFAULT_MAX_BATCH_ENTRIES",
    "Completion",
    "DataPlane",
    "Entry",
    "coalesce",
    "split_batches",
]

Entry = tuple[int, int, int]
"""One write: (local_src_addr, remote_dst_addr, length in bytes)."""

DEFAULT_MAX_BATCH_ENTRIES = 1024
"""Entries per Mooncake batch; Mooncake fails batches above ~2048 entries."""


@dataclass(frozen=True, slots=True)
class Completion:
    """Outcome of one submitted transfer; ``nbytes`` is the transfer's total requested size."""

    xfer_id: Hashable
    ok: bool
    reason: str
    nbytes: int
    # Failed after the bytes were handed to the transport: some may still land later, so the
    # destination blocks are tainted until a lease expires (the core's FailedSending.in_doubt).
    in_doubt: bool = False


@runtime_checkable
class DataPlane(Protocol):
    """What the lw runtime needs from a data plane (see module docstring for the contract)."""

    def register_memory(self, addr: int, length: int) -> None:
        """Register a local region that peers may write into and we may send from."""
        ...

    @property
    def session(self) -> str:
        """The string a remote peer passes as ``session`` to write into our memory."""
        ...

    def connect(self, session: str) -> None:
        """Start first contact with a peer in the background; idempotent, never blocks."""
        ...

    def submit(self, xfer_id: Hashable, session: str, entries: Sequence[Entry],
               within_s: float = math.inf) -> None:
        """Queue a transfer; never blocks, reports via ``poll``; ValueError for bad entries.
        A transfer not handed to the transport within ``within_s`` fails unsent."""
        ...

    def poll(self) -> list[Completion]:
        """Return the completions finished since the last call, without blocking."""
        ...

    def fileno(self) -> int:
        """File descriptor that is readable while completions are pending."""
        ...

    def stats(self) -> dict[str, int | float]:
        """Counters: submitted, completed, failed, bytes, entries, batches (and extras)."""
        ...

    def close(self) -> None:
        """Stop the threads; queued transfers complete with ok=False, reason "closed"."""
        ...


# --------------------------------------------------------------------------------------------
# Pure helpers


def coalesce(entries: Iterable[Entry], dst_boundaries: Collection[int] = ()) -> list[Entry]:
    """Merge each entry into the previous one when both its src and dst continue it (order kept).

    ``dst_boundaries`` are remote addresses where a merge must not happen (starts of separately
    registered remote regions: Mooncake rejects an entry that spans two of them).
    """
    out: list[Entry] = []
    ps = pd = pn = -1
    for s, d, n in entries:
        if pn >= 0 and ps + pn == s and pd + pn == d and d not in dst_boundaries:
            pn += n
            continue
        if pn >= 0:
            out.append((ps, pd, pn))
        ps, pd, pn = s, d, n
    if pn >= 0:
        out.append((ps, pd, pn))
    return out


def split_batches(
    entries: Sequence[Entry], max_entries: int = DEFAULT_MAX_BATCH_ENTRIES
) -> list[list[Entry]]:
    """Cut ``entries`` into consecutive batches of at most ``max_entries`` (order kept)."""
    if max_entries < 1:
        raise ValueError(f"max_entries must be >= 1, got {max_entries}")
    return [list(entries[i : i + max_entries]) for i in range(0, len(entries), max_entries)]


def _validated(entries: Sequence[Entry]) -> tuple[list[Entry], int]:
    """Copy ``entries`` and check each is (src > 0, dst > 0, length > 0); return (copy, bytes).

    Values must be integers (Python or numpy); to keep submit cheap the integer *type* is
    checked on the first entry only, the ranges on every entry."""
    try:
        copy = list(entries)
    except TypeError as exc:
        raise ValueError(f"entries must be a sequence of (src, dst, length): {exc}") from None
    if copy:
        try:
            for value in copy[0]:
                operator.index(value)
        except TypeError:
            msg = f"entry 0 is not an (src, dst, length) int triple: {copy[0]!r}"
            raise ValueError(msg) from None
    total = 0
    for i, entry in enumerate(copy):
        try:
            s, d, n = entry
            bad = n <= 0 or s <= 0 or d <= 0
        except (TypeError, ValueError):
            msg = f"entry {i} is not an (src, dst, length) int triple: {entry!r}"
            raise ValueError(msg) from None
        if bad:
            raise ValueError(f"entry {i} needs src > 0, dst > 0, length > 0: {entry!r}")
        total += n
    return copy, total


class _Regions:
    """Union of registered address ranges; copy-on-write so readers need no lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, addr: int, length: int) -> None:
        """Add [addr, addr+length), merging with overlapping or touching ranges."""
        with self._lock:
            spans = sorted([*zip(self._starts, self._ends, strict=True), (addr, addr + length)])
            starts: list[int] = []
            ends: list[int] = []
            for s, e in spans:
                if ends and s <= ends[-1]:
                    ends[-1] = max(ends[-1], e)
                else:
                    starts.append(s)
                    ends.append(e)
            self._starts, self._ends = starts, ends

    def contains(self, addr: int, length: int) -> bool:
        """True when [addr, addr+length) lies inside one registered range."""
        starts, ends = self._starts, self._ends
        i = bisect.bisect_right(starts, addr) - 1
        return i >= 0 and addr + length <= ends[i]

    def __bool__(self) -> bool:
        return bool(self._starts)


def _fmt_range(addr: int, length: int) -> str:
    """Human-readable address range for failure reasons."""
    return f"[{addr:#x}, +{length})"


# --------------------------------------------------------------------------------------------
# Shared machinery: per-session FIFO workers, completion pipe, stats


class _Job:
    """One queued unit of work for a peer's sender thread: a transfer or a first contact."""

    __slots__ = ("xfer_id", "entries", "nbytes", "is_connect", "not_after")

    def __init__(
        self, xfer_id: Hashable, entries: list[Entry], nbytes: int, is_connect: bool = False,
        not_after: float = math.inf,
    ) -> None:
        self.xfer_id = xfer_id
        self.entries = entries
        self.nbytes = nbytes
        self.is_connect = is_connect
        self.not_after = not_after  # time.monotonic() after which no byte may be handed over

    def expired(self, now: float) -> str:
        """Why the job may no longer be handed to the transport at ``now`` ("" if it may)."""
        if now <= self.not_after:
            return ""
        return (f"not handed to the transport by its request's deadline ({now - self.not_after:.3f}"
                f" s late, queued behind earlier writes): nothing was sent")


class _Peer:
    """State of one destination session: its FIFO queue, condition and sender thread."""

    __slots__ = ("session", "queue", "cond", "thread", "connected", "connect_reason", "dead",
                 "backlog_s")

    def __init__(self, session: str) -> None:
        self.session = session
        self.queue: deque[_Job] = deque()
        self.cond = threading.Condition(threading.Lock())
        self.thread: threading.Thread | None = None
        self.connected: bool | None = None
        self.connect_reason = ""
        self.dead = False  # its sender thread crashed; no longer accepts jobs
        # seconds the link needs to drain what is in flight to this peer (its sender sets it;
        # 0 while unknown)
        self.backlog_s = 0.0


class _QueuedDataPlane:
    """Base of both data planes: queues, worker threads, completions, stats, close."""

    def __init__(self, *, max_batch_entries: int, join_timeout_s: float) -> None:
        if max_batch_entries < 1:
            raise ValueError(f"max_batch_entries must be >= 1, got {max_batch_entries}")
        self._max_batch = max_batch_entries
        self._join_timeout_s = join_timeout_s
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._closed = False
        self._closed_event = threading.Event()
        self._local = _Regions()
        self._done: deque[Completion] = deque()
        self._done_lock = threading.Lock()
        self._signaled = False
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        self._pipe_open = True
        self._counters: dict[str, int] = dict.fromkeys(
            (
                "fences",
                "fence_failures",
                "submitted",
                "completed",
                "failed",
                "bytes",
                "entries",
                "batches",
                "entries_sent",
                "connects",
                "connect_failures",
                "uncoalesced_retries",
                "resends",
            ),
            0,
        )

    # -- backend hooks -------------------------------------------------------------------------

    def _backend_register(self, addr: int, length: int) -> None:
        """Make [addr, addr+length) known to the backend."""
        raise NotImplementedError

    def _backend_connect(self, session: str) -> str:
        """First contact with ``session``; return "" on success or a failure reason."""
        raise NotImplementedError

    def _backend_transfer(self, session: str, job: _Job) -> str:
        """Move ``job``'s bytes; return "" on success or a failure reason (runs in a worker)."""
        raise NotImplementedError

    def _backend_close(self, all_joined: bool) -> None:
        """Release backend resources after the workers have been stopped."""

    def _wake_waiters(self) -> None:
        """Wake backend waits (e.g. frozen in-process writes) so close() is prompt."""

    # -- public API ----------------------------------------------------------------------------

    @property
    def session(self) -> str:
        """The string a remote peer passes as ``session`` to write into our memory."""
        raise NotImplementedError

    def register_memory(self, addr: int, length: int) -> None:
        """Register local memory that peers may write into and that we may send from."""
        if addr <= 0 or length <= 0:
            raise ValueError(f"register_memory needs addr > 0 and length > 0, got {addr}, {length}")
        self._backend_register(addr, length)
        self._local.add(addr, length)

    def registered(self, addr: int, length: int) -> bool:
        """Whether ``[addr, addr + length)`` lies in memory registered with register_memory."""
        return self._local.contains(addr, length)

    def connect(self, session: str) -> None:
        """Warm up contact with ``session`` in its sender thread; idempotent and non-blocking."""
        self._peer(session, connect=True)

    def is_connected(self, session: str) -> bool | None:
        """Result of first contact: True/False once known, None while pending or never tried."""
        peer = self._peers.get(session)
        return None if peer is None else peer.connected

    def submit(self, xfer_id: Hashable, session: str, entries: Sequence[Entry],
               within_s: float = math.inf) -> None:
        """Queue ``entries`` for ``session`` and return at once; the outcome comes from poll().
        A sender that reaches the transfer more than ``within_s`` later fails it unsent (the
        request's deadline: the lease argument bounds a write's life from the core's submission,
        so queueing here must not extend it)."""
        copy, nbytes = _validated(entries)
        job = _Job(xfer_id, copy, nbytes, not_after=time.monotonic() + within_s)
        with self._lock:
            self._counters["submitted"] += 1
            self._counters["entries"] += len(copy)
        for _attempt in range(2):  # a second try only if the sender thread just crashed
            peer = self._peer(session, connect=False)
            if peer is None:
                break
            with peer.cond:
                if not self._closed and not peer.dead:
                    peer.queue.append(job)
                    peer.cond.notify()
                    return
            if self._closed:
                break
        self._complete(job, "closed" if self._closed else "data plane sender thread crashed")

    def poll(self) -> list[Completion]:
        """Return completions finished since the last poll (never blocks); drains fileno()."""
        with self._done_lock:
            if not self._done:
                return []
            out = list(self._done)
            self._done.clear()
            if self._signaled:
                self._signaled = False
                if self._pipe_open:
                    try:
                        while os.read(self._rfd, 4096):
                            pass
                    except BlockingIOError:
                        pass
        return out

    def fileno(self) -> int:
        """Read end of a pipe that is readable while completions are waiting for poll()."""
        return self._rfd

    def backlog_s(self) -> float:
        """The longest time any peer's link needs to drain what is in flight to it (0 when
        unknown or idle): while it is long, handing the next layers over sooner moves no byte
        sooner (``lw.transport.inbox``). Read from any thread."""
        return max((p.backlog_s for p in list(self._peers.values())), default=0.0)

    def stats(self) -> dict[str, int | float]:
        """Counters: submitted, completed (ok), failed, bytes (of ok transfers), entries (as
        submitted), batches (Mooncake batches in spin mode, submission passes in poll mode),
        entries_sent (after coalescing), connects, connect_failures, uncoalesced_retries,
        resends, fences, fence_failures, peers, queued (not yet taken by a sender), pending
        (submitted, not yet completed)."""
        with self._lock:
            out: dict[str, int | float] = dict(self._counters)
            out["peers"] = len(self._peers)
            out["queued"] = sum(len(p.queue) for p in self._peers.values())
        out["pending"] = out["submitted"] - out["completed"] - out["failed"]
        return out

    def close(self) -> None:
        """Stop the sender threads; queued transfers complete with ok=False, reason "closed".

        Transfers already inside Mooncake finish first (up to ``join_timeout_s``); poll() still
        returns every completion afterwards. Unregister fileno() from selectors before calling:
        the pipe is closed once all threads have stopped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers.values())
        self._closed_event.set()
        for peer in peers:
            with peer.cond:
                dropped = list(peer.queue)
                peer.queue.clear()
                peer.cond.notify_all()
            for job in dropped:
                if not job.is_connect:
                    self._complete(job, "closed")
        self._wake_waiters()
        deadline = time.monotonic() + self._join_timeout_s
        all_joined = True
        for peer in peers:
            if peer.thread is not None and peer.thread is not threading.current_thread():
                peer.thread.join(max(0.0, deadline - time.monotonic()))
                all_joined = all_joined and not peer.thread.is_alive()
        self._backend_close(all_joined)
        if all_joined:
            with self._done_lock:
                self._pipe_open = False
                self._signaled = False
                os.close(self._rfd)
                os.close(self._wfd)

    def __enter__(self) -> Self:
        """Use as a context manager that closes on exit."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close on leaving the ``with`` block."""
        self.close()

    # -- internals -----------------------------------------------------------------------------

    def _peer(self, session: str, *, connect: bool) -> _Peer | None:
        """Get or create the peer for ``session`` (starting its thread); None when closed."""
        peer = self._peers.get(session)
        if peer is not None:
            return peer
        with self._lock:
            if self._closed:
                return None
            peer = self._peers.get(session)
            if peer is not None:
                return peer
            peer = _Peer(session)
            if connect:
                peer.queue.append(_Job(None, [], 0, is_connect=True))
            peer.thread = threading.Thread(
                target=self._named_worker, args=(peer,), name=f"lw-dp->{session}", daemon=True
            )
            self._peers[session] = peer
            peer.thread.start()
            return peer

    def _named_worker(self, peer: _Peer) -> None:
        name_os_thread(f"lw-dp:{peer.session.rsplit(':', 1)[-1]}")
        self._worker(peer)

    def _worker(self, peer: _Peer) -> None:
        """Sender thread for one destination: runs its jobs strictly in FIFO order."""
        while True:
            with peer.cond:
                while not peer.queue and not self._closed:
                    peer.cond.wait()
                if not peer.queue:
                    return
                job = peer.queue.popleft()
            if job.is_connect:
                self._do_connect(peer)
                continue
            if not job.entries:
                reason = "closed" if self._closed else ""
            else:
                reason = job.expired(time.monotonic()) or self._guard(
                    self._backend_transfer, peer.session, job)
            self._complete(job, reason)

    def _sender_crashed(self, peer: _Peer, in_flight: list[_Job], exc: Exception) -> None:
        """A pipelined sender thread raised: fail its jobs in flight and queued (never leave
        submitters waiting on a dead thread) and forget the peer, so that the next submit
        starts a fresh sender."""
        with peer.cond:
            dropped = [job for job in peer.queue if not job.is_connect]
            peer.queue.clear()
            peer.dead = True
        with self._lock:
            if self._peers.get(peer.session) is peer:
                del self._peers[peer.session]
        for job in in_flight + dropped:
            self._complete(job, f"internal error in data plane sender: {exc!r}")

    def _do_connect(self, peer: _Peer) -> None:
        """Run first contact with ``peer`` and record its outcome."""
        reason = self._guard(self._backend_connect, peer.session)
        peer.connected = not reason
        peer.connect_reason = reason
        with self._lock:
            self._counters["connects"] += 1
            self._counters["connect_failures"] += bool(reason)

    @staticmethod
    def _guard(fn: Callable[..., str], *args: Any) -> str:
        """Call a backend hook; turn an unexpected exception into a failure reason."""
        try:
            return fn(*args)
        except Exception as exc:  # a transport bug must become ok=False, not a dead thread
            return f"internal error in data plane: {exc!r}"

    def _count(self, **incs: int) -> None:
        """Add to the stats counters."""
        with self._lock:
            for key, inc in incs.items():
                self._counters[key] += inc

    def _in_doubt(self, reason: str) -> bool:
        """Whether a failure with this reason may still move bytes later (default: no)."""
        return False

    def _complete(self, job: _Job, reason: str) -> None:
        """Record a finished job, queue its Completion and make fileno() readable."""
        ok = not reason
        with self._lock:
            if ok:
                self._counters["completed"] += 1
                self._counters["bytes"] += job.nbytes
            else:
                self._counters["failed"] += 1
        completion = Completion(job.xfer_id, ok, reason, job.nbytes,
                                in_doubt=not ok and self._in_doubt(reason))
        with self._done_lock:
            self._done.append(completion)
            if not self._signaled and self._pipe_open:
                self._signaled = True
                try:
                    os.write(self._wfd, b"\x01")
                except BlockingIOError:  # pipe full: already readable
                    pass

    def _check_local(self, entries: Sequence[Entry]) -> str:
        """Reason if some source range is outside memory registered with register_memory."""
        contains = self._local.contains
        for s, _d, n in entries:
            if not contains(s, n):
                return (
                    f"local source range {_fmt_range(s, n)} is outside memory registered "
                    f"with register_memory on {self.session}"
                )
        return ""
