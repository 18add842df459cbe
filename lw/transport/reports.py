"""The worker loop's reports to its engine (SendFinished, RecvDone, RecvFailed, Quarantine,
Reprefill, ReleaseBlocks): appended on the loop thread, waited for and drained by the engine's
thread."""

from __future__ import annotations

import threading
from collections import deque

from lw.fsm import Effect

__all__ = ["ReportQueue"]


class ReportQueue:
    """A lock-free single-producer queue with a wake-up event for an idle engine step."""

    def __init__(self) -> None:
        self._q: deque[Effect] = deque()
        self._event = threading.Event()

    def put(self, e: Effect) -> None:
        """Queue one report (loop thread) and wake a waiting engine."""
        self._q.append(e)
        self._event.set()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until a report is there to drain; True when one is."""
        if self._q:
            return True
        self._event.clear()
        if self._q:  # appended between the check and the clear
            return True
        return self._event.wait(timeout)

    def drain(self) -> list[Effect]:
        """Every report queued since the last call, oldest first."""
        out: list[Effect] = []
        pop = self._q.popleft
        try:
            while True:
                out.append(pop())
        except IndexError:
            return out

    def __len__(self) -> int:
        return len(self._q)
