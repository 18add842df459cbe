"""The worker loop's timers: what the core armed, fired in time order, re-arming replacing."""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from lw.fsm.effects import TimerKey

__all__ = ["Timers"]


class Timers:
    """Armed timers by key; a heap with lazy deletion (cancelled and replaced entries are
    skipped when they come up, and dropped now and then)."""

    def __init__(self) -> None:
        self._armed: dict[TimerKey, tuple[float, int]] = {}  # key -> (at, seq)
        self._heap: list[tuple[float, int, TimerKey]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._armed)

    def arm(self, key: TimerKey, at: float) -> None:
        """Fire ``key`` at ``at`` (replacing an earlier arming of it)."""
        self._seq += 1
        self._armed[key] = (at, self._seq)
        heapq.heappush(self._heap, (at, self._seq, key))

    def cancel(self, key: TimerKey) -> None:
        """Forget ``key`` if armed."""
        self._armed.pop(key, None)

    def next_at(self) -> float | None:
        """When the earliest entry comes up (possibly a cancelled one: firing skips it)."""
        return self._heap[0][0] if self._heap else None

    def due(self, now: float) -> Iterator[TimerKey]:
        """Pop the timers due at ``now``, earliest first (each disarmed as it is yielded)."""
        heap, armed = self._heap, self._armed
        while heap and heap[0][0] <= now:
            _, seq, key = heapq.heappop(heap)
            cur = armed.get(key)
            if cur is None or cur[1] != seq:
                continue  # replaced or cancelled
            del armed[key]
            yield key
        if len(heap) > 2 * len(armed) + 1024:  # drop cancelled entries now and then
            self._heap = [(at, seq, key) for key, (at, seq) in armed.items()]
            heapq.heapify(self._heap)
