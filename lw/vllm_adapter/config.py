"""lw's connector configuration: ``kv_connector_extra_config`` validated once, at engine start.

A user sets at most 20 keys: the supported ones, in five sections (placement, transfer,
liveness, failover, security), and one ``experimental`` object holding unsupported knobs of
benchmarks and tests. Settings nobody should need are derived from those keys. Every key is
optional; unknown keys, a moved or derived one given anyway (the error names where it went),
wrong types, out-of-range values and unsupported layouts (kv_role ``kv_both``, pipeline
parallelism, a peer TP that cannot shard the model) raise :class:`ConfigError` naming the key
and what was expected, so a bad deployment fails before its first request. A setting the core
or the worker loop declares (PrefillConfig, DecodeConfig, LoopConfig) is range-checked by that
declaration; the connector's own are checked by :mod:`lw.vllm_adapter.config_checks`.
``lw config --explain`` (:mod:`lw.vllm_adapter.config_explain`) shows each value and its source.

Ports: the side channel of worker (dp_rank, tp_rank) listens on
``kv_port + dp_rank * tp_size + tp_rank`` (see :func:`side_channel_port`).
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from dataclasses import Field, dataclass, fields
from typing import Any

from lw.fsm import DecodeConfig, PrefillConfig
from lw.fsm.settings import core_config
from lw.transport.dataplane.planes import can_fence
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
    derive,
    loop_config_of,
    model_heads,
)
from lw.vllm_adapter.config_fields import (
    DERIVED,
    EXPERIMENTAL,
    FAILOVER,
    LIVENESS,
    PLACEMENT,
    PREFIX,
    SECTIONS,
    SECURITY,
    TRANSFER,
    derived_setting,
    experimental_setting,
    setting,
)

__all__ = ["CONSUMER", "DERIVED", "EXPERIMENTAL", "MOONCAKE_PROTOCOLS", "PRODUCER", "SECTIONS",
           "ConfigError", "LwConfig", "ModelHeads", "fields_of", "key_name", "key_problems",
           "model_heads", "side_channel_port"]

PRODUCER = "kv_producer"
CONSUMER = "kv_consumer"

log = logging.getLogger("vllm.lw.connector")  # under "vllm": shown with vLLM's log settings
_warned_unkeyed: set[tuple[str, str]] = set()
"""(role, engine_id) already warned of running without a cluster key, once per process: the
scheduler's and a worker's connector may share one."""


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
    # ---- keys of kv_connector_extra_config, by section: each documented once, here;
    # docs/deployment.md's tables are generated from these by `lw diagrams` (shown: the
    # default as documented, when it is not the field's value).
    # ---- placement: where this engine listens and what its peers look like
    host: str = setting(
        PLACEMENT, "", "both",
        "address peers use for this server's side channel and transfer engine: an IPv4 "
        "address or host name, not a wildcard (listen on every interface with `bind_host`)",
        shown="`VLLM_HOST_IP`, else vLLM's guess of the host address")
    bind_host: str = setting(
        PLACEMENT, "", "both",
        "side-channel listen address (e.g. `0.0.0.0` in a container; `host` stays the advertised "
        "one)",
        shown="= `host`")
    peer_tp_size: int = setting(
        PLACEMENT, 0, "both",
        "tensor-parallel size of the other side (D counts its senders with it; P checks D's "
        "posted TP against it); refused at start only if it cannot shard the model's KV heads."
        " A D whose count does not match the prefill's TP refuses its claims (\"its prefill TP "
        "size (peer_tp_size) is not the prefill's\") rather than finish a request with heads "
        "nobody wrote",
        shown="= own TP")
    transport_cpus: str = setting(
        PLACEMENT, "all", "both",
        "CPUs of lw's transport threads (worker loop, data-plane senders, Mooncake's and ZMQ's "
        "IO threads): `all` (every online CPU), `inherit` (the worker's own pinning) or a list "
        "such as `0,2-3`")
    # ---- transfer: how the KV moves
    data_plane: str = setting(
        TRANSFER, "mooncake", "both",
        "`\"mooncake\"` (Mooncake's transfer engine), `\"nixl\"` (a NIXL agent's UCX backend: "
        "the `nixl` extra; UCX is set by its own environment variables, e.g. `UCX_TLS`, "
        "`UCX_NET_DEVICES`; lease-only, no fence yet), `\"inprocess\"` only for "
        "single-process tests")
    mooncake_protocol: str = setting(
        TRANSFER, "tcp", "both",
        "`protocol` of `TransferEngine.initialize`, one of Mooncake's transports (`tcp`, "
        "`rdma`, `efa`, `barex`, `nvlink`, `nvlink_intra`, `hip`, `ascend`, `hccl`, `ubshmem`, "
        "`cxl`, `nvmeof`; any case); anything else is refused at start")
    mooncake_device: str = setting(
        TRANSFER, "", "both",
        "`device_name` of `TransferEngine.initialize` (e.g. the RDMA NIC; empty: Mooncake's "
        "choice)")
    push_mode: str = setting(
        TRANSFER, "auto", "P",
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
    first_token_from_p: bool = setting(
        TRANSFER, True, "both",
        "D streams the token P sampled as the request's first token as soon as it arrives (before "
        "the KV lands) and continues from it without recomputing the last prompt token; needs "
        "lw's scheduler (and, on vLLM's V1 model runner, lw's worker) classes, which `python -m "
        "lw.vllm_adapter.serve` adds. Requests it cannot seed exactly (logprobs, structured output,"
        " other sampling parameters on P) take vLLM's own path, counted by reason. false = always"
        " vLLM's own path")
    kv_checksum: bool = setting(
        TRANSFER, False, "both",
        "P sends the CRC-32C of every block it wrote with DONE; D recomputes them over its blocks"
        " before the request may decode (each sender's at its DONE, and every sender's again at "
        "the request's last DONE, so bytes of an older claim that land late are caught: with "
        "several P TP ranks writing one D worker, D sums those blocks twice); a mismatch fails "
        "the request (`kv_load_failure_policy` decides) and is counted in "
        "`lw_checksum_mismatches_total`. Set it on P and D alike. One DONE carries at most "
        "131,072 checksums (layers × blocks of a request per D worker, e.g. 61 layers × 2,148 "
        "blocks): longer requests fail with checksums on")
    # ---- liveness: deadlines and heartbeats (the derived settings below follow from these)
    request_timeout_s: float = setting(
        LIVENESS, 30.0, "both",
        "P: the whole push of one request, from the step its prefill completes. D reads it as "
        "its prefill servers' and sizes its lease from it: set the same value on P and D")
    prefill_timeout_s: float = setting(
        LIVENESS, 60.0, "D",
        "from block allocation to every sender's DONE")
    heartbeat_s: float = setting(
        LIVENESS, 0.5, "both",
        "liveness probes to the peers that live requests need (batched per peer, answered by the "
        "peer's protocol thread). A needed peer silent past its budget (3 probes, more for a "
        "peer that lately came back from longer silences) is declared lost, and its requests "
        "fail (or fail over) at once, when our side-channel connection to it is down; while it "
        "is up (a process starved of CPU, paused by its GC) it is waited for, up to "
        "`heartbeat_cap_s` (derived). A worker that was itself stalled does not blame its "
        "peers. 0 = off")
    # ---- failover: prefill again after a lost P (D)
    retry_prefill: int = setting(
        FAILOVER, 0, "D",
        "prefill failover: how many times a request whose P was lost (heartbeats, a failure "
        "report, a P that never claimed it) is prefilled again on another P, into the same "
        "blocks under a new claim epoch, before it fails (`kv_load_failure_policy` then decides);"
        " D asks the proxy's metaserver for each retry. 0 = never (it fails as without failover). "
        "In 0..64; needs the decode engine's tensor_parallel_size 1")
    retry_prefill_avoid: str = setting(
        FAILOVER, "lost", "D",
        "which P engines a retry avoids: `\"lost\"` (each one lost for this request; the proxy "
        "answers 503 when no other prefill server is left) or `\"none\"` (any P, e.g. one "
        "restarted behind the same address; the proxy still tries a server the request has not "
        "tried first, as the last one may still hold the old attempt and refuse its transfer id)")
    restart_claim_s: float = setting(
        FAILOVER, 5.0, "D",
        "with `retry_prefill`: a request routed to a P engine that restarted (a higher "
        "incarnation in its message or heartbeat answer) before any of its workers claimed it "
        "may have gone to the old process or the new one; the new one has this long to claim "
        "it, then it is prefilled again. What the old process claimed is lost at once")
    # ---- security: who is let in
    cluster_key: str = setting(
        SECURITY, "", "both",
        "HMAC key (≥ 16 bytes; `hex:...` or text) for side-channel frames, D's metaserver "
        "calls and the proxy's signature on transfer params (P and D act on no others); the "
        "same value on every P, D and the proxy. The environment variable keeps it off"
        " the command line (`ps` shows `--kv-transfer-config`)",
        shown="`$LW_CLUSTER_KEY`", secret=True)
    allowed_metaservers: str = setting(
        SECURITY, "", "both",
        "comma-separated metaserver URLs this decode engine may call (defence in depth: it "
        "calls only URLs in params the proxy signed anyway); on P, the `/v1/ahead` beside each "
        "is the only URL it fetches admit-ahead params from; empty: any such URL",
        shown="empty")
    # ---- experimental: inside the one `experimental` object; unsupported (docs/deployment.md)
    layer_batch_ms: float = experimental_setting(
        15.0, "P",
        "a computed layer starts lw's writes (wakes its loop thread) only if the last layer to do"
        " so is this many milliseconds old, or it is the forward pass's last layer; the layers in"
        " between go out together with it, as one transfer per decode worker. The first layer "
        "after a quiet spell still starts at once; the last layer's tail grows by at most one "
        "batch. 0 = every layer",
        "a CPU-forward trade-off measured by `benchmarks/push_cpu.py` and `lw-batch5`; a GPU "
        "forward's layers (under 2 ms apart) are drained by the loop's 1 ms poll, so there it "
        "changes nothing")
    write_during_forward: bool = experimental_setting(
        False, "P",
        "a push that starts with a prompt's last chunk writes layer by layer even where lw's "
        "threads share the forward's CPUs; by default it writes once that forward is done there "
        "(with P's first token on and a measured link fast enough: lw.fsm.push_schedule)",
        "measures the default against writing during the forward (`lw-during`)")
    push_start_margin: float = experimental_setting(
        1.0, "P",
        "`push_mode: auto` starts a prompt's push at the first chunk after which the compute left"
        " is shorter than the transfer × this margin (both measured by P's workers while they "
        "push). Above 1 the push starts earlier. In (0, 10]",
        "tunes `auto` against a measured link in benchmarks; `auto` measures both sides itself, "
        "and `push_mode: progressive` is the supported way to start every push early")
    idle_wait_ms: float = experimental_setting(
        2.0, "both",
        "an engine step that computes nothing while lw transfers (D waiting for KV, P for its "
        "pushes to end) waits up to this long for a transfer to finish instead of returning at "
        "once; new requests arriving during such a step wait at most this long; in [0, 100], "
        "0 = off",
        "keeps vLLM's loop from spinning about a thousand empty steps a second; a step ends the "
        "moment a transfer does, so only a benchmark of the empty-step cost needs another value")
    ahead_compute_max_tokens: int = experimental_setting(
        0, "P",
        "`lw proxy --start-mode compute-ahead`: compute ahead only prompts of at most this many "
        "tokens; a longer one is admitted ahead (computed once D's params came). 0: any length",
        "measured only in benchmarks (`lw-compute-step`): level with any length since P's worker"
        " binds mid-step; compute-ahead is not the default start mode",
        shown="0 (any length)")
    ahead_wait_s: float = experimental_setting(
        5.0, "P",
        "`lw proxy --start-mode compute-ahead`: a prefill computed ahead of D's params that they"
        " have not bound by then is dropped and its blocks freed (a bind after that is refused)."
        " Above the proxy's `--ahead-wait` (2 s), by the longest a P engine may stall",
        "a bound of the non-default compute-ahead mode, sized against the proxy's `--ahead-wait`;"
        " the checker's `lw check --design compute-ahead` varies it, a deployment need not")
    local_tail_tokens: int = experimental_setting(
        -1, "D",
        "after a prefix-cache hit, D computes a remainder of at most this many tokens itself (no "
        "prefill from P); -1 = one block, 0 = always ask P",
        "one block is what a cached prefix leaves at most by vLLM's block rounding; other values "
        "exist to test and measure the local path")
    progress_timeout_s: float = experimental_setting(
        0.0, "P",
        "fail a push sooner when it made no progress for this long (no layer computed, no "
        "answer from D, no write landing on its D, another request's included); a push that "
        "keeps progressing on a slow link lives to `request_timeout_s`. Under "
        "`request_timeout_s`; 0: off",
        "off by default and not measured on a deployment; heartbeats already end a push whose D "
        "was lost")
    heartbeat_misses: int = experimental_setting(
        3, "both",
        "the floor of a peer's silence budget: `heartbeat_s × heartbeat_misses`; it rises to 3× "
        "the longest silence the peer lately came back from (halving each minute)",
        "the budget adapts to each peer's measured silences above this floor; the fault tests "
        "vary it, a deployment tunes `heartbeat_s`")
    timeline_entries: int = experimental_setting(
        32768, "both",
        "lifecycle events each worker remembers for `lw status` histories and traces (0 = none; "
        "see [operations.md](operations.md))",
        "a memory bound of a few MiB per worker; `benchmarks/fsm_dispatch.py` measures the "
        "bookkeeping with and without it")
    stuck_fraction: float = experimental_setting(
        0.5, "both",
        "a request still in one state after this fraction of its deadline is logged once as stuck"
        " and counted in `lw_stuck_requests_total`",
        "an alarm threshold of the observability tests; half the deadline is early enough to "
        "look and late enough not to cry wolf")
    metaserver_timeout_s: float = experimental_setting(
        5.0, "both",
        "timeout of one call to the proxy's control plane (D's metaserver call, P's `/v1/ahead` "
        "fetch); the proxy's `--ahead-wait` stays below it",
        "a call within the cluster's own network; the tests of a slow proxy vary it")
    metaserver_attempts: int = experimental_setting(
        3, "D",
        "tries per metaserver call (connection errors and 5xx are retried; 4xx are not)",
        "3 tries fit well inside `prefill_timeout_s`; the tests of a failing proxy vary it")
    mooncake_metadata_server: str = experimental_setting(
        "P2PHANDSHAKE", "both",
        "Mooncake metadata mode (P2P handshake: no metadata server)",
        "lw's peers exchange their addresses on the side channel; a metadata server is untried "
        "with lw")
    # ---- derived: not settings; each follows from the keys above (a given one is refused)
    peer_request_timeout_s: float = derived_setting(
        30.0, "request_timeout_s",
        "= `request_timeout_s`: D reads its own as its prefill servers' push deadline")
    transfer_timeout_s: float = derived_setting(
        30.0, "request_timeout_s",
        "Mooncake's `MC_TRANSFER_TIMEOUT` (and NIXL's transfer timeout) = `request_timeout_s` "
        "in whole seconds, at least 5 (Mooncake's minimum): no write outlives the push it is of")
    lease_s: float = derived_setting(
        90.0, "request_timeout_s",
        "the longest quarantine of a failed request's blocks = 2 × `request_timeout_s` + "
        "`transfer_timeout_s` (90 s at the defaults): past the last moment a P write could land "
        "(its deadline plus the transfer timeout) by one more `request_timeout_s`")
    heartbeat_cap_s: float = derived_setting(
        30.0, "request_timeout_s, heartbeat_s",
        "the longest a needed peer may be silent however alive its connection = "
        "`request_timeout_s` (at least the heartbeat budget's floor): a peer silent longer has "
        "lost any push it was part of anyway")
    meta_retry_s: float = derived_setting(
        0.5, "heartbeat_s",
        "a claim (`MetaRequest`) D has not answered is sent again after `heartbeat_s`, at most "
        "0.5 s (0.5 s with heartbeats off): at the pace its peer is probed")
    ack_retry_s: float = derived_setting(
        0.5, "heartbeat_s",
        "a DONE D has not acknowledged is sent again at the pace of `meta_retry_s`")
    meta_attempts: int = derived_setting(
        20, "request_timeout_s, heartbeat_s",
        "claims P sends for a third of `request_timeout_s` (20 at the defaults) before it gives "
        "up; with heartbeats on it resends until its deadline and the liveness verdict decides, "
        "so the count matters only with `heartbeat_s: 0`")
    ack_attempts: int = derived_setting(
        10, "request_timeout_s, heartbeat_s",
        "DONEs P sends for a sixth of `request_timeout_s` (10 at the defaults); as "
        "`meta_attempts`, only with `heartbeat_s: 0`")
    push_nice: int = derived_setting(
        0, "",
        "P's transport threads run at the forward's priority: a lower one (nice 10) made lw's "
        "TTFT 1,003 ms against 645 on a shared core, as the niced loop thread held locks the "
        "forward waits on")
    retry_fresh_blocks: bool = derived_setting(
        False, "",
        "always false in the vLLM connector: vLLM's scheduler owns block allocation, so a "
        "worker has no fresh blocks to give a prefill retry; D fences instead (waits for the "
        "lost P's senders, up to `lease_s`); the synthetic cluster grants fresh blocks "
        "(docs/protocol.md, 'Prefill failover: claim epochs')")

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
        fence = can_fence(self.data_plane, self.mooncake_protocol, self.mooncake_device)
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
        """The keys a user sets: the supported ones, by section, and ``experimental``."""
        return (*(f.name for f in fields_of(*SECTIONS)), EXPERIMENTAL)

    @classmethod
    def experimental_keys(cls) -> tuple[str, ...]:
        """The keys the ``experimental`` object accepts (unsupported: benchmarks and tests)."""
        return tuple(f.name for f in fields_of(EXPERIMENTAL))

    @classmethod
    def derived_keys(cls) -> dict[str, str]:
        """Each setting lw derives -> the keys it derives from ("" for one that is fixed)."""
        return {f.name: f.metadata["from"] for f in fields_of(DERIVED)}

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
        return cls.explained(role=role, engine_id=engine_id, kv_port=kv_port, tp_size=tp_size,
                             pp_size=pp_size, dp_size=dp_size, dp_rank=dp_rank,
                             load_failure_policy=load_failure_policy, extra=extra,
                             heads=heads)[0]

    @classmethod
    def explained(cls, *, role: str | None, engine_id: str, kv_port: int, tp_size: int,
                  pp_size: int, dp_size: int, dp_rank: int, load_failure_policy: str,
                  extra: dict[str, Any], heads: ModelHeads | None = None
                  ) -> tuple[LwConfig, dict[str, str]]:
        """:meth:`build`'s config with where each setting came from (``default``, ``file``,
        an environment variable, ``derived from`` a key), or ConfigError."""
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
        problems = key_problems(extra)
        if problems:
            raise ConfigError("; ".join(problems))
        given = {**{k: v for k, v in extra.items() if k != EXPERIMENTAL},
                 **extra.get(EXPERIMENTAL, {})}
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for f in fields(cls):
            if f.metadata.get("section") in (*SECTIONS, EXPERIMENTAL):
                values[f.name] = coerce(key_name(f.name), given.get(f.name, f.default),
                                        f.default, secret=f.metadata["secret"])
                sources[f.name] = "file" if f.name in given else "default"
        values.update(derive(values))
        sources.update({k: f"derived from {src}" if src else "fixed"
                        for k, src in cls.derived_keys().items()})
        names = {k: key_name(k) for k in values}
        check_values(values, given, names, producer=role == PRODUCER, tp_size=tp_size,
                     heads=heads)
        if not 1 <= kv_port or kv_port + dp_size * tp_size - 1 > 65535:
            raise ConfigError(f"kv_port={kv_port}: the side-channel ports kv_port .. kv_port + "
                              f"dp_size*tp_size-1 = {kv_port + dp_size * tp_size - 1} must be "
                              "valid TCP ports")
        if not 0 <= dp_rank < max(dp_size, 1):
            raise ConfigError(f"data parallel rank {dp_rank} outside data_parallel_size "
                              f"{dp_size}")
        key_from = names["cluster_key"]
        if not values["cluster_key"]:
            # The environment keeps the key off `ps` (the kv_transfer_config is on the command
            # line); `lw status` and `lw proxy` read the same variable.
            values["cluster_key"] = os.environ.get("LW_CLUSTER_KEY", "")
            key_from = ("environment variable LW_CLUSTER_KEY (read as "
                        "kv_connector_extra_config.cluster_key is unset)")
            if values["cluster_key"]:
                sources["cluster_key"] = "environment $LW_CLUSTER_KEY"
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
            check_host(values["bind_host"], names["bind_host"], wildcard_ok=True)
        host_from = names["host"]
        if not values["host"]:
            host_from = ("environment variable VLLM_HOST_IP" if os.environ.get("VLLM_HOST_IP")
                         else "the address vLLM guessed for this host")
            sources["host"] = ("environment $VLLM_HOST_IP" if os.environ.get("VLLM_HOST_IP")
                               else "default (vLLM's guess of this host's address)")
            values["host"] = default_host()
        check_host(values["host"], host_from, wildcard_ok=False)
        # the lease outlasts P's writes by its derivation (lw.fsm's check_lease; a test holds it)
        return cls(role=role, engine_id=engine_id, kv_port=kv_port, tp_size=tp_size,
                   dp_size=dp_size, dp_rank=dp_rank, load_failure_policy=load_failure_policy,
                   **values), sources


def fields_of(*sections: str) -> list[Field[Any]]:
    """LwConfig's settings of these sections (or ``experimental``, ``derived``), in order."""
    return [f for f in fields(LwConfig) if f.metadata.get("section") in sections]


