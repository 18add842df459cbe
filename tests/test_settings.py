"""One builder of the core's configurations (lw.fsm.settings): the vLLM connector, the synthetic
cluster and the checker each hand the core every setting they name by the core's name."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from lw.fsm import DecodeConfig, PrefillConfig
from lw.fsm.settings import core_config
from lw.lab.synthetic.config import ClusterConfig
from lw.sim.config import WorldConfig
from lw.vllm_adapter.config import PRODUCER, LwConfig


def test_named_settings_reach_the_core_and_the_rest_keep_its_defaults() -> None:
    got = core_config(PrefillConfig, {"request_timeout_s": 7.0, "kv_checksum": True, "host": ""})
    assert got == PrefillConfig(request_timeout_s=7.0, kv_checksum=True)


def test_computed_values_add_or_replace_and_an_unknown_name_is_an_error() -> None:
    got = core_config(DecodeConfig, {"lease_s": 90.0}, lease_s=120.0, timeline_entries=0)
    assert got == DecodeConfig(lease_s=120.0, timeline_entries=0)
    with pytest.raises(TypeError, match="DecodeConfig has no setting meta_attempts"):
        core_config(DecodeConfig, {}, meta_attempts=3)


@pytest.mark.parametrize("settings", [
    LwConfig(PRODUCER, "P", 14579, 1, 1, 0, "fail", request_timeout_s=7.0, meta_attempts=3,
             prefill_timeout_s=9.0, lease_s=99.0, timeline_entries=5, stuck_fraction=0.25,
             kv_checksum=True),
    ClusterConfig(request_timeout_s=3.0, ack_attempts=4, prefill_timeout_s=5.0,
                  kv_checksum=True, retry_prefill=2, retry_prefill_avoid="none"),
    WorldConfig(request_timeout_s=11.0, ack_retry_s=2.0, lease_s=95.0, kv_checksum=True,
                retry_prefill=1),
], ids=["vllm", "synthetic", "checker"])
def test_every_setting_a_driver_names_as_the_core_does_reaches_the_core(settings: Any) -> None:
    for built in (settings.prefill_config(), settings.decode_config()):
        named = [f.name for f in dataclasses.fields(built) if hasattr(settings, f.name)]
        assert "kv_checksum" in named
        assert {n: getattr(built, n) for n in named} == {n: getattr(settings, n) for n in named}
