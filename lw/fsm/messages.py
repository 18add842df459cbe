"""The protocol's vocabulary: side-channel messages between prefill (P) and decode (D) workers.

Plain ``msgspec`` Structs (tagged, frozen, versioned) with bounds that make absurd values a decode
error rather than a problem for the core. They are the core's language; their byte encoding lives
in :mod:`lw.transport.wire`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from lw.fsm.failures import FailureKind

MAX_TIMELINE = 100_000  # timeline entries one StatusQuery may ask for
MAX_TEXT = 1024  # longest reason or other free text a message carries (senders cut theirs)
MAX_KV_HEADS = 4096  # KV heads of a model (real ones have at most a few hundred)
MAX_TP = 4096  # ranks of one tensor-parallel group
MAX_CHECKSUMS = 1 << 17  # KV checksums one DONE carries (one per layer and block)
# 2: KVFormat in layouts and claims (heterogeneous TP, MLA); 3: a claim names the D blocks;
# 4: claims, DONEs, failures, aborts and their acks carry the claim epoch (prefill failover);
# 5: a claim names the digest of the prompt its sender computed (D refuses another prompt's);
# 6: P sends the first token it sampled (FirstToken); 7: a status reply carries the engine's
# first-token mode and counts (FirstTokenStatus); 8: a D ``fail`` event in a status reply carries
# its failure kind (TimelineEntry.failure)
PROTOCOL_VERSION = 8

# Bounds that make absurd values a decode error rather than a problem for the core.
_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
_Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
_Rank = Annotated[int, msgspec.Meta(ge=0, le=65535)]
_Count = Annotated[int, msgspec.Meta(ge=1, le=65536)]
_Addr = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]  # msgspec bounds are int64
_Len = Annotated[int, msgspec.Meta(ge=1, le=1 << 40)]
_NBlocks = Annotated[int, msgspec.Meta(ge=1, le=1 << 32)]
_Incarnation = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
_BlockId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)]
# Which prefill attempt of a request a message belongs to: D starts at 0 and moves to the next
# epoch when it asks for a re-prefill; messages of another epoch never count for the current one.
_Epoch = Annotated[int, msgspec.Meta(ge=0, le=65535)]
_Prompt = Annotated[str, msgspec.Meta(pattern=r"^([0-9a-f]{32})?$")]
"""The digest of a prompt's token ids (lw.contract.params.prompt_digest); "" when unbound."""
_Heads = Annotated[int, msgspec.Meta(ge=1, le=MAX_KV_HEADS)]
MAX_SPEC = 64  # longest sampling-spec digest a FirstToken carries
_Token = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]  # a vocabulary index
# opaque to lw, but it reaches logs and timelines: printable ASCII, no spaces
_Spec = Annotated[str, msgspec.Meta(max_length=MAX_SPEC, pattern=r"^[!-~]*$")]
_TP = Annotated[int, msgspec.Meta(ge=1, le=MAX_TP)]


def tp_problem(tp: int, total_heads: int, mla: bool = False) -> str:
    """"" if ``tp`` ranks can share ``total_heads`` KV heads as vLLM does, else why not."""
    if tp < 1 or total_heads < 1:
        return f"tp={tp} and total_heads={total_heads} must be >= 1"
    if mla:
        return ""
    if total_heads >= tp and total_heads % tp:
        return f"{total_heads} KV heads do not split evenly over TP {tp}"
    if total_heads < tp and tp % total_heads:
        return f"TP {tp} is not a multiple of the {total_heads} KV heads it replicates"
    return ""


def heads_of(tp_rank: int, tp: int, total_heads: int, mla: bool = False) -> tuple[int, int]:
    """Global KV heads [lo, hi) held by one TP rank (vLLM's split; raises ValueError)."""
    problem = tp_problem(tp, total_heads, mla)
    if problem:
        raise ValueError(problem)
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank {tp_rank} outside TP {tp}")
    if mla:
        return 0, 1
    if total_heads >= tp:
        per = total_heads // tp
        return tp_rank * per, (tp_rank + 1) * per
    h = tp_rank * total_heads // tp
    return h, h + 1


