"""What a P worker's endpoint keeps per request: its configuration, the request the scheduler
hands it, and the mutable per-request and per-target records of the prefill lifecycle.

Split from :mod:`lw.fsm.prefill` (the endpoint's logic) so that each file holds one concern.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lw.fsm.kvmap import Segment
from lw.fsm.messages import MAX_CHECKSUMS, KVLayout
from lw.fsm.timeline import DEFAULT_TIMELINE_ENTRIES, check_observability


def blocks_complete(tokens_done: int, prompt_tokens: int, block_size: int) -> int:
    """How many of a prompt's blocks hold their final KV once ``tokens_done`` of its
    ``prompt_tokens`` are computed: whole blocks, and the last (partial) one with the last
    token. A block that straddles two chunks is complete with the later one."""
    if tokens_done >= prompt_tokens:
        return -(-prompt_tokens // block_size)
    return tokens_done // block_size


def received_blocks(prompt_tokens: int, cached_tokens: int, block_size: int) -> range:
    """The blocks of a prompt (indices into its block table) D receives from P: those holding
    tokens ``cached_tokens`` to the end, where ``cached_tokens`` is D's own prefix-cache hit
    (whole blocks, less than the prompt). Raises ValueError saying which input is impossible."""
    if block_size < 1 or prompt_tokens < 1:
        raise ValueError(f"block size {block_size} and prompt of {prompt_tokens} tokens must "
                         "be >= 1")
    if not 0 <= cached_tokens < prompt_tokens:
        raise ValueError(f"a prefix hit of {cached_tokens} tokens on a prompt of "
                         f"{prompt_tokens} leaves nothing to receive")
    if cached_tokens % block_size:
        raise ValueError(f"a prefix hit of {cached_tokens} tokens is not whole blocks of "
                         f"{block_size}: its last block would be written over")
    return range(cached_tokens // block_size, -(-prompt_tokens // block_size))


def checksum_problem(num_layers: int, blocks: int) -> str:
    """Why one DONE cannot carry the KV checksums of ``blocks`` blocks of ``num_layers``
    layers (``kv_checksum``: one per layer and block), or ""."""
    n = num_layers * blocks
    if n <= MAX_CHECKSUMS:
        return ""
    return (f"kv_checksum needs {n:,} checksums ({num_layers} layers x {blocks:,} blocks), "
            f"over the {MAX_CHECKSUMS:,} a DONE carries")


@dataclass(frozen=True)
class PrefillConfig:
    """Deadlines and retry budgets of a P worker (seconds)."""

    meta_retry_s: float = 0.5  # resend MetaRequest after this long without an answer
    meta_attempts: int = 20  # give up (FAILED) after this many unanswered or "unknown" replies
    # after an "unknown" reply (D not registered yet), the next MetaRequest goes this soon,
    # doubling per try up to meta_retry_s (the 20 tries then last 7.6 s instead of 10)
    unknown_retry_s: float = 0.01
    ack_retry_s: float = 0.5
    ack_attempts: int = 10
    # Past meta_attempts / ack_attempts, resend MetaRequests and DONE (at the same pace) until
    # the request deadline instead of failing: a D that stays silent is judged by the liveness
    # verdict (lw.fsm.silence: lost when its connection is down), not by a count, so a live D
    # starved of CPU for longer than the attempts last is not taken for a dead one. For drivers
    # with heartbeats on; without them the count is the only way to find a silent D early.
    resend_until_deadline: bool = False
    request_timeout_s: float = 30.0  # whole transfer, from add_request; D's lease must exceed it
    # A prefill computed ahead of D's parameters (add_ahead) not bound to them by then is
    # dropped and its blocks go back; its deadline then counts from the bind.
    ahead_wait_s: float = 5.0
    # Fail a request sooner when it made no progress for this long (layers computed, D's
    # answers, writes landing on its D, any request's): a slow link keeps it to the cap above,
    # a stuck one ends early. 0: off (the cap alone).
    progress_timeout_s: float = 0.0
    tombstone_ttl_s: float = 300.0  # remember D's aborts for requests we have not seen yet
    # ... for at most this many request ids (each with its newest aborted epochs): past it the
    # oldest is forgotten (counted as tombstones_forgotten), so Aborts cannot grow P's memory
    tombstone_memory: int = 65536
    finished_memory: int = 4096  # finished requests remembered to recognise late duplicates
    timeline_entries: int = DEFAULT_TIMELINE_ENTRIES  # lifecycle events remembered; 0 = none
    stuck_fraction: float = 0.5  # a request this far into its deadline in one state is "stuck"
    kv_checksum: bool = False  # writes are summed (CRC-32C) and DONE carries the sums
    # TP rank 0 sends D the token P's scheduler sampled as a request's first (first_token)
    first_token_from_p: bool = False
    # ... and holds a request's DONE until then, at most this long (its ack timer's first
    # wait): sent on one side channel, the token then reaches D before DONE, and D need not
    # compute token 1 itself because the KV won the race (the token leaves one engine step
    # after P sampled it, the DONE as the last write lands)
    first_token_wait_s: float = 0.05

    def __post_init__(self) -> None:
        for name in ("meta_retry_s", "ack_retry_s", "request_timeout_s", "tombstone_ttl_s",
                     "ahead_wait_s", "unknown_retry_s"):
            # finite too: an infinite deadline passes "> 0" and overflows a timestamp later
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"PrefillConfig.{name} must be > 0 and finite, got "
                                 f"{getattr(self, name)}")
        p = self.progress_timeout_s
        if not (p == 0 or 0 < p < self.request_timeout_s):
            raise ValueError(f"PrefillConfig.progress_timeout_s must be 0 (off) or between 0 "
                             f"and request_timeout_s={self.request_timeout_s} (the cap), got {p}")
        for name in ("meta_attempts", "ack_attempts", "finished_memory", "tombstone_memory"):
            if getattr(self, name) < 1:
                raise ValueError(f"PrefillConfig.{name} must be >= 1, got {getattr(self, name)}")
        check_observability(self)


@dataclass(frozen=True)
class PrefillRequest:
    """What the P scheduler knows of a request whose prefill completes in this step.

    ``decoder_addr`` is the side-channel address of the D worker that allocated the blocks, or a
    tuple of them when this rank writes into several D TP ranks (empty: nothing to send).

    ``final`` false (progressive push): the prompt is computed in chunks and this step computes
    its first one; ``local_blocks`` are the P blocks of the first ``len(local_blocks)`` remote
    blocks, the ones complete after this chunk (possibly none); ``add_chunk`` announces the
    rest."""

    req_id: str
    decoder_addr: str | tuple[str, ...]
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    expected_senders: int = 1
    final: bool = True
    # D's claim epoch of this prefill attempt (0: the first; a re-prefill after a lost P has a
    # higher one): every message of this request carries it, D takes only its current one.
    epoch: int = 0
    # the digest of the prompt this rank computes, named in its claim ("" : not bound)
    prompt: str = ""

    @property
    def targets(self) -> tuple[str, ...]:
        """The D workers this rank writes into, in a fixed order."""
        a = self.decoder_addr
        return (a,) if isinstance(a, str) else tuple(a)


class _Target:
    """One D worker a request is written into: its claim, layout, byte runs and acknowledgement."""

    __slots__ = ("addr", "accepted", "claimed", "acked", "layout", "segs")

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.accepted = False
        self.claimed = False  # D accepted us: it expects DONE or FAILED from us
        self.acked = False
        self.layout: KVLayout | None = None
        self.segs: tuple[tuple[Segment, ...] | None, ...] = ()  # per layer; None: whole blocks


class PrefillRecord:
    """Mutable per-request record of the prefill lifecycle (state + the data the table needs)."""

    __slots__ = (
        "req",
        "state",
        "targets",
        "computed",
        "submitted",
        "sent",
        "out_of_order",
        "pending",
        "inflight",
        "meta_tries",
        "ack_tries",
        "reason",
        "abort_acks",
        "in_doubt",
        "since",
        "deadline",
        "progress_at",
        "alarmed",
        "local",
        "chunks",
        "limit",
        "final",
        "skip",
        "announced",
        "first",
        "first_sent",
        "done_held",
    )

    @property
    def req_id(self) -> str:
        """The request's id (as a D record has it)."""
        return self.req.req_id

    def __init__(self, req: PrefillRequest, state: str, now: float, deadline: float) -> None:
        self.req = req
        self.state = state
        self.since = now  # when the request entered its current state (observability only)
        self.deadline = deadline  # when the request deadline fires; its writes' not_after
        self.progress_at = now  # its last progress (progress_timeout_s)
        self.alarmed = False  # reported stuck in its current state already
        self.targets = [_Target(a) for a in req.targets]
        # Writes are numbered seq = chunk * L + layer (one chunk: seq is the layer).
        self.computed = 0  # writes 0..computed-1 have been computed by the forward pass
        self.submitted = 0  # writes 0..submitted-1 have been handed to the data plane
        self.sent = 0  # writes 0..sent-1 have been written to every target (in order)
        self.out_of_order: set[int] = set()
        self.pending: dict[int, int] = {}  # seq -> target writes not completed yet
        self.local: tuple[int, ...] = ()  # P blocks of the remote blocks announced so far
        # The prompt's first ``skip`` blocks are D's own prefix hit: P holds them too (a prefill
        # computed ahead computes the whole prompt) but writes none of them.
        self.skip = 0
        self.announced = 0  # the prompt's blocks announced so far, written or skipped
        # Per announced chunk: (P blocks, D blocks) it completes (what its layers write).
        self.chunks: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        self.limit = 0  # writes the announced chunks make: len(chunks) * L
        self.final = req.final  # the prompt's last chunk has been announced
        self.inflight = 0
        self.meta_tries = 0
        self.ack_tries = 0
        self.reason = ""
        self.abort_acks: list[str] = []  # D addresses waiting for our AbortAck
        self.in_doubt = False  # a write failed in a way that may still deliver bytes later
        self.first: tuple[int, str] | None = None  # the first token P sampled, and its spec
        self.first_sent = False  # ... went to D (at most once per record)
        self.done_held = False  # every write landed, DONE waits for the token (bounded)

    def target(self, addr: str) -> _Target | None:
        for t in self.targets:
            if t.addr == addr:
                return t
        return None


# P's per-request record types, all with __slots__ (a copier may carry them as tuples of values).
PREFILL_RECORDS: tuple[type, ...] = (PrefillRecord, _Target)
