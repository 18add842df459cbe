"""The checks behind :meth:`lw.vllm_adapter.config.LwConfig.build`: each extra-config value's
type (:func:`coerce`), the settings derived from the keys (:func:`derive`), the ranges and
combinations the connector cannot run with
(:func:`check_values`, against the model's KV heads too: :class:`ModelHeads`), and the host it
advertises (:func:`check_host`, :func:`default_host`).

Each raises :class:`ConfigError` naming the key and what was expected. No state: the config's
keys and defaults are :mod:`lw.vllm_adapter.config`'s, which re-exports these names.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from lw.fsm import DecodeConfig, PrefillConfig
from lw.fsm.kvmap import tp_problem
from lw.fsm.push_schedule import PUSH_MODES
from lw.fsm.settings import core_config
from lw.transport.loopconfig import LoopConfig
from lw.vllm_adapter.placement import parse_cpus

__all__ = ["MOONCAKE_PROTOCOLS", "ConfigError", "ModelHeads", "check_host", "check_values",
           "coerce", "default_host", "derive", "loop_config_of", "model_heads"]

# Transports Mooncake's TransferEngine.initialize knows (its installTransport; mooncake's docs).
# Anything else is refused at start: Mooncake falls back to TCP without a word, and D would
# then run without the data fence it keys on "tcp".
MOONCAKE_PROTOCOLS = ("tcp", "rdma", "efa", "barex", "nvlink", "nvlink_intra", "hip", "ascend",
                      "hccl", "ubshmem", "cxl", "nvmeof")
_WILDCARDS = ("0.0.0.0", "*", "::")
_HOST_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


class ConfigError(ValueError):
    """A kv_transfer_config lw cannot run with; the message names the key and the fix."""


def loop_config_of(settings: dict[str, Any], producer: bool, name: str) -> LoopConfig:
    """The loop settings the extra config names, by the loop's names, plus the layer batch: its
    key is in ms, and it is P's alone (only a P worker's computed layers start writes)."""
    batch_s = settings["layer_batch_ms"] / 1000 if producer else 0.0
    return core_config(LoopConfig, settings, name=name, layer_batch_s=batch_s)


def derive(values: dict[str, Any]) -> dict[str, Any]:
    """The settings lw derives from the keys' ``values`` (each rule is documented beside its
    field in :class:`~lw.vllm_adapter.config.LwConfig`); at the defaults they are the values
    these settings had when they were keys."""
    timeout, beat = values["request_timeout_s"], values["heartbeat_s"]
    resend = min(beat, 0.5) if beat > 0 else 0.5
    transfer = float(max(5, math.ceil(timeout)))  # Mooncake: whole seconds, at least 5
    return {"peer_request_timeout_s": timeout, "transfer_timeout_s": transfer,
            "lease_s": 2 * timeout + transfer,
            "heartbeat_cap_s": max(timeout, beat * values["heartbeat_misses"]),
            "meta_retry_s": resend, "ack_retry_s": resend,
            "meta_attempts": max(1, round(timeout / 3 / resend)),
            "ack_attempts": max(1, round(timeout / 6 / resend)),
            "push_nice": 0, "retry_fresh_blocks": False}


def check_values(values: dict[str, Any], given: dict[str, Any], names: dict[str, str], *,
                 producer: bool, tp_size: int, heads: ModelHeads | None) -> None:
    """The settings (``values``: coerced and derived; ``given``: the keys as written; ``names``:
    each as the user writes it) in range and consistent with each other, the engine's role, its
    TP size and the model's ``heads``; normalizes ``mooncake_protocol`` in place."""
    for key in ("request_timeout_s", "metaserver_timeout_s"):
        if not values[key] > 0:
            raise ConfigError(f"{names[key]} must be > 0, got {values[key]}")
    for key, low, high in (("idle_wait_ms", 0, 100), ("layer_batch_ms", 0, 1000)):
        if not low <= values[key] <= high:
            raise ConfigError(f"{names[key]} must be in [{low}, {high}], got {values[key]}")
    if values["metaserver_attempts"] < 1:
        raise ConfigError(f"{names['metaserver_attempts']} must be >= 1, "
                          f"got {values['metaserver_attempts']}")
    values["mooncake_protocol"] = values["mooncake_protocol"].strip().lower()
    if values["mooncake_protocol"] not in MOONCAKE_PROTOCOLS:
        raise ConfigError(f"{names['mooncake_protocol']}={given.get('mooncake_protocol')!r}: "
                          f"expected one of Mooncake's transports "
                          f"{', '.join(MOONCAKE_PROTOCOLS)}")
    try:
        parse_cpus(values["transport_cpus"])
    except ValueError as exc:
        raise ConfigError(f"{names['transport_cpus']}: {exc}") from None
    if values["data_plane"] not in ("mooncake", "nixl", "inprocess"):
        raise ConfigError(f"{names['data_plane']}={values['data_plane']!r}: "
                          "expected 'mooncake', 'nixl' or 'inprocess'")
    if values["data_plane"] == "nixl":
        from lw.transport.dataplane.nixl import nixl_missing
        if missing := nixl_missing():
            raise ConfigError(f"{names['data_plane']}='nixl': {missing}")
    if not 0 < values["push_start_margin"] <= 10:
        raise ConfigError(f"{names['push_start_margin']} must be in (0, 10], "
                          f"got {values['push_start_margin']}")
    if values["push_mode"] not in PUSH_MODES:
        raise ConfigError(f"{names['push_mode']}={values['push_mode']!r}: "
                          f"expected one of {', '.join(PUSH_MODES)}")
    if values["ahead_compute_max_tokens"] < 0:
        raise ConfigError(f"{names['ahead_compute_max_tokens']} must be >= 0 "
                          f"(0: any length), got {values['ahead_compute_max_tokens']}")
    if values["local_tail_tokens"] < -1:
        raise ConfigError(f"{names['local_tail_tokens']} must be >= 0 "
                          f"(or -1: one block), got {values['local_tail_tokens']}")
    try:  # the core's and the loop's settings are checked by their declarations
        core_config(PrefillConfig, values)
        core_config(DecodeConfig, values)
        loop_config_of(values, producer, "lw")
    except ValueError as exc:
        raise ConfigError(f"kv_connector_extra_config: {exc}") from None
    if not producer and values["retry_prefill"] and tp_size != 1:
        # Each D TP worker runs its own core and would decide its own re-prefills, under
        # epochs the others never saw: the core has no agreement between them.
        raise ConfigError(f"{names['retry_prefill']}={values['retry_prefill']} needs the "
                          f"decode engine's tensor_parallel_size 1, got {tp_size} (set "
                          "retry_prefill: 0)")
    if values["peer_tp_size"] < 0:
        raise ConfigError(f"{names['peer_tp_size']} must be >= 0")
    if values["peer_tp_size"] and heads is not None:
        why = tp_problem(values["peer_tp_size"], heads.total, heads.mla)
        if why:
            side = "decode" if producer else "prefill"
            raise ConfigError(f"{names['peer_tp_size']}={values['peer_tp_size']}: the {side} "
                              f"engine cannot shard this model's KV that way ({why})")


