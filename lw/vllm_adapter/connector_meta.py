"""What lw's connector halves share: per-step metadata and the KV geometry (the params and their
version are lw.contract's)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from lw.fsm.messages import FirstTokenStatus
from lw.vllm_adapter.config import ConfigError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["BindSpec", "FetchSpec", "FirstTokenIn", "FirstTokenSpec", "LwConnectorMetadata",
           "LwWorkerMeta", "RecvSpec", "Reprefill", "Route", "SendSpec", "kv_geometry", "log"]

log = logging.getLogger("vllm.lw.connector")  # under "vllm": shown with vLLM's log settings

@dataclass(frozen=True)
class SendSpec:
    """P: push this request's KV computed in this step: the chunk this step computes completes
    ``local_blocks``, the P blocks of the next D blocks of ``remote_blocks`` (all of them)."""

    transfer_id: str
    req_id: str
    decoder_host: str
    decoder_port: int  # D's side-channel port for tp rank 0 of its DP rank
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    decoder_tp: int = 1  # D's tensor-parallel size: which of its ranks this P rank writes into
    first: bool = True  # the request's first push (the core adds it; else a further chunk)
    final: bool = True  # the prompt's last chunk: every remote block is covered after it
    # the request's W3C trace context (first push, vLLM tracing on; lw.vllm_adapter.tracing)
    trace: tuple[tuple[str, str], ...] = ()
    epoch: int = 0  # D's claim epoch of this prefill attempt (``lw_epoch``; > 0: a re-prefill)
    prompt: str = ""  # the digest of D's prompt (``lw_prompt_digest``), named in the claim
    # computed ahead (compute-ahead): no decoder known yet; a first push adds it to the core
    # ahead (``add_ahead``, ``prompt`` being P's own digest) and a BindSpec binds it later
    ahead: bool = False


@dataclass(frozen=True)
class BindSpec:
    """P: D's params for a request computed ahead: the core renames it from ``ahead_id`` to
    ``transfer_id`` (D's sub-transfer) and writes its computed layers into D's blocks."""

    ahead_id: str
    transfer_id: str
    req_id: str
    decoder_host: str
    decoder_port: int
    remote_blocks: tuple[int, ...]  # D's blocks, for the prompt's blocks from first_block on
    first_block: int  # D's own prefix hit, in blocks (computed by P, never written)
    decoder_tp: int = 1
    epoch: int = 0
    prompt: str = ""


@dataclass(frozen=True)
class FetchSpec:
    """P: a request computed ahead: the worker asks the proxy for D's params itself, so that
    they bind it mid-step (the scheduler hears the answer in the worker's metadata)."""

    req_id: str
    ahead_id: str  # the proxy's transfer id, the request's id in the core until bound
    url: str
    grant: str
    prompt: str  # digest of the prompt computed
    num_prompt_tokens: int
    geometry: str  # this engine's KV geometry (D's must be the same)
    block_size: int


@dataclass(frozen=True)
class RecvSpec:
    """D: blocks were allocated for this request; its prefill is being requested."""

    transfer_id: str
    req_id: str
    block_ids: tuple[int, ...]
    trace: tuple[tuple[str, str], ...] = ()  # as SendSpec.trace
    prompt: str = ""  # the digest of the prompt the blocks are for (a claim must name it)


@dataclass(frozen=True)
class Route:
    """D: the proxy sent claim epoch ``epoch`` of a request's prefill to P engine ``engine_id``,
    whose TP rank 0 listens at ``addr`` (the core then watches that P before it claims)."""

    transfer_id: str
    req_id: str
    engine_id: str
    addr: str
    epoch: int


@dataclass(frozen=True)
class Reprefill:
    """D: the core lost a request's P and keeps its blocks: ask the proxy for a new prefill
    under claim epoch ``epoch``, on a P engine not in ``avoid``."""

    transfer_id: str
    req_id: str
    epoch: int
    avoid: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class FirstTokenSpec:
    """P: the token this engine sampled as ``req_id``'s first (its scheduler saw it finish);
    P's worker of TP rank 0 sends it to D under the claim's transfer and epoch. ``spec``: the
    digest of the sampling spec it was drawn with (lw.contract.sampling)."""

    transfer_id: str  # as in the request's SendSpec (the ahead id until a compute-ahead bind)
    req_id: str
    token: int
    spec: str


@dataclass(frozen=True)
class FirstTokenIn:
    """D: P's first token for ``req_id`` reached this worker and its core took it (the request
    is live under the claim epoch the token was sampled for). The scheduler decides whether
    the request uses it (lw.vllm_adapter.first_token)."""

    transfer_id: str
    req_id: str
    token: int
    spec: str
    epoch: int


@dataclass
class LwConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side tells every worker for one step."""

    sends: list[SendSpec] = field(default_factory=list)
    binds: list[BindSpec] = field(default_factory=list)  # P: before this step's sends
    fetches: list[FetchSpec] = field(default_factory=list)  # P: params to fetch (compute-ahead)
    recvs: list[RecvSpec] = field(default_factory=list)
    aborts: list[tuple[str, str, str]] = field(default_factory=list)  # (transfer, req, reason)
    # D: the failure kind (lw.fsm.failures.FailureKind value) of an abort the scheduler caused
    # itself, by transfer (a failed metaserver call); a plain abort has none
    abort_kinds: dict[str, str] = field(default_factory=dict)
    # D: where the proxy sent a prefill attempt, for the core's prefill_routed
    routes: list[Route] = field(default_factory=list)
    idle: bool = False  # the engine computes nothing in this step (it only polls transfers)
    step_tokens: int = 0  # tokens the step computes (the workers time their forward per token)
    step_pairs: int = 0  # (token, earlier token) pairs those tokens attend (and per pair)
    first_tokens: list[FirstTokenSpec] = field(default_factory=list)  # P: to send to D
    # D, vLLM's V1 model runner: (request, token) whose first output token came from P, to seed
    # in the runner's state as the step schedules position L (lw.vllm_adapter.lw_worker)
    seeds: list[tuple[str, int]] = field(default_factory=list)
    # the engine's first-token mode and counts, when they changed since the last step: the
    # workers keep the latest for `lw status` (lw.vllm_adapter.first_token.checked_status)
    first_token: FirstTokenStatus | None = None


@dataclass
class LwWorkerMeta(KVConnectorWorkerMetadata):
    """What P's workers measured, for the scheduler's push_mode "auto": seconds of forward per
    token and per attended pair and, per decode host, seconds of wire per KV block. Workers
    combine by the maximum (the slowest worker decides)."""

    compute_s_per_token: float | None = None
    wire_s_per_block: dict[str, float] = field(default_factory=dict)
    compute_s_per_pair: float = 0.0
    # D: re-prefills the core asked for since the last step (prefill failover, TP 1 only)
    reprefills: list[Reprefill] = field(default_factory=list)
    # P: the answers of the workers' fetches (FetchSpec): (vLLM request id, "go" / "fallback" /
    # "error", D's params or why); "go" only for params the worker found to fit
    ahead_answers: list[tuple[str, str, Any]] = field(default_factory=list)
    # D: first tokens the workers' cores took since the last step
    first_tokens: list[FirstTokenIn] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """The slowest of two workers' figures; every worker's re-prefills and answers."""
        if not isinstance(other, LwWorkerMeta):
            return self
        c = [x for x in (self.compute_s_per_token, other.compute_s_per_token) if x is not None]
        wire = dict(self.wire_s_per_block)
        for host, s in other.wire_s_per_block.items():
            wire[host] = max(s, wire.get(host, s))
        return LwWorkerMeta(max(c) if c else None, wire,
                            max(self.compute_s_per_pair, other.compute_s_per_pair),
                            self.reprefills + other.reprefills,
                            self.ahead_answers + other.ahead_answers,
                            self.first_tokens + other.first_tokens)


def kv_geometry(kv_cache_config: KVCacheConfig) -> str:
    """What P and D must share to exchange blocks, whatever their TP sizes: layers, block size,
    bytes of one KV head in one block, dtype (heads per rank are matched at the claim)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(f"lw supports models with one KV cache group, this one has "
                          f"{len(groups)} (hybrid attention / HMA is not supported)")
    spec = groups[0].kv_cache_spec
    dtype = str(getattr(spec, "dtype", "?")).removeprefix("torch.")
    heads = int(getattr(spec, "num_kv_heads", 1) or 1)
    return (f"layers={len(groups[0].layer_names)} block_size={spec.block_size} "
            f"head_bytes={spec.page_size_bytes // heads} dtype={dtype}")
