"""The connector's keys after issue 61: at most 20 a user sets (``experimental`` counting as
one), every moved or derived key refused at start naming where it went, unknown keys inside
``experimental`` refused too, and the derived settings equal to the old defaults at the new
defaults and always safe (the lease outlasts P's writes)."""

from __future__ import annotations

from typing import Any

import pytest

from lw.fsm import check_lease
from lw.vllm_adapter.config import SECTIONS, ConfigError, LwConfig, fields_of, key_problems

OLD_DEFAULTS = {"peer_request_timeout_s": 30.0, "transfer_timeout_s": 30.0, "lease_s": 90.0,
                "heartbeat_cap_s": 30.0, "meta_retry_s": 0.5, "ack_retry_s": 0.5,
                "meta_attempts": 20, "ack_attempts": 10, "retry_fresh_blocks": False,
                "push_nice": 0}
"""The derived settings' values when they were keys (their defaults then; ``push_nice``'s
before it existed: its use was dropped, 687e43d)."""


def _build(role: str = "kv_consumer", extra: dict[str, Any] | None = None,
           **over: Any) -> LwConfig:
    args: dict[str, Any] = dict(role=role, engine_id="e", kv_port=14579, tp_size=1, pp_size=1,
                                dp_size=1, dp_rank=0, load_failure_policy="fail",
                                extra={"host": "127.0.0.1", **(extra or {})})
    args.update(over)
    return LwConfig.build(**args)


def test_a_user_sets_at_most_20_keys_and_each_has_a_section() -> None:
    keys = LwConfig.extra_keys()
    assert len(keys) <= 20, keys
    assert keys[-1] == "experimental" and len(set(keys)) == len(keys)
    sectioned = [f.name for f in fields_of(*SECTIONS)]
    assert sectioned == list(keys[:-1])
    assert set(SECTIONS) == {"placement", "transfer", "liveness", "failover", "security"}
    assert all(fields_of(s) for s in SECTIONS)  # no empty section
    inner, derived = set(LwConfig.experimental_keys()), set(LwConfig.derived_keys())
    assert not (inner & derived) and not (set(keys) & (inner | derived))


def test_the_derived_settings_keep_the_old_defaults() -> None:
    cfg = _build()
    assert {k: getattr(cfg, k) for k in OLD_DEFAULTS} == OLD_DEFAULTS
    assert set(OLD_DEFAULTS) == set(LwConfig.derived_keys())
    # the declared defaults (the docs' "at the defaults") are the derived values
    assert {f.name: f.default for f in fields_of("derived")} == OLD_DEFAULTS
    lease = _build(extra={"request_timeout_s": 10}).lease_s
    assert lease == 30.0  # test_e2e_failover.py's LEASE_S


@pytest.mark.parametrize("timeout", [0.5, 1, 4.2, 10, 30, 300, 3600])
@pytest.mark.parametrize("beat", [0, 0.05, 0.5, 2])
def test_the_derived_lease_always_outlasts_ps_last_write(timeout: float, beat: float) -> None:
    cfg = _build(extra={"request_timeout_s": timeout, "heartbeat_s": beat})
    check_lease(cfg.decode_config(), cfg.peer_request_timeout_s, cfg.transfer_timeout_s)
    assert cfg.peer_request_timeout_s == timeout
    assert cfg.transfer_timeout_s >= max(5, timeout) and cfg.transfer_timeout_s.is_integer()
    assert cfg.heartbeat_cap_s >= max(timeout, beat * cfg.heartbeat_misses)
    assert 0 < cfg.meta_retry_s <= 0.5 and cfg.meta_attempts >= 1 and cfg.ack_attempts >= 1
    loop = cfg.loop_config("lw")
    assert loop.heartbeat_cap_s == cfg.heartbeat_cap_s


@pytest.mark.parametrize("key", LwConfig.experimental_keys())
def test_a_moved_key_at_the_top_level_is_refused_naming_its_place(key: str) -> None:
    default = next(f.default for f in fields_of("experimental") if f.name == key)
    with pytest.raises(ConfigError) as exc:
        _build(extra={key: default})
    assert f"kv_connector_extra_config.{key} moved to kv_connector_extra_config." \
           f"experimental.{key}" in str(exc.value)
    assert getattr(_build(extra={"experimental": {key: default}}), key) == default


@pytest.mark.parametrize(("key", "source"), sorted(LwConfig.derived_keys().items()))
@pytest.mark.parametrize("inside", [False, True])
def test_a_derived_key_is_refused_naming_what_it_derives_from(key: str, source: str,
                                                              inside: bool) -> None:
    extra: dict[str, Any] = {"experimental": {key: 1}} if inside else {key: 1}
    with pytest.raises(ConfigError) as exc:
        _build(extra=extra)
    why = str(exc.value)
    name = f"experimental.{key}" if inside else key
    assert f"kv_connector_extra_config.{name} is no longer a setting: " in why
    assert (f"derived from {source}" if source else "fixed") in why


def test_unknown_keys_inside_experimental_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"unknown kv_connector_extra_config.experimental key "
                                          r"'idle_wait' \(did you mean 'idle_wait_ms'\?\)"):
        _build(extra={"experimental": {"idle_wait": 3}})
    with pytest.raises(ConfigError, match="'host' is a supported key; set it at the top level"):
        _build(extra={"experimental": {"host": "10.0.0.1"}})
    with pytest.raises(ConfigError, match="experimental must be a JSON object"):
        _build(extra={"experimental": [1]})


def test_a_misspelt_key_points_into_experimental_and_all_problems_are_named() -> None:
    problems = key_problems({"layer_batch": 5, "lease_s": 3, "experimental": {"x": 1},
                             "host": "h"})
    assert len(problems) == 3
    assert "did you mean 'experimental.layer_batch_ms'" in problems[0]
    assert "lease_s is no longer a setting: derived from request_timeout_s" in problems[1]
    assert "experimental key 'x'" in problems[2]
    with pytest.raises(ConfigError) as exc:
        _build(extra={"layer_batch": 5, "lease_s": 3})
    assert "layer_batch" in str(exc.value) and "lease_s" in str(exc.value)


def test_fresh_blocks_are_no_setting_and_always_false() -> None:
    for value in (True, False):
        with pytest.raises(ConfigError) as exc:
            _build(extra={"retry_prefill": 1, "retry_fresh_blocks": value})
        assert "vLLM's scheduler owns block allocation" in str(exc.value)
        assert "D fences instead" in str(exc.value)
    assert _build(extra={"retry_prefill": 1}).decode_config().retry_fresh_blocks is False