def coerce(name: str, value: Any, default: Any, *, secret: bool = False) -> Any:
    """Check ``value`` has the type of ``default`` (ints accepted for floats; strings parsed);
    ``name`` is the key as the user writes it; a ``secret`` key's value is never shown."""
    want = type(default)
    if want is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    if isinstance(value, bool) or value is None:
        raise ConfigError(f"{name} must be a {want.__name__}, got {value!r}")
    if want is str:
        if not isinstance(value, str):
            # A secret given as a number or a list must not reach the log with the error.
            shown = "a value that is not shown (secret)" if secret else repr(value)
            raise ConfigError(f"{name} must be a string, got {shown}")
        return value
    try:
        if want is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{name} must be a {want.__name__}, got {value!r}") from None
    if not math.isfinite(number):
        # "inf" or "1e400" would pass every "> 0" check and then overflow a deadline per request
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    return number


def check_host(host: str, source: str, wildcard_ok: bool) -> None:
    """Refuse a host the side channel and Mooncake cannot use (``source`` names where it came
    from): not an IPv4 address or DNS name, or a wildcard where peers need an address."""
    if host in _WILDCARDS:
        if wildcard_ok:
            return
        raise ConfigError(
            f"{source}={host!r} is a wildcard, which peers cannot reach: set "
            "kv_connector_extra_config.host (or VLLM_HOST_IP) to this node's address on the "
            "transfer network, and bind_host to the wildcard to listen on every interface")
    labels = host.split(".")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None and ip.version == 6:
        raise ConfigError(f"{source}={host!r}: IPv6 addresses are not supported (lw's side "
                          "channel binds IPv4); use an IPv4 address or a host name")
    if ip is None and (len(host) > 253 or all(p.isdigit() for p in labels)
                       or not all(_HOST_LABEL.fullmatch(p) for p in labels)):
        raise ConfigError(f"{source}={host!r} is not an IPv4 address or a host name")


def default_host() -> str:
    """VLLM_HOST_IP, else vLLM's guess of this host's address, else loopback."""
    env = os.environ.get("VLLM_HOST_IP")
    if env:
        return env
    try:
        from vllm.utils.network_utils import get_ip

        return str(get_ip())
    except Exception:  # noqa: BLE001 - any failure: fall back to loopback
        return "127.0.0.1"


@dataclass(frozen=True)
class ModelHeads:
    """The served model's KV heads, as P and D must agree on them."""

    total: int  # KV heads of the model (1 for MLA's latent vector)
    mla: bool


def model_heads(vllm_config: Any) -> ModelHeads | None:
    """The served model's KV heads, or None when there is no model config."""
    mc = getattr(vllm_config, "model_config", None)
    if mc is None:
        return None
    if getattr(mc, "use_mla", False):
        return ModelHeads(1, True)
    return ModelHeads(int(mc.get_total_num_kv_heads()), False)
