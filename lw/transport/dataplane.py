"""Data planes: the part of lw that moves KV-cache bytes from this process into a peer's memory.

A data plane writes ``(local_src_addr, remote_dst_addr, length)`` entries into memory a peer has
registered, and reports each submitted transfer exactly once as a :class:`Completion`.
``submit`` never blocks and never raises for transport failures; ``poll`` / ``fileno`` hand the
completions to an event loop. Each destination session has its own FIFO queue and sender thread,
so completions for one destination come back in submission order and a stuck peer stalls only
its own queue (see the Mooncake caveat below).

Two implementations:

* :class:`InProcessDataPlane` -- for tests and simulations inside one process: addresses are real
  pointers, a module-level registry maps session names to registered regions, copies are done with
  ``ctypes.memmove`` after a bounds check, and faults can be injected (``fail_next``, ``delay``,
  ``freeze``).
* :class:`MooncakeDataPlane` -- wraps ``mooncake.engine.TransferEngine`` (P2P handshake, TCP when
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
:meth:`MooncakeDataPlane.hint_remote_regions` instead); an empty batch performs the first contact
with a peer (its ``openSegment``) and nothing else, which is what ``connect`` uses; Mooncake does
not check that local source addresses are registered on TCP, so this module checks them itself;
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

import bisect
import ctypes
import math
import operator
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any, Literal, Protocol, Self, runtime_checkable

__all__ = [
    "Completion",
    "DataPlane",
    "Entry",
    "InProcessDataPlane",
    "MooncakeDataPlane",
    "coalesce",
    "split_batches",
]

Entry = tuple[int, int, int]
"""One write: (local_src_addr, remote_dst_addr, length in bytes)."""

DEFAULT_MAX_BATCH_ENTRIES = 1024
"""Entries per Mooncake batch; Mooncake fails batches above ~2048 entries."""

_FAST_FAIL_S = 0.5
"""A failed batch that returned faster than this was rejected up front (not a timeout)."""

_MIN_NAP_S = 2e-5
"""First sleep of the poll-mode sender when nothing progressed (doubles up to the interval)."""

_BAD_BATCH_IDS = frozenset({0, -1, (1 << 64) - 1})
"""What Mooncake's transfer_submit_write returns when it could not submit."""


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

    def submit(self, xfer_id: Hashable, session: str, entries: Sequence[Entry]) -> None:
        """Queue a transfer; never blocks, reports via ``poll``; ValueError for bad entries."""
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

    __slots__ = ("xfer_id", "entries", "nbytes", "is_connect")

    def __init__(
        self, xfer_id: Hashable, entries: list[Entry], nbytes: int, is_connect: bool = False
    ) -> None:
        self.xfer_id = xfer_id
        self.entries = entries
        self.nbytes = nbytes
        self.is_connect = is_connect


class _Peer:
    """State of one destination session: its FIFO queue, condition and sender thread."""

    __slots__ = ("session", "queue", "cond", "thread", "connected", "connect_reason", "dead")

    def __init__(self, session: str) -> None:
        self.session = session
        self.queue: deque[_Job] = deque()
        self.cond = threading.Condition(threading.Lock())
        self.thread: threading.Thread | None = None
        self.connected: bool | None = None
        self.connect_reason = ""
        self.dead = False  # its sender thread crashed; no longer accepts jobs


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
        "retried",
        "first_failure",
    )

    def __init__(self, job: _Job, plan: list[Entry]) -> None:
        self.job = job
        self.plan = plan
        self.next = 0
        self.pending: list[int] = []
        self.failure = ""
        self.started = 0.0
        self.deadline = math.inf
        self.retried = False
        self.first_failure = ""


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

    def connect(self, session: str) -> None:
        """Warm up contact with ``session`` in its sender thread; idempotent and non-blocking."""
        self._peer(session, connect=True)

    def is_connected(self, session: str) -> bool | None:
        """Result of first contact: True/False once known, None while pending or never tried."""
        peer = self._peers.get(session)
        return None if peer is None else peer.connected

    def submit(self, xfer_id: Hashable, session: str, entries: Sequence[Entry]) -> None:
        """Queue ``entries`` for ``session`` and return at once; the outcome comes from poll()."""
        copy, nbytes = _validated(entries)
        job = _Job(xfer_id, copy, nbytes)
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

    def stats(self) -> dict[str, int | float]:
        """Counters: submitted, completed (ok), failed, bytes (of ok transfers), entries (as
        submitted), batches (Mooncake batches in spin mode, submission passes in poll mode),
        entries_sent (after coalescing), connects, connect_failures, uncoalesced_retries,
        peers, queued (not yet taken by a sender), pending (submitted, not yet completed)."""
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
                target=self._worker, args=(peer,), name=f"lw-dp->{session}", daemon=True
            )
            self._peers[session] = peer
            peer.thread.start()
            return peer

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
                reason = self._guard(self._backend_transfer, peer.session, job)
            self._complete(job, reason)

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


