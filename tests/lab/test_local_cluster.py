"""LocalCluster mounts lw's admission guard on lw's engines only: on an engine of vLLM's own
connector (the serving benchmark's peer) it refused every request as "contract version None"."""

from __future__ import annotations

from pathlib import Path

from lw.lab.local_cluster import (
    ADMISSION,
    LocalCluster,
    in_multi_connector,
    is_lw_connector,
    kv_transfer_config,
)

MOONCAKE = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer", "engine_id": "p",
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}


def test_the_guard_is_mounted_on_lw_engines_only(tmp_path: Path) -> None:
    lw = kv_transfer_config("kv_producer", 5600, "prefill")
    cluster = LocalCluster(model=tmp_path, workdir=tmp_path)
    for kv, guarded in ((lw, True), (in_multi_connector(lw), True), (MOONCAKE, False),
                        (in_multi_connector(MOONCAKE), False), (None, False)):
        assert is_lw_connector(kv) is guarded, kv
        argv = cluster._engine("prefill", 0, kv).argv
        assert (ADMISSION in argv) is guarded, argv
        assert ("--kv-transfer-config" in argv) is (kv is not None)
