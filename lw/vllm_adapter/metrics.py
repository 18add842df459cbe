"""lw's transfer statistics for vLLM: a ``KVConnectorStats`` and Prometheus metrics.

Workers report *deltas* of counters since their previous report plus current gauges. vLLM
combines reports with :meth:`LwKVConnectorStats.aggregate` both across the workers of a step and
across the steps of a logging interval, so counters are summed and gauges take the maximum (the
busiest worker; over an interval, the peak). :meth:`LwKVConnectorStats.reduce` makes vLLM's
periodic log line; :class:`LwPromMetrics` feeds the ``lw_*`` series on ``/metrics``.
D's failed requests are also counted by reason (``failed_by_reason``: the kinds D's core gives
its failures, lw.fsm.failures.FailureKind, a bounded label set), as
``lw_requests_failed_by_reason_total{reason=...}``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from lw.fsm.failures import FAILURE_KINDS, FailureKind
from lw.vllm_adapter.first_token import FALLBACK_REASONS

__all__ = ["BY_REASON", "COUNTERS", "FALLBACKS", "GAUGES", "HISTOGRAMS", "LwKVConnectorStats",
           "LwPromMetrics"]

COUNTERS: dict[str, str] = {
    "transfers": "Layer writes completed (one per request, plane and P worker)",
    "transfer_failures": "Layer writes that failed",
    "transfer_bytes": "Bytes written by completed layer writes",
    "transfer_seconds": "Seconds from a request's first layer write to its last completion",
    "requests_done": "Requests whose transfer completed (P: acknowledged; D: all layers in)",
    "requests_failed": "Requests whose transfer failed or was aborted",
    "deadlines_fired": "Deadlines that fired (P meta/ack/request; D prefill)",
    "leases_expired": "D quarantines ended by their lease rather than by P's confirmation",
    "quarantines": "D requests whose blocks were quarantined after a failure",
    "metaserver_failures": "D requests whose prefill could not be requested from the proxy",
    "prefix_hit_blocks": "D: prompt blocks D already held in its prefix cache (not sent by P)",
    "local_tails": "D: requests whose uncached tail D computed itself (no prefill requested)",
    "early_chunk_blocks": "P: blocks pushed with a chunk before the prompt's last chunk "
                          "(progressive push)",
    "preempted_pushes": "P: pushes failed because vLLM preempted their request between chunks "
                        "(its blocks are freed without the connector)",
    "prefill_retries": "D: new prefills asked of the proxy after a request's P was lost "
                       "(retry_prefill; each under a new claim epoch)",
    "refused_params": "Requests whose kv_transfer_params were refused (malformed, of another "
                      "contract version, or not signed by the cluster's proxy): served as plain "
                      "requests, nothing of the params acted on",
    "ahead_admitted": "P: requests the proxy sent ahead of D's params (admit-ahead), held "
                      "unscheduled until they came",
    "ahead_computed": "P: requests computed ahead of D's params (compute-ahead)",
    "ahead_bound": "P: requests computed ahead that D's params bound",
    "ahead_bound_early": "P: of those, bound by the worker as its fetch brought the params "
                         "(mid-step), not with the scheduler's next metadata",
    "ahead_fallbacks": "P: requests sent ahead whose params did not come or did not fit (the "
                       "proxy starts them D first; one computed ahead drops its KV)",
    "protocol_errors": "Messages or events the core refused (counted and dropped, never raised)",
    "checksum_mismatches": "D: requests failed because a sender's KV checksums did not match "
                           "the bytes in our blocks (kv_checksum)",
    "stuck_requests": "Requests that stayed in one state longer than stuck_fraction of their "
                      "deadline (each logged once, as lw status prints it)",
    "first_token_from_p": "D: requests whose first output token was the one P sampled "
                          "(streamed before their KV landed; D computed no prompt token)",
    "last_token_recomputed": "D: remote-prefill requests whose last prompt token D computed "
                             "itself to sample token 1 (vLLM's own path)",
    "ended_at_first_token": "D: requests that ended at P's token (max_tokens 1, EOS, a stop id) "
                            "while their KV was still arriving (the transfer is stopped)",
    "first_token_discarded": "D: P's tokens not used because the request already held one (a "
                             "re-prefill's) or had computed its own",
    "first_token_waits_expired": "D: requests whose KV landed and whose P token did not come "
                                 "within the wait (then D computed token 1: does P run lw's "
                                 "scheduler class with first_token_from_p?)",
}
GAUGES: dict[str, str] = {
    "live_requests": "Requests lw holds blocks for (P: sending; D: receiving or quarantined), "
                     "busiest worker",
    "held_blocks": "Blocks lw keeps from the scheduler (same requests), busiest worker",
}


# Sample lists (seconds): summed over workers and steps by concatenation, observed one by one.
# time_in_state samples are [state class, seconds] pairs.
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "time_in_state": ("Seconds a request spent in a lifecycle state before leaving it",
                      (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0)),
    "layer_write_seconds": ("Seconds from submitting a layer write to its completion",
                            (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)),
}
MAX_SAMPLES = 8192  # per histogram and report: the oldest samples beyond it are dropped

BY_REASON = "failed_by_reason"
"""Stats key of D's failed requests per failure kind ({kind: count}, deltas, summed); a kind
outside lw.fsm.failures.FailureKind counts as "other" (the label set stays bounded)."""


FALLBACKS = "first_token_fallbacks"
"""Stats key of D's requests that took vLLM's path instead of P's token, per reason ({reason:
count}, deltas, summed; lw.vllm_adapter.first_token.FALLBACK_REASONS)."""


_LABELS = frozenset(k.value for k in FailureKind)


def _label(kind: object) -> str:
    """A failure kind's metric label: its value, or "other" for one lw does not declare."""
    return str(kind) if kind in _LABELS else FailureKind.OTHER.value


