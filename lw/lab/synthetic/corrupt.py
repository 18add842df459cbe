"""The ``corrupt-write`` fault: a data plane that now and then writes the wrong bytes.

It wraps a real data plane and, for every ``every``-th transfer, reads the first entry from one
byte further on in P's memory (one byte earlier where that would leave the registered memory):
the bytes that land in D's block differ from the ones P computed (a misdirected or corrupted
write, the failure KV checksums exist for). The write itself succeeds: a shifted read past the
end of the registered memory made the data plane refuse the write at once, a failed write the
fault does not declare (``lw validate`` rejected a run for it; issue 20). Everything else is the
wrapped plane's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

Entry = tuple[int, int, int]


class CorruptingPlane:
    """A data plane whose every ``every``-th transfer lands shifted bytes (test fault only)."""

    def __init__(self, inner: Any, every: int = 7,
                 memory: tuple[int, int] | None = None,
                 spare: Callable[[str], bool] | None = None) -> None:
        """``memory``: (address, length) of the memory registered with ``inner``, which every
        shifted read stays inside (None: reads are shifted forward, unchecked). ``spare``: a
        request it must not corrupt (a retried claim epoch, for a fault of first attempts
        only); its transfers are not counted either."""
        if every < 1:
            raise ValueError("every must be >= 1")
        self._inner = inner
        self._every = every
        self._memory = memory
        self._spare = spare
        self._n = 0
        self.corrupted = 0

    def _shifted(self, src: int, n: int) -> int:
        if self._memory is None:
            return src + 1
        lo, length = self._memory
        return src + 1 if src + 1 + n <= lo + length else src - 1

    def submit(self, xfer_id: Hashable, session: str, entries: Sequence[Entry],
               within_s: float = math.inf) -> None:
        """Submit, shifting the source of the first entry of every ``every``-th transfer."""
        spare = self._spare
        if spare is not None and isinstance(xfer_id, tuple) and any(
                spare(rid) for rid, _seq in xfer_id):
            self._inner.submit(xfer_id, session, entries, within_s)
            return
        self._n += 1
        if self._n % self._every == 0 and entries:
            src, dst, n = entries[0]
            entries = [(self._shifted(src, n), dst, n), *entries[1:]]
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

