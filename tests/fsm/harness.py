"""A tiny synchronous driver for core tests: routes Send effects, completes writes on request."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lw.fsm import (
    ArmTimer,
    CancelTimer,
    DecodeEndpoint,
    Effect,
    PrefillEndpoint,
    RecvDone,
    RecvFailed,
    Send,
    SendFinished,
    SumBlocks,
    Sums,
    WriteLayer,
)
from lw.transport.wire import DoneSending, KVLayout, LayerLayout, Sender, decode, encode

P_ADDR = "tcp://p0"
D_ADDR = "tcp://d0"


def p_sender(rank: int = 0) -> Sender:
    return Sender("P", rank, 1, f"{P_ADDR}/{rank}")


def d_sender(incarnation: int = 1) -> Sender:
    return Sender("D", 0, incarnation, D_ADDR)


def d_layout(num_layers: int, incarnation: int = 1, num_blocks: int = 64) -> KVLayout:
    layers = [LayerLayout(0x1000_0000 + i * 0x100_0000, 4096, 4096, num_blocks)
              for i in range(num_layers)]
    return KVLayout("D", incarnation, "127.0.0.1:15000", layers)


def done_to_d(d: DecodeEndpoint, msg: DoneSending, now: float,
              local: Mapping[tuple[str, int], Sequence[int]] | Sequence[int]) -> list[Effect]:
    """Hand D a DONE and answer the SumBlocks it asks (kv_checksum) with ``local`` as the
    driver's sums, flat per sender (bare: the DONE's sender's); a sender not in it: none."""
    out = d.on_message(msg, now)
    asks = [e for e in out if isinstance(e, SumBlocks)]
    if not asks:
        return out
    (ask,) = asks
    if not isinstance(local, Mapping):
        local = {(msg.sender.engine_id, msg.sender.rank): local}
    got = tuple((tuple(local[p.sender]),) if p.sender in local else () for p in ask.plans)
    return [e for e in out if e is not ask] + d.on_sums(Sums(ask, got), now)


@dataclass
class Pair:
    """One P rank (or several) and one D worker with a message queue between them."""

    ps: list[PrefillEndpoint]
    d: DecodeEndpoint
    now: float = 0.0
    queue: list[Send] = field(default_factory=list)
    writes: list[tuple[int, WriteLayer]] = field(default_factory=list)
    timers: dict[tuple[int | str, tuple[str, str]], float] = field(default_factory=dict)
    finished: list[SendFinished] = field(default_factory=list)
    recv: list[RecvDone | RecvFailed] = field(default_factory=list)
    other: list[Effect] = field(default_factory=list)

    def absorb(self, who: int | str, effects: list[Effect]) -> None:
        for e in effects:
            if isinstance(e, Send):
                self.queue.append(e)
            elif isinstance(e, WriteLayer):
                self.writes.append((int(who), e))
            elif isinstance(e, ArmTimer):
                self.timers[(who, e.key)] = e.at
            elif isinstance(e, CancelTimer):
                self.timers.pop((who, e.key), None)
            elif isinstance(e, SendFinished):
                self.finished.append(e)
            elif isinstance(e, (RecvDone, RecvFailed)):
                self.recv.append(e)
            else:
                self.other.append(e)

    def deliver_all(self) -> None:
        while self.queue:
            s = self.queue.pop(0)
            msg = decode(encode(s.msg))  # every message crosses the real wire format
            if s.dest == D_ADDR:
                self.absorb("d", self.d.on_message(msg, self.now))
            else:
                rank = int(s.dest.rsplit("/", 1)[1])
                self.absorb(rank, self.ps[rank].on_message(msg, self.now))

    def complete_writes(self, ok: bool = True, reason: str = "") -> None:
        while self.writes:
            rank, w = self.writes.pop(0)
            self.absorb(rank, self.ps[rank].transfer_done(w.req_id, w.seq, ok, reason, self.now))

    def advance(self, to: float) -> None:
        """Move the clock to ``to`` firing due timers in time order."""
        while True:
            # P workers are ints and D is "d": a P and a D timer due at the same instant are
            # ordered by the owner's name (comparing an int with a str would raise)
            due = sorted(((at, who, key) for (who, key), at in self.timers.items() if at <= to),
                         key=lambda d: (d[0], str(d[1]), d[2]))
            if not due:
                break
            at, who, key = due[0]
            del self.timers[(who, key)]
            self.now = at
            if who == "d":
                self.absorb("d", self.d.on_timer(key, at))
            else:
                self.absorb(who, self.ps[int(who)].on_timer(key, at))
            self.deliver_all()
        self.now = to
