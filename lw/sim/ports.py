"""How the checker world performs the endpoints' effects: the ports of
:func:`lw.fsm.interpreter.perform` (messages into the network multiset, writes into a P
worker's data plane, timers into the clock, reports and sums to the parts that keep them), and
the serial-handshake quirk's lane of first contacts (a part of :class:`lw.sim.world.World`).

The parts that take reports are declared here as protocols and connected once the world has
made them (:meth:`Ports.connect`), so that this module needs none of them.
"""

from __future__ import annotations

import weakref
from typing import Protocol

from lw.fsm import Effect, Quarantine, RecvDone, RecvFailed, Reprefill, SendFinished, WriteLayer
from lw.fsm.effects import FenceData, FirstTokenTaken, Granted, ReleaseBlocks, SumPlan, TimerKey
from lw.fsm.interpreter import Answer, Report, perform
from lw.fsm.messages import KVLayout, Message, MetaRequest
from lw.sim.config import Owner, _who, d_addr, p_addr
from lw.sim.kvbytes import KVBytes
from lw.sim.state import WorldState


class SendReports(Protocol):
    """Where P's reports go (P's scheduler)."""

    def on_send_finished(self, i: int, e: SendFinished) -> None:
        """P worker ``i`` finished sending a request."""


class RecvReports(Protocol):
    """Where D's reports go (D's scheduler)."""

    def on_recv_done(self, v: int, e: RecvDone) -> None:
        """D worker ``v`` has every layer of a request."""

    def on_recv_failed(self, v: int, e: RecvFailed) -> None:
        """D worker ``v`` failed a request and released its blocks."""

    def on_quarantine(self, v: int, e: Quarantine) -> None:
        """D worker ``v`` failed a request and holds its blocks."""

    def on_release(self, v: int, e: ReleaseBlocks) -> None:
        """D worker ``v`` frees the blocks of a request's abandoned claim epoch."""

    def fresh_blocks(self, v: int, req_id: str, count: int) -> tuple[int, ...] | None:
        """D worker ``v``'s scheduler allocates fresh blocks for a request, or refuses."""

    def on_first_token(self, v: int, e: FirstTokenTaken) -> None:
        """D worker ``v`` took P's first token of a request (its scheduler decides its use)."""


class RetryReports(Protocol):
    """Where D's requests to prefill again go (the proxy's failover)."""

    def on_reprefill(self, v: int, e: Reprefill) -> None:
        """D worker ``v`` asks for a new prefill attempt."""


class WriteSink(Protocol):
    """Where P's writes go (the data plane)."""

    def on_write(self, i: int, e: WriteLayer) -> None:
        """P worker ``i`` submits a write."""

    def on_fence(self, v: int, e: FenceData) -> None:
        """D worker ``v`` asks for a fence of the data plane from some senders."""


class Ports:
    """Routes one endpoint's effects into the world (reads and writes ``net``, ``timers``,
    ``lane``, ``held``; the rest through the connected parts)."""

    __slots__ = ("s", "kv", "p_node", "d_node", "failover", "data")

    p_node: SendReports
    d_node: RecvReports
    failover: RetryReports
    data: WriteSink

    def __init__(self, s: WorldState, kv: KVBytes) -> None:
        self.s = s
        self.kv = kv

    def connect(self, p_node: SendReports, d_node: RecvReports, failover: RetryReports,
                data: WriteSink) -> None:
        """The parts that take the endpoints' reports and writes (held weakly: they hold these
        ports, and a world without reference cycles is freed as soon as the explorer drops it,
        not by the cyclic garbage collector)."""
        self.p_node = weakref.proxy(p_node)
        self.d_node = weakref.proxy(d_node)
        self.failover = weakref.proxy(failover)
        self.data = weakref.proxy(data)

    def run(self, owner: Owner, effects: list[Effect]) -> None:
        """Perform the effects an endpoint returned (the runtime's interpreter, the world's
        ports)."""
        perform(effects, _Port(self, owner))

    # ------------------------------------------------------------------ serial-handshake
    def handshake(self, w: int, dest: str, msg: MetaRequest) -> None:
        """Quirk serial-handshake: one first contact in flight per P worker; others wait."""
        s = self.s
        if s.lane[w] in (None, dest):
            s.lane[w] = dest
            s.net.add(p_addr(w), dest, msg)
        elif all(h != (dest, msg) for h in s.held[w]):
            s.held[w].append((dest, msg))
            s.note(f"P{w}", f"first contact with {_who(dest)} for {msg.req_id} waits behind "
                            f"the one with {_who(s.lane[w] or '')}")

    def next_handshake(self, w: int) -> None:
        """P worker ``w``'s first contact was answered: send what waited behind it."""
        s = self.s
        s.lane[w] = None
        held, s.held[w] = s.held[w], []
        for dest, msg in held:
            self.handshake(w, dest, msg)