# --------------------------------------------------------------------------------------------
# In-process data plane


class _Registry:
    """Process-wide directory of in-process data planes, and which sessions are frozen."""

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.planes: dict[str, InProcessDataPlane] = {}
        self.frozen: set[str] = set()
        self.ids = count(1)


_REGISTRY = _Registry()


class InProcessDataPlane(_QueuedDataPlane):
    """Data plane between objects of one process (tests, simulations), copying with memmove.

    Memory is real: register real pointers (e.g. ``numpy_array.ctypes.data``). Every write is
    bounds-checked against the regions the target session registered. Fault knobs: ``fail_next``,
    ``delay``, ``freeze``/``unfreeze`` (frozen targets make writes wait up to ``timeout_s``).
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        timeout_s: float = 5.0,
        max_batch_entries: int = DEFAULT_MAX_BATCH_ENTRIES,
        join_timeout_s: float = 5.0,
    ) -> None:
        super().__init__(max_batch_entries=max_batch_entries, join_timeout_s=join_timeout_s)
        self.timeout_s = timeout_s
        self._fail_next = 0
        self._delay_s = 0.0
        with _REGISTRY.cond:
            self._session = f"inproc://{name or next(_REGISTRY.ids)}"
            if self._session in _REGISTRY.planes:
                raise ValueError(f"session {self._session} already exists in this process")
            _REGISTRY.planes[self._session] = self

    @property
    def session(self) -> str:
        """This plane's name in the in-process registry (``inproc://...``)."""
        return self._session

    # -- fault injection -----------------------------------------------------------------------

    def fail_next(self, n: int = 1) -> None:
        """Make the next ``n`` transfers sent by this plane fail with an "injected" reason."""
        with self._lock:
            self._fail_next += n

    def delay(self, seconds: float) -> None:
        """Wait ``seconds`` before every later transfer sent by this plane (0 to stop)."""
        self._delay_s = seconds

    def freeze(self, session: str) -> None:
        """Freeze ``session`` for every sender in the process, like a SIGSTOPped peer."""
        with _REGISTRY.cond:
            _REGISTRY.frozen.add(session)

    def unfreeze(self, session: str) -> None:
        """Undo :meth:`freeze`; waiting writes to ``session`` proceed."""
        with _REGISTRY.cond:
            _REGISTRY.frozen.discard(session)
            _REGISTRY.cond.notify_all()

    # -- backend hooks -------------------------------------------------------------------------

    def _backend_register(self, addr: int, length: int) -> None:
        """Nothing to do: the region list kept by the base class is the registry's view."""

    def _backend_connect(self, session: str) -> str:
        """Check the target exists (and wait while it is frozen, as a real first contact would)."""
        reason = self._wait_not_frozen(session, time.monotonic() + self.timeout_s)
        if reason:
            return reason
        with _REGISTRY.cond:
            if session not in _REGISTRY.planes:
                return f"unknown session {session} (no in-process data plane by that name)"
        return ""

    def _backend_transfer(self, session: str, job: _Job) -> str:
        """Bounds-check all entries, then memmove them batch by batch."""
        started = time.monotonic()
        with self._lock:
            if self._fail_next > 0:
                self._fail_next -= 1
                return f"injected failure (fail_next) writing to {session}"
        if self._delay_s > 0 and self._closed_event.wait(self._delay_s):
            return "closed"
        reason = self._wait_not_frozen(session, started + self.timeout_s)
        if reason:
            return reason
        with _REGISTRY.cond:
            target = _REGISTRY.planes.get(session)
        if target is None:
            return f"unknown session {session} (no in-process data plane by that name)"
        plan = coalesce(job.entries)
        reason = self._check_local(plan)
        if reason:
            return reason
        remote = target._local
        for _s, d, n in plan:
            if not remote.contains(d, n):
                return (
                    f"remote range {_fmt_range(d, n)} is outside the memory registered by "
                    f"session {session}"
                )
        batches = split_batches(plan, self._max_batch)
        for i, batch in enumerate(batches):
            if self._closed and i > 0:
                return f"closed after {i}/{len(batches)} batches"
            for s, d, n in batch:
                ctypes.memmove(int(d), int(s), int(n))
            self._count(batches=1, entries_sent=len(batch))
        return ""

    def _wait_not_frozen(self, session: str, deadline: float) -> str:
        """Block while ``session`` is frozen; reason on timeout or close, "" once unfrozen."""
        with _REGISTRY.cond:
            while session in _REGISTRY.frozen:
                if self._closed:
                    return "closed"
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return (
                        f"timeout after {self.timeout_s:.2f}s writing to {session} (session frozen)"
                    )
                _REGISTRY.cond.wait(remaining)
        return ""

    def _wake_waiters(self) -> None:
        """Wake writes waiting on frozen sessions so they see the close."""
        with _REGISTRY.cond:
            _REGISTRY.cond.notify_all()

    def _backend_close(self, all_joined: bool) -> None:
        """Leave the registry so later writes to this session fail as unknown."""
        with _REGISTRY.cond:
            if _REGISTRY.planes.get(self._session) is self:
                del _REGISTRY.planes[self._session]


