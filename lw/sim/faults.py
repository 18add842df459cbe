"""Faults of the checker world: message loss and duplication, failed writes, crashes, aborts,
and the survivors learning of a crash (a mixin of :class:`lw.sim.world.World`)."""

from __future__ import annotations

from lw.fsm.lifecycles import DONE, FAILED
from lw.sim.config import Action, _who, d_addr, p_addr
from lw.sim.network import MsgKey, describe_key
from lw.sim.request import Req


class Faults:
    """Fault actions and their handlers."""

    def _fault_actions(self) -> list[Action]:
        kinds = self.cfg.fault_kinds
        acts: list[Action] = []
        if "drop" in kinds:
            acts += [("drop", k) for k in self.net.keys()]
        if "dup" in kinds:
            acts += [("dup", k) for k in self.net.keys()]
        if "write" in kinds:
            acts += [("fail_write", w, doubt) for w, f in enumerate(self.fifo) if f
                     for doubt in (False, True)]
            if self.cfg.unordered_writes:  # any write in flight may fail next
                acts += [("fail_write", w, doubt, j) for w, f in enumerate(self.fifo)
                         for j in range(1, len(f)) for doubt in (False, True)]
        if "crash" in kinds:
            if self.p_alive:
                acts.append(("crash_p",))
            acts += [("crash_d", d) for d in range(self.cfg.d_dp) if self.d_alive[d]]
        if "rank-crash" in kinds:
            acts += self._rank_crash_actions()
        if "forge" in kinds and self.design.d_first and self.p_alive:
            acts += [("forge", q.idx) for q in self.reqs if self._forgeable(q)]
        if "abort" in kinds:
            for q in self.reqs:
                if self._d_abortable(q):
                    acts.append(("abort_d", q.idx))
                if self._p_abortable(q):
                    acts.append(("abort_p", q.idx))
        return acts

    def _forged_blocks(self, q: Req) -> tuple[int, ...]:
        """Other D blocks of the same size: each of q's blocks moved one along D's pool (into
        another request's blocks, a free one, or q's own in another order)."""
        n = len(self.d_pool[q.d_rank])
        return tuple((b + 1) % n for b in q.d_remote)

    def _forgeable(self, q: Req) -> bool:
        # Before D's own call started the prefill (the proxy starts one per sub-transfer).
        return (q.d_stage == "allocated" and not q.started and q.p_stage == "none"
                and q.loads() and self._forged_blocks(q) != q.d_remote)

    def _do_forge(self, r: int) -> None:
        q = self.reqs[r]
        q.forged = self._forged_blocks(q)
        q.touched = True
        q.started = True
        q.p_stage = "queued"
        self.p_queue[q.p_rank].append(r)
        self._arrow("Proxy", f"P{q.p_rank * self.tp}",
                    f"prefill {q.rid} into D block(s) {list(q.forged)} (forged call)")

    def _d_abortable(self, q: Req) -> bool:
        if q.d_stage in ("waiting", "decoding"):
            return True
        if q.d_stage == "allocated" and self.d_alive[q.d_rank]:
            for v in self.d_workers_of(q.d_rank):
                st = self.d[v].state_of(q.rid)
                if st is not None and st not in (DONE, FAILED):
                    return True
        return False

    def _p_abortable(self, q: Req) -> bool:
        if not self.rank_alive(q.p_rank) or self.phase is not None:
            return False  # the scheduler handles aborts between steps
        if q.p_stage == "queued":
            return True
        if q.p_added and q.p_stage == "scheduled":
            for w in self.workers_of(q.p_rank):
                st = self.p[w].state_of(q.rid)
                if st is not None and st not in (DONE, FAILED):
                    return True
        return False

    def _do_drop(self, key: MsgKey) -> None:
        self.net.take(key)
        q = self.req_of(key[3])
        if q is not None:
            q.losses += 1
        self._note(_who(key[1]), f"network drops {describe_key(key)}")

    def _do_dup(self, key: MsgKey) -> None:
        self.net.duplicate(key)
        self._note(_who(key[1]), f"network duplicates {describe_key(key)}")

    def _do_fail_write(self, i: int, in_doubt: bool, j: int = 0) -> None:
        r, seq, _l, remote, d, _dl, inc = self.fifo[i].pop(j)
        q = self.reqs[r]
        q.touched = True
        self._note(f"P{i}", f"write of {q.rid} {self.what(r, seq)} fails"
                   + (" in doubt (bytes may still land)" if in_doubt else ""))
        if in_doubt:
            self._zombie(i, r, seq, d, remote, inc)
        self._effects(("p", i), self.p[i].transfer_done(q.rid, seq, False, "injected",
                                                        self.now, in_doubt))

    def _do_crash_p(self) -> None:
        self.p_alive = False
        if self.cfg.crash_zombies:  # bytes already handed to the transport may still land
            for w, fifo in enumerate(self.fifo):
                for r, seq, _l, remote, d, _dl, inc in fifo:
                    self._zombie(w, r, seq, d, remote, inc)
        self.fifo = [[] for _ in self.p]  # the processes are gone: no new writes
        self.timers = {k: v for k, v in self.timers.items() if k[0][0] != "p"}
        self.net.drop_to([p_addr(w) for w in range(len(self.p))])
        self.phase = None
        self.p_queue = [[] for _ in range(self.cfg.dp)]
        self.p_batch = [[] for _ in range(self.cfg.dp)]
        self.p_free_pending = [[] for _ in range(self.cfg.dp)]
        self.p_running = [[] for _ in range(self.cfg.dp)]
        self.unpolled = [[] for _ in self.p]
        self.lane = [None] * len(self.p)
        self.held = [[] for _ in self.p]
        for q in self.reqs:
            q.touched = True
            if q.p_stage in ("queued", "scheduled", "finished"):
                q.p_stage = "lost"
        self._note("P0", "P engine crashes")

    def _do_crash_d(self, d: int) -> None:
        self.d_alive[d] = False
        dead = self.d_workers_of(d)
        self.timers = {k: t for k, t in self.timers.items()
                       if not (k[0][0] == "d" and k[0][1] in dead)}
        self.net.drop_to([d_addr(v) for v in dead])
        self.zombies = [z for z in self.zombies if z[3] not in dead]
        self.d_queue[d] = []
        for q in self.reqs:
            # only requests that reached this engine: one arriving after a restart must end
            # DONE like any other (progress), one arriving at a dead engine is touched then
            if q.d_rank == d and q.d_stage != "new":
                q.touched = True
                if not q.d_final():
                    q.d_stage = "lost"
        self._note(self.dpart(d), "crashes")

    def _do_restart_d(self, d: int) -> None:
        """A new process of D engine ``d``: new incarnation, new layout, empty pool and memory."""
        self.restarts += 1
        inc = self.d_inc[d] + 1
        self.d_inc[d] = inc
        self.d_alive[d] = True
        self.d_pool[d] = [None] * self.cfg.d_blocks
        self._forget_memory(d)
        for v in self.d_workers_of(d):
            self.d[v] = self._new_decode(v, inc)
            self.p_lost_seen[v] = False
        self._note(self.dpart(d), f"restarts (incarnation {inc}, memory registered anew)")

    def _do_p_lost(self, v: int) -> None:
        self.p_lost_seen[v] = True
        for i in range(self.cfg.dp) if self.p_engine(1) != "P" else (0,):
            self._effects(("d", v), self.d[v].peer_lost(self.p_engine(i), "P engine crashed",
                                                        self.now))

    def _do_d_lost(self, i: int, d: int) -> None:
        self.d_lost_seen.add((i, d))
        for v in self.d_workers_of(d):
            self._effects(("p", i), self.p[i].peer_lost(d_addr(v), "D crashed", self.now))

    def _do_abort_d(self, r: int) -> None:
        q = self.reqs[r]
        q.touched = True
        d = q.d_rank
        self._note(self.dpart(d), f"client aborts {q.rid}")
        if q.d_stage == "waiting":
            self.d_queue[d].remove(r)
            q.d_stage = "aborted"
        elif q.d_stage == "decoding":
            self._free_d(q, "decode aborted")
            q.d_stage = "done"
        else:  # the scheduler's abort reaches every TP worker of the engine
            for v in self.d_workers_of(d):
                self._effects(("d", v), self.d[v].abort(q.rid, "client gone", self.now))

    def _do_abort_p(self, r: int) -> None:
        q = self.reqs[r]
        q.touched = True
        i = q.p_rank
        self._note(f"P{i * self.tp}", f"client aborts {q.rid}")
        if q.p_stage == "queued":
            self.p_queue[i].remove(r)
            q.p_stage = "aborted"
        else:  # the scheduler stops computing it (its later chunks never run)
            if r in self.p_running[i]:
                self.p_running[i].remove(r)
            for w in self.workers_of(i):
                self._effects(("p", w), self.p[w].abort(q.rid, "client gone", self.now))