class _Port:
    """The ports for one endpoint (``owner``), as :func:`lw.fsm.interpreter.perform` calls
    them."""

    __slots__ = ("idx", "kind", "me", "ports")

    def __init__(self, ports: Ports, owner: Owner) -> None:
        self.ports = ports
        self.kind, self.idx = owner
        self.me = p_addr(self.idx) if self.kind == "p" else d_addr(self.idx)

    def send(self, dest: str, msg: Message) -> None:
        ports = self.ports
        if self.kind == "p" and "serial-handshake" in ports.s.quirks and isinstance(
                msg, MetaRequest) and msg.want_layout:
            ports.handshake(self.idx, dest, msg)
        else:
            ports.s.net.add(self.me, dest, msg)

    def write(self, writes: list[WriteLayer]) -> list[list[Effect]]:
        data = self.ports.data
        for e in writes:
            data.on_write(self.idx, e)
        return []  # the world's data plane fails writes later, as actions

    def arm(self, key: TimerKey, at: float) -> None:
        s = self.ports.s
        if s.design.timers:
            s.timers[((self.kind, self.idx), key)] = at

    def cancel(self, key: TimerKey) -> None:
        self.ports.s.timers.pop(((self.kind, self.idx), key), None)

    def report(self, e: Report) -> None:
        ports = self.ports
        if isinstance(e, SendFinished):
            ports.p_node.on_send_finished(self.idx, e)
        elif isinstance(e, RecvDone):
            ports.d_node.on_recv_done(self.idx, e)
        elif isinstance(e, RecvFailed):
            ports.d_node.on_recv_failed(self.idx, e)
        elif isinstance(e, Reprefill):
            ports.failover.on_reprefill(self.idx, e)
        elif isinstance(e, ReleaseBlocks):
            ports.d_node.on_release(self.idx, e)
        elif isinstance(e, FirstTokenTaken):
            ports.d_node.on_first_token(self.idx, e)
        else:
            ports.d_node.on_quarantine(self.idx, e)

    def sum_blocks(self, layout: KVLayout, plan: SumPlan) -> list[list[int]]:
        return self.ports.kv.block_sums(self.idx, plan, len(layout.layers))

    def kept_sums(self, req_id: str, target: str, layers: int) -> list[list[int]]:
        return self.ports.kv.kept_sums(req_id, layers)

    def fresh_blocks(self, req_id: str, count: int) -> tuple[int, ...] | None:
        return self.ports.d_node.fresh_blocks(self.idx, req_id, count)

    def fence(self, effect: FenceData) -> None:
        self.ports.data.on_fence(self.idx, effect)

    def answer(self, answer: Answer) -> list[Effect]:
        s = self.ports.s
        if isinstance(answer, Granted):
            return s.d[self.idx].on_fresh(answer, s.now)
        ep = s.p[self.idx] if self.kind == "p" else s.d[self.idx]
        return ep.on_sums(answer, s.now)
