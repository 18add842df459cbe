"""Prefill failover in the checker world: P DP ranks as separate P engines, one of which may
die (``rank-crash``), and the proxy that performs D's ``Reprefill`` on a live rank (a mixin of
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
from lw.sim.config import Action, p_addr
from lw.sim.properties import Violation
from lw.sim.request import Req

# Bytes of request r written under claim epoch e are tagged r + e * EPOCH_TAG in D's memory.
EPOCH_TAG = 1 << 16


class Failover:
    """Rank crashes, their detection, and re-prefills."""

    def p_engine(self, rank: int) -> str:
        """The engine id of P DP rank ``rank``: one engine for all ranks, unless ranks are
        servers of their own (failover, or one may die alone)."""
        cfg = self.cfg
        return f"P{rank}" if cfg.retry_prefill or "rank-crash" in cfg.fault_kinds else "P"

    def rank_alive(self, rank: int) -> bool:
        """Whether P DP rank ``rank`` lives (and the P engine)."""
        return self.p_alive and rank not in self.dead_ranks

    def claim_tag(self, r: int, epoch: int) -> int:
        """The memory tag of request ``r``'s bytes written under claim epoch ``epoch``."""
        return r + epoch * EPOCH_TAG

    def _first_live_rank(self, avoid: tuple[str, ...] = ()) -> int | None:
        for i in range(self.cfg.dp):
            if self.rank_alive(i) and self.p_engine(i) not in avoid:
                return i
        return None

    def _route(self, q: Req) -> None:
        """The proxy sends ``q``'s current attempt to its rank: D watches that P from now."""
        i = q.p_rank
        for v in self.d_workers_of(q.d_rank):
            self._effects(("d", v), self.d[v].prefill_routed(
                q.rid, self.p_engine(i), p_addr(i * self.tp), q.p_epoch, self.now))

    # ------------------------------------------------------------------ rank crashes
    def _rank_crash_actions(self) -> list[Action]:
        if not self.p_alive or self.phase is not None:
            return []  # between steps: a rank dies with no collective half done
        return [("crash_rank", i) for i in range(self.cfg.dp) if self.rank_alive(i)]

    def _do_crash_rank(self, i: int) -> None:
        self.dead_ranks = self.dead_ranks | {i}
        workers = self.workers_of(i)
        for w in workers:
            if self.cfg.crash_zombies:  # bytes already handed to the transport may still land
                for r, seq, _l, remote, v, _dl, inc in self.fifo[w]:
                    self._zombie(w, r, seq, v, remote, inc)
            self.fifo[w] = []
            self.unpolled[w] = []
        self.timers = {k: t for k, t in self.timers.items()
                       if not (k[0][0] == "p" and k[0][1] in workers)}
        self.net.drop_to([p_addr(w) for w in workers])
        for lst in (self.p_queue, self.p_batch, self.p_free_pending, self.p_running):
            lst[i] = []
        for q in self.reqs:
            if q.p_rank == i and q.p_stage in ("queued", "scheduled", "finished"):
                q.p_stage = "lost"
                q.p_crashes += 1
        self._note(f"P{i * self.tp}", f"P rank {i} crashes (engine {self.p_engine(i)})")

    def _rank_lost_actions(self) -> list[Action]:
        if not self.cfg.p_loss_detection:
            return []
        return [("rank_lost", v, i) for i in sorted(self.dead_ranks) for v in range(len(self.d))
                if self.d_alive[v // self.d_tp] and (v, i) not in self.rank_lost_seen]

    def _do_rank_lost(self, v: int, i: int) -> None:
        self.rank_lost_seen = self.rank_lost_seen | {(v, i)}
        self._effects(("d", v), self.d[v].peer_lost(self.p_engine(i), "heartbeats lost",
                                                    self.now))

    # ------------------------------------------------------------------ re-prefill
    def _on_reprefill(self, v: int, e: Reprefill) -> None:
        q = self.reqs[int(e.req_id[1:])]
        if e.block_ids != q.d_remote:
            raise Violation("kv-placement", f"D{v} asks to prefill {q.rid} again into block(s) "
                                            f"{list(e.block_ids)}, not its {list(q.d_remote)}")
        if e.epoch > self.cfg.retry_prefill:
            raise Violation("request-ends",
                            f"D{v} asks for prefill attempt {e.epoch + 1} of {q.rid}, beyond "
                            f"its budget of {self.cfg.retry_prefill} retries: a request whose "
                            "P keeps failing is retried for ever (an abort storm)")
        q.epoch = e.epoch
        q.retry = e.avoid
        self._note(f"D{v}", f"{q.rid}: prefill again under claim epoch {e.epoch} "
                            f"(avoid {', '.join(e.avoid) or 'none'})")

    def _reprefill_actions(self) -> list[Action]:
        acts: list[Action] = []
        for q in self.reqs:
            if q.retry is None or not self.d_alive[q.d_rank]:
                continue
            if q.p_stage not in ("none", "released", "aborted", "lost"):
                continue  # the old attempt's P side still runs (its blocks are not free yet)
            if self.d[q.d_rank * self.d_tp].state_of(q.rid) != PREFILL_REQUESTED:
                continue  # D gave up meanwhile (its deadline)
            if self._first_live_rank(q.retry) is not None:
                acts.append(("reprefill", q.idx))
        return acts

    def _do_reprefill(self, r: int) -> None:
        q = self.reqs[r]
        assert q.retry is not None
        i = self._first_live_rank(q.retry)
        assert i is not None
        q.retry = None
        q.p_rank, q.p_epoch = i, q.epoch
        q.p_stage, q.p_blocks, q.p_added, q.p_freed, q.t_padd = "none", None, False, False, None
        q.chunk, q.accepted, q.landed = 0, frozenset(), frozenset()
        q.send_reports, q.send_ok = (0,) * self.tp, (False,) * self.tp
        self._note("Proxy", f"{q.rid} epoch {q.epoch} goes to P rank {i}")
        self._do_start(r)
