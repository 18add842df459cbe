"""Rate-limited warnings: refused input (a flood of forged calls or malformed params) is logged
at most once per kind and period, with a count of what was left out."""

from __future__ import annotations

import logging
import time

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """Warnings for refused input, at most one per ``every_s`` per kind, with the count of
    those left out: a flood of refused calls must not flood the log."""

    def __init__(self, log: logging.Logger, every_s: float = 5.0) -> None:
        self._log = log
        self._every = every_s
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def warning(self, kind: str, msg: str, *args: object) -> None:
        """Log ``msg`` now, or count it for the next line of this ``kind``."""
        now = time.monotonic()
        if now - self._last.get(kind, -1e18) < self._every:
            self._quiet[kind] = self._quiet.get(kind, 0) + 1
            return
        self._last[kind] = now
        quiet = self._quiet.pop(kind, 0)
        suffix = f" ({quiet} more like it not logged)" if quiet else ""
        self._log.warning(msg + suffix, *args)