def key_name(key: str) -> str:
    """How a setting is written in the kv_transfer_config (``experimental.`` before such keys)."""
    inside = key in LwConfig.experimental_keys()
    return f"{PREFIX}{EXPERIMENTAL + '.' if inside else ''}{key}"


def key_problems(extra: Any) -> list[str]:
    """Why each key of ``extra`` (and of its ``experimental`` object) is refused, one message
    each: unknown (with a close match), moved into ``experimental``, derived, or supported but
    put inside ``experimental``; empty when every key is known."""
    if not isinstance(extra, dict):
        return [f"kv_connector_extra_config must be a JSON object, got {type(extra).__name__}"]
    top, inner = LwConfig.extra_keys(), LwConfig.experimental_keys()
    derived = LwConfig.derived_keys()
    out = []
    for k in extra:
        if k in top:
            continue
        if k in inner:
            out.append(f"{PREFIX}{k} moved to {PREFIX}{EXPERIMENTAL}.{k} (an unsupported "
                       "setting: benchmarks and tests; docs/deployment.md, 'experimental')")
        elif k in derived:
            out.append(_derived_problem(k, k, derived[k]))
        else:
            out.append(_unknown(k, PREFIX.rstrip("."), top, inner))
    sub = extra.get(EXPERIMENTAL, {})
    if not isinstance(sub, dict):
        return [*out, f"{PREFIX}{EXPERIMENTAL} must be a JSON object, got {sub!r}"]
    for k in sub:
        name = f"{EXPERIMENTAL}.{k}"
        if k in inner:
            continue
        if k in top:
            out.append(f"{PREFIX}{name}: {k!r} is a supported key; set it at the top level of "
                       "kv_connector_extra_config")
        elif k in derived:
            out.append(_derived_problem(name, k, derived[k]))
        else:
            out.append(_unknown(k, PREFIX + EXPERIMENTAL, inner))
    return out


def _derived_problem(name: str, key: str, source: str) -> str:
    """The refusal of a derived setting given as a key (``name``: as it was written)."""
    rule = next(f.metadata["doc"] for f in fields_of(DERIVED) if f.name == key)
    origin = f"derived from {source}" if source else "fixed"
    return f"{PREFIX}{name} is no longer a setting: {origin} ({rule}); remove it"


def _unknown(key: Any, where: str, valid: tuple[str, ...], inner: tuple[str, ...] = ()) -> str:
    """The refusal of an unknown key of ``where``, with the closest key (of ``valid`` or, inside
    ``experimental``, of ``inner``) and every key ``where`` accepts."""
    close = difflib.get_close_matches(str(key), (*valid, *inner), n=1)
    near = "".join(f"{EXPERIMENTAL}.{k}" if k in inner else k for k in close)
    hint = f" (did you mean {near!r}?)" if near else ""
    return f"unknown {where} key {key!r}{hint}; lw accepts: {', '.join(valid)}"


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