class _Msg(msgspec.Struct, frozen=True, tag_field="kind", forbid_unknown_fields=True):
    """Base of every side-channel message."""

    version: int


class Sender(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Who sent a message: engine, worker rank within it, incarnation and reply address."""

    engine_id: _Id
    rank: _Rank
    incarnation: _Incarnation
    addr: _Text  # side-channel address where this worker listens, e.g. tcp://10.0.0.2:5600


class LayerLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where one attention layer's KV blocks live in a worker's registered memory."""

    base_addr: _Addr
    block_stride: _Len  # bytes between block b and block b+1
    block_len: _Len  # bytes to copy per block (<= block_stride)
    num_blocks: _NBlocks

    def __post_init__(self) -> None:
        # A block longer than its stride overlaps the next block: a write into block b would
        # land in block b + 1, which may belong to another request.
        if self.block_len > self.block_stride:
            raise ValueError(f"block_len {self.block_len} exceeds block_stride "
                             f"{self.block_stride}: blocks would overlap")


class KVFormat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a worker's blocks hold the model's KV heads: what head-sliced writes are computed from.

    The defaults describe an opaque block (one "head", one rank): whole blocks are copied."""

    dtype: _Text = "bytes"
    block_tokens: _Count = 1  # tokens per block
    order: Literal["HND", "NHD"] = "HND"  # inside a block: heads outermost, or tokens outermost
    total_heads: _Heads = 1  # KV heads of the model (1 for MLA's latent vector)
    head_lo: _Rank = 0  # this worker holds global heads [head_lo, head_hi)
    head_hi: _Count = 1
    tp_rank: _Rank = 0
    tp_size: _TP = 1
    mla: bool = False  # latent KV, identical on every TP rank

    def __post_init__(self) -> None:
        # Every head mapping is computed from (tp_rank, tp_size, total_heads, mla); heads that
        # disagree with them would make P and D compute different byte runs for one block.
        if self.mla and self.total_heads != 1:
            raise ValueError(f"an MLA format has one latent head, not {self.total_heads}")
        lo, hi = heads_of(self.tp_rank, self.tp_size, self.total_heads, self.mla)
        if (self.head_lo, self.head_hi) != (lo, hi):
            raise ValueError(
                f"heads {self.head_lo}..{self.head_hi - 1} are not what TP rank {self.tp_rank} "
                f"of {self.tp_size} holds of {self.total_heads} ({lo}..{hi - 1})")


class KVLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A worker's KV-cache description: transfer-engine session, per-layer layout, head format."""

    engine_id: _Id
    incarnation: _Incarnation
    te_session: _Text  # transfer-engine address, host:rpc_port
    layers: Annotated[list[LayerLayout], msgspec.Meta(min_length=1, max_length=4096)]
    fmt: KVFormat = msgspec.field(default_factory=KVFormat)


class MetaRequest(_Msg, tag="meta_req"):
    """P asks D to accept it as a sender for a request (and for D's layout when not cached)."""

    req_id: _Id
    sender: Sender
    want_layout: bool
    # The D blocks this sender was told to write (by the metaserver call that started its
    # prefill): D accepts only the blocks it registered for the request.
    blocks: Annotated[tuple[_BlockId, ...], msgspec.Meta(max_length=1 << 20)]
    fmt: KVFormat = msgspec.field(default_factory=KVFormat)  # the heads this sender holds
    epoch: _Epoch = 0  # the prefill attempt that started this sender (D accepts only its own)
    # The digest of the prompt this sender computed: D accepts it only for the prompt it
    # allocated the blocks for ("" on both sides: not bound, as in the checker's world).
    prompt: _Prompt = ""


MetaStatus = Literal["accepted", "refused", "unknown"]


class MetaReply(_Msg, tag="meta_rep"):
    """D's answer to MetaRequest: only ``accepted`` allows P to write into D's blocks."""

    req_id: _Id
    status: MetaStatus
    responder: Sender
    layout: KVLayout | None = None
    reason: _Text = ""
    epoch: _Epoch = 0  # the claim's, echoed


_Crc = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]


