"""The world's virtual clock: timers the endpoints arm, write timeouts, in-doubt bytes
(a mixin of :class:`lw.sim.world.World`)."""

from __future__ import annotations

import math

from lw.sim.config import EPSILON, Action, Owner
from lw.sim.properties import Violation


class Clock:
    """Timer, timeout and in-doubt-byte actions.

    Abstract time: with faults and delays on, a timer may fire before pending work (arbitrary
    delays), and the world may *idle* until just before the next deadline, so that any event
    (a proxy start, a layer, a write) can happen arbitrarily late relative to the timers already
    armed, e.g. a P write submitted just before D's deadline fires. Deadlines keep their real
    values, so what the protocol relies on (D's lease exceeds P's request timeout plus the
    transfer timeout) still holds."""

    def _deadlines(self) -> list[tuple[float, Action]]:
        due: list[tuple[float, Action]] = [(at, ("timer", owner, key))
                                           for (owner, key), at in self.timers.items()]
        due += [(f[0][5], ("wto", i)) for i, f in enumerate(self.fifo) if f]
        due += [(z[5], ("zexp", z[0], z[1], z[2], z[3])) for z in self.zombies
                if z[5] != math.inf]
        return due

    def _due_timers(self) -> list[Action]:
        due = self._deadlines()
        if not due:
            return []
        first = min(at for at, _ in due)
        return [a for at, a in due if at == first]

    def _idle(self, acts: list[Action]) -> list[Action]:
        """("idle",) when the next deadline is one of D's (its prefill deadline or a lease) for a
        request P is about to start, schedule or compute, and the clock can still move to just
        before it: P's next step for that request then happens after D armed its timer and
        just before it fires. (P's own timers are relative to P's own events.)"""
        due = self._deadlines()
        if not due:
            return []
        first = min(at for at, _ in due)
        if first - self.now <= 1.5 * EPSILON:
            return []
        for at, a in due:
            if at == first and a[0] == "timer" and a[1][0] == "d" and self._slow_for(
                    acts, a[2][1]):
                return [("idle",)]
        return []

    def _do_idle(self) -> None:
        at = min(at for at, _ in self._deadlines()) - EPSILON
        self._note("Proxy", f"time passes: t={at:g}, just before the next deadline")
        self._tick(at)

    def _do_wto(self, i: int) -> None:
        r, seq, _l, remote, d, deadline, inc = self.fifo[i].pop(0)
        self._tick(deadline)
        q = self.reqs[r]
        self._note(f"P{i}", f"t={deadline:g}: write of {q.rid} {self.what(r, seq)} times out (in "
                            "doubt)")
        self._zombie(i, r, seq, d, remote, inc)
        self._effects(("p", i), self.p[i].transfer_done(q.rid, seq, False, "transfer timeout",
                                                        self.now, True))

    def _zombie(self, i: int, r: int, seq: int, v: int, remote: tuple[int, ...],
                inc: int) -> None:
        """Bytes of a failed write that may still land in D's blocks for transfer_timeout_s, or
        at any later time with late_writes (not in another incarnation of D: the memory they
        were addressed to is gone)."""
        if self.d_alive[v // self.d_tp] and inc == self.d_inc[v // self.d_tp]:
            # with the claim epoch of the attempt that wrote them (prefill failover)
            self.zombies.append((i, r, seq, v, remote, self._zombie_deadline(),
                                 self.reqs[r].p_epoch))

    def _do_zexp(self, i: int, r: int, seq: int, v: int) -> None:
        z = next(z for z in self.zombies if z[:4] == (i, r, seq, v))
        self.zombies.remove(z)
        self._tick(z[5])

    def _do_timer(self, owner: Owner, key: tuple[str, str]) -> None:
        at = self.timers.pop((owner, key))
        self._tick(at)
        kind, idx = owner
        self._note(f"{kind.upper()}{idx}", f"t={at:g}: timer {key[0]}({key[1]}) fires")
        if not self.cfg.faults and not self.cfg.misconfigured():
            raise Violation("no-deadline-without-faults",
                            f"{kind.upper()}{idx}'s timer {key[0]}({key[1]}) fired at t={at:g} "
                            "in a run without faults")
        before = self._deadline_count()
        if kind == "p":
            self._effects(owner, self.p[idx].on_timer(key, self.now))
        else:
            self._effects(owner, self.d[idx].on_timer(key, self.now))
        if self._deadline_count() > before or key[0] in ("meta", "ack"):
            self.flags.add("deadline")  # a deadline, lease or retry: the fault model bites

    def _tick(self, at: float) -> None:
        if at < self.now:
            raise AssertionError(f"clock would go back from {self.now} to {at}")
        self.now = at

    def _deadline_count(self) -> int:
        n = sum(ep.counters["deadlines"] for ep in self.p)
        return n + sum(ep.counters["deadlines"] + ep.counters["leases_expired"] for ep in self.d)
