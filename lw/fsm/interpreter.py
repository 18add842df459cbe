"""The one interpreter of the core's effects: every driver (the runtime, the model checker's
world) carries them out through here, supplying only its ports.

What an effect means is decided once: writes of one batch go out together after its other
effects (one data-plane submit per destination), a write that could not even start feeds the
core's answer back into the same loop, and a DONE carries the sender's checksums when the
core marks it so (the driver only computes the CRCs). A driver's ports only move bytes, messages
and timers; they decide nothing about a request. No I/O here: ports do it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from lw.fsm.effects import (
    ArmTimer,
    CancelTimer,
    Effect,
    Quarantine,
    RecvDone,
    RecvFailed,
    Send,
    SendFinished,
    TimerKey,
    WriteLayer,
)
from lw.fsm.messages import DoneSending, Message

Report = SendFinished | RecvDone | RecvFailed | Quarantine
"""Effects that tell the driver's owner (vLLM's scheduler, the world's bookkeeping) an outcome."""

_REPORTS = (SendFinished, RecvDone, RecvFailed, Quarantine)


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

    def checksummed(self, msg: DoneSending, dest: str) -> DoneSending:
        """P: ``msg`` with the checksums of the writes to ``dest`` the core marked
        ``checksum`` (a DONE the core sends ``with_sums``)."""
        ...


def perform(effects: list[Effect], ports: EffectPorts,
            on_error: Callable[[Effect, Exception], None] | None = None) -> None:
    """Carry out ``effects`` in order, the writes of each batch together after the rest.

    ``on_error``: called with an effect whose port raised, and the loop goes on (the runtime:
    one bad effect must not stop the others); ``None`` lets the exception out (the checker:
    a port raising is a finding)."""
    work: deque[list[Effect]] = deque([effects])
    while work:
        writes: list[WriteLayer] = []
        for e in work.popleft():
            try:
                if isinstance(e, Send):
                    msg = e.msg
                    if e.with_sums and isinstance(msg, DoneSending):
                        msg = ports.checksummed(msg, e.dest)
                    ports.send(e.dest, msg)
                elif isinstance(e, WriteLayer):
                    writes.append(e)
                elif isinstance(e, ArmTimer):
                    ports.arm(e.key, e.at)
                elif isinstance(e, CancelTimer):
                    ports.cancel(e.key)
                elif isinstance(e, _REPORTS):
                    ports.report(e)
                else:
                    raise TypeError(f"unknown effect {e!r}")
            except Exception as exc:
                if on_error is None:
                    raise
                on_error(e, exc)
        if writes:
            work.extend(ports.write(writes))
