"""What a synthetic-cluster run returns: every request's outcome, the blocks held at the end,
the fault's detection time, the bytes moved and the summary line ``lw demo`` ends with."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from lw.lab.synthetic.config import FAILURES_EXPECTED, ClusterConfig

__all__ = ["ClusterResult", "short_reason"]

_NUMBERS = re.compile(r"\d[\w.:/-]*")


def short_reason(reason: str) -> str:
    """A failure reason without numbers and addresses, for grouping in ``reasons``."""
    return _NUMBERS.sub("#", reason)[:72]

# Worker counters worth a line in the report (summed per role, "p." or "d." before each).
_INTERESTING = ("side.unauthenticated", "side.forged", "side.wire_errors", "side.replayed",
                "side.injected_drops", "side.injected_duplicates", "side.injected_garbage",
                "loop.protocol_errors", "loop.core_errors", "loop.effect_errors",
                "core.stale_messages", "core.deadlines", "core.leases_expired",
                "loop.transfers_failed", "side.send_dropped", "core.peer_restarts",
                "side.replies_matched", "core.fresh_blocks", "core.ghosts_released",
                "core.fences", "core.fence_failures")


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
    # what the first corrupt requests' wrong blocks held (synthetic D's report), at most a few
    corrupt_details: list[str] = field(default_factory=list)
    counters: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    double_reports: int = 0
    decoder_generations: int = 1
    dead_ranks: list[int] = field(default_factory=list)
    detect_s: float = 0.0  # injected fault (kill, freeze) -> first request failed because of it
    aborts: int = 0  # client aborts sent to the decoder
    client_gone: int = 0  # failed requests whose client had sent an abort
    # several decoders: requests of a dead decoder that had streamed a token (failed: the
    # client saw part of an answer), and attempts moved to another decoder before their first
    failed_after_first_token: int = 0
    failovers: int = 0
    reprefills: int = 0  # prefills D asked for again on another P rank (prefill failover)
    reprefills_fenced: int = 0  # of them, after waiting out the old epoch (it had written)
    # the slowest of those requests, from the fault to its outcome: not fenced, and fenced
    failover_s: float = 0.0
    failover_fenced_s: float = 0.0
    tokens: int = 0  # tokens the client received
    # worker -> RSS (KiB) at start, once 10 % of the requests ended (warm), and at the end
    rss_kib: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    log_dir: str = ""

    def add_p_stats(self, s: dict[str, Any]) -> None:
        """Add a live P rank's final stats: blocks it still holds, bytes, step and hook times."""
        self.leaked_p += s["held_blocks"]
        self.bytes_moved += int(s.get("dp.bytes", 0))
        self.tails_s.extend(s.get("tails", []))
        self.max_step_s = max(self.max_step_s, s["max_step_s"])
        self.max_busy_step_s = max(self.max_busy_step_s, s["max_busy_step_s"])
        self.busy_steps_s.extend(s.get("busy_step_s", []))
        self.max_hook_s = max(self.max_hook_s, s.get("max_hook_s", 0.0))
        self.hooks_s.extend(s.get("hook_s", []))
        self.steps = max(self.steps, s["steps"])
        self._add_counters(s, "p")

    def add_d_stats(self, s: dict[str, Any]) -> None:
        """Add a live decoder's final stats: the blocks it still holds, its counters."""
        self.leaked_d += s["held_blocks"]
        self._add_counters(s, "d")

    def _add_counters(self, stats: dict[str, Any], role: str) -> None:
        for k in _INTERESTING:
            v = stats.get(k)
            if v:
                self.counters[f"{role}.{k}"] += int(v)

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
            # with a live decoder to move to, only a request that had streamed a token (or
            # whose client went away) may fail when a decoder dies
            and not (cfg.fault == "kill-decoder" and cfg.decoders > 1
                     and self.failed != self.failed_after_first_token + self.client_gone)
            # with a live P rank to prefill on again, a dead rank's requests must not fail
            and not (cfg.fault == "kill-prefill-rank" and cfg.retry_prefill
                     and self.failed != self.client_gone)
        )

    @property
    def gbps(self) -> float:
        """Bytes moved per second of the run, in GB/s (10^9)."""
        return self.bytes_moved / self.elapsed_s / 1e9 if self.elapsed_s > 0 else 0.0

    def summary_line(self) -> str:
        """The machine-readable last line of ``lw demo`` (``failed_after_first_token`` only
        where D streams tokens: with one decoder and none, the line is as it always was)."""
        line = (f"summary done={self.done} failed={self.failed} "
                f"leaked_blocks={self.leaked} corrupt={self.corrupt}")
        if self.config.decode_tokens:
            line += f" failed_after_first_token={self.failed_after_first_token}"
        return line
