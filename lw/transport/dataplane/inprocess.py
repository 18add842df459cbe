"""The in-process data plane: peers are objects of one process, copies are memmoves.

:class:`InProcessDataPlane` is for tests and simulations inside one process: addresses are real
pointers, a module-level registry maps session names to registered regions, copies are done with
``ctypes.memmove`` after a bounds check, and faults can be injected (``fail_next``, ``delay``,
``freeze``).
"""

from __future__ import annotations

import ctypes
import threading
import time
from itertools import count

from lw.transport.dataplane.base import (
    DEFAULT_MAX_BATCH_ENTRIES,
    _fmt_range,
    _Job,
    _QueuedDataPlane,
    coalesce,
    split_batches,
)

__all__ = ["InProcessDataPlane"]


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
        for _s, d, n in plan:
            if not target.registered(d, n):
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
