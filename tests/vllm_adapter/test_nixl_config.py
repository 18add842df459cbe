"""`data_plane: nixl` in the connector config: accepted where NIXL imports, refused at start
naming the key where it does not, and lease-only on D (no fence)."""

from __future__ import annotations

from typing import Any

import pytest

from lw.transport.dataplane import nixl
from lw.vllm_adapter.config import ConfigError, LwConfig


def _build(**extra: Any) -> LwConfig:
    return LwConfig.build(role="kv_consumer", engine_id="e", kv_port=14579, tp_size=1,
                          pp_size=1, dp_size=1, dp_rank=0, load_failure_policy="fail",
                          extra={"host": "127.0.0.1", **extra})


def test_nixl_is_a_data_plane_and_is_lease_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nixl, "nixl_missing", lambda: "")  # whether installed or not
    cfg = _build(data_plane="nixl")
    assert cfg.data_plane == "nixl"
    assert cfg.decode_config().fence_data is False  # even with mooncake_protocol tcp


def test_nixl_not_installed_is_refused_at_start_naming_the_key(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nixl, "_MODULES", ("lw_no_such_nixl_module",))
    with pytest.raises(ConfigError, match=r"data_plane='nixl': NIXL is not installed"):
        _build(data_plane="nixl")


def test_an_unknown_data_plane_lists_nixl() -> None:
    with pytest.raises(ConfigError, match="expected 'mooncake', 'nixl' or 'inprocess'"):
        _build(data_plane="ucx")