# --------------------------------------------------------------------------------------------
# Mooncake data plane


class MooncakeDataPlane(_QueuedDataPlane):
    """Data plane over Mooncake's transfer engine (P2P handshake; TCP without an RDMA card).

    ``wait``: ``"poll"`` (default) pipelines per-entry submits and polls their status with sleeps
    of at most ``poll_interval_s``; ``"spin"`` writes batch by batch with the busy-waiting
    ``batch_transfer_sync_write`` (see the module docstring). ``timeout_s`` (if given) sets
    ``MC_TRANSFER_TIMEOUT`` (whole seconds, Mooncake's minimum 5, which bounds spin mode) and is
    the poll-mode deadline as given (plus 1 s per GiB, as Mooncake does; 30 s when not given);
    ``env`` sets other
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
        join_timeout_s: float = 5.0,
        metadata_server: str = "P2PHANDSHAKE",
        protocol: str = "tcp",
        device_name: str = "",
    ) -> None:
        super().__init__(max_batch_entries=max_batch_entries, join_timeout_s=join_timeout_s)
        if wait not in ("spin", "poll"):
            raise ValueError(f"wait must be 'spin' or 'poll', got {wait!r}")
        if timeout_s is not None:
            os.environ["MC_TRANSFER_TIMEOUT"] = str(max(5, math.ceil(timeout_s)))
        for key, value in (env or {}).items():
            os.environ[key] = value
        from mooncake.engine import TransferEngine  # deferred: optional dependency

        self.timeout_s = timeout_s
        self.wait = wait
        self._deadline_s = float(timeout_s) if timeout_s is not None else 30.0
        self._poll_interval_s = poll_interval_s
        self._coalesce = coalesce_entries
        self._remote_bounds: dict[str, frozenset[int]] = {}
        self._engine: Any = TransferEngine()
        rc = self._engine.initialize(hostname, metadata_server, protocol, device_name)
        if rc != 0:
            raise RuntimeError(
                f"mooncake TransferEngine.initialize({hostname!r}, {metadata_server!r}, "
                f"{protocol!r}, {device_name!r}) returned {rc}"
            )
        self._session = f"{hostname}:{self._engine.get_rpc_port()}"

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
        reason, fast = self._write_all(session, plan)
        if reason and fast and len(plan) != len(job.entries) and not self._closed:
            # A merged entry may span two separately registered remote regions (Mooncake
            # rejects that at once); writes are idempotent, so resend the original entries.
            self._count(uncoalesced_retries=1)
            retry_reason, _ = self._write_all(session, job.entries)
            if not retry_reason:
                return ""
            reason = f"{retry_reason} (also failed coalesced: {reason})"
        return reason

    def _write_all(self, session: str, plan: list[Entry]) -> tuple[str, bool]:
        """Write ``plan`` in batches; return (reason or "", whether a failure came back fast)."""
        batches = split_batches(plan, self._max_batch)
        write = self._write_spin
        for i, batch in enumerate(batches):
            if self._closed and i > 0:
                return f"closed after {i}/{len(batches)} batches", False
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
        except Exception as exc:  # never leave submitters waiting on a dead thread
            with peer.cond:
                dropped = [job for job in peer.queue if not job.is_connect]
                peer.queue.clear()
                peer.dead = True
            with self._lock:
                if self._peers.get(peer.session) is peer:
                    del self._peers[peer.session]  # the next submit starts a fresh sender
            for job in [f.job for f in flights] + dropped:
                self._complete(job, f"internal error in data plane sender: {exc!r}")
            raise

    def _pipelined_worker(self, peer: _Peer, flights: deque[_Flight]) -> None:
        """Poll mode: keep up to ``max_batch_entries`` entries of successive transfers in flight
        (so layer k+1 is on the wire while layer k finishes) and report transfers strictly in
        submission order, each only once Mooncake has resolved every one of its entries."""
        submit = self._engine.transfer_submit_write
        check = self._engine.transfer_check_status
        session = peer.session
        inflight = 0
        nap = _MIN_NAP_S
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
            for f in flights:
                if inflight >= self._max_batch:
                    break
                if f.failure or f.next >= len(f.plan) or self._closed:
                    continue
                if f.next == 0:
                    f.started = now
                    f.deadline = now + self._deadline_s + f.job.nbytes / (1 << 30)
                    self._count(batches=1)
                first = f.next
                while f.next < len(f.plan) and inflight < self._max_batch:
                    s, d, n = f.plan[f.next]
                    bid = submit(session, s, d, n)
                    if bid in _BAD_BATCH_IDS:
                        f.failure = f"transfer_submit_write returned {bid} for {_fmt_range(d, n)}"
                        break
                    f.pending.append(bid)
                    f.next += 1
                    inflight += 1
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
                    del f.pending[:resolved]
                if f.pending and now > f.deadline:
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
                    and not f.retried
                    and elapsed < _FAST_FAIL_S
                    and len(f.plan) != len(f.job.entries)
                    and not self._closed
                ):
                    # Fast failure with merged entries: maybe a merge spanned two remote
                    # registrations. Writes are idempotent: resend the original entries.
                    self._count(uncoalesced_retries=1)
                    f.first_failure = f.failure
                    f.plan, f.next, f.failure, f.retried = f.job.entries, 0, "", True
                    progressed = True
                    break
                if f.failure and f.started:
                    reason = (
                        f"mooncake {f.failure} to {session} after {elapsed:.2f}s "
                        f"({len(f.plan)} entries, {f.job.nbytes} bytes)"
                    )
                    if f.retried:
                        reason += f" (retried uncoalesced; merged entries: {f.first_failure})"
                elif f.failure:
                    reason = f.failure  # rejected before anything was sent
                elif f.next < len(f.plan):
                    reason = f"closed after {f.next}/{len(f.plan)} entries were sent"
                else:
                    reason = ""
                flights.popleft()
                self._complete(f.job, reason)
            # 5. Nothing moved: wait a little (a new submit wakes us at once).
            if progressed:
                nap = _MIN_NAP_S
            elif flights:
                with peer.cond:
                    if not peer.queue:
                        peer.cond.wait(nap)
                nap = min(nap * 2, self._poll_interval_s)

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