class LwKVConnectorStats(KVConnectorStats):
    """Counters (deltas, summed) and gauges (maximum over workers and steps)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        """Zero counters and gauges."""
        self.data = dict.fromkeys((*COUNTERS, *GAUGES), 0)
        for key in HISTOGRAMS:
            self.data[key] = []
        self.data[BY_REASON] = {}
        self.data[FALLBACKS] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add another worker's (or interval's) figures to ours."""
        for key, value in (other.data or {}).items():
            if key in COUNTERS:
                self.data[key] = self.data.get(key, 0) + value
            elif key in GAUGES:
                self.data[key] = max(self.data.get(key, 0), value)
            elif key in HISTOGRAMS:
                self.data[key] = (list(self.data.get(key) or []) + list(value))[-MAX_SAMPLES:]
            elif key == BY_REASON and isinstance(value, dict):
                mine = dict(self.data.get(key) or {})
                for kind, n in value.items():
                    kind = _label(kind)
                    mine[kind] = mine.get(kind, 0) + n
                self.data[key] = mine
            elif key == FALLBACKS and isinstance(value, dict):
                mine = dict(self.data.get(key) or {})
                for reason, n in value.items():
                    mine[reason] = mine.get(reason, 0) + n
                self.data[key] = mine
        return self

    def reduce(self) -> dict[str, int | float]:
        """Figures for vLLM's periodic log line."""
        d = self.data
        n = d.get("transfers", 0)
        secs = d.get("transfer_seconds", 0.0)
        mb = d.get("transfer_bytes", 0) / 2**20
        return {
            "transfers": n,
            "MiB": round(mb, 3),
            "MB/s": round(mb / secs, 1) if secs > 0 else 0,
            "failures": d.get("transfer_failures", 0),
            "done": d.get("requests_done", 0),
            "failed": d.get("requests_failed", 0),
            "deadlines": d.get("deadlines_fired", 0),
            "live": d.get("live_requests", 0),
            "held_blocks": d.get("held_blocks", 0),
            "prefix_hit_blocks": d.get("prefix_hit_blocks", 0),
            "local_tails": d.get("local_tails", 0),
            "stuck": d.get("stuck_requests", 0),
        }

    def is_empty(self) -> bool:
        """True when nothing happened and nothing is held."""
        return not any(self.data.get(k)
                       for k in (*COUNTERS, *GAUGES, *HISTOGRAMS, BY_REASON, FALLBACKS))


class LwPromMetrics(KVConnectorPromMetrics):
    """``lw_<counter>_total`` counters and ``lw_<gauge>`` gauges per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        self._gauges: dict[str, dict[int, Any]] = {}
        self._hists: dict[str, Any] = {}
        for key, doc in COUNTERS.items():
            metric = self._counter_cls(name=f"lw_{key}", documentation=doc,
                                       labelnames=labelnames)
            self._counters[key] = self._per_engine(metric)
        for key, doc in GAUGES.items():
            metric = self._gauge_cls(name=f"lw_{key}", documentation=doc,
                                     labelnames=labelnames, multiprocess_mode="mostrecent")
            self._gauges[key] = self._per_engine(metric)

        by_reason = self._counter_cls(
            name="lw_requests_failed_by_reason", labelnames=[*labelnames, "reason"],
            documentation="D: requests whose transfer failed, by reason (" + "; ".join(
                f"{k}: {v}" for k, v in FAILURE_KINDS.items()) + ")")
        self._by_reason = {(idx, kind.value): by_reason.labels(*values, kind.value)
                           for idx, values in self.per_engine_labelvalues.items()
                           for kind in FAILURE_KINDS}
        fallbacks = self._counter_cls(
            name="lw_first_token_fallbacks", labelnames=[*labelnames, "reason"],
            documentation="D: remote-prefill requests that did not take P's first token, by "
                          "reason (" + ", ".join(FALLBACK_REASONS) + ")")
        self._fallbacks = {(idx, r): fallbacks.labels(*values, r)
                           for idx, values in self.per_engine_labelvalues.items()
                           for r in FALLBACK_REASONS}
        for key, (doc, buckets) in HISTOGRAMS.items():
            extra = ["state"] if key == "time_in_state" else []
            name = "lw_time_in_state_seconds" if key == "time_in_state" else f"lw_{key}"
            self._hists[key] = self._histogram_cls(name=name, documentation=doc,
                                                   labelnames=[*labelnames, *extra],
                                                   buckets=list(buckets))

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one interval's aggregated figures."""
        for key, per_engine in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value > 0 and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
        for key, per_engine in self._gauges.items():
            if key in transfer_stats_data and engine_idx in per_engine:
                per_engine[engine_idx].set(transfer_stats_data[key])
        for kind, n in (transfer_stats_data.get(BY_REASON) or {}).items():
            counter = self._by_reason.get((engine_idx, _label(kind)))
            if counter is not None and n > 0:
                counter.inc(n)
        for reason, n in (transfer_stats_data.get(FALLBACKS) or {}).items():
            counter = self._fallbacks.get((engine_idx, reason))
            if counter is not None and n > 0:
                counter.inc(n)
        values = self.per_engine_labelvalues.get(engine_idx)
        if values is None:
            return
        for sample in transfer_stats_data.get("time_in_state") or ():
            state, secs = sample
            self._hists["time_in_state"].labels(*values, str(state)).observe(float(secs))
        hist = self._hists["layer_write_seconds"].labels(*values)
        for secs in transfer_stats_data.get("layer_write_seconds") or ():
            hist.observe(float(secs))
