"""Prefill failover in the checker world: P DP ranks as separate P engines, one of which may
die (``rank-crash``), and the proxy that performs D's ``Reprefill`` on a live rank (a part of
:class:`lw.sim.world.World`).

With ``retry_prefill`` each DP rank is a P engine of its own (engine id ``P<rank>``): a dead
rank's place in the lock step is taken by a dummy stepper (as the synthetic cluster's ghost),
its writes in flight may still land (zombies of their claim epoch), and each D worker may learn
of it at any later time (``peer_lost``). A re-prefill is started by the proxy once D asked for
it and the old attempt's P side is over (its rank dead, or its blocks freed): the world then
describes the new attempt in the request's P-side fields, on the lowest live rank D does not
avoid. Without such a rank the request waits for D's deadline, as with no P at all.
"""

from __future__ import annotations

from lw.fsm import Reprefill
from lw.fsm.lifecycles import PREFILL_REQUESTED
from lw.sim.clock import Clock
from lw.sim.config import Action, p_addr
from lw.sim.ports import Ports
from lw.sim.properties import Violation
from lw.sim.proxy import Proxy
from lw.sim.state import WorldState


class Failover:
    """Rank crashes (``dead_ranks``), their detection (``rank_lost_seen``), and re-prefills
    (the requests' ``retry``, ``epoch`` and P-side fields)."""

    __slots__ = ("s", "ports", "clock", "proxy", "__weakref__")  # the ports hold it weakly

    def __init__(self, s: WorldState, ports: Ports, clock: Clock, proxy: Proxy) -> None:
        self.s = s
        self.ports = ports
        self.clock = clock
        self.proxy = proxy

    # ------------------------------------------------------------------ rank crashes
    def rank_crash_actions(self) -> list[Action]:
        """The P ranks that may crash alone now."""
        s = self.s
        if not s.p_alive or s.phase is not None:
            return []  # between steps: a rank dies with no collective half done
        return [("crash_rank", i) for i in range(s.cfg.dp) if s.rank_alive(i)]

    def do_crash_rank(self, i: int) -> None:
        """P DP rank ``i`` dies alone (its engine's other ranks live)."""
        s = self.s
        s.dead_ranks = s.dead_ranks | {i}
        workers = s.workers_of(i)
        for w in workers:
            if s.cfg.crash_zombies:  # bytes already handed to the transport may still land
                for r, seq, _l, remote, v, _dl, inc in s.fifo[w]:
                    self.clock.zombie(w, r, seq, v, remote, inc)
            s.fifo[w] = []
            s.unpolled[w] = []
        s.timers = {k: t for k, t in s.timers.items()
                    if not (k[0][0] == "p" and k[0][1] in workers)}
        s.net.drop_to([p_addr(w) for w in workers])
        for lst in (s.p_queue, s.p_batch, s.p_free_pending, s.p_running):
            lst[i] = []
        for q in s.reqs:
            if q.p_rank == i and q.p_stage in ("queued", "scheduled", "finished"):
                q.p_stage = "lost"
                q.p_crashes += 1
        s.note(f"P{i * s.tp}", f"P rank {i} crashes (engine {s.p_engine(i)})")

    def rank_lost_actions(self) -> list[Action]:
        """D workers that may learn now of a dead P rank."""
        s = self.s
        if not s.cfg.p_loss_detection:
            return []
        return [("rank_lost", v, i) for i in sorted(s.dead_ranks) for v in range(len(s.d))
                if s.d_alive[v // s.d_tp] and (v, i) not in s.rank_lost_seen]

    def do_rank_lost(self, v: int, i: int) -> None:
        """D worker ``v`` learns that P rank ``i`` died."""
        s = self.s
        s.rank_lost_seen = s.rank_lost_seen | {(v, i)}
        self.ports.run(("d", v), s.d[v].peer_lost(s.p_engine(i), "heartbeats lost", s.now))

    # ------------------------------------------------------------------ re-prefill
    def on_reprefill(self, v: int, e: Reprefill) -> None:
        """D worker ``v`` asks for another prefill attempt of a request."""
        s = self.s
        q = s.reqs[int(e.req_id[1:])]
        if e.block_ids != q.d_remote:
            raise Violation("kv-placement", f"D{v} asks to prefill {q.rid} again into block(s) "
                                            f"{list(e.block_ids)}, not its {list(q.d_remote)}")
        if e.epoch > s.cfg.retry_prefill:
            raise Violation("request-ends",
                            f"D{v} asks for prefill attempt {e.epoch + 1} of {q.rid}, beyond "
                            f"its budget of {s.cfg.retry_prefill} retries: a request whose "
                            "P keeps failing is retried for ever (an abort storm)")
        q.epoch = e.epoch
        q.retry = e.avoid
        s.note(f"D{v}", f"{q.rid}: prefill again under claim epoch {e.epoch} "
                        f"(avoid {', '.join(e.avoid) or 'none'})")

    def reprefill_actions(self) -> list[Action]:
        """The re-prefills the proxy may start now."""
        s = self.s
        acts: list[Action] = []
        for q in s.reqs:
            if q.retry is None or not s.d_alive[q.d_rank]:
                continue
            if q.p_stage not in ("none", "released", "aborted", "lost"):
                continue  # the old attempt's P side still runs (its blocks are not free yet)
            if s.d[q.d_rank * s.d_tp].state_of(q.rid) != PREFILL_REQUESTED:
                continue  # D gave up meanwhile (its deadline)
            if s.first_live_rank(q.retry) is not None:
                acts.append(("reprefill", q.idx))
        return acts

    def do_reprefill(self, r: int) -> None:
        """The proxy starts request ``r``'s next attempt on the lowest live rank D accepts."""
        s = self.s
        q = s.reqs[r]
        assert q.retry is not None
        i = s.first_live_rank(q.retry)
        assert i is not None
        q.retry = None
        q.p_rank, q.p_epoch = i, q.epoch
        q.p_stage, q.p_blocks, q.p_added, q.p_freed, q.t_padd = "none", None, False, False, None
        q.chunk, q.accepted, q.landed = 0, frozenset(), frozenset()
        q.send_reports, q.send_ok = (0,) * s.tp, (False,) * s.tp
        s.note("Proxy", f"{q.rid} epoch {q.epoch} goes to P rank {i}")
        self.proxy.do_start(r)
