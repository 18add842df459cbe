"""lw's connector configuration: ``kv_connector_extra_config`` validated once, at engine start.

Every key is optional; unknown keys, wrong types, out-of-range values and unsupported layouts
(kv_role ``kv_both``, pipeline parallelism, a peer TP that cannot shard the model) raise
:class:`ConfigError` naming the key and what was expected, so a bad deployment fails before its
first request.

Ports: the side channel of worker (dp_rank, tp_rank) listens on
``kv_port + dp_rank * tp_size + tp_rank`` (see :func:`side_channel_port`).
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, fields
from typing import Any

from lw.fsm import DecodeConfig, PrefillConfig, check_lease
from lw.fsm.kvmap import tp_problem
from lw.fsm.push_schedule import PUSH_MODES
from lw.fsm.settings import core_config
from lw.transport.sidechannel import parse_cluster_key

__all__ = ["ConfigError", "LwConfig", "ModelHeads", "model_heads", "side_channel_port",
           "PRODUCER", "CONSUMER"]

PRODUCER = "kv_producer"
CONSUMER = "kv_consumer"


class ConfigError(ValueError):
    """A kv_transfer_config lw cannot run with; the message names the key and the fix."""


def side_channel_port(kv_port: int, dp_rank: int, tp_size: int, tp_rank: int) -> int:
    """Port of the side channel of worker (dp_rank, tp_rank): ``kv_port + dp*tp_size + tp``."""
    return kv_port + dp_rank * tp_size + tp_rank


@dataclass(frozen=True)
class LwConfig:
    """Validated connector settings (extra-config keys are the field names below)."""

    role: str  # kv_producer (prefill) or kv_consumer (decode)
    engine_id: str
    kv_port: int
    tp_size: int
    dp_size: int
    dp_rank: int
    load_failure_policy: str
    # ---- keys of kv_connector_extra_config -------------------------------------------------
    host: str = ""  # address peers reach this engine at (side channel + transfer engine)
    bind_host: str = ""  # side-channel listen address; "" = host (e.g. 0.0.0.0 in containers)
    peer_tp_size: int = 0  # TP of the other side; 0 = same as ours (D counts senders with it)
    # HMAC key shared by P, D and the proxy ("hex:..." or text, >= 16 B; default $LW_CLUSTER_KEY):
    # authenticates the side channel and D's metaserver calls
    cluster_key: str = ""
    # prefill (P) deadlines
    request_timeout_s: float = 30.0
    meta_retry_s: float = 0.5
    meta_attempts: int = 20
    ack_retry_s: float = 0.5
    ack_attempts: int = 10
    # decode (D) deadlines
    prefill_timeout_s: float = 60.0
    lease_s: float = 90.0
    peer_request_timeout_s: float = 30.0  # P's request_timeout_s, for the lease check on D
    # data plane
    data_plane: str = "mooncake"  # "mooncake" or "inprocess" (single-process tests only)
    transfer_timeout_s: float = 30.0  # Mooncake MC_TRANSFER_TIMEOUT (whole seconds, >= 5)
    mooncake_protocol: str = "tcp"
    mooncake_device: str = ""
    mooncake_metadata_server: str = "P2PHANDSHAKE"
    # metaserver calls (D)
    metaserver_timeout_s: float = 5.0
    metaserver_attempts: int = 3
    # prefix-cache hits (D): a remainder of at most this many tokens after D's cached prefix is
    # computed by D itself (no round trip); -1 = one block (block_size), 0 = always ask P
    local_tail_tokens: int = -1
    # P: "progressive" writes each chunk's complete blocks while that chunk computes (chunked
    # prefill), from the first chunk; "auto" starts that at the first chunk after which the
    # compute left (as measured) would no longer cover the transfer at the link's measured
    # goodput, so a fast link costs the early chunks nothing; "last_chunk" writes every block
    # during the prompt's last chunk (lw before 0.3)
    push_mode: str = "auto"
    # P, push_mode auto: start when the transfer x this margin needs the compute left after the
    # chunk (> 1: earlier, for hosts where writes cost the forward nothing)
    push_start_margin: float = 1.0
    # An engine step that computes nothing while lw transfers (D waiting for KV, P for its
    # pushes to end) waits up to this long for a transfer to finish instead of returning at
    # once: vLLM's engine loop would otherwise spin ~1,000 steps/s on a core P or D needs, and
    # the step ends the moment a transfer does. 0 = off.
    idle_wait_ms: float = 2.0
    # P: a computed layer wakes lw's loop (and so starts its writes) only if the last layer to
    # do so is this old, or it is the forward's last layer; the layers in between go out with
    # it as one transfer. Per-layer wake-ups cost P's forward a context switch, a submit and
    # polls each; 0 = every layer.
    layer_batch_ms: float = 15.0
    # observability: lifecycle events each worker remembers for lw status (0 = none), and the
    # fraction of a deadline after which a request still in one state is logged as stuck
    timeline_entries: int = 32768
    stuck_fraction: float = 0.5
    # P sends CRC-32C of every written block with DONE; D verifies them before the request may
    # decode (a mismatch fails it through kv_load_failure_policy). Set it on both sides.
    kv_checksum: bool = False
    # liveness: a peer our live requests need that stays silent (heartbeats unanswered) for
    # heartbeat_s * heartbeat_misses is declared lost (its requests fail); heartbeat_s 0 = off
    heartbeat_s: float = 0.5
    heartbeat_misses: int = 3

    @property
    def is_producer(self) -> bool:
        """True on a prefill engine."""
        return self.role == PRODUCER

    def prefill_config(self) -> PrefillConfig:
        """The core's P settings (those this config names as the core does)."""
        return core_config(PrefillConfig, vars(self))

    def decode_config(self) -> DecodeConfig:
        """The core's D settings (those this config names as the core does)."""
        return core_config(DecodeConfig, vars(self))

    def port(self, tp_rank: int, dp_rank: int | None = None) -> int:
        """Side-channel port of one of this engine's workers."""
        dp = self.dp_rank if dp_rank is None else dp_rank
        return side_channel_port(self.kv_port, dp, self.tp_size, tp_rank)

    # ------------------------------------------------------------------------- construction
    @classmethod
    def extra_keys(cls) -> tuple[str, ...]:
        """Names accepted in kv_connector_extra_config."""
        fixed = {"role", "engine_id", "kv_port", "tp_size", "dp_size", "dp_rank",
                 "load_failure_policy"}
        return tuple(f.name for f in fields(cls) if f.name not in fixed)

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> LwConfig:
        """Validate a VllmConfig's kv_transfer_config and parallel layout for lw."""
        ktc = vllm_config.kv_transfer_config
        if ktc is None:
            raise ConfigError("lw's connector needs --kv-transfer-config")
        par = vllm_config.parallel_config
        dp_rank = getattr(par, "data_parallel_index", None)
        if dp_rank is None:
            dp_rank = par.data_parallel_rank
        # Dense models run DP ranks as independent engines: vLLM then reports each engine core
        # as DP size 1, rank 0, and keeps the real rank only in data_parallel_index.
        dp_size = max(int(par.data_parallel_size), int(dp_rank) + 1)
        return cls.build(
            role=ktc.kv_role, engine_id=str(ktc.engine_id), kv_port=ktc.kv_port,
            tp_size=par.tensor_parallel_size, pp_size=par.pipeline_parallel_size,
            dp_size=dp_size, dp_rank=dp_rank,
            load_failure_policy=getattr(ktc, "kv_load_failure_policy", "fail"),
            extra=dict(ktc.kv_connector_extra_config or {}),
            heads=model_heads(vllm_config),
        )

    @classmethod
    def build(cls, *, role: str | None, engine_id: str, kv_port: int, tp_size: int,
              pp_size: int, dp_size: int, dp_rank: int, load_failure_policy: str,
              extra: dict[str, Any], heads: ModelHeads | None = None) -> LwConfig:
        """Validate everything and return the config, or raise ConfigError."""
        if role not in (PRODUCER, CONSUMER):
            raise ConfigError(
                f"kv_role={role!r} is not supported by lw: use 'kv_producer' on prefill engines "
                "and 'kv_consumer' on decode engines ('kv_both' is not supported)")
        if pp_size != 1:
            raise ConfigError(f"lw does not support pipeline parallelism (pipeline_parallel_size"
                              f"={pp_size}); run P and D with pipeline_parallel_size=1")
        if load_failure_policy not in ("fail", "recompute"):
            raise ConfigError(f"kv_load_failure_policy={load_failure_policy!r}: expected "
                              "'fail' or 'recompute'")
        valid = cls.extra_keys()
        unknown = [k for k in extra if k not in valid]
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(str(k), valid, n=1)
                hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConfigError(f"unknown kv_connector_extra_config key(s) {', '.join(hints)}; "
                              f"lw accepts: {', '.join(valid)}")
        defaults = {f.name: f.default for f in fields(cls)}
        values: dict[str, Any] = {}
        for key in valid:
            values[key] = _coerce(key, extra.get(key, defaults[key]), defaults[key])
        for key in ("request_timeout_s", "meta_retry_s", "ack_retry_s", "prefill_timeout_s",
                    "lease_s", "peer_request_timeout_s", "metaserver_timeout_s"):
            if not values[key] > 0:
                raise ConfigError(f"kv_connector_extra_config.{key} must be > 0, "
                                  f"got {values[key]}")
        if not 0 <= values["idle_wait_ms"] <= 100:
            raise ConfigError("kv_connector_extra_config.idle_wait_ms must be in [0, 100], "
                              f"got {values['idle_wait_ms']}")
        if not 0 <= values["layer_batch_ms"] <= 1000:
            raise ConfigError("kv_connector_extra_config.layer_batch_ms must be in [0, 1000], "
                              f"got {values['layer_batch_ms']}")
        if values["heartbeat_s"] < 0:
            raise ConfigError("kv_connector_extra_config.heartbeat_s must be >= 0 (0: off), "
                              f"got {values['heartbeat_s']}")
        for key in ("meta_attempts", "ack_attempts", "metaserver_attempts", "heartbeat_misses"):
            if values[key] < 1:
                raise ConfigError(f"kv_connector_extra_config.{key} must be >= 1, "
                                  f"got {values[key]}")
        if values["transfer_timeout_s"] < 5:
            raise ConfigError("kv_connector_extra_config.transfer_timeout_s must be >= 5 "
                              f"(Mooncake's minimum), got {values['transfer_timeout_s']}")
        if values["data_plane"] not in ("mooncake", "inprocess"):
            raise ConfigError(f"kv_connector_extra_config.data_plane="
                              f"{values['data_plane']!r}: expected 'mooncake' or 'inprocess'")
        if not 0 < values["push_start_margin"] <= 10:
            raise ConfigError("kv_connector_extra_config.push_start_margin must be in (0, 10], "
                              f"got {values['push_start_margin']}")
        if values["push_mode"] not in PUSH_MODES:
            raise ConfigError(f"kv_connector_extra_config.push_mode={values['push_mode']!r}: "
                              f"expected one of {', '.join(PUSH_MODES)}")
        if values["local_tail_tokens"] < -1:
            raise ConfigError("kv_connector_extra_config.local_tail_tokens must be >= 0 "
                              f"(or -1: one block), got {values['local_tail_tokens']}")
        if values["peer_tp_size"] < 0:
            raise ConfigError("kv_connector_extra_config.peer_tp_size must be >= 0")
        if values["peer_tp_size"] and heads is not None:
            why = tp_problem(values["peer_tp_size"], heads.total, heads.mla)
            if why:
                side = "decode" if role == PRODUCER else "prefill"
                raise ConfigError(f"kv_connector_extra_config.peer_tp_size="
                                  f"{values['peer_tp_size']}: the {side} engine cannot shard "
                                  f"this model's KV that way ({why})")
        if not 1 <= kv_port or kv_port + dp_size * tp_size > 65535:
            raise ConfigError(f"kv_port={kv_port}: the side-channel ports kv_port .. kv_port + "
                              f"dp_size*tp_size-1 = {kv_port + dp_size * tp_size - 1} must be "
                              "valid TCP ports")
        if not 0 <= dp_rank < max(dp_size, 1):
            raise ConfigError(f"data parallel rank {dp_rank} outside data_parallel_size "
                              f"{dp_size}")
        if not values["cluster_key"]:
            # The environment keeps the key off `ps` (the kv_transfer_config is on the command
            # line); `lw status` and `lw proxy` read the same variable.
            values["cluster_key"] = os.environ.get("LW_CLUSTER_KEY", "")
        if values["cluster_key"]:
            try:
                parse_cluster_key(values["cluster_key"])
            except ValueError as exc:
                raise ConfigError(f"kv_connector_extra_config.cluster_key: {exc}") from None
        if not values["host"]:
            values["host"] = _default_host()
        cfg = cls(role=role, engine_id=engine_id, kv_port=kv_port, tp_size=tp_size,
                  dp_size=dp_size, dp_rank=dp_rank, load_failure_policy=load_failure_policy,
                  **values)
        try:
            cfg.prefill_config()
            dec = cfg.decode_config()
            if role == CONSUMER:
                check_lease(dec, cfg.peer_request_timeout_s, cfg.transfer_timeout_s)
        except ValueError as exc:
            raise ConfigError(f"kv_connector_extra_config: {exc}") from None
        return cfg


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


def _coerce(key: str, value: Any, default: Any) -> Any:
    """Check ``value`` has the type of ``default`` (ints accepted for floats; strings parsed)."""
    want = type(default)
    if want is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"kv_connector_extra_config.{key} must be true or false, got {value!r}")
    if isinstance(value, bool) or value is None:
        raise ConfigError(f"kv_connector_extra_config.{key} must be a {want.__name__}, "
                          f"got {value!r}")
    if want is str:
        if not isinstance(value, str):
            raise ConfigError(f"kv_connector_extra_config.{key} must be a string, got {value!r}")
        return value
    try:
        if want is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"kv_connector_extra_config.{key} must be a {want.__name__}, "
                          f"got {value!r}") from None


def _default_host() -> str:
    """VLLM_HOST_IP, else vLLM's guess of this host's address, else loopback."""
    env = os.environ.get("VLLM_HOST_IP")
    if env:
        return env
    try:
        from vllm.utils.network_utils import get_ip

        return str(get_ip())
    except Exception:  # noqa: BLE001 - any failure: fall back to loopback
        return "127.0.0.1"
