"""What a synthetic-cluster run returns: every request's outcome, the blocks held at the end,
the fault's detection time, the bytes moved and the summary line ``lw demo`` ends with."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from lw.synthetic.config import FAILURES_EXPECTED, ClusterConfig

__all__ = ["ClusterResult"]


@dataclass
class ClusterResult:
    """What a run did: outcomes, bytes, latencies, step times, leaks and counters."""

    config: ClusterConfig
    done: int = 0
    failed: int = 0
    corrupt: int = 0
    bytes_moved: int = 0
    elapsed_s: float = 0.0  # first request to last outcome
    latencies_s: list[float] = field(default_factory=list)  # D: allocation -> verified
    max_outcome_s: float = 0.0  # D: allocation -> final report, over done and failed requests
    tails_s: list[float] = field(default_factory=list)  # P: last layer hook -> last write done
    max_step_s: float = 0.0
    max_busy_step_s: float = 0.0
    busy_steps_s: list[float] = field(default_factory=list)  # every step that had requests
    max_hook_s: float = 0.0  # longest forward-hook call (WorkerLoop.layer_computed)
    hooks_s: list[float] = field(default_factory=list)  # every forward-hook call
    steps: int = 0
    leaked_p: int = 0
    leaked_d: int = 0
    p_unreported: int = 0  # requests a live P rank never released (SendFinished)
    reasons: Counter = field(default_factory=Counter)
    counters: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    double_reports: int = 0
    decoder_generations: int = 1
    dead_ranks: list[int] = field(default_factory=list)
    detect_s: float = 0.0  # injected fault (kill, freeze) -> first request failed because of it
    aborts: int = 0  # client aborts sent to the decoder
    # worker -> RSS (KiB) at start, once 10 % of the requests ended (warm), and at the end
    rss_kib: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    log_dir: str = ""

    @property
    def accounted(self) -> int:
        """Requests with a final outcome."""
        return self.done + self.failed + self.corrupt

    @property
    def leaked(self) -> int:
        """Blocks still held at the end on P (live ranks) and D (live decoder)."""
        return self.leaked_p + self.leaked_d

    @property
    def ok(self) -> bool:
        """Every request accounted for, nothing leaked or corrupt, no worker error, and no
        failure unless the fault makes failures expected."""
        cfg = self.config
        return (
            self.accounted == cfg.requests
            and self.leaked == 0
            and self.corrupt == 0
            and self.double_reports == 0
            and not self.errors
            and (self.failed == 0 or cfg.fault in FAILURES_EXPECTED)
        )

    @property
    def gbps(self) -> float:
        """Bytes moved per second of the run, in GB/s (10^9)."""
        return self.bytes_moved / self.elapsed_s / 1e9 if self.elapsed_s > 0 else 0.0

    def summary_line(self) -> str:
        """The machine-readable last line of ``lw demo``."""
        return (f"summary done={self.done} failed={self.failed} "
                f"leaked_blocks={self.leaked} corrupt={self.corrupt}")
