"""What D keeps per worker and per request: its deadlines (DecodeConfig) and the mutable
record of one request's decode lifecycle (read by the endpoint, lw.fsm.decode, and by
``lw status``'s rows, lw.fsm.status)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lw.fsm.effects import Send
from lw.fsm.failures import FailureKind
from lw.fsm.lifecycles import DECODE_LIVE, PREFILL_REQUESTED
from lw.fsm.messages import PROTOCOL_VERSION, Ack, DoneSending, FailedSending, KVFormat, Sender
from lw.fsm.timeline import DEFAULT_TIMELINE_ENTRIES, check_observability

__all__ = ["DecodeConfig", "DecodeRecord", "Ghost", "SenderKey", "ack", "brief_blocks",
           "check_lease"]

SenderKey = tuple[str, int]  # (engine_id, rank)


@dataclass(frozen=True)
class DecodeConfig:
    """Deadlines of a D worker (seconds)."""

    prefill_timeout_s: float = 60.0  # from allocation to every sender's DONE
    lease_s: float = 90.0  # quarantine bound; must exceed P's request timeout + transfer timeout
    finished_memory: int = 4096
    timeline_entries: int = DEFAULT_TIMELINE_ENTRIES  # lifecycle events remembered; 0 = none
    stuck_fraction: float = 0.5  # a request this far into its deadline in one state is "stuck"
    # Every sender's DONE must carry per-block CRC-32C that match what landed in our blocks
    # (the driver recomputes them where the core's SumBlocks says); a mismatch fails the
    # request. The last DONE re-verifies every sender: bytes of a superseded claim landing late
    # are never accepted.
    kv_checksum: bool = False
    # Prefill failover: how many times a request whose P was lost (heartbeats, a restart, a
    # failure report, a P that never claimed it) is prefilled again before it fails; 0 = never.
    retry_prefill: int = 0
    # Which P engines a re-prefill avoids: "lost" (each one lost for this request), "none".
    retry_prefill_avoid: str = "lost"
    # Prefill failover into fresh blocks: when a sender of the lost epoch may still write, the
    # next epoch receives into blocks the driver allocates now (FreshBlocks) instead of waiting
    # for those senders (FENCING); the old blocks are quarantined as a failed request's are
    # (a "ghost": abort its senders, free the blocks when each stopped or the lease ends). A
    # driver that cannot allocate outside its scheduler (vLLM's worker) refuses: then FENCING.
    retry_fresh_blocks: bool = False
    # A lease that ends with senders not known to have stopped (a failure "in doubt", a lost
    # P) does not free or reuse the blocks until the driver fenced the data plane from those
    # senders (FenceData): bytes a lossy TCP link still carries land long after the writer gave
    # up (measured up to 83 s, benchmarks/late_landing.py). Off: the lease alone decides, for a
    # data plane that cannot fence (then a late byte can land in a reused block).
    fence_data: bool = False
    fence_retry_s: float = 2.0  # a fence that failed is tried again this much later
    # A request routed to a P engine whose worker restarted before any of its workers claimed
    # it may have gone to the old process (lost with it) or to the new one (about to claim):
    # the new one has this long to claim it, then it is lost (retry_prefill only)
    restart_claim_s: float = 5.0
    # Take the first token P sampled (FirstToken) for the scheduler, bound to the claim
    first_token_from_p: bool = False

    def __post_init__(self) -> None:
        for name in ("prefill_timeout_s", "lease_s", "fence_retry_s", "restart_claim_s"):
            # finite too: an infinite deadline passes "> 0" and overflows a timestamp later
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"DecodeConfig.{name} must be > 0 and finite, got "
                                 f"{getattr(self, name)}")
        if self.finished_memory < 1:
            raise ValueError("DecodeConfig.finished_memory must be >= 1")
        if not 0 <= self.retry_prefill <= 64:
            raise ValueError(f"DecodeConfig.retry_prefill must be in 0..64, got "
                             f"{self.retry_prefill}")
        if self.retry_prefill_avoid not in ("lost", "none"):
            raise ValueError(f"DecodeConfig.retry_prefill_avoid must be 'lost' or 'none', got "
                             f"{self.retry_prefill_avoid!r}")
        check_observability(self)


def brief_blocks(blocks: Sequence[int], most: int = 16) -> str:
    """Block ids for a reason text (bounded: reasons travel in messages)."""
    head = ", ".join(map(str, blocks[:most]))
    return f"[{head}{', ...' if len(blocks) > most else ''}] ({len(blocks)})"


def ack(me: Sender, msg: DoneSending | FailedSending, of: str, accepted: bool) -> Send:
    """D worker ``me``'s answer to a sender's DONE (``of`` "done") or failure ("failed")."""
    return Send(msg.sender.addr, Ack(PROTOCOL_VERSION, msg.req_id, of, me, accepted))


def check_lease(
    decode: DecodeConfig, request_timeout_s: float, transfer_timeout_s: float
) -> None:
    """Refuse deadlines under which a P write could land after D released a quarantine."""
    need = request_timeout_s + transfer_timeout_s
    if decode.lease_s <= need:
        raise ValueError(
            f"decode lease_s={decode.lease_s} must exceed P request_timeout_s + transfer timeout "
            f"= {request_timeout_s} + {transfer_timeout_s} = {need}"
        )


class DecodeRecord:
    """Mutable per-request record of the decode lifecycle."""

    __slots__ = ("req_id", "state", "blocks", "expected", "ranks", "by_rank", "claimers", "done",
                 "stopped", "reason", "kind", "since", "deadline", "alarmed", "formats", "sums",
                 "asked", "epoch", "retries", "avoid", "route", "asking", "prompt", "fencing",
                 "token_epoch", "claim_due")

    def __init__(self, req_id: str, blocks: tuple[int, ...], expected: int,
                 ranks: frozenset[int] | None, now: float, deadline: float,
                 prompt: str = "") -> None:
        self.req_id = req_id
        self.state = PREFILL_REQUESTED
        self.since = now  # when the request entered its current state (observability only)
        self.deadline = deadline  # prefill deadline, then the lease end (observability only)
        self.alarmed = False  # reported stuck in its current state already
        self.formats: dict[SenderKey, KVFormat] = {}  # each accepted sender's head format
        self.blocks = blocks
        self.prompt = prompt  # the digest of the prompt the blocks are for ("": not bound)
        self.expected = expected
        self.ranks = ranks  # the P TP ranks that write into us; None: any ``expected`` senders
        self.by_rank: dict[int, SenderKey] = {}  # P TP rank -> the sender that claimed it
        self.claimers: dict[SenderKey, Sender] = {}
        self.done: set[SenderKey] = set()
        self.stopped: set[SenderKey] = set()
        self.reason = ""
        self.kind: FailureKind | None = None  # why it failed (set with the reason, by _fail)
        self.sums: dict[SenderKey, tuple[int, ...]] = {}  # kv_checksum: each DONE sender's sums
        # kv_checksum: the DONE whose SumBlocks awaits its answer (set only within one
        # interpreter call: never seen by the checker's states between events)
        self.asked: DoneSending | None = None
        self.epoch = 0  # claim epoch: which prefill attempt may claim, write and be DONE
        self.retries = 0  # re-prefills asked so far (bounded by DecodeConfig.retry_prefill)
        self.avoid: tuple[str, ...] = ()  # P engines lost for it (a re-prefill goes elsewhere)
        # (engine id, address) of the P the current epoch's prefill was sent to, as the driver
        # said (prefill_routed): watched before it claims, so an orphan is found by heartbeats
        self.route: tuple[str, str] | None = None
        # retry_fresh_blocks: a FreshBlocks question awaits its answer (set only within one
        # interpreter call, like ``asked``)
        self.asking = False
        self.fencing = False  # fence_data: its lease ended, the FenceData awaits its answer
        self.token_epoch = -1  # the claim epoch whose first token from P was taken (-1: none)
        # the routed P engine that restarted before claiming the current epoch ("": none): it
        # must claim before the "claim" timer fires (DecodeConfig.restart_claim_s)
        self.claim_due = ""

    def awaits_claim_from(self, engine_id: str) -> bool:
        """Live, its epoch routed to P engine ``engine_id``, and none of that engine's workers
        has claimed it yet."""
        return (self.state in DECODE_LIVE and self.route is not None and self.route[0] == engine_id
                and not any(k[0] == engine_id for k in self.claimers))


class Ghost:
    """A request's abandoned claim epoch (``retry_fresh_blocks``): the blocks it received into
    and its senders that may still write there. Held by the endpoint, whatever became of the
    request, until every one of them stopped or the lease passed; then the blocks are freed
    (``ReleaseBlocks``)."""

    __slots__ = ("req_id", "epoch", "blocks", "pending", "reason", "deadline", "fencing")

    def __init__(self, req_id: str, epoch: int, blocks: tuple[int, ...],
                 pending: dict[SenderKey, Sender], reason: str, deadline: float) -> None:
        self.req_id = req_id
        self.epoch = epoch
        self.blocks = blocks
        self.pending = pending  # accepted senders of that epoch not known to have stopped
        self.reason = reason  # why the epoch was abandoned (free text, for the release)
        self.deadline = deadline  # the lease's end (observability: the timer is armed)
        self.fencing = False  # fence_data: its lease ended, the FenceData awaits its answer


# D's per-request record types, all with __slots__ (a copier may carry them as tuples of values).
DECODE_RECORDS: tuple[type, ...] = (DecodeRecord, Ghost)
