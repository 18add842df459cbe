"""The ghosts of D's abandoned claim epochs (``DecodeConfig.retry_fresh_blocks``): when a
request's prefill fails over into fresh blocks, the lost epoch's blocks are quarantined as a
failed request's are, until every sender of that epoch stopped or its lease passed
(docs/protocol.md, "Prefill failover").

:class:`Ghosts` is a part that :class:`lw.fsm.decode.DecodeEndpoint` holds: its own state (the
ghosts held), its own events (:meth:`Ghosts.hold`, :meth:`Ghosts.take`, :meth:`Ghosts.on_timer`)
and its own timer key (an :class:`~lw.fsm.effects.EpochTimer`); each event returns the effects
for the endpoint to hand on. It knows nothing of the endpoint's requests but what it is told.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from lw.fsm.decode_request import Ghost, SenderKey, ack, brief_blocks
from lw.fsm.effects import (
    ArmTimer,
    CancelTimer,
    Effect,
    EpochTimer,
    FenceData,
    ReleaseBlocks,
    Send,
)
from lw.fsm.messages import (
    MAX_TEXT,
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    DoneSending,
    FailedSending,
    Sender,
)
from lw.fsm.snapshot import ENDPOINT_RULES, OMIT, RECORD_RULES, Rules
from lw.fsm.timeline import Timeline

__all__ = ["GHOST_LEASE", "GHOST_RULES", "Ghosts", "grant_problem", "lease_key"]

GHOST_LEASE = "ghost"  # the timer kind of a ghost's lease (keyed by request and epoch)


def lease_key(req_id: str, epoch: int) -> EpochTimer:
    """The key of the lease timer of request ``req_id``'s abandoned claim epoch ``epoch``."""
    return EpochTimer(GHOST_LEASE, req_id, epoch)


def grant_problem(blocks: Sequence[int], count: int, held: Collection[int]) -> str:
    """Why granted blocks cannot be a request's next ones ("" if they can): not ``count``
    distinct blocks, or a block ``held`` here already by a request or a ghost (a driver's bug)."""
    if len(blocks) != count or len(set(blocks)) != len(blocks):
        return (f"granted {brief_blocks(blocks)} for {count} block(s): not as many distinct "
                "blocks as asked")
    taken = sorted(set(held).intersection(blocks))
    if taken:
        return f"granted block(s) {brief_blocks(taken)} that are held here already"
    return ""


