"""The world's virtual clock: timers the endpoints arm, write timeouts, in-doubt bytes
(a part of :class:`lw.sim.world.World`)."""

from __future__ import annotations

import math

from lw.fsm.effects import TimerKey, timer_name
from lw.sim.config import EPSILON, Action, Owner
from lw.sim.kvbytes import KVBytes
from lw.sim.pnode import PNode
from lw.sim.ports import Ports
from lw.sim.properties import Violation
from lw.sim.state import WorldState


class Clock:
    """Timer, timeout and in-doubt-byte actions (``now``, ``timers``, ``zombies``, the head of
    each ``fifo``).

    Abstract time: with faults and delays on, a timer may fire before pending work (arbitrary
    delays), and the world may *idle* until just before the next deadline, so that any event
    (a proxy start, a layer, a write) can happen arbitrarily late relative to the timers already
    armed, e.g. a P write submitted just before D's deadline fires. Deadlines keep their real
    values, so what the protocol relies on (D's lease exceeds P's request timeout plus the
    transfer timeout) still holds."""

    __slots__ = ("s", "ports", "kv", "p_node")

    def __init__(self, s: WorldState, ports: Ports, kv: KVBytes, p_node: PNode) -> None:
        self.s = s
        self.ports = ports
        self.kv = kv
        self.p_node = p_node

    def deadlines(self) -> list[tuple[float, Action]]:
        """Every pending deadline: (when, the action that happens then)."""
        s = self.s
        due: list[tuple[float, Action]] = [(at, ("timer", owner, key))
                                           for (owner, key), at in s.timers.items()]
        due += [(f[0][5], ("wto", i)) for i, f in enumerate(s.fifo) if f]
        due += [(z[5], ("zexp", z[0], z[1], z[2], z[3])) for z in s.zombies
                if z[5] != math.inf]
        due += [(f[4], ("fenced", f[0], f[1], f[2])) for f in s.fences
                if s.d_alive[f[0] // s.d_tp]]
        return due

    def due_timers(self) -> list[Action]:
        """The actions of the earliest deadline."""
        due = self.deadlines()
        if not due:
            return []
        first = min(at for at, _ in due)
        return [a for at, a in due if at == first]

    def idle(self, acts: list[Action]) -> list[Action]:
        """("idle",) when the clock can still move to just before the next deadline and either
        a write is in flight or that deadline is one of D's (its prefill deadline or a lease)
        for a request P is about to start, schedule or compute: P's next step for that request
        then happens after D armed its timer and just before it fires."""
        due = self.deadlines()
        if not due:
            return []
        first = min(at for at, _ in due)
        if first - self.s.now <= 1.5 * EPSILON:
            return []
        if any(self.s.fifo):
            # A write takes as long as the link makes it: it may complete just before any
            # deadline, P's own included (a slow-link run sent its DONE 17 ms before P's request
            # deadline, which then fired before the DONE's ack timer; issue 20, finding 8).
            return [("idle",)]
        for at, a in due:
            if at == first and a[0] == "timer" and a[1][0] == "d" and self.p_node.slow_for(
                    acts, a[2][1]):
                return [("idle",)]
        return []

    def do_idle(self) -> None:
        """Time passes, to just before the next deadline."""
        at = min(at for at, _ in self.deadlines()) - EPSILON
        self.s.note("Proxy", f"time passes: t={at:g}, just before the next deadline")
        self._tick(at)

    def do_wto(self, i: int) -> None:
        """The oldest write in flight of P worker ``i`` times out (in doubt)."""
        s = self.s
        r, seq, _l, remote, d, deadline, inc = s.fifo[i].pop(0)
        self._tick(deadline)
        q = s.reqs[r]
        s.note(f"P{i}", f"t={deadline:g}: write of {q.rid} {s.what(r, seq)} times out (in "
                        "doubt)")
        self.zombie(i, r, seq, d, remote, inc)
        self.ports.run(("p", i), s.p[i].transfer_done(q.rid, seq, False, "transfer timeout",
                                                      s.now, True))

    def zombie(self, i: int, r: int, seq: int, v: int, remote: tuple[int, ...],
               inc: int) -> None:
        """Bytes of a failed write that may still land in D's blocks for transfer_timeout_s, or
        at any later time with late_writes (not in another incarnation of D: the memory they
        were addressed to is gone)."""
        s = self.s
        if s.d_alive[v // s.d_tp] and inc == s.d_inc[v // s.d_tp]:
            # with the claim epoch of the attempt that wrote them (prefill failover)
            s.zombies.append((i, r, seq, v, remote, self.kv.zombie_deadline(),
                              s.reqs[r].p_epoch))

    def do_zexp(self, i: int, r: int, seq: int, v: int) -> None:
        """In-doubt bytes can no longer land."""
        s = self.s
        z = next(z for z in s.zombies if z[:4] == (i, r, seq, v))
        s.zombies.remove(z)
        self._tick(z[5])

    def do_timer(self, owner: Owner, key: TimerKey) -> None:
        """An endpoint's timer fires."""
        s = self.s
        at = s.timers.pop((owner, key))
        self._tick(at)
        kind, idx = owner
        s.note(f"{kind.upper()}{idx}", f"t={at:g}: timer {timer_name(key)} fires")
        if not s.cfg.faults and not s.cfg.misconfigured():
            raise Violation("no-deadline-without-faults",
                            f"{kind.upper()}{idx}'s timer {timer_name(key)} fired at t={at:g} "
                            "in a run without faults")
        before = self._deadline_count()
        if kind == "p":
            self.ports.run(owner, s.p[idx].on_timer(key, s.now))
        else:
            self.ports.run(owner, s.d[idx].on_timer(key, s.now))
        if self._deadline_count() > before or key[0] in ("meta", "ack"):
            s.flags.add("deadline")  # a deadline, lease or retry: the fault model bites

    def _tick(self, at: float) -> None:
        if at < self.s.now:
            raise AssertionError(f"clock would go back from {self.s.now} to {at}")
        self.s.now = at

    def _deadline_count(self) -> int:
        s = self.s
        n = sum(ep.counters["deadlines"] for ep in s.p)
        return n + sum(ep.counters["deadlines"] + ep.counters["leases_expired"]
                       + ep.counters["fences"] for ep in s.d)