class DoneSending(_Msg, tag="done"):
    """P tells D that every layer write of this sender for a request has completed, for every
    block of the request (sent in one chunk or chunk by chunk).

    With ``kv_checksum`` on, ``checksums`` holds the CRC-32C of the bytes this sender wrote into
    each D block, layer by layer (layer-major, blocks in request order), computed from P's
    source memory; D recomputes them over its blocks before it counts the sender done."""

    req_id: _Id
    sender: Sender
    expected_senders: _Count
    num_layers: _Count
    checksums: Annotated[list[_Crc], msgspec.Meta(max_length=MAX_CHECKSUMS)] = msgspec.field(
        default_factory=list)
    # How many of D's blocks this sender wrote, every layer of each (progressive push writes
    # them chunk by chunk); D refuses a DONE that does not cover all of its blocks.
    num_blocks: Annotated[int, msgspec.Meta(ge=0, le=1 << 24)] | None = None
    epoch: _Epoch = 0  # the prefill attempt whose writes this DONE covers


class FailedSending(_Msg, tag="failed"):
    """P tells D that it stopped sending a request without completing it, and why."""

    req_id: _Id
    sender: Sender
    expected_senders: _Count
    reason: _Text
    in_doubt: bool = False  # a write timed out: its bytes may still land, D must wait its lease
    epoch: _Epoch = 0


class Ack(_Msg, tag="ack"):
    """D acknowledges a DoneSending or FailedSending (``accepted`` false: D had failed it)."""

    req_id: _Id
    of: Literal["done", "failed"]
    responder: Sender
    accepted: bool


class Abort(_Msg, tag="abort"):
    """D tells a P sender to stop writing a request (deadline, local abort, failure)."""

    req_id: _Id
    responder: Sender
    reason: _Text
    epoch: _Epoch = 0  # the prefill attempt to stop


class AbortAck(_Msg, tag="abort_ack"):
    """P confirms that no write of this request from this sender is or will be in flight."""

    req_id: _Id
    sender: Sender
    known: bool
    in_doubt: bool = False  # a write of ours timed out: its bytes may still land (lease applies)
    epoch: _Epoch = 0


class FirstToken(_Msg, tag="first_token"):
    """P tells D the token it sampled as a request's first, bound to the claim it was computed
    under (epoch, prompt) and to the sampling spec it was drawn with."""

    req_id: _Id
    sender: Sender
    epoch: _Epoch  # the claim epoch whose prefill sampled it
    token: _Token
    prompt: _Prompt  # the prompt digest that claim names ("": not bound)
    spec: _Spec  # digest of the sampling parameters it was drawn with (lw.contract.sampling)


def first_token_problem(token: int, spec: str) -> str:
    """Why a FirstToken could not carry ``token`` and ``spec`` (the wire would refuse it), or
    "" (a sender checks before it builds one: a Struct made in Python is not validated)."""
    if not 0 <= token < 1 << 31:
        return f"token {token} is outside 0..2**31-1"
    if len(spec) > MAX_SPEC or not all("!" <= c <= "~" for c in spec):
        return f"spec {spec[:80]!r} is not up to {MAX_SPEC} printable ASCII characters"
    return ""


class Heartbeat(_Msg, tag="hb"):
    """Liveness probe to a worker we share live requests with (answered by its loop thread)."""

    sender: Sender


class HeartbeatAck(_Msg, tag="hb_ack"):
    """Answer to a Heartbeat: the responder's loop is alive."""

    responder: Sender


