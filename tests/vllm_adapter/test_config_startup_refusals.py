"""Connector settings refused at start, each error naming the key (or variable) and the value:
infinite numbers (top level and in ``experimental``), unknown Mooncake transports, hosts peers
cannot reach, LW_CPU_AFFINITY."""

from __future__ import annotations

import os
from typing import Any

import pytest

from lw.fsm import DecodeConfig, PrefillConfig
from lw.vllm_adapter import serve
from lw.vllm_adapter.config import ConfigError, LwConfig


def _build(role: str = "kv_consumer", **over: Any) -> LwConfig:
    extra = {"host": "127.0.0.1", **over.pop("extra", {})}
    args: dict[str, Any] = dict(role=role, engine_id="e", kv_port=14579, tp_size=1, pp_size=1,
                                dp_size=1, dp_rank=0, load_failure_policy="fail", extra=extra)
    args.update(over)
    return LwConfig.build(**args)


@pytest.mark.parametrize("key", ["request_timeout_s", "prefill_timeout_s", "heartbeat_s",
                                 "experimental.metaserver_timeout_s", "experimental.ahead_wait_s"])
@pytest.mark.parametrize("value", ["inf", "1e400", float("inf"), "nan"])
def test_a_non_finite_number_is_refused_naming_its_key(key: str, value: Any) -> None:
    outer, _, inner = key.rpartition(".")
    extra = {outer: {inner: value}} if outer else {key: value}
    with pytest.raises(ConfigError, match=f"kv_connector_extra_config.{key} must be a finite"):
        _build(extra=extra)


@pytest.mark.parametrize("cls", [PrefillConfig, DecodeConfig])
def test_the_cores_configs_refuse_infinite_deadlines(cls: type) -> None:
    name = "request_timeout_s" if cls is PrefillConfig else "lease_s"
    with pytest.raises(ValueError, match=f"{name} must be > 0 and finite"):
        cls(**{name: float("inf")})


def test_the_last_side_channel_port_may_be_65535() -> None:
    assert _build(kv_port=65535).port(0) == 65535
    with pytest.raises(ConfigError, match="kv_port=65535"):
        _build(kv_port=65535, tp_size=2, extra={"peer_tp_size": 1})


@pytest.mark.parametrize(("given", "fence"), [("TCP", True), (" tcp ", True), ("RDMA", False),
                                              ("ascend", False)])
def test_mooncake_protocol_is_normalised_and_the_fence_keys_on_it(given: str,
                                                                   fence: bool) -> None:
    cfg = _build(extra={"mooncake_protocol": given})
    assert cfg.mooncake_protocol == given.strip().lower()
    assert cfg.decode_config().fence_data is fence


@pytest.mark.parametrize("given", ["tpc", "bogus", ""])
def test_an_unknown_mooncake_protocol_is_refused_listing_the_known_ones(given: str) -> None:
    with pytest.raises(ConfigError, match=r"mooncake_protocol=.*expected one of .*tcp, rdma"):
        _build(extra={"mooncake_protocol": given})


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "*"])
def test_a_wildcard_host_is_refused_pointing_at_bind_host(host: str) -> None:
    with pytest.raises(ConfigError, match=r"host='.*' is a wildcard.*bind_host"):
        _build(extra={"host": host})
    assert _build(extra={"bind_host": "0.0.0.0"}).bind_host == "0.0.0.0"  # what to do instead


@pytest.mark.parametrize(("key", "host"), [("host", "not a host!!"), ("host", " "),
                                           ("host", "999.1.1.1"), ("host", "::1"),
                                           ("bind_host", "999.1.1.1"), ("bind_host", "a b")])
def test_an_unusable_host_is_refused_naming_its_key(key: str, host: str) -> None:
    with pytest.raises(ConfigError, match=f"kv_connector_extra_config.{key}="):
        _build(extra={key: host})


@pytest.mark.parametrize("host", ["10.0.0.2", "decode-0.svc.cluster.local", "localhost"])
def test_addresses_and_names_pass(host: str) -> None:
    assert _build(extra={"host": host}).host == host


def test_a_wildcard_from_vllm_host_ip_names_the_variable(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setenv("VLLM_HOST_IP", "0.0.0.0")
    with pytest.raises(ConfigError, match="environment variable VLLM_HOST_IP='0.0.0.0'"):
        _build(extra={"host": ""})


@pytest.mark.parametrize(("timeout", "transfer"), [(5.5, 6.0), (2, 5.0), (30, 30.0)])
def test_the_transfer_timeout_is_whole_seconds_of_at_least_five(timeout: float,
                                                                transfer: float) -> None:
    """Mooncake's MC_TRANSFER_TIMEOUT is whole seconds, at least 5: derived so, never refused."""
    assert _build(extra={"request_timeout_s": timeout}).transfer_timeout_s == transfer


def test_a_bad_cluster_key_from_the_environment_is_reported_as_such(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LW_CLUSTER_KEY", "short")
    with pytest.raises(ConfigError, match=r"^environment variable LW_CLUSTER_KEY \(read as "):
        _build()
    with pytest.raises(ConfigError, match="^kv_connector_extra_config.cluster_key: "):
        _build(extra={"cluster_key": "short"})


@pytest.mark.parametrize(("spec", "needle"), [("abc", "not a CPU list"),
                                              ("3-1", "bad CPU range"),
                                              ("99999", "not usable here"),
                                              ("0,99999", "[99999] are not usable")])
def test_lw_cpu_affinity_is_refused_with_a_message(spec: str, needle: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LW_CPU_AFFINITY", spec)
    before = os.sched_getaffinity(0)
    with pytest.raises(ValueError, match="LW_CPU_AFFINITY") as exc:
        serve.pin_from_env()
    assert needle in str(exc.value)
    assert os.sched_getaffinity(0) == before
    with pytest.raises(SystemExit, match="LW_CPU_AFFINITY"):
        serve.main([])


def test_lw_cpu_affinity_takes_the_transport_cpus_syntax(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    before = os.sched_getaffinity(0)
    first = min(before)
    try:
        monkeypatch.setenv("LW_CPU_AFFINITY", f"{first}-{first}")
        serve.pin_from_env()
        assert os.sched_getaffinity(0) == {first}
        monkeypatch.setenv("LW_CPU_AFFINITY", "inherit")
        serve.pin_from_env()
        assert os.sched_getaffinity(0) == {first}
    finally:
        os.sched_setaffinity(0, before)
