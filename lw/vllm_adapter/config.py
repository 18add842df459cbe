"""lw's connector configuration: ``kv_connector_extra_config`` validated once, at engine start.

Every key is optional; unknown keys, wrong types, out-of-range values and unsupported layouts
(kv_role ``kv_both``, pipeline parallelism, a peer TP that cannot shard the model, fresh blocks
for failover) raise :class:`ConfigError` naming the key and what was expected, so a bad
deployment fails before its first request. A key the core or the worker loop declares
(PrefillConfig, DecodeConfig, LoopConfig) is range-checked by that declaration; this checks the
connector's own keys (:mod:`lw.vllm_adapter.config_checks`).

Ports: the side channel of worker (dp_rank, tp_rank) listens on
``kv_port + dp_rank * tp_size + tp_rank`` (see :func:`side_channel_port`).
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from lw.fsm import DecodeConfig, PrefillConfig, check_lease
from lw.fsm.settings import core_config
from lw.transport.loopconfig import LoopConfig
from lw.transport.sidechannel import parse_cluster_key
from lw.vllm_adapter.config_checks import (
    MOONCAKE_PROTOCOLS,
    ConfigError,
    ModelHeads,
    check_host,
    check_values,
    coerce,
    default_host,
    loop_config_of,
    model_heads,
)

__all__ = ["MOONCAKE_PROTOCOLS", "ConfigError", "LwConfig", "ModelHeads", "model_heads",
           "side_channel_port", "PRODUCER", "CONSUMER"]

PRODUCER = "kv_producer"
CONSUMER = "kv_consumer"

log = logging.getLogger("vllm.lw.connector")  # under "vllm": shown with vLLM's log settings
_warned_unkeyed: set[tuple[str, str]] = set()
"""(role, engine_id) already warned of running without a cluster key, once per process: the
scheduler's and a worker's connector may share one."""


def side_channel_port(kv_port: int, dp_rank: int, tp_size: int, tp_rank: int) -> int:
    """Port of the side channel of worker (dp_rank, tp_rank): ``kv_port + dp*tp_size + tp``."""
    return kv_port + dp_rank * tp_size + tp_rank


def _key(default: Any, side: str, doc: str, shown: str | None = None,
         secret: bool = False) -> Any:
    """A ``kv_connector_extra_config`` key: its default, which side reads it (``P``, ``D`` or
    ``both``), what it means, the default as documented when that is not the value, and
    whether it is a secret (then kept out of the config's repr and of error messages)."""
    return field(default=default, repr=not secret,
                 metadata={"side": side, "doc": doc, "shown": shown, "secret": secret})


def key_table() -> str:
    """The markdown table of every extra-config key (docs/deployment.md, by `lw diagrams`)."""
    rows = ["| key | default | side | meaning |", "|---|---|---|---|"]
    for f in fields(LwConfig):
        if "doc" not in f.metadata:
            continue
        shown = f.metadata["shown"]
        if shown is None:
            v = f.default
            shown = (str(v).lower() if isinstance(v, bool) else f'`"{v}"`' if isinstance(v, str)
                     else format(v, "g") if isinstance(v, float) else str(v))
        rows.append(f"| `{f.name}` | {shown} | {f.metadata['side']} | {f.metadata['doc']} |")
    return "\n".join(rows) + "\n"


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
    # ---- keys of kv_connector_extra_config: each documented once, here; docs/deployment.md's
    # table is generated from these by `lw diagrams` (shown: the default as documented, when
    # it is not the field's value).
    host: str = _key(
        "", "both",
        "address peers use for this server's side channel and transfer engine: an IPv4 "
        "address or host name, not a wildcard (listen on every interface with `bind_host`)",
        shown="`VLLM_HOST_IP`, else vLLM's guess of the host address")
    bind_host: str = _key(
        "", "both",
        "side-channel listen address (e.g. `0.0.0.0` in a container; `host` stays the advertised "
        "one)",
        shown="= `host`")
    peer_tp_size: int = _key(
        0, "both",
        "tensor-parallel size of the other side (D counts its senders with it; P checks D's "
        "posted TP against it); refused at start only if it cannot shard the model's KV heads."
        " A D whose count does not match the prefill's TP refuses its claims (\"its prefill TP "
        "size (peer_tp_size) is not the prefill's\") rather than finish a request with heads "
        "nobody wrote",
        shown="= own TP")
    cluster_key: str = _key(
        "", "both",
        "HMAC key (≥ 16 bytes; `hex:...` or text) for side-channel frames, D's metaserver "
        "calls and the proxy's signature on transfer params (P and D act on no others); the "
        "same value on every P, D and the proxy. The environment variable keeps it off"
        " the command line (`ps` shows `--kv-transfer-config`)",
        shown="`$LW_CLUSTER_KEY`", secret=True)
    allowed_metaservers: str = _key(
        "", "both",
        "comma-separated metaserver URLs this decode engine may call (defence in depth: it "
        "calls only URLs in params the proxy signed anyway); on P, the `/v1/ahead` beside each "
        "is the only URL it fetches admit-ahead params from; empty: any such URL",
        shown="empty")
    request_timeout_s: float = _key(
        30.0, "P",
        "whole push of one request, from the step its prefill completes")
    ahead_wait_s: float = _key(
        5.0, "P",
        "`lw proxy --start-mode compute-ahead`: a prefill computed ahead of D's params that they"
        " have not bound by then is dropped and its blocks freed (a bind after that is refused)."
        " Above the proxy's `--ahead-wait` (2 s), by the longest a P engine may stall")
    ahead_compute_max_tokens: int = _key(
        0, "P",
        "`lw proxy --start-mode compute-ahead`: compute ahead only prompts of at most this many "
        "tokens; a longer one is admitted ahead (computed once D's params came). 0: any length."
        " Measured (docs/benchmarks.md): with P's transfer threads off the forward's core, "
        "prompts of several chunks gain as one-chunk ones do; with every thread on the "
        "forward's core they lost 1-5 % on fast links, and one step's token budget "
        "(`max_num_batched_tokens`) is the cap for such a host",
        shown="0 (any length)")
    progress_timeout_s: float = _key(
        0.0, "P",
        "fail a push sooner when it made no progress for this long (no layer computed, no "
        "answer from D, no write landing on its D, another request's included); a push that "
        "keeps progressing on a slow link lives to `request_timeout_s`. Under "
        "`request_timeout_s`; 0: off")
    meta_retry_s: float = _key(
        0.5, "P",
        "resend the claim (`MetaRequest`) to D after this long")
    meta_attempts: int = _key(
        20, "P",
        "give up after this many unanswered or \"unknown\" claims")
    ack_retry_s: float = _key(
        0.5, "P",
        "resend DONE after this long without D's acknowledgement")
    ack_attempts: int = _key(
        10, "P",
        "give up after this many DONE without acknowledgement")
    prefill_timeout_s: float = _key(
        60.0, "D",
        "from block allocation to every sender's DONE")
    lease_s: float = _key(
        90.0, "D",
        "longest quarantine of a failed request's blocks")
    peer_request_timeout_s: float = _key(
        30.0, "D",
        "P's `request_timeout_s`, for the lease check")
    data_plane: str = _key(
        "mooncake", "both",
        "`\"mooncake\"` (Mooncake's transfer engine), `\"nixl\"` (a NIXL agent's UCX backend: "
        "the `nixl` extra; UCX is set by its own environment variables, e.g. `UCX_TLS`, "
        "`UCX_NET_DEVICES`; lease-only, no fence yet), `\"inprocess\"` only for "
        "single-process tests")
    transfer_timeout_s: float = _key(
        30.0, "both",
        "Mooncake's `MC_TRANSFER_TIMEOUT` (whole seconds, ≥ 5)")
    mooncake_protocol: str = _key(
        "tcp", "both",
        "`protocol` of `TransferEngine.initialize`, one of Mooncake's transports (`tcp`, "
        "`rdma`, `efa`, `barex`, `nvlink`, `nvlink_intra`, `hip`, `ascend`, `hccl`, `ubshmem`, "
        "`cxl`, `nvmeof`; any case); anything else is refused at start")
    mooncake_device: str = _key(
        "", "both",
        "`device_name` of `TransferEngine.initialize`")
    transport_cpus: str = _key(
        "all", "both",
        "CPUs of lw's transport threads (worker loop, data-plane senders, Mooncake's and ZMQ's "
        "IO threads): `all` (every online CPU), `inherit` (the worker's own pinning) or a list "
        "such as `0,2-3`")
    push_nice: int = _key(
        10, "P",
        "how much lower than the forward's the priority (nice value) of P's transport threads is:"
        " where they share a core with the forward, the forward (token 1) goes first and the push"
        " fills its gaps; where they have cores of their own it changes nothing. In [0, 19]; 0 ="
        " the forward's priority")
    mooncake_metadata_server: str = _key(
        "P2PHANDSHAKE", "both",
        "Mooncake metadata mode (P2P handshake: no metadata server)")
    metaserver_timeout_s: float = _key(
        5.0, "D",
        "timeout of one metaserver call")
    metaserver_attempts: int = _key(
        3, "D",
        "tries per call (connection errors and 5xx are retried; 4xx are not)")
    local_tail_tokens: int = _key(
        -1, "D",
        "after a prefix-cache hit, D computes a remainder of at most this many tokens itself (no "
        "prefill from P); -1 = one block, 0 = always ask P")
    push_mode: str = _key(
        "auto", "P",
        "`progressive`: a prompt prefilled in chunks (`max_num_batched_tokens` per step) has each"
        " chunk's complete blocks written, layer by layer, while that chunk computes, so the "
        "transfer spreads over the whole prefill; `auto`: the same, but starting at the first "
        "chunk after which the compute left would no longer cover the transfer at the link's "
        "measured goodput (P's workers fit their forward to tokens and attended pairs and measure"
        " their writes' goodput per decode host over busy periods of at least 4 MiB; until a "
        "first push measured the link to a decode host, pushes to it start at the first chunk), "
        "so that a fast link costs the early chunks no push CPU; `last_chunk`: every block is "
        "written during the prompt's last chunk (the earlier behaviour). A request vLLM preempts "
        "between chunks fails its push (counted in `lw_preempted_pushes_total`), since vLLM frees"
        " its blocks without asking the connector; `lw_early_chunk_blocks_total` counts blocks "
        "sent before their prompt's last chunk. Each (chunk, layer) is its own, smaller write: "
        "over Mooncake's TCP transport on a high-latency link (one ack per write per connection) "
        "that divides throughput by the number of chunks (`--fault slow-link`, 200 ms RTT: 0 of "
        "40 requests in time with 4 chunks, 16 with `last_chunk`, docs/benchmarks.md); use "
        "`last_chunk` there (`auto` measures such a link as slow and starts early, which is the "
        "wrong answer for a latency-bound link)")
    push_start_margin: float = _key(
        1.0, "P",
        "`push_mode: auto` starts a prompt's push at the first chunk after which the compute left"
        " is shorter than the transfer × this margin (both measured by P's workers while they "
        "push). Above 1 the push starts earlier: for GPU hosts, where writing costs the forward "
        "nothing and a tail is all there is to lose. In (0, 10]")
    idle_wait_ms: float = _key(
        2.0, "both",
        "an engine step that computes nothing while lw transfers (D waiting for KV, P for its "
        "pushes to end) waits up to this long for a transfer to finish instead of returning at "
        "once: vLLM's loop otherwise spins about a thousand empty steps a second on a core P or D"
        " needs, and the step ends the moment a transfer does. New requests arriving during such "
        "a step wait at most this long; 0 = off")
    layer_batch_ms: float = _key(
        15.0, "P",
        "a computed layer starts lw's writes (wakes its loop thread) only if the last layer to do"
        " so is this many milliseconds old, or it is the forward pass's last layer; the layers in"
        " between go out together with it, as one transfer per decode worker. Each wake-up costs "
        "the core the forward runs on a context switch, lw's bookkeeping and a data-plane submit "
        "and polls; per layer of every chunk, on a CPU forward with layers milliseconds apart, "
        "that cost P's prefill noticeably (docs/benchmarks.md). The first layer after a quiet "
        "spell still starts at once, so a push begins with its first layer; the last layer's tail"
        " grows by at most one batch. Layers less than 2 ms apart (a GPU forward) are drained by "
        "the loop's 1 ms poll anyway, so there the setting changes nothing. 0 = every layer")
    timeline_entries: int = _key(
        32768, "both",
        "lifecycle events each worker remembers for `lw status` histories and traces (0 = none; "
        "see [operations.md](operations.md))")
    stuck_fraction: float = _key(
        0.5, "both",
        "a request still in one state after this fraction of its deadline is logged once as stuck"
        " and counted in `lw_stuck_requests_total`")
    kv_checksum: bool = _key(
        False, "both",
        "P sends the CRC-32C of every block it wrote with DONE; D recomputes them over its blocks"
        " before the request may decode (each sender's at its DONE, and every sender's again at "
        "the request's last DONE, so bytes of an older claim that land late are caught: with "
        "several P TP ranks writing one D worker, D sums those blocks twice); a mismatch fails "
        "the request (`kv_load_failure_policy` decides) and is counted in "
        "`lw_checksum_mismatches_total`. Set it on P and D alike. One DONE carries at most "
        "131,072 checksums (layers × blocks of a request per D worker, e.g. 61 layers × 2,148 "
        "blocks): longer requests fail with checksums on")
    first_token_from_p: bool = _key(
        True, "both",
        "D streams the token P sampled as the request's first token as soon as it arrives (before "
        "the KV lands) and continues from it without recomputing the last prompt token; needs "
        "lw's scheduler (and, on vLLM's V1 model runner, lw's worker) classes, which `python -m "
        "lw.vllm_adapter.serve` adds. Requests it cannot seed exactly (logprobs, structured output,"
        " other sampling parameters on P) take vLLM's own path, counted by reason. false = always"
        " vLLM's own path")
    retry_prefill: int = _key(
        0, "D",
        "prefill failover: how many times a request whose P was lost (heartbeats, a failure "
        "report, a P that never claimed it) is prefilled again on another P, into the same "
        "blocks under a new claim epoch, before it fails (`kv_load_failure_policy` then decides);"
        " D asks the proxy's metaserver for each retry. 0 = never (it fails as without failover). "
        "In 0..64; needs the decode engine's tensor_parallel_size 1")
    retry_prefill_avoid: str = _key(
        "lost", "D",
        "which P engines a retry avoids: `\"lost\"` (each one lost for this request; the proxy "
        "answers 503 when no other prefill server is left) or `\"none\"` (any P, e.g. one "
        "restarted behind the same address; the proxy still tries a server the request has not "
        "tried first, as the last one may still hold the old attempt and refuse its transfer id)")
    retry_fresh_blocks: bool = _key(
        False, "D",
        "prefill failover into fresh blocks, which the vLLM connector refuses (`true` fails at "
        "start): a retry whose lost P may still write would receive into newly allocated blocks "
        "instead of waiting for that P's senders, but vLLM's scheduler owns the blocks. D fences "
        "instead (waits for those senders, up to `lease_s`); the synthetic cluster grants fresh "
        "blocks ([protocol.md](protocol.md#prefill-failover-claim-epochs))")
    heartbeat_s: float = _key(
        0.5, "both",
        "liveness probes to the peers that live requests need (batched per peer, answered by the "
        "peer's protocol thread); 0 = off")
    heartbeat_misses: int = _key(
        3, "both",
        "the floor of a peer's silence budget: `heartbeat_s × heartbeat_misses`; it rises to 3× "
        "the longest silence the peer lately came back from (halving each minute). A needed "
        "peer silent past its budget is declared lost, and its requests fail (or fail over) at "
        "once, when our side-channel connection to it is down (reset, refused, timed out); "
        "while that connection stays up its process lives (starved of CPU, paused by its GC) "
        "and it is waited for, up to `heartbeat_cap_s`. A worker that was itself stalled does "
        "not blame its peers")
    heartbeat_cap_s: float = _key(
        30.0, "both",
        "the longest a needed peer may be silent, however alive its connection: a wedged "
        "process is found within this long. At least `heartbeat_s × heartbeat_misses`")

    @property
    def is_producer(self) -> bool:
        """True on a prefill engine."""
        return self.role == PRODUCER

    def prefill_config(self) -> PrefillConfig:
        """The core's P settings (those this config names as the core does)."""
        # with heartbeats on, a silent D is judged by the liveness verdict, not by attempts
        return core_config(PrefillConfig, vars(self),
                           resend_until_deadline=self.heartbeat_s > 0)

    def decode_config(self) -> DecodeConfig:
        """The core's D settings (those this config names as the core does); a lease's end
        fences the data plane where it can (Mooncake over TCP; not RDMA, not in-process; NIXL
        is lease-only until a fence is measured)."""
        fence = (self.data_plane == "mooncake"
                 and self.mooncake_protocol.strip().lower() == "tcp" and not self.mooncake_device)
        return core_config(DecodeConfig, vars(self), fence_data=fence)

    def loop_config(self, name: str) -> LoopConfig:
        """The settings of this engine's worker loops (``name``: the loop thread's)."""
        return loop_config_of(vars(self), self.is_producer, name)

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
        cfg = cls.build(
            role=ktc.kv_role, engine_id=str(ktc.engine_id), kv_port=ktc.kv_port,
            tp_size=par.tensor_parallel_size, pp_size=par.pipeline_parallel_size,
            dp_size=dp_size, dp_rank=dp_rank,
            load_failure_policy=getattr(ktc, "kv_load_failure_policy", "fail"),
            extra=dict(ktc.kv_connector_extra_config or {}),
            heads=model_heads(vllm_config),
        )
        if not cfg.cluster_key:
            _warn_unkeyed(cfg)
        return cfg

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
        secret = {f.name for f in fields(cls) if f.metadata.get("secret")}
        values: dict[str, Any] = {}
        for key in valid:
            values[key] = coerce(key, extra.get(key, defaults[key]), defaults[key],
                                 secret=key in secret)
        check_values(values, extra, producer=role == PRODUCER, tp_size=tp_size, heads=heads)
        if not 1 <= kv_port or kv_port + dp_size * tp_size - 1 > 65535:
            raise ConfigError(f"kv_port={kv_port}: the side-channel ports kv_port .. kv_port + "
                              f"dp_size*tp_size-1 = {kv_port + dp_size * tp_size - 1} must be "
                              "valid TCP ports")
        if not 0 <= dp_rank < max(dp_size, 1):
            raise ConfigError(f"data parallel rank {dp_rank} outside data_parallel_size "
                              f"{dp_size}")
        key_from = "kv_connector_extra_config.cluster_key"
        if not values["cluster_key"]:
            # The environment keeps the key off `ps` (the kv_transfer_config is on the command
            # line); `lw status` and `lw proxy` read the same variable.
            values["cluster_key"] = os.environ.get("LW_CLUSTER_KEY", "")
            key_from = ("environment variable LW_CLUSTER_KEY (read as "
                        "kv_connector_extra_config.cluster_key is unset)")
        if values["cluster_key"]:
            try:
                parse_cluster_key(values["cluster_key"])
            except ValueError as exc:
                raise ConfigError(f"{key_from}: {exc}") from None
        for url in filter(None, (u.strip() for u in values["allowed_metaservers"].split(","))):
            if not re.fullmatch(r"https?://[^\s@/?#]+(/[^\s?#]*)?", url):
                raise ConfigError(f"kv_connector_extra_config.allowed_metaservers: {url!r} is "
                                  "not an http(s) URL without user part, query or fragment")
        if values["bind_host"]:
            check_host(values["bind_host"], "kv_connector_extra_config.bind_host",
                        wildcard_ok=True)
        host_from = "kv_connector_extra_config.host"
        if not values["host"]:
            host_from = ("environment variable VLLM_HOST_IP" if os.environ.get("VLLM_HOST_IP")
                         else "the address vLLM guessed for this host")
            values["host"] = default_host()
        check_host(values["host"], host_from, wildcard_ok=False)
        cfg = cls(role=role, engine_id=engine_id, kv_port=kv_port, tp_size=tp_size,
                  dp_size=dp_size, dp_rank=dp_rank, load_failure_policy=load_failure_policy,
                  **values)
        if role == CONSUMER:
            try:
                check_lease(cfg.decode_config(), cfg.peer_request_timeout_s,
                            cfg.transfer_timeout_s)
            except ValueError as exc:
                raise ConfigError(f"kv_connector_extra_config: {exc}") from None
        return cfg


def _warn_unkeyed(cfg: LwConfig) -> None:
    """Log, once per process and engine, that this engine runs without a cluster key."""
    if (cfg.role, cfg.engine_id) in _warned_unkeyed:
        return
    _warned_unkeyed.add((cfg.role, cfg.engine_id))
    side = "prefill" if cfg.is_producer else "decode"
    log.warning(
        "lw: %s engine %s has no cluster key (kv_connector_extra_config.cluster_key or "
        "LW_CLUSTER_KEY): its side channel (ports %d..%d) and the metaserver calls between D and "
        "the proxy are UNAUTHENTICATED; anyone who can reach them can forge transfers, status "
        "queries and prefill requests. Set the same key (>= 16 bytes) on every P, D and the proxy "
        "unless this network is trusted.", side, cfg.engine_id, cfg.port(0),
        cfg.port(cfg.tp_size - 1))


