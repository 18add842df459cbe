"""One builder of declared configurations (lw.fsm.settings): the vLLM connector, the synthetic
cluster and the checker each hand the core (and the worker loop) every setting they name by the
declaration's name, and the declaration checks it, once, when the driver's config is built."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from lw.fsm import DecodeConfig, PrefillConfig
from lw.fsm.settings import core_config
from lw.lab.synthetic.config import ClusterConfig
from lw.sim.config import WorldConfig
from lw.transport.loopconfig import LoopConfig
from lw.vllm_adapter.config import CONSUMER, PRODUCER, LwConfig


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


def test_loop_settings_reach_the_loop_by_its_names() -> None:
    named = dict(heartbeat_s=0.2, heartbeat_misses=5, layer_batch_ms=10.0)
    p = LwConfig(PRODUCER, "P", 14579, 1, 1, 0, "fail", **named).loop_config("lw-p0")
    assert p == LoopConfig(name="lw-p0", heartbeat_s=0.2, heartbeat_misses=5, layer_batch_s=0.01)
    d = LwConfig(CONSUMER, "D", 14579, 1, 1, 0, "fail", **named).loop_config("lw-d0")
    assert d.layer_batch_s == 0.0  # only P's computed layers start writes
    synthetic = ClusterConfig(heartbeat_s=0.3, heartbeat_misses=4).loop_config("lw-loop-d0")
    assert synthetic == LoopConfig(name="lw-loop-d0", heartbeat_s=0.3, heartbeat_misses=4)


@pytest.mark.parametrize(("bad", "needle"), [
    ({"heartbeat_misses": 0}, "LoopConfig.heartbeat_misses must be >= 1"),
    ({"heartbeat_s": -0.5}, "LoopConfig.heartbeat_s must be >= 0"),
    ({"meta_attempts": 0}, "PrefillConfig.meta_attempts must be >= 1"),
])
def test_the_synthetic_cluster_refuses_a_bad_setting_at_start(bad: dict, needle: str) -> None:
    """Not in a spawned worker: the declaration's check runs when the cluster config is made."""
    with pytest.raises(ValueError, match=None) as exc:
        ClusterConfig(**bad)
    assert needle in str(exc.value)
