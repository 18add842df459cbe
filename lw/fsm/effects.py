"""Effects returned by the sans-I/O endpoints: the runtime performs them, the simulator records."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from lw.fsm.failures import FailureKind
from lw.fsm.messages import KVLayout, Message, Sender


class EpochTimer(NamedTuple):
    """The key of a timer that belongs to one claim epoch of a request (D's ghost lease): the
    epoch is a number the core reads back, never text. A tuple, so that keys of both shapes
    hash, compare and sort together wherever drivers keep them."""

    kind: str
    req_id: str
    epoch: int


TimerKey = tuple[str, str] | EpochTimer  # (kind, req_id), e.g. ("meta", "req-7"), or per epoch


def timer_name(key: TimerKey) -> str:
    """How a timer reads in notes and traces: ``kind(req_id)``, per epoch ``kind:epoch(req_id)``
    (the text the checker's counterexamples have always shown)."""
    if isinstance(key, EpochTimer):
        return f"{key.kind}:{key.epoch}({key.req_id})"
    return f"{key[0]}({key[1]})"


@dataclass(frozen=True, slots=True)
class Send:
    """Send a side-channel message to the worker listening at ``dest``."""

    dest: str
    msg: Message


@dataclass(frozen=True, slots=True)
class WriteLayer:
    """Write one layer of a request's blocks from local memory into D's blocks (non-blocking)."""

    req_id: str
    layer: int
    layout: KVLayout  # D's layout: transfer-engine session and per-layer addresses
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    # Byte runs (src offset, dst offset, length) of each block that go to this D worker, from the
    # two head formats (lw.fsm.kvmap); None: the whole block, as long on both sides.
    segments: tuple[tuple[int, int, int], ...] | None = None
    target: str = ""  # side-channel address of the D worker written into (its DONE's dest)
    # The write's number within its request, in (chunk, layer) order: chunk * L + layer (-1 when
    # made: the layer, a request pushed in one chunk). ``transfer_done`` takes it back.
    seq: int = -1
    checksum: bool = False  # kv_checksum: the driver keeps the CRC-32C of what this writes
    # The request's deadline: a driver must not hand the write to its transport later (it fails
    # it unsent instead), so every byte of P's lands by deadline + transfer timeout: the bound
    # D's lease is checked against (check_lease). Queueing before the transport otherwise adds
    # to it unbounded.
    not_after: float = math.inf

    def __post_init__(self) -> None:
        if self.seq < 0:
            object.__setattr__(self, "seq", self.layer)


@dataclass(frozen=True, slots=True)
class ArmTimer:
    """Call ``on_timer(key)`` at time ``at`` (re-arming the same key replaces it)."""

    key: TimerKey
    at: float


@dataclass(frozen=True, slots=True)
class CancelTimer:
    """Forget the timer ``key`` if armed."""

    key: TimerKey


@dataclass(frozen=True, slots=True)
class SendFinished:
    """P: no transfer touches this request's blocks any more; the scheduler may free them."""

    req_id: str
    ok: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class RecvDone:
    """D: every expected sender wrote every layer; the request may decode."""

    req_id: str


@dataclass(frozen=True, slots=True)
class RecvFailed:
    """D: the request failed and no sender can still write its blocks; report and free them.
    ``kind``: why, as the core decided it (what metrics, status and client errors read)."""

    req_id: str
    block_ids: tuple[int, ...]
    reason: str
    kind: FailureKind


@dataclass(frozen=True, slots=True)
class FirstTokenTaken:
    """D: P's first token for the request, taken under claim ``epoch`` (sent by a sender D
    accepted for it, for the request's prompt); the scheduler decides whether to use it."""

    req_id: str
    token: int
    spec: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Quarantine:
    """D: the request failed but writes may still land; its blocks must stay untouched
    (``kind``: why, as for :class:`RecvFailed`)."""

    req_id: str
    block_ids: tuple[int, ...]
    reason: str
    kind: FailureKind


@dataclass(frozen=True, slots=True)
class Reprefill:
    """D: the request's prefill was lost and nothing of it can land any more; ask for a new
    prefill under claim epoch ``epoch`` into the same ``block_ids``, on a P engine not in
    ``avoid`` where one is live (the driver's router or proxy picks it)."""

    req_id: str
    epoch: int
    block_ids: tuple[int, ...]
    avoid: tuple[str, ...]
    reason: str
    fenced: bool = False  # the old epoch had to be waited out first (a sender may have written)


@dataclass(frozen=True, slots=True)
class ReleaseBlocks:
    """D: blocks a request received into under an abandoned claim epoch (given up for fresh
    ones, ``retry_fresh_blocks``) that no sender of that epoch can write any more: free them.
    The request itself lives on under a later epoch, or has ended; it is not failed."""

    req_id: str
    epoch: int
    block_ids: tuple[int, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class FenceData:
    """D (``fence_data``): cut every data-plane connection from ``senders``' hosts into this
    worker, so that no byte they had in flight can land here any more, then answer
    ``DecodeEndpoint.data_fenced(req_id, epoch, ok)``. Asked when a lease ends with senders
    that never confirmed they stopped: the lease bounds when P issues writes, not when bytes a
    lossy link still carries arrive (measured: 83 s after the write was reported failed)."""

    req_id: str
    epoch: int
    senders: tuple[Sender, ...]


# KV checksums (kv_checksum) are questions the core asks its driver, answered by the interpreter
# in the same call it performs them (lw.fsm.interpreter): the driver's ports compute or look up
# CRC-32C over memory, and the answer goes straight back to the core's ``on_sums`` as a
# :class:`Sums` event. Synchronous on purpose: no other event (a late write's completion, an
# abort, a deadline, a second DONE) can come between a question and its answer, so the pending
# question needs no state of the lifecycle tables and adds no interleaving for the checker.
# (An asynchronous answer would need that state, and rules for everything that may come first.)
# A port that raises leaves a question unanswered: P's ack timer asks again, D asks again at
# the DONE's retry, and the deadlines still hold. P's CRCs are computed as its writes leave, not
# when DONE is due: a pass over every block then would lengthen the tail after the last layer.

# A request's next claim epoch may receive into fresh blocks (``retry_fresh_blocks``): the core
# asks with :class:`FreshBlocks` and the interpreter hands the driver's answer straight back to
# ``DecodeEndpoint.on_fresh`` as a :class:`Granted` event, synchronously for the same reasons.

Runs = tuple[tuple[int, int], ...]
"""(offset, length) byte runs within one block."""


@dataclass(frozen=True, slots=True)
class SumPlan:
    """Where one sender wrote into D's blocks: its (engine id, rank), D's block ids in request
    order and, per layer, the runs of each block it wrote (what its checksums cover)."""

    sender: tuple[str, int]
    blocks: tuple[int, ...]
    runs: tuple[Runs, ...]


@dataclass(frozen=True, slots=True)
class SumBlocks:
    """D: the CRC-32C of what our blocks hold now where each plan's sender wrote, per layer of
    ``layout`` (our own); answered with :class:`Sums` through ``DecodeEndpoint.on_sums``."""

    req_id: str
    layout: KVLayout
    plans: tuple[SumPlan, ...]


@dataclass(frozen=True, slots=True)
class KeptSums:
    """P: the CRC-32C the driver kept of the writes to each of ``targets`` (those the core
    marked ``WriteLayer.checksum``), per layer of ``layers``; answered with :class:`Sums`
    through ``PrefillEndpoint.on_sums``, which sends each target its DONE with them."""

    req_id: str
    targets: tuple[str, ...]
    layers: int


@dataclass(frozen=True, slots=True)
class FreshBlocks:
    """D: may claim epoch ``epoch`` of a request receive into ``count`` fresh blocks (none of
    them the request's own)? The driver allocates them now or refuses; answered with
    :class:`Granted` through ``DecodeEndpoint.on_fresh``."""

    req_id: str
    epoch: int
    count: int


@dataclass(frozen=True, slots=True)
class Granted:
    """The answer to a :class:`FreshBlocks` (an event for the core): the blocks the driver
    allocated for the request, ``count`` of them, or None (refused: no free blocks, or a driver
    that cannot allocate outside its scheduler)."""

    ask: FreshBlocks
    blocks: tuple[int, ...] | None


@dataclass(frozen=True, slots=True)
class Sums:
    """The answer to a :class:`SumBlocks` or :class:`KeptSums` (an event for the core): per plan
    or target of ``ask``, in its order, per layer, the CRC-32C of each block."""

    ask: SumBlocks | KeptSums
    sums: tuple[Sequence[Sequence[int]], ...]


Effect = (
    Send | WriteLayer | ArmTimer | CancelTimer | SendFinished | RecvDone | RecvFailed | Quarantine
    | Reprefill | ReleaseBlocks | SumBlocks | KeptSums | FreshBlocks | FenceData | FirstTokenTaken
)


def effects_of_type(effects: list[Effect], kind: type) -> list[Any]:
    """The effects of one kind, in order (a convenience for drivers and tests)."""
    return [e for e in effects if isinstance(e, kind)]
