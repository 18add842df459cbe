"""D's prefill failover into fresh blocks (``DecodeConfig.retry_fresh_blocks``), a part of
:class:`lw.fsm.decode.DecodeEndpoint`: the driver's answer to D's question for fresh blocks, and
the ghosts of abandoned claim epochs, whose blocks are quarantined as a failed request's are
until every sender of that epoch stopped or its lease passed (docs/protocol.md, "Prefill
failover").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lw.fsm.decode_request import DecodeConfig, DecodeRecord, Ghost, brief_blocks
from lw.fsm.effects import (
    ArmTimer,
    CancelTimer,
    Effect,
    Granted,
    ReleaseBlocks,
    Send,
    TimerKey,
)
from lw.fsm.machine import ProtocolError
from lw.fsm.messages import (
    MAX_TEXT,
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    DoneSending,
    FailedSending,
    Sender,
)
from lw.fsm.timeline import Timeline

__all__ = ["FreshRetries"]

GHOST_TIMER = "ghost:"  # timer kind of a ghost's lease: "ghost:<epoch>", keyed by request


class FreshRetries:
    """Ghosts of abandoned claim epochs (``_ghosts``), and the answer to ``FreshBlocks``."""

    # Set by DecodeEndpoint (declared here: these methods read them).
    config: DecodeConfig
    me: Sender
    counters: dict[str, int]
    timeline: Timeline
    _reqs: dict[str, DecodeRecord]
    _ghosts: dict[tuple[str, int], Ghost]

    def _fence(self, rec: DecodeRecord, pending: list[Sender], now: float,
               out: list[Effect]) -> None:
        raise NotImplementedError

    def _new_epoch(self, rec: DecodeRecord, now: float, out: list[Effect]) -> None:
        raise NotImplementedError

    def _ack(self, msg: DoneSending | FailedSending, of: str, accepted: bool) -> Any:
        raise NotImplementedError

    def ghosts(self) -> dict[tuple[str, int], tuple[int, ...]]:
        """Abandoned claim epochs (request, epoch) whose blocks must not be touched yet."""
        return {k: g.blocks for k, g in self._ghosts.items()}

    def _ghost_timer(self, key: TimerKey, now: float, out: list[Effect]) -> bool:
        """Whether ``key`` is a ghost's lease (then handled: the ghost, if still held, is
        released, since every write of its senders has landed or never will)."""
        kind, rid = key
        if not kind.startswith(GHOST_TIMER):
            return False
        ghost = self._ghosts.get((rid, int(kind[len(GHOST_TIMER):])))
        if ghost is not None:
            self.counters["leases_expired"] += 1
            self._release_ghost(ghost, "lease expired", now, out)
        return True

    def on_fresh(self, answer: Granted, now: float) -> list[Effect]:
        """The driver's answer to a :class:`FreshBlocks`: with blocks, the lost epoch's blocks
        and its senders become a ghost (quarantined; its senders aborted) and the request goes
        on at once under the next epoch in the fresh blocks, where no byte of the lost epoch
        can land (its writes name the old blocks). Refused: FENCING, as without the setting."""
        ask = answer.ask
        rec = self._reqs.get(ask.req_id)
        if rec is None or not rec.asking or ask.epoch != rec.epoch + 1:
            raise ProtocolError("decode", ask.req_id, rec.state if rec else "UNKNOWN", "fresh",
                                "fresh blocks nobody asked for")
        rec.asking = False
        out: list[Effect] = [CancelTimer(("deadline", rec.req_id))]
        pending = {k: s for k, s in rec.claimers.items() if k not in rec.stopped}
        blocks = answer.blocks
        if blocks is None:
            self.counters["fresh_refused"] += 1
            self._fence(rec, list(pending.values()), now, out)
            return out
        problem = self._grant_problem(rec, blocks)
        if problem:
            raise ProtocolError("decode", rec.req_id, rec.state, "fresh", problem)
        self.counters["fresh_blocks"] += 1
        ghost = Ghost(rec.req_id, rec.epoch, rec.blocks, pending, rec.reason,
                      now + self.config.lease_s)
        self._ghosts[(rec.req_id, rec.epoch)] = ghost
        self.timeline.record(now, rec.req_id, "fresh", "", "",
                             f"epoch {rec.epoch}: {len(rec.blocks)} block(s) quarantined "
                             f"until {len(pending)} sender(s) stopped")
        for sender in pending.values():
            out.append(Send(sender.addr, Abort(PROTOCOL_VERSION, rec.req_id, self.me,
                                               rec.reason[:MAX_TEXT], rec.epoch)))
        out.append(ArmTimer((f"{GHOST_TIMER}{rec.epoch}", rec.req_id), ghost.deadline))
        rec.blocks = tuple(blocks)
        self._new_epoch(rec, now, out)
        return out

    def _grant_problem(self, rec: DecodeRecord, blocks: Sequence[int]) -> str:
        """Why granted blocks cannot be the request's next ones ("" if they can): another
        number than asked, or a block some request or ghost here holds (a driver's bug)."""
        if len(blocks) != len(rec.blocks) or len(set(blocks)) != len(blocks):
            return (f"granted {brief_blocks(blocks)} for {len(rec.blocks)} block(s): not as many "
                    "distinct blocks as asked")
        held = {b for r in self._reqs.values() for b in r.blocks}
        held.update(b for g in self._ghosts.values() for b in g.blocks)
        taken = sorted(held.intersection(blocks))
        if taken:
            return f"granted block(s) {brief_blocks(taken)} that are held here already"
        return ""

    def _to_ghost(self, msg: DoneSending | FailedSending | AbortAck, now: float,
                  out: list[Effect]) -> bool:
        """A message of an abandoned epoch whose ghost is held: the ghost takes it (a
        DoneSending or a FailedSending not in doubt, an AbortAck not in doubt: that sender
        stopped), answered "not accepted". Whether it was such a message."""
        ghost = self._ghosts.get((msg.req_id, msg.epoch))
        if ghost is None:
            return False
        rec = self._reqs.get(msg.req_id)
        if rec is not None and rec.epoch == msg.epoch:
            return False  # the id was given to a new request: its own epoch goes first
        key = (msg.sender.engine_id, msg.sender.rank)
        if isinstance(msg, DoneSending):
            out.append(self._ack(msg, "done", False))
        elif isinstance(msg, FailedSending):
            out.append(self._ack(msg, "failed", False))
        self.counters["stale_epoch"] += 1
        if key in ghost.pending and not getattr(msg, "in_doubt", False):
            del ghost.pending[key]
        self.timeline.record(now, msg.req_id, "ghost", "", "",
                             f"epoch {msg.epoch}: {type(msg).__name__} from P {key[0]} rank "
                             f"{key[1]}, {len(ghost.pending)} sender(s) left")
        if not ghost.pending:
            out.append(CancelTimer((f"{GHOST_TIMER}{ghost.epoch}", ghost.req_id)))
            self._release_ghost(ghost, "every sender stopped", now, out)
        return True

    def _release_ghost(self, ghost: Ghost, why: str, now: float, out: list[Effect]) -> None:
        """No byte of the ghost's epoch can land any more: its blocks go back."""
        del self._ghosts[(ghost.req_id, ghost.epoch)]
        self.counters["ghosts_released"] += 1
        self.timeline.record(now, ghost.req_id, "ghost_released", "", "",
                             f"epoch {ghost.epoch}: {why}")
        out.append(ReleaseBlocks(ghost.req_id, ghost.epoch, ghost.blocks,
                                 f"claim epoch {ghost.epoch} abandoned ({why}): "
                                 f"{ghost.reason}"[:MAX_TEXT]))
