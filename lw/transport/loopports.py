"""The ports a worker loop gives :func:`lw.fsm.interpreter.perform` (a part of
:class:`lw.transport.runtime.WorkerLoop`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from lw.fsm import DecodeEndpoint, Effect, PrefillEndpoint, WriteLayer
from lw.fsm.effects import FenceData, Granted, SumPlan, TimerKey
from lw.fsm.interpreter import Answer, Report
from lw.fsm.messages import KVLayout, Message
from lw.transport.kvmemory import KVMemory
from lw.transport.timers import Timers
from lw.transport.wire import (
    Abort,
    AbortAck,
    Ack,
    DoneSending,
    FailedSending,
    MetaReply,
    MetaRequest,
)

if TYPE_CHECKING:
    from lw.transport.sidechannel import Inbound, SideChannel

_REPLIES = (MetaReply, Ack, AbortAck)  # answers: sent back on the asker's connection
_REQUESTS = (MetaRequest, DoneSending, FailedSending, Abort)  # questions: correlated


class PortsLoop(Protocol):
    """What the ports need of their :class:`~lw.transport.runtime.WorkerLoop` (not imported:
    it imports this module)."""

    endpoint: PrefillEndpoint | DecodeEndpoint
    side: SideChannel
    timers: Timers
    memory: KVMemory
    counters: dict[str, int | float]

    def now(self) -> float:
        """The loop's clock."""

    def start_writes(self, writes: list[WriteLayer]) -> list[list[Effect]]:
        """Start ``writes``; the core's effects for those that could not start."""

    def report(self, e: Report) -> None:
        """Hand a report to the engine."""

    def fence(self, e: FenceData) -> None:
        """Fence the data plane from ``e.senders``; the core hears the outcome later."""

    def fresh_blocks(self, req_id: str, count: int) -> Sequence[int] | None:
        """D: fresh blocks for ``req_id``'s next claim epoch, or None (refused)."""


class LoopPorts:
    """The runtime's ports for :func:`lw.fsm.interpreter.perform`: the side channel (a reply
    goes back on the asker's connection), the data plane, the loop's timer heap, the reports,
    CRC-32C over the worker's memory, and the core for the answers to checksum questions."""

    __slots__ = ("ib", "loop")

    def __init__(self, loop: PortsLoop, ib: Inbound | None) -> None:
        self.loop = loop
        self.ib = ib  # the message being answered, if any

    def send(self, dest: str, msg: Message) -> None:
        ib, side = self.ib, self.loop.side
        if ib is not None and isinstance(msg, _REPLIES):
            src = ib.msg
            origin = getattr(src, "sender", None) or getattr(src, "responder", None)
            if origin is not None and origin.addr == dest:
                side.reply(ib, dest, msg)
                return
        side.send(dest, msg, expect_reply=isinstance(msg, _REQUESTS))

    def write(self, writes: list[WriteLayer]) -> list[list[Effect]]:
        return self.loop.start_writes(writes)

    def arm(self, key: TimerKey, at: float) -> None:
        self.loop.timers.arm(key, at)

    def cancel(self, key: TimerKey) -> None:
        self.loop.timers.cancel(key)

    def report(self, effect: Report) -> None:
        self.loop.report(effect)

    def sum_blocks(self, layout: KVLayout, plan: SumPlan) -> list[list[int]]:
        self.loop.counters["checksums_verified"] += 1
        return KVMemory.sums_over(layout, plan)

    def kept_sums(self, req_id: str, target: str, layers: int) -> list[list[int]]:
        return self.loop.memory.kept_sums(req_id, target, layers)

    def fresh_blocks(self, req_id: str, count: int) -> Sequence[int] | None:
        return self.loop.fresh_blocks(req_id, count)

    def fence(self, effect: FenceData) -> None:
        self.loop.fence(effect)

    def answer(self, answer: Answer) -> list[Effect]:
        ep, now = self.loop.endpoint, self.loop.now()
        if isinstance(answer, Granted):
            assert isinstance(ep, DecodeEndpoint)
            return ep.on_fresh(answer, now)
        return ep.on_sums(answer, now)
