"""Test faults for real engines: data planes that write short, or hold writes, while a flag
file exists.

e2e tests plant wrong KV with :class:`TruncatingPlane`, for the output oracle to catch (issue 20),
and hold a prefill's writes with :class:`HoldingPlane`, so that a kill lands while the request is
certainly in flight whatever the machine's speed. A vLLM worker wraps its data plane only when
``LW_TEST_TRUNCATE_WRITES_FILE`` or ``LW_TEST_HOLD_WRITES_FILE`` names a flag file. Here, not in
lw.lab.synthetic, so that a worker need not import the synthetic cluster.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Hashable, Sequence
from typing import Any

Entry = tuple[int, int, int]

TRUNCATE_ENV = "LW_TEST_TRUNCATE_WRITES_FILE"
HOLD_ENV = "LW_TEST_HOLD_WRITES_FILE"
HELD_SUFFIX = ".held"
"""The marker a :class:`HoldingPlane` writes beside its flag file once it holds a write."""


def planted_from_env(plane: Any) -> Any:
    """``plane``, wrapped in a :class:`TruncatingPlane` when the environment names a flag file
    in ``LW_TEST_TRUNCATE_WRITES_FILE`` (e2e tests plant wrong KV so), in a
    :class:`HoldingPlane` when it names one in ``LW_TEST_HOLD_WRITES_FILE``, else itself."""
    flag = os.environ.get(TRUNCATE_ENV)
    if flag:
        plane = TruncatingPlane(plane, flag)
    hold = os.environ.get(HOLD_ENV)
    return HoldingPlane(plane, hold) if hold else plane


class HoldingPlane:
    """A data plane that, while the file ``flag`` exists, keeps every submitted write instead
    of sending it, and writes ``flag + ".held"`` once it holds one: a test can then kill a
    prefill server knowing its request is in flight (a 700-token prefill takes 150 ms on a fast
    machine and 10 s on a slow one; a kill after a guess lands before or after it). Writes held
    go out, in order, within ``_RELEASE_POLL_S`` of the file's removal (a thread of this plane
    watches it: the owner's loop polls the plane only when its pipe says so). Test fault only."""

    _RELEASE_POLL_S = 0.01

    def __init__(self, inner: Any, flag: str) -> None:
        self._inner = inner
        self._flag = flag
        self._held: list[tuple[Hashable, str, Sequence[Entry], float, float]] = []
        self._lock = threading.Lock()

    def submit(self, xfer_id: Hashable, session: str, entries: Sequence[Entry],
               within_s: float = math.inf) -> None:
        """Hold the write while the flag file exists (and mark it), else pass it on."""
        with self._lock:
            if self._held or os.path.exists(self._flag):
                if not self._held:
                    with open(self._flag + HELD_SUFFIX, "w") as f:
                        f.write(str(os.getpid()))
                    threading.Thread(target=self._watch, name="lw-test-hold",
                                     daemon=True).start()
                self._held.append((xfer_id, session, list(entries), within_s,
                                   time.monotonic()))
                return
        self._inner.submit(xfer_id, session, entries, within_s)

    def _watch(self) -> None:
        while os.path.exists(self._flag):
            time.sleep(self._RELEASE_POLL_S)
        self._release()

    def _release(self) -> None:
        """Send what was held, in order, once the file is gone."""
        with self._lock:
            if not self._held or os.path.exists(self._flag):
                return
            held, self._held = self._held, []
            now = time.monotonic()
            for xfer_id, session, entries, within_s, at in held:
                self._inner.submit(xfer_id, session, entries, within_s - (now - at))

    def poll(self) -> list[Any]:
        """The inner plane's completions (after sending what was held, if the file is gone)."""
        self._release()
        return self._inner.poll()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class TruncatingPlane:
    """A data plane that, while the file ``flag`` exists, writes only the first N bytes of
    each entry: the planted wrong KV that D's checksums and the e2e output oracle must catch
    (issues 20, 40). The file reads ``N`` (every transfer while it exists) or ``N K`` (the next
    K transfers after it was written, then none: a fault of a request's first attempt only).
    Test fault only; a vLLM worker wraps its plane in one when the environment names the file
    in ``LW_TEST_TRUNCATE_WRITES_FILE``."""

    def __init__(self, inner: Any, flag: str) -> None:
        self._inner = inner
        self._flag = flag
        self.truncated = 0
        self._spent: dict[tuple[int, str], int] = {}  # per plant (mtime, text): transfers cut

    def _limit(self) -> int | None:
        try:
            with open(self._flag) as f:
                text = f.read().strip()
            plant = (os.stat(self._flag).st_mtime_ns, text)
            n_max, _, count = (text or "64").partition(" ")
            if count and self._spent.get(plant, 0) >= int(count):
                return None
            self._spent[plant] = self._spent.get(plant, 0) + 1
            return max(1, int(n_max))
        except (OSError, ValueError):
            return None

    def submit(self, xfer_id: Hashable, session: str, entries: Sequence[Entry],
               within_s: float = math.inf) -> None:
        """Submit, each entry cut to the flag file's byte count while it plants a fault."""
        n_max = self._limit()
        if n_max is not None:
            entries = [(s, d, min(n, n_max)) for s, d, n in entries]
            self.truncated += 1
        self._inner.submit(xfer_id, session, entries, within_s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
