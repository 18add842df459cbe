"""The ``corrupt-write`` fault: a data plane that now and then writes the wrong bytes.

It wraps a real data plane and, for every ``every``-th transfer, reads the first entry from one
byte further on in P's memory: the bytes that land in D's block differ from the ones P computed
(a misdirected or corrupted write, the failure KV checksums exist for). Everything else is the
wrapped plane's.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

Entry = tuple[int, int, int]


class CorruptingPlane:
    """A data plane whose every ``every``-th transfer lands shifted bytes (test fault only)."""

    def __init__(self, inner: Any, every: int = 7) -> None:
        if every < 1:
            raise ValueError("every must be >= 1")
        self._inner = inner
        self._every = every
        self._n = 0
        self.corrupted = 0

    def submit(self, xfer_id: Hashable, session: str, entries: Sequence[Entry],
               within_s: float = math.inf) -> None:
        """Submit, shifting the source of the first entry of every ``every``-th transfer."""
        self._n += 1
        if self._n % self._every == 0 and entries:
            src, dst, n = entries[0]
            entries = [(src + 1, dst, n), *entries[1:]]
            self.corrupted += 1
        self._inner.submit(xfer_id, session, entries, within_s)

    def stats(self) -> dict[str, int | float]:
        """The wrapped plane's counters plus how many transfers were corrupted."""
        return {**self._inner.stats(), "corrupted": self.corrupted}

    @property
    def session(self) -> str:
        """The wrapped plane's session."""
        return str(self._inner.session)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
