"""Faults of the checker world: message loss and duplication, failed writes, crashes, aborts,
forged starts, D restarts, and the survivors learning of a crash (a part of
:class:`lw.sim.world.World`)."""

from __future__ import annotations

from lw.fsm.lifecycles import DONE, FAILED, RECEIVING
from lw.fsm.silence import ALIVE, Silence
from lw.sim.clock import Clock
from lw.sim.config import Action, _who, d_addr, p_addr
from lw.sim.dnode import DNode
from lw.sim.failover import Failover
from lw.sim.kvbytes import KVBytes
from lw.sim.network import MsgKey, describe_key
from lw.sim.ports import Ports
from lw.sim.request import Req
from lw.sim.state import WorldState


class Faults:
    """Fault actions and their handlers (they may touch every field of the state: a crash
    takes a whole process's share of it)."""

    __slots__ = ("s", "ports", "clock", "kv", "d_node", "failover")

    def __init__(self, s: WorldState, ports: Ports, clock: Clock, kv: KVBytes, d_node: DNode,
                 failover: Failover) -> None:
        self.s = s
        self.ports = ports
        self.clock = clock
        self.kv = kv
        self.d_node = d_node
        self.failover = failover

    def fault_actions(self) -> list[Action]:
        """The faults that may happen now (the budget is the caller's)."""
        s = self.s
        kinds = s.cfg.fault_kinds
        acts: list[Action] = []
        if "drop" in kinds:
            acts += [("drop", k) for k in s.net.keys()]
        if "dup" in kinds:
            acts += [("dup", k) for k in s.net.keys()]
        if "write" in kinds:
            acts += [("fail_write", w, doubt) for w, f in enumerate(s.fifo) if f
                     for doubt in (False, True)]
            if s.cfg.unordered_writes:  # any write in flight may fail next
                acts += [("fail_write", w, doubt, j) for w, f in enumerate(s.fifo)
                         for j in range(1, len(f)) for doubt in (False, True)]
        if "crash" in kinds:
            if s.p_alive:
                acts.append(("crash_p",))
            acts += [("crash_d", d) for d in range(s.cfg.d_dp) if s.d_alive[d]]
        if "rank-crash" in kinds:
            acts += self.failover.rank_crash_actions()
        if "corrupt" in kinds and s.cfg.kv_checksum:  # without sums D cannot tell: no fault
            acts += [("corrupt", v, q.idx) for q in s.reqs if s.d_alive[q.d_rank]
                     for v in s.d_workers_of(q.d_rank) if self._corruptible(q, v)]
        if "stall" in kinds:
            acts += self._stall_actions()
        if "fence-fail" in kinds:
            acts += [("fence_fail", f[0], f[1], f[2]) for f in s.fences
                     if s.d_alive[f[0] // s.d_tp]]
        if "forge" in kinds and s.design.d_first and s.p_alive:
            acts += [("forge", q.idx) for q in s.reqs if self._forgeable(q)]
        if "abort" in kinds:
            for q in s.reqs:
                if self._d_abortable(q):
                    acts.append(("abort_d", q.idx))
                if self._p_abortable(q):
                    acts.append(("abort_p", q.idx))
        return acts

    def _stall_actions(self) -> list[Action]:
        """("stall", side, worker, peer address): a live peer that the worker's live requests
        await goes silent for ``stall_s`` while its process lives."""
        s = self.s
        acts: list[Action] = []
        for i, ep in enumerate(s.p):
            if s.rank_alive(i // s.tp):
                acts += [("stall", "p", i, a) for a in sorted(ep.awaited_peers())
                         if s.d_alive[int(a[1:]) // s.d_tp]]
        for v, ep in enumerate(s.d):
            if s.d_alive[v // s.d_tp]:
                acts += [("stall", "d", v, a) for a in sorted(ep.awaited_peers())
                         if s.rank_alive(int(a[1:]) // s.tp)]
        return acts

    def do_stall(self, side: str, w: int, addr: str) -> None:
        """Worker ``w`` of ``side`` hears nothing from ``addr`` for ``stall_s``; its connection
        to it stays up (its process lives). The endpoint's verdict decides whether it is lost."""
        s = self.s
        cfg = s.cfg
        s.flags.add("stall")
        ep = s.p[w] if side == "p" else s.d[w]
        silence = Silence(cfg.stall_s, cfg.heartbeat_floor_s, cfg.heartbeat_cap_s, ALIVE)
        effects = ep.peer_silent(ep.awaited_peers()[addr], silence, s.now)
        if effects is not None:
            s.note(f"P{w}" if side == "p" else s.dwname(w),
                   f"declares the live {_who(addr)} lost: {silence.reason()}")
            self.ports.run((side, w), effects)

    def _forgeable(self, q: Req) -> bool:
        # Before D's own call started the prefill (the proxy starts one per sub-transfer).
        return (q.d_stage == "allocated" and not q.started and q.p_stage == "none"
                and q.loads() and self.s.forged_blocks(q) != q.d_remote)

    def _corruptible(self, q: Req, v: int) -> bool:
        """Whether bytes of ``q``'s current claim have landed in D worker ``v``'s blocks while
        it receives (a bad transfer: what D verifies before the request may decode)."""
        s = self.s
        if s.d[v].state_of(q.rid) != RECEIVING:
            return False
        tag = s.claim_tag(q.idx, q.epoch)
        return any(k[0] == v and k[1] in q.d_remote and r == tag for k, r in s.d_mem.items())

    def do_corrupt(self, v: int, r: int) -> None:
        """The bytes of request ``r`` that have landed in D worker ``v``'s blocks read wrong (one
        sum per block and layer: which of them is wrong only the checksums' detail says)."""
        s = self.s
        q = s.reqs[r]
        tag = s.claim_tag(r, q.epoch)
        s.d_mem = {k: (-2 if k[0] == v and k[1] in q.d_remote and t == tag else t)
                   for k, t in s.d_mem.items()}
        q.bad_transfers += 1

    def do_forge(self, r: int) -> None:
        """A forged metaserver call starts ``r``'s prefill into other D blocks."""
        s = self.s
        q = s.reqs[r]
        q.forged = s.forged_blocks(q)
        q.touched = True
        q.started = True
        q.p_stage = "queued"
        s.p_queue[q.p_rank].append(r)
        s.arrow("Proxy", f"P{q.p_rank * s.tp}",
                f"prefill {q.rid} into D block(s) {list(q.forged)} (forged call)")

    def _d_abortable(self, q: Req) -> bool:
        s = self.s
        if q.d_stage in ("waiting", "decoding"):
            return True
        if q.d_stage == "allocated" and s.d_alive[q.d_rank]:
            for v in s.d_workers_of(q.d_rank):
                st = s.d[v].state_of(q.rid)
                if st is not None and st not in (DONE, FAILED):
                    return True
        return False

    def _p_abortable(self, q: Req) -> bool:
        s = self.s
        if not s.rank_alive(q.p_rank) or s.phase is not None:
            return False  # the scheduler handles aborts between steps
        if q.p_stage == "queued":
            return True
        if q.p_added and q.p_stage == "scheduled":
            for w in s.workers_of(q.p_rank):
                st = s.p[w].state_of(q.rid)
                if st is not None and st not in (DONE, FAILED):
                    return True
        return False

    def do_drop(self, key: MsgKey) -> None:
        """The network loses a message."""
        s = self.s
        s.net.take(key)
        q = s.req_of(key[3])
        if q is not None and key[2] != "FirstToken":  # the token never moves a lifecycle
            q.losses += 1
        s.note(_who(key[1]), f"network drops {describe_key(key)}")

    def do_dup(self, key: MsgKey) -> None:
        """The network duplicates a message."""
        self.s.net.duplicate(key)
        self.s.note(_who(key[1]), f"network duplicates {describe_key(key)}")

    def do_fail_write(self, i: int, in_doubt: bool, j: int = 0) -> None:
        """Write ``j`` in flight of P worker ``i`` fails (in doubt: its bytes may still land)."""
        s = self.s
        r, seq, _l, remote, d, _dl, inc = s.fifo[i].pop(j)
        q = s.reqs[r]
        q.touched = True
        s.note(f"P{i}", f"write of {q.rid} {s.what(r, seq)} fails"
               + (" in doubt (bytes may still land)" if in_doubt else ""))
        if in_doubt:
            self.clock.zombie(i, r, seq, d, remote, inc)
        self.ports.run(("p", i), s.p[i].transfer_done(q.rid, seq, False, "injected",
                                                      s.now, in_doubt))

    def do_fence_fail(self, v: int, req_id: str, epoch: int) -> None:
        """A fence D worker ``v`` asked for does not hold: what it was to cut may still land,
        and D is told so."""
        s = self.s
        f = next(f for f in s.fences if f[:3] == (v, req_id, epoch))
        s.fences.remove(f)
        s.note(s.dwname(v), f"the data-plane fence for {req_id} epoch {epoch} does NOT hold")
        self.ports.run(("d", v), s.d[v].data_fenced(req_id, epoch, False, "injected", s.now))

    def do_crash_p(self) -> None:
        """The P engine crashes (all DP ranks: they share collectives)."""
        s = self.s
        s.p_alive = False
        if s.cfg.crash_zombies:  # bytes already handed to the transport may still land
            for w, fifo in enumerate(s.fifo):
                for r, seq, _l, remote, d, _dl, inc in fifo:
                    self.clock.zombie(w, r, seq, d, remote, inc)
        s.fifo = [[] for _ in s.p]  # the processes are gone: no new writes
        s.timers = {k: v for k, v in s.timers.items() if k[0][0] != "p"}
        s.net.drop_to([p_addr(w) for w in range(len(s.p))])
        s.phase = None
        s.p_queue = [[] for _ in range(s.cfg.dp)]
        s.p_batch = [[] for _ in range(s.cfg.dp)]
        s.p_free_pending = [[] for _ in range(s.cfg.dp)]
        s.p_running = [[] for _ in range(s.cfg.dp)]
        s.unpolled = [[] for _ in s.p]
        s.lane = [None] * len(s.p)
        s.held = [[] for _ in s.p]
        for q in s.reqs:
            q.touched = True
            if q.p_stage in ("queued", "scheduled", "finished"):
                q.p_stage = "lost"
        s.note("P0", "P engine crashes")

    def do_crash_d(self, d: int) -> None:
        """D engine ``d`` crashes (all its TP workers)."""
        s = self.s
        s.d_alive[d] = False
        dead = s.d_workers_of(d)
        s.timers = {k: t for k, t in s.timers.items()
                    if not (k[0][0] == "d" and k[0][1] in dead)}
        s.net.drop_to([d_addr(v) for v in dead])
        s.zombies = [z for z in s.zombies if z[3] not in dead]
        s.fences = [f for f in s.fences if f[0] not in dead]
        s.d_queue[d] = []
        for q in s.reqs:
            # only requests that reached this engine: one arriving after a restart must end
            # DONE like any other (progress), one arriving at a dead engine is touched then
            if q.d_rank == d and q.d_stage != "new":
                q.touched = True
                if not q.d_final():
                    q.d_stage = "lost"
        s.note(s.dpart(d), "crashes")

    def do_restart_d(self, d: int) -> None:
        """A new process of D engine ``d``: new incarnation, new layout, empty pool and memory."""
        s = self.s
        s.restarts += 1
        inc = s.d_inc[d] + 1
        s.d_inc[d] = inc
        s.d_alive[d] = True
        s.d_pool[d] = [None] * s.cfg.d_blocks
        self.kv.forget_memory(d)
        for v in s.d_workers_of(d):
            s.d[v] = s.new_decode(v, inc)
            s.p_lost_seen[v] = False
        s.note(s.dpart(d), f"restarts (incarnation {inc}, memory registered anew)")

    def do_p_lost(self, v: int) -> None:
        """D worker ``v`` learns that the P engine is gone."""
        s = self.s
        s.p_lost_seen[v] = True
        for i in range(s.cfg.dp) if s.p_engine(1) != "P" else (0,):
            self.ports.run(("d", v), s.d[v].peer_lost(s.p_engine(i), "P engine crashed", s.now))

    def do_d_lost(self, i: int, d: int) -> None:
        """P worker ``i`` learns that D engine ``d`` is gone."""
        s = self.s
        s.d_lost_seen.add((i, d))
        for v in s.d_workers_of(d):
            self.ports.run(("p", i), s.p[i].peer_lost(d_addr(v), "D crashed", s.now))

    def do_abort_d(self, r: int) -> None:
        """The client aborts request ``r`` on D."""
        s = self.s
        q = s.reqs[r]
        q.touched = True
        d = q.d_rank
        s.note(s.dpart(d), f"client aborts {q.rid}")
        if q.d_stage == "waiting":
            s.d_queue[d].remove(r)
            q.d_stage = "aborted"
        elif q.d_stage == "decoding":
            self.d_node.free_d(q, "decode aborted")
            q.d_stage = "done"
        else:  # the scheduler's abort reaches every TP worker of the engine
            for v in s.d_workers_of(d):
                self.ports.run(("d", v), s.d[v].abort(q.rid, "client gone", s.now))

    def do_abort_p(self, r: int) -> None:
        """The client aborts request ``r`` on P."""
        s = self.s
        q = s.reqs[r]
        q.touched = True
        i = q.p_rank
        s.note(f"P{i * s.tp}", f"client aborts {q.rid}")
        if q.p_stage == "queued":
            s.p_queue[i].remove(r)
            q.p_stage = "aborted"
        else:  # the scheduler stops computing it (its later chunks never run)
            if r in s.p_running[i]:
                s.p_running[i].remove(r)
            for w in s.workers_of(i):
                self.ports.run(("p", w), s.p[w].abort(q.rid, "client gone", s.now))
