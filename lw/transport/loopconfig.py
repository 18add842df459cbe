"""The settings of one worker's event loop (:class:`~lw.transport.runtime.WorkerLoop`).

Each is declared and range-checked here, once: a driver names the ones it sets as this does
(``heartbeat_s``, ``heartbeat_misses``, ...), builds a :class:`LoopConfig` at start so that a bad
value fails there, and the loop trusts what it is given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lw.transport.liveness import Liveness

__all__ = ["LoopConfig"]


@dataclass(frozen=True)
class LoopConfig:
    """Timing, bounds and thread name of one worker's loop; every value checked on creation."""

    name: str = "lw-loop"  # the loop thread's name, in logs and stack dumps
    # A layer event wakes the loop only if the last one to wake it is this old (or it is the
    # forward's last layer): the layers between go out with it as one transfer. 0 = every layer.
    layer_batch_s: float = 0.0
    # While layer events come faster than 2 * hot_poll_s, the loop polls every hot_poll_s for
    # hot_window_s after each, and hooks skip their wake-up write. 0 = never poll.
    hot_poll_s: float = 0.001
    hot_window_s: float = 0.05
    # Liveness probes to the peers live requests need. A needed peer silent past its budget is
    # lost: heartbeat_misses intervals, raised to heartbeat_factor times the longest silence it
    # lately came back from, never above heartbeat_cap_s (lw.transport.liveness). 0 = off.
    heartbeat_s: float = 0.5
    heartbeat_misses: int = 3
    heartbeat_cap_s: float = 30.0
    heartbeat_factor: float = 3.0
    stuck_check_s: float = 1.0  # how often requests are checked for being stuck; 0 = never
    max_inbox: int = 1_000_000  # engine events queued for a loop that no longer runs are dropped
    tail_samples: int = 65536  # last-layer tails and round trips kept for stats()
    # D (fence_data): the longest a data-plane fence waits for the transport to close what it
    # cut; past it the fence has not held, and the core asks again later
    fence_timeout_s: float = 5.0
    # lw status answers may take this share of the loop thread's time on average and
    # status_burst_s of it at once (a full timeline costs tens of ms); a query over that budget
    # gets a short refusal. 0 burst: every query refused.
    status_share: float = 0.05
    status_burst_s: float = 0.25
    # answers (or refusals) one connection gets; its further queries are dropped, so an asker
    # that never reads holds at most this many replies (1 MiB each) in the send queue. lw
    # status asks once per connection.
    status_per_route: int = 4
    # at most two warnings per this and kind of what the core refused, the second with the count
    warn_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"LoopConfig.name must be a non-empty string, got {self.name!r}")
        for key, note in (("layer_batch_s", " (0: every layer)"), ("hot_poll_s", " (0: off)"),
                          ("hot_window_s", ""), ("heartbeat_s", " (0: off)"),
                          ("heartbeat_cap_s", ""), ("heartbeat_factor", ""),
                          ("stuck_check_s", " (0: off)"), ("fence_timeout_s", ""),
                          ("status_share", ""), ("status_burst_s", " (0: status off)"),
                          ("warn_interval_s", "")):
            value = getattr(self, key)
            # NaN and infinity compare in surprising ways with the loop's deadlines
            if (not isinstance(value, (int, float)) or isinstance(value, bool)
                    or not math.isfinite(value) or value < 0):
                raise ValueError(f"LoopConfig.{key} must be >= 0 and finite{note}, "
                                 f"got {value!r}")
        if self.status_share > 1:
            raise ValueError(f"LoopConfig.status_share must be at most 1 (a share of the loop's "
                             f"time), got {self.status_share!r}")
        for key in ("heartbeat_misses", "max_inbox", "tail_samples", "status_per_route"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LoopConfig.{key} must be >= 1 (an integer), got {value!r}")
        self.liveness()  # the heartbeat budget's own checks (cap over floor, factor >= 1)

    def liveness(self) -> Liveness:
        """A fresh clock of the peers' liveness under these settings."""
        return Liveness(self.heartbeat_s, self.heartbeat_misses, cap_s=self.heartbeat_cap_s,
                        factor=self.heartbeat_factor)