class RequestStatus(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One live request on one worker, as ``lw status`` shows it: where it is and what it awaits."""

    req_id: _Id
    state: _Text
    in_state_s: float  # seconds in the current state
    waiting_for: _Text  # the event that would move it, and from whom
    deadline_in_s: float  # seconds until its deadline (D quarantine: the lease); < 0: past
    blocks: int  # blocks lw holds for it on this worker
    peers: list[_Text] = msgspec.field(default_factory=list)  # side-channel addresses it awaits
    layers_done: int = -1  # P: layers written to every target (-1: not known on this side)
    layers_total: int = 0
    quarantined: bool = False  # D: failed, blocks kept until every sender stopped or the lease
    stuck: bool = False  # in this state for longer than the configured fraction of its deadline


class TimelineEntry(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One remembered lifecycle event (``t`` on the worker's clock, see StatusReply.now)."""

    t: float
    req_ids: list[_Id]  # one request, or the batch of a layer_computed milestone
    event: _Text
    src: _Text
    dst: _Text
    detail: _Text
    # D's ``fail`` events: why, as data (metrics, ``lw status`` and the proxy read it, never the
    # words of ``detail``); None for every other event. An unknown kind is a decode error.
    failure: FailureKind | None = None


class StatusQuery(_Msg, tag="status_q"):
    """``lw status`` asks a worker for its live requests (and the newest timeline entries)."""

    asker: _Text  # side-channel address of the asker (replies fall back to it)
    req_id: str = ""  # only this request (live or in the timeline); "" = every live request
    timeline: Annotated[int, msgspec.Meta(ge=0, le=MAX_TIMELINE)] = 0  # newest entries wanted


MAX_FIRST_TOKEN_REASONS = 32  # fallback reasons one FirstTokenStatus carries (lw has 12)
_Total = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
_Reason = Annotated[str, msgspec.Meta(min_length=1, max_length=32, pattern=r"^[a-z0-9_]+$")]


class FirstTokenStatus(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An engine's first token from P, as ``lw status`` shows it: whether it is on (P: sends
    its sampled token; D: streams P's token and continues from it) or why not, and the counts
    of D's scheduler since the engine started (the totals of its ``lw_*`` series). The engine's
    scheduler process keeps them; its workers relay the latest in their status replies."""

    role: Literal["prefill", "decode"]
    on: bool
    why_off: _Text = ""  # off: why (the start log's reason)
    dp_rank: _Rank = 0  # which of the engine's data-parallel schedulers
    first_token_from_p: _Total = 0
    last_token_recomputed: _Total = 0
    ended_at_first_token: _Total = 0
    first_token_discarded: _Total = 0
    first_token_waits_expired: _Total = 0
    # requests that took vLLM's path although P sent a token, by reason
    fallbacks: Annotated[dict[_Reason, _Total], msgspec.Meta(
        max_length=MAX_FIRST_TOKEN_REASONS)] = msgspec.field(default_factory=dict)


class StatusReply(_Msg, tag="status_rep"):
    """A worker's live requests, its newest lifecycle events and its counters (and its
    engine's first-token mode and counts, where its connector relays them)."""

    worker: Sender
    role: Literal["prefill", "decode"]
    now: float  # the worker's monotonic clock when it answered (timeline times are on it)
    wall: float  # the worker's wall clock at the same moment (to merge timelines of workers)
    requests: list[RequestStatus] = msgspec.field(default_factory=list)
    timeline: list[TimelineEntry] = msgspec.field(default_factory=list)
    counters: dict[str, float] = msgspec.field(default_factory=dict)
    truncated: bool = False  # rows or entries were left out to fit one message
    first_token: FirstTokenStatus | None = None


Message = (MetaRequest | MetaReply | DoneSending | FailedSending | Ack | Abort | AbortAck
           | FirstToken | StatusQuery | StatusReply | Heartbeat | HeartbeatAck)

