"""A worker's memory of what happened to its requests: a bounded ring of lifecycle events.

Each endpoint appends one tuple per fired event (declared transitions and declared no-ops alike)
plus a few milestones that are not transitions (request admitted, a batch's layer computed, one
layer write completed). Appending is the only hot-path cost; everything else (per-request
history, time-in-state samples, stuck-request detection) is derived on demand. No I/O, no clock:
times are the ``now`` the driver passed in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lw.fsm.failures import Failure

# (t, req_id or tuple of req_ids for a batch milestone, event, from_state, to_state, detail);
# detail is text, or a layer number (formatted only when someone reads the timeline), or for a
# D ``fail`` event a lw.fsm.failures.Failure (its kind and reason; ``str()`` gives the reason)
Entry = tuple[float, "str | tuple[str, ...]", str, str, str, "str | int | Failure"]

DEFAULT_TIMELINE_ENTRIES = 32768


def state_class(state: str) -> str:
    """Bounded label for a state: LAYER_k_SENT of every k become LAYER_SENT (metric labels)."""
    if state.startswith("LAYER_") and state.endswith("_SENT"):
        return "LAYER_SENT"
    return state


def check_observability(config: Any) -> None:
    """Validate a config's ``timeline_entries`` and ``stuck_fraction`` (shared by P and D)."""
    name = type(config).__name__
    if config.timeline_entries < 0:
        raise ValueError(f"{name}.timeline_entries must be >= 0, got {config.timeline_entries}")
    if not 0 < config.stuck_fraction <= 1:
        raise ValueError(f"{name}.stuck_fraction must be in (0, 1], got {config.stuck_fraction}")


class Timeline:
    """Bounded ring of lifecycle events of one worker (``capacity`` 0 records nothing).

    Endpoints append to ``ring`` and ``durations`` directly on their hot paths (both None when
    off): a method call per event would double the cost."""

    __slots__ = ("capacity", "ring", "durations")

    def __init__(self, capacity: int = DEFAULT_TIMELINE_ENTRIES) -> None:
        if capacity < 0:
            raise ValueError(f"timeline capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.ring: deque[Entry] | None = deque(maxlen=capacity) if capacity else None
        # (state, seconds spent in it), one per state change, for time-in-state histograms; a
        # driver drains it (bounded: an undrained worker keeps only the newest).
        self.durations: deque[tuple[str, float]] | None = (
            deque(maxlen=4096) if capacity else None)

    def record(self, t: float, req: str | tuple[str, ...], event: str, src: str = "",
               dst: str = "", detail: str | int | Failure = "") -> None:
        """Append one event (the oldest falls off when full)."""
        if self.ring is not None:
            self.ring.append((t, req, event, src, dst, detail))

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.ring) if self.ring is not None else iter(())

    def __len__(self) -> int:
        return len(self.ring) if self.ring is not None else 0

    def of(self, req_id: str) -> list[Entry]:
        """Every remembered event of one request, oldest first (batch milestones included)."""
        return [e for e in self if e[1] == req_id or (type(e[1]) is tuple and req_id in e[1])]

    def last(self, n: int) -> list[Entry]:
        """The newest ``n`` events, oldest first."""
        if n <= 0 or self.ring is None:
            return []
        ring = list(self.ring)
        return ring[-n:] if n < len(ring) else ring

    def drain_durations(self) -> list[tuple[str, float]]:
        """Time-in-state samples since the previous drain, states classed for metric labels
        (safe against a concurrent append: one popleft at a time)."""
        if self.durations is None:
            return []
        return [(state_class(s), secs) for s, secs in drain(self.durations)]


def drain(q: deque) -> list:
    """Pop every item of ``q`` (oldest first) without losing one appended meanwhile."""
    out = []
    pop = q.popleft
    try:
        while True:
            out.append(pop())
    except IndexError:
        return out
