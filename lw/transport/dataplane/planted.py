"""A test fault for real engines: a data plane that writes short while a flag file exists.

e2e tests plant wrong KV with it, for the output oracle to catch (issue 20): a vLLM worker wraps
its data plane in :class:`TruncatingPlane` only when ``LW_TEST_TRUNCATE_WRITES_FILE`` names a
flag file. Here, not in lw.synthetic, so that a worker need not import the synthetic cluster.
"""

from __future__ import annotations

import math
import os
from collections.abc import Hashable, Sequence
from typing import Any

Entry = tuple[int, int, int]

TRUNCATE_ENV = "LW_TEST_TRUNCATE_WRITES_FILE"


def planted_from_env(plane: Any) -> Any:
    """``plane``, wrapped in a :class:`TruncatingPlane` when the environment names a flag file
    in ``LW_TEST_TRUNCATE_WRITES_FILE`` (e2e tests plant wrong KV so), else itself."""
    flag = os.environ.get(TRUNCATE_ENV)
    return TruncatingPlane(plane, flag) if flag else plane


class TruncatingPlane:
    """A data plane that, while the file ``flag`` exists, writes only the first N bytes of
    each entry (N: the file's content): the planted wrong KV that the e2e output oracle must
    catch (issue 20). Test fault only; a vLLM worker wraps its plane in one when the
    environment names the file in ``LW_TEST_TRUNCATE_WRITES_FILE``."""

    def __init__(self, inner: Any, flag: str) -> None:
        self._inner = inner
        self._flag = flag
        self.truncated = 0

    def _limit(self) -> int | None:
        try:
            with open(self._flag) as f:
                return max(1, int(f.read().strip() or "64"))
        except (OSError, ValueError):
            return None

    def submit(self, xfer_id: Hashable, session: str, entries: Sequence[Entry],
               within_s: float = math.inf) -> None:
        """Submit, each entry cut to the flag file's byte count while the file exists."""
        n_max = self._limit()
        if n_max is not None:
            entries = [(s, d, min(n, n_max)) for s, d, n in entries]
            self.truncated += 1
        self._inner.submit(xfer_id, session, entries, within_s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
