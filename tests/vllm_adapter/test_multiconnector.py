"""lw behind vLLM's MultiConnector: its stats survive the trip to vLLM's logger process, where
MultiConnector rebuilds every wrapped connector's stats by the connector's registered name."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (  # noqa: E402
    MultiConnector,
    MultiKVConnectorStats,
)

from lw.vllm_adapter.connector import LwConnector, register_with_vllm  # noqa: E402
from lw.vllm_adapter.metrics import LwKVConnectorStats  # noqa: E402


def test_lw_is_registered_with_vllms_connector_factory() -> None:
    register_with_vllm()  # idempotent
    assert KVConnectorFactory.get_connector_class_by_name("LwConnector") is LwConnector


def test_multiconnector_rebuilds_lws_stats_from_their_serialized_form() -> None:
    mine = LwKVConnectorStats()
    mine.data.update(transfers=3, transfer_bytes=3 << 20, live_requests=2)
    mine.data["layer_write_seconds"] = [0.01, 0.02]
    multi = MultiConnector.build_kv_connector_stats(data={"LwConnector": dict(mine.data)})
    assert isinstance(multi, MultiKVConnectorStats)
    rebuilt = multi["LwConnector"]
    assert isinstance(rebuilt, LwKVConnectorStats)
    assert rebuilt.data["transfers"] == 3 and rebuilt.data["layer_write_seconds"] == [0.01, 0.02]
    again = MultiKVConnectorStats(data={"LwConnector": LwKVConnectorStats(data=dict(mine.data))})
    total = multi.aggregate(again)["LwConnector"]
    assert total.data["transfers"] == 6 and total.data["live_requests"] == 2
    assert total.reduce()
