"""D's engine in the checker world: its workers' reports (RecvDone, RecvFailed), which the
scheduler aggregates per request, with the partial-kv property, and decoding (a mixin of
:class:`lw.sim.world.World`)."""

from __future__ import annotations

from lw.fsm import RecvDone, RecvFailed
from lw.sim.config import _owner
from lw.sim.heads import held
from lw.sim.properties import Violation
from lw.sim.request import Req


class DNode:
    """D's scheduler: reports, decoding, frees."""

    def _do_decode(self, r: int) -> None:
        q = self.reqs[r]
        self._free_d(q, "decode finished")
        q.d_stage = "done"

    def _free_d(self, q: Req, why: str) -> None:
        d = q.d_rank
        pool = self.d_pool[d]
        for b in q.d_blocks or ():
            if pool[b] != q.idx:
                raise Violation("double-free", f"{self.dname(d)} frees block {b} of {q.rid} but "
                                               f"it is owned by {_owner(pool[b])}")
            pool[b] = None
            self.free_why[("D", d, b)] = why
        self._note(self.dpart(d), f"frees block(s) {list(q.d_blocks or ())} of {q.rid} ({why})")

    def _recv_report(self, v: int, q: Req, ok: bool) -> None:
        """Count one D worker's RecvDone/RecvFailed for ``q`` (each reports exactly once)."""
        j = v % self.d_tp
        reports = list(q.recv_reports)
        reports[j] += 1
        q.recv_reports = tuple(reports)
        if reports[j] > 1 or not q.loads():
            raise Violation("reported-twice", f"D{v} reports {q.rid} finished "
                                              + ("twice" if q.loads() else
                                                 "but it had nothing to load"))
        if ok:
            oks = list(q.recv_ok)
            oks[j] = True
            q.recv_ok = tuple(oks)

    def _missing_kv(self, q: Req, v: int) -> tuple[list[tuple[int, int, int]], list[str]]:
        """(P worker, layer, D block) of the sender plan no write landed in D worker ``v``:
        every layer of every block it receives, whichever chunk wrote it; and the writes of
        ``q`` still in flight towards it."""
        want = {(w, k, b) for w in self.writers(q, v) for k in range(self.cfg.layers)
                for b in q.d_remote}
        missing = sorted(want - {(w, k, b) for w, x, k, b in q.landed if x == v})
        inflight = [self.what(w[0], w[1]) for f in self.fifo for w in f
                    if w[0] == q.idx and w[4] == v]
        return missing, inflight

    def _check_heads_covered(self, q: Req, v: int) -> None:
        """Property partial-kv by the world's own head model (lw.sim.heads), not the sender
        plan kvmap computed: every head D worker ``v`` holds, of every layer and block it
        decodes ``q`` from, came with a write that landed."""
        cfg = self.cfg
        need = held(v % self.d_tp, self.d_tp, cfg.kv_heads(), cfg.mla)
        got: dict[tuple[int, int], set[int]] = {}
        for w, x, k, b in q.landed:
            if x == v:
                got.setdefault((k, b), set()).update(held(w % self.tp, self.tp, cfg.kv_heads(),
                                                          cfg.mla))
        for k in range(cfg.layers):
            for b in q.d_remote:
                lost = sorted(set(need) - got.get((k, b), set()))
                if lost:
                    raise Violation("partial-kv",
                                    f"{self.dname(q.d_rank)} decodes {q.rid} but no write "
                                    f"carried head(s) {lost} of D{v} block {b} layer {k} (its "
                                    f"senders: P worker(s) {sorted(self.writers(q, v))})")

    def _on_recv_done(self, v: int, e: RecvDone) -> None:
        q = self.reqs[int(e.req_id[1:])]
        self._recv_report(v, q, True)
        # every earlier epoch may have taken its deadline and a fencing lease
        retried = q.epoch * (self.cfg.prefill_timeout_s + self.cfg.lease_s)
        self._check_d_bound(v, q, retried + self.cfg.prefill_timeout_s)
        missing, inflight = self._missing_kv(q, v)
        if missing or inflight:
            raise Violation("partial-kv",
                            f"D{v} reports {q.rid} done but no write landed for (P worker, "
                            f"layer, D block) {missing} (in flight: {inflight})")
        if self.d_tp > 1:
            self._note(f"D{v}", f"RecvDone({q.rid}): all its layers landed")
        self._d_settle(q)

    def _d_settle(self, q: Req) -> None:
        """The engine's scheduler: a request is finished receiving once every TP worker reported
        (vLLM aggregates finished_recving); DONE only if every worker was DONE."""
        if min(q.recv_reports) == 0:
            return
        if not all(q.recv_ok):
            self._free_d(q, "failed_recving")
            q.d_stage = "failed"
            q.quarantined = False
            return
        for v in self.d_workers_of(q.d_rank):
            missing, inflight = self._missing_kv(q, v)
            if missing or inflight:
                raise Violation("partial-kv",
                                f"{self.dname(q.d_rank)} decodes {q.rid} but no write landed "
                                f"in D{v} for (P worker, layer, D block) {missing} (in flight: "
                                f"{inflight})")
            self._check_heads_covered(q, v)
        self._check_fenced(q)
        q.d_stage = "decoding"
        self.flags.add("done")
        if self.d_tp == 1:
            self._note(self.dpart(q.d_rank), f"RecvDone({q.rid}): all layers landed; decoding")
        else:
            self._note(self.dpart(q.d_rank), f"{q.rid}: every TP worker is DONE; decoding")

    def _check_d_bound(self, v: int, q: Req, bound: float) -> None:
        if self.design.timers and q.t_alloc is not None and self.now - q.t_alloc > bound + 1e-9:
            raise Violation("request-ends", f"D{v} finished {q.rid} {self.now - q.t_alloc:g} s "
                                            f"after allocation, beyond its bound of {bound:g} s")

    def _on_recv_failed(self, v: int, e: RecvFailed) -> None:
        q = self.reqs[int(e.req_id[1:])]
        self._recv_report(v, q, False)
        if tuple(e.block_ids) != q.d_remote:
            raise Violation("double-free", f"D{v} releases blocks {list(e.block_ids)} for "
                                           f"{q.rid}, which receives into {list(q.d_remote)}")
        self._check_d_bound(v, q, (q.epoch + 1) * (self.cfg.prefill_timeout_s
                                                   + self.cfg.lease_s))
        self._note(f"D{v}", f"RecvFailed({q.rid}): {e.reason[:60]}")
        self._d_settle(q)
