"""The one interpreter of the core's effects: every driver (the runtime, the model checker's
world) carries them out through here, supplying only its ports.

What an effect means is decided once: writes of one batch go out together after its other
effects (one data-plane submit per destination), a write that could not even start feeds the
core's answer back into the same loop, and a checksum question (``SumBlocks`` on D,
``KeptSums`` on P) or D's question for fresh blocks (``FreshBlocks``) is answered here and
now: the ports compute or look up the CRCs, or allocate blocks, and the interpreter hands the
answer to the core (``on_sums``, ``on_fresh``) before anything else can happen (why:
lw.fsm.effects). A driver's ports only move bytes, messages and timers, sum memory and
allocate blocks, start a fence; they decide nothing about a request. No I/O here: ports do it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from lw.fsm.effects import (
    ArmTimer,
    CancelTimer,
    Effect,
    FenceData,
    FirstTokenTaken,
    FreshBlocks,
    Granted,
    KeptSums,
    Quarantine,
    RecvDone,
    RecvFailed,
    ReleaseBlocks,
    Reprefill,
    Send,
    SendFinished,
    SumBlocks,
    SumPlan,
    Sums,
    TimerKey,
    WriteLayer,
)
from lw.fsm.messages import KVLayout, Message

Report = (SendFinished | RecvDone | RecvFailed | Quarantine | Reprefill | ReleaseBlocks
          | FirstTokenTaken)
"""Effects that tell the driver's owner (vLLM's scheduler, the world's bookkeeping) an outcome."""

_REPORTS = (SendFinished, RecvDone, RecvFailed, Quarantine, Reprefill, ReleaseBlocks,
            FirstTokenTaken)

Answer = Sums | Granted
"""The answers to the core's questions, handed back to it by :meth:`EffectPorts.answer`."""


class EffectPorts(Protocol):
    """What a driver supplies to :func:`perform`."""

    def send(self, dest: str, msg: Message) -> None:
        """Put ``msg`` on the side channel to the worker at ``dest``."""

    def write(self, writes: list[WriteLayer]) -> list[list[Effect]]:
        """Start ``writes`` (non-blocking); return the core's effects for those that could not
        start (the driver asks the core with ``transfer_done(..., ok=False)``)."""
        ...

    def arm(self, key: TimerKey, at: float) -> None:
        """Call the core's ``on_timer(key)`` at ``at`` (re-arming replaces)."""

    def cancel(self, key: TimerKey) -> None:
        """Forget timer ``key``."""

    def report(self, effect: Report) -> None:
        """Hand an outcome to the driver's owner."""

    def sum_blocks(self, layout: KVLayout, plan: SumPlan) -> Sequence[Sequence[int]]:
        """D: per layer of ``layout`` (our memory), the CRC-32C of each of ``plan.blocks`` over
        that layer's ``plan.runs``."""
        ...

    def kept_sums(self, req_id: str, target: str, layers: int) -> Sequence[Sequence[int]]:
        """P: per layer up to ``layers``, the CRC-32C kept of each block the writes of
        ``req_id`` to ``target`` marked ``checksum`` sent (empty where none was kept)."""
        ...

    def fresh_blocks(self, req_id: str, count: int) -> Sequence[int] | None:
        """D: ``count`` free blocks allocated now for a request's next claim epoch (none of
        its own), or None: refused (none free, or a driver that cannot allocate here)."""
        ...

    def fence(self, effect: FenceData) -> None:
        """D: start cutting the data-plane connections from ``effect.senders`` into this worker
        (non-blocking); answer the core's ``data_fenced`` when done or failed."""

    def answer(self, answer: Answer) -> list[Effect]:
        """Hand an answer to the core (``Sums`` to its ``on_sums``, ``Granted`` to D's
        ``on_fresh``, at the driver's now); its effects."""
        ...


def perform(effects: list[Effect], ports: EffectPorts,
            on_error: Callable[[Effect, Exception], None] | None = None) -> None:
    """Carry out ``effects`` in order, the writes of each batch together after the rest; the
    core's effects for writes that could not start, and its answer to checksums it asked for,
    are performed after the batch that caused them.

    ``on_error``: called with an effect whose port raised, and the loop goes on (the runtime:
    one bad effect must not stop the others); ``None`` lets the exception out (the checker:
    a port raising is a finding)."""
    work: deque[list[Effect]] = deque([effects])
    while work:
        writes: list[WriteLayer] = []
        for e in work.popleft():
            try:
                if isinstance(e, Send):
                    ports.send(e.dest, e.msg)
                elif isinstance(e, WriteLayer):
                    writes.append(e)
                elif isinstance(e, ArmTimer):
                    ports.arm(e.key, e.at)
                elif isinstance(e, CancelTimer):
                    ports.cancel(e.key)
                elif isinstance(e, _REPORTS):
                    ports.report(e)
                elif isinstance(e, SumBlocks):
                    got = tuple(ports.sum_blocks(e.layout, plan) for plan in e.plans)
                    work.append(ports.answer(Sums(e, got)))
                elif isinstance(e, FenceData):
                    ports.fence(e)
                elif isinstance(e, FreshBlocks):
                    got = ports.fresh_blocks(e.req_id, e.count)
                    work.append(ports.answer(Granted(e, None if got is None else tuple(got))))
                elif isinstance(e, KeptSums):
                    got = tuple(ports.kept_sums(e.req_id, t, e.layers) for t in e.targets)
                    work.append(ports.answer(Sums(e, got)))
                else:
                    raise TypeError(f"unknown effect {e!r}")
            except Exception as exc:
                if on_error is None:
                    raise
                on_error(e, exc)
        if writes:
            work.extend(ports.write(writes))