class Ghosts:
    """The abandoned claim epochs one D worker holds, by (request, epoch): each one's blocks
    stay quarantined, whatever becomes of its request, until its senders stopped or its lease
    passed, and then go back (``ReleaseBlocks``)."""

    __slots__ = ("me", "lease_s", "counters", "timeline", "held", "fence")

    def __init__(self, me: Sender, lease_s: float, counters: dict[str, int],
                 timeline: Timeline, fence: bool = False) -> None:
        self.me = me  # the D worker: the sender of the ghosts' aborts and acks
        self.lease_s = lease_s  # DecodeConfig.lease_s: a ghost's quarantine bound
        self.counters = counters  # the endpoint's statistics, shared
        self.timeline = timeline  # the endpoint's timeline, shared ("fresh", "ghost", ...)
        self.held: dict[tuple[str, int], Ghost] = {}
        self.fence = fence  # DecodeConfig.fence_data: a lease ends with a fence (FenceData)

    def blocks(self) -> dict[tuple[str, int], tuple[int, ...]]:
        """The blocks of each ghost held, by (request, epoch)."""
        return {k: g.blocks for k, g in self.held.items()}

    def held_blocks(self) -> set[int]:
        """Every block a ghost holds."""
        return {b for g in self.held.values() for b in g.blocks}

    # ----------------------------------------------------------------------------- events
    def hold(self, req_id: str, epoch: int, blocks: tuple[int, ...],
             pending: dict[SenderKey, Sender], reason: str, now: float) -> list[Effect]:
        """Claim epoch ``epoch`` of a request is given up for fresh blocks while ``pending``
        senders may still write into ``blocks``: a ghost holds them, those senders are aborted
        and its lease is armed."""
        ghost = Ghost(req_id, epoch, blocks, pending, reason, now + self.lease_s)
        self.held[(req_id, epoch)] = ghost
        self.timeline.record(now, req_id, "fresh", "", "",
                             f"epoch {epoch}: {len(blocks)} block(s) quarantined until "
                             f"{len(pending)} sender(s) stopped")
        out: list[Effect] = [
            Send(s.addr, Abort(PROTOCOL_VERSION, req_id, self.me, reason[:MAX_TEXT], epoch))
            for s in pending.values()]
        out.append(ArmTimer(lease_key(req_id, epoch), ghost.deadline))
        return out

    def take(self, msg: DoneSending | FailedSending | AbortAck, current: int | None,
             now: float) -> list[Effect] | None:
        """A message of an abandoned epoch whose ghost is held: the ghost takes it (a DONE or
        failure answered "not accepted"); one not in doubt says its sender stopped, and the
        last one releases the ghost. ``current``: the epoch of the live request of that id
        (None: none). None when the message is not the ghost's (the endpoint's, then)."""
        ghost = self.held.get((msg.req_id, msg.epoch))
        if ghost is None or current == msg.epoch:
            return None  # (current: the id was given to a new request: its own epoch first)
        out: list[Effect] = []
        if isinstance(msg, DoneSending):
            out.append(ack(self.me, msg, "done", False))
        elif isinstance(msg, FailedSending):
            out.append(ack(self.me, msg, "failed", False))
        self.counters["stale_epoch"] += 1
        key = (msg.sender.engine_id, msg.sender.rank)
        if key in ghost.pending and not getattr(msg, "in_doubt", False):
            del ghost.pending[key]
        self.timeline.record(now, msg.req_id, "ghost", "", "",
                             f"epoch {msg.epoch}: {type(msg).__name__} from P {key[0]} rank "
                             f"{key[1]}, {len(ghost.pending)} sender(s) left")
        if not ghost.pending:
            out += self.release(ghost.req_id, ghost.epoch, "every sender stopped", now)
        return out

    def on_timer(self, key: EpochTimer, now: float) -> list[Effect]:
        """A ghost's lease passed: every write of its senders has landed or never will, so the
        ghost, if still held, is released."""
        if key.kind != GHOST_LEASE:
            raise ValueError(f"unknown timer kind {key.kind!r} for request {key.req_id!r}")
        out: list[Effect] = []
        ghost = self.held.get((key.req_id, key.epoch))
        if ghost is not None and self.fence and ghost.pending:
            ghost.fencing = True  # its senders issue no more writes; fence their bytes in flight
            self.counters["fences"] += 1
            self.timeline.record(now, ghost.req_id, "fence_data", "", "",
                                 f"epoch {ghost.epoch}: lease over, fencing "
                                 f"{len(ghost.pending)} sender(s)")
            out.append(FenceData(ghost.req_id, ghost.epoch, tuple(ghost.pending.values())))
        elif ghost is not None:
            self.counters["leases_expired"] += 1
            self._free(ghost, "lease expired", now, out)
        return out

    def fenced(self, req_id: str, epoch: int, ok: bool, reason: str, now: float,
               retry_s: float) -> list[Effect]:
        """The driver's answer to a ghost's :class:`FenceData`: released when it holds, else
        the lease timer asks again after ``retry_s``."""
        ghost = self.held[(req_id, epoch)]
        out: list[Effect] = []
        if not ghost.fencing:
            self.counters["stale_fences"] += 1
        elif ok:
            self.counters["leases_expired"] += 1
            self._free(ghost, "lease expired, data plane fenced", now, out)
        else:
            ghost.fencing = False
            self.counters["fence_failures"] += 1
            self.timeline.record(now, req_id, "fence_failed", "", "",
                                 f"epoch {epoch}: {reason}"[:MAX_TEXT])
            ghost.deadline = now + retry_s
            out.append(ArmTimer(lease_key(req_id, epoch), ghost.deadline))
        return out

    def release(self, req_id: str, epoch: int, why: str, now: float) -> list[Effect]:
        """Release a held ghost before its lease (which is cancelled): ``why`` no byte of its
        epoch can land any more."""
        ghost = self.held[(req_id, epoch)]
        out: list[Effect] = [CancelTimer(lease_key(req_id, epoch))]
        self._free(ghost, why, now, out)
        return out

    def _free(self, ghost: Ghost, why: str, now: float, out: list[Effect]) -> None:
        """No byte of the ghost's epoch can land any more: its blocks go back."""
        del self.held[(ghost.req_id, ghost.epoch)]
        self.counters["ghosts_released"] += 1
        self.timeline.record(now, ghost.req_id, "ghost_released", "", "",
                             f"epoch {ghost.epoch}: {why}")
        out.append(ReleaseBlocks(ghost.req_id, ghost.epoch, ghost.blocks,
                                 f"claim epoch {ghost.epoch} abandoned ({why}): "
                                 f"{ghost.reason}"[:MAX_TEXT]))


# What the endpoint's snapshot leaves out of its ghosts, and why (lw.fsm.decode.SNAPSHOT_RULES).
GHOST_RULES: Rules = {
    Ghosts: {
        **{k: ENDPOINT_RULES[k] for k in ("me", "counters", "timeline")},
        "lease_s": (OMIT, "fixed when made (DecodeConfig.lease_s)"),
        "fence": (OMIT, "fixed when made (DecodeConfig.fence_data)"),
    },
    Ghost: {
        "reason": RECORD_RULES["reason"],
        "deadline": (OMIT, "the lease timer is armed by an effect"),
    },
}
