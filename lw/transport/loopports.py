"""The ports a worker loop gives :func:`lw.fsm.interpreter.perform` (a part of
:class:`lw.transport.runtime.WorkerLoop`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lw.fsm import DecodeEndpoint, Effect, WriteLayer
from lw.fsm.effects import FenceData, Granted, SumPlan, TimerKey
from lw.fsm.interpreter import Answer, Report
from lw.fsm.messages import KVLayout, Message
from lw.transport.kvmemory import KVMemory

if TYPE_CHECKING:
    from lw.transport.sidechannel import Inbound


class LoopPorts:
    """The runtime's ports for :func:`lw.fsm.interpreter.perform`: the side channel (a reply
    goes back on the asker's connection), the data plane, the loop's timer heap, the reports,
    CRC-32C over the worker's memory, and the core for the answers to checksum questions."""

    __slots__ = ("ib", "loop")

    def __init__(self, loop: Any, ib: Inbound | None) -> None:
        # loop: the WorkerLoop (not imported: it imports this module)
        self.loop = loop
        self.ib = ib  # the message being answered, if any

    def send(self, dest: str, msg: Message) -> None:
        self.loop._send(dest, msg, self.ib)

    def write(self, writes: list[WriteLayer]) -> list[list[Effect]]:
        return self.loop._write(writes)

    def arm(self, key: TimerKey, at: float) -> None:
        self.loop.timers.arm(key, at)

    def cancel(self, key: TimerKey) -> None:
        self.loop.timers.cancel(key)

    def report(self, effect: Report) -> None:
        self.loop._report(effect)

    def sum_blocks(self, layout: KVLayout, plan: SumPlan) -> list[list[int]]:
        self.loop.counters["checksums_verified"] += 1
        return KVMemory.sums_over(layout, plan)

    def kept_sums(self, req_id: str, target: str, layers: int) -> list[list[int]]:
        return self.loop.memory.kept_sums(req_id, target, layers)

    def fresh_blocks(self, req_id: str, count: int) -> Sequence[int] | None:
        fresh = self.loop._fresh_blocks
        return None if fresh is None else fresh(req_id, count)

    def fence(self, effect: FenceData) -> None:
        self.loop._fence(effect)

    def answer(self, answer: Answer) -> list[Effect]:
        ep, now = self.loop.endpoint, self.loop._clock()
        if isinstance(answer, Granted):
            assert isinstance(ep, DecodeEndpoint)
            return ep.on_fresh(answer, now)
        return ep.on_sums(answer, now)
