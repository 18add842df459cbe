"""D's failed requests counted by reason: the stats key ``failed_by_reason`` sums over workers
and intervals, and becomes ``lw_requests_failed_by_reason_total{reason}`` with every kind of
lw.fsm.failures.FailureKind declared (a kind outside them counts as "other")."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("prometheus_client")

from lw.fsm.failures import FAILURE_KINDS, FailureKind  # noqa: E402
from lw.vllm_adapter.metrics import BY_REASON, LwKVConnectorStats  # noqa: E402

from .prom import lw_prom  # noqa: E402


def test_reasons_sum_over_workers_and_unknown_ones_count_as_other() -> None:
    a = LwKVConnectorStats()
    a.reset()
    assert a.data[BY_REASON] == {} and a.is_empty()
    a.aggregate(LwKVConnectorStats(data={BY_REASON: {"checksum_mismatch": 2}}))
    a.aggregate(LwKVConnectorStats(data={BY_REASON: {"checksum_mismatch": 1,
                                                     "prefill_deadline": 1, "new": 4}}))
    assert a.data[BY_REASON] == {"checksum_mismatch": 3, "prefill_deadline": 1, "other": 4}
    assert not a.is_empty()


def test_prom_counter_per_reason_and_engine() -> None:
    prom, reg = lw_prom({0: ["0"], 1: ["1"]})
    for kind in FAILURE_KINDS:  # declared at 0: a dashboard sees every reason from the start
        assert reg.get_sample_value("lw_requests_failed_by_reason_total",
                                    {"engine": "0", "reason": kind.value}) == 0
    prom.observe({BY_REASON: {"checksum_mismatch": 3, "bogus": 1}}, 1)
    prom.observe({BY_REASON: {"checksum_mismatch": 1}}, 1)
    got = {k: reg.get_sample_value("lw_requests_failed_by_reason_total",
                                   {"engine": "1", "reason": k.value}) for k in FAILURE_KINDS}
    assert got == {**dict.fromkeys(FAILURE_KINDS, 0.0), "checksum_mismatch": 4.0, "other": 1.0}
    assert reg.get_sample_value("lw_requests_failed_by_reason_total",
                                {"engine": "0", "reason": "checksum_mismatch"}) == 0


def test_the_cores_kinds_are_the_labels() -> None:
    """A worker counts its RecvFailed by their ``kind`` (the enum itself, or its value once
    pickled across processes): the same labels either way."""
    a = LwKVConnectorStats()
    a.reset()
    a.aggregate(LwKVConnectorStats(data={BY_REASON: {FailureKind.METASERVER: 2}}))
    a.aggregate(LwKVConnectorStats(data={BY_REASON: {"metaserver": 1, FailureKind.OTHER: 1}}))
    assert a.data[BY_REASON] == {"metaserver": 3, "other": 1}
    assert all(type(k) is str for k in a.data[BY_REASON])
    prom, reg = lw_prom({0: ["0"]})
    prom.observe({BY_REASON: {FailureKind.PREFILL_LOST: 2}}, 0)
    prom.observe({BY_REASON: {"prefill_lost": 1}}, 0)
    assert reg.get_sample_value("lw_requests_failed_by_reason_total",
                                {"engine": "0", "reason": "prefill_lost"}) == 3
