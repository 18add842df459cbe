"""P's engine in the checker world: its scheduler (queue, running chunked requests, block pool,
frees between steps) and the lock-step forward pass whose layer hooks call the core (a mixin of
:class:`lw.sim.world.World`)."""

from __future__ import annotations

from lw.fsm import PrefillRequest, SendFinished, WriteLayer
from lw.fsm.lifecycles import AWAIT_DECODER_META
from lw.sim.config import _owner, d_addr
from lw.sim.properties import Violation
from lw.sim.request import Req


class PNode:
    """P's scheduler and forward pass."""

    def blocked_hooks(self) -> dict[int, list[str]]:
        """P workers whose layer hook cannot return now (only in a design whose hook waits)."""
        out: dict[int, list[str]] = {}
        if not self.design.hook_waits_for_meta or self.phase is None or not self.p_alive:
            return out
        for w in range(len(self.p)):
            if self.hooks_done[w]:
                continue
            waiting = [self.reqs[r].rid for r in self.p_batch[w // self.tp]
                       if not self._meta_ready(w, r)]
            if waiting:
                out[w] = waiting
        return out

    def _meta_ready(self, w: int, r: int) -> bool:
        st = self.p[w].state_of(self.reqs[r].rid)
        return st is not None and st != AWAIT_DECODER_META

    def _schedulable(self, i: int) -> bool:
        return bool(self.p_queue[i]) and (
            self.p_pool[i].count(None) >= self.cfg.blocks_per_request)

    def _do_schedule(self) -> None:
        if "poll-on-step" in self.quirks:  # the step polls the completions of its writes
            for w, done in enumerate(self.unpolled):
                self.unpolled[w] = []
                for r, seq, ok in done:
                    self._effects(("p", w), self.p[w].transfer_done(
                        self.reqs[r].rid, seq, ok, "" if ok else "peer gone", self.now))
        bpr = self.cfg.blocks_per_request
        for i in range(self.cfg.dp):
            if not self.rank_alive(i):
                continue  # a dead rank's place in the lock step is a dummy stepper's
            # vLLM schedules its running requests first: each computes its next chunk, which
            # completes the next of its blocks (announced to every worker of the rank).
            running, self.p_running[i] = self.p_running[i], []
            for r in running:
                self.p_batch[i].append(r)
                self._next_chunk(self.reqs[r])
            pool = self.p_pool[i]
            while self.p_queue[i] and pool.count(None) >= bpr:
                r = self.p_queue[i].pop(0)
                q = self.reqs[r]
                blocks = tuple([b for b, o in enumerate(pool) if o is None][:bpr])
                for b in blocks:
                    pool[b] = r
                q.p_blocks = blocks  # all of them at once (vLLM allocates chunk by chunk)
                q.p_stage = "scheduled"
                q.chunk = 1
                self.p_batch[i].append(r)
                if self.design.d_first or q.d_blocks is not None:
                    self._p_add(q)
        self.phase = 0
        self.hooks_done = [False] * len(self.p)
        batches = "; ".join(f"P{i}: " + (",".join(self._in_step(r) for r in b) or "dummy")
                            for i, b in enumerate(self.p_batch))
        self._note(self._all_p(), f"step {self.steps + 1}: {batches}")

    def _next_chunk(self, q: Req) -> None:
        """The step now starting computes chunk ``q.chunk`` of ``q``: announce its blocks to
        every P worker of its rank (a chunk completing no block is not announced)."""
        c = q.chunk
        q.chunk += 1
        if not q.p_added or not q.announced(c):
            return
        local = self._p_sent(q)[q.span(c)]
        for w in self.workers_of(q.p_rank):
            self._effects(("p", w), self.p[w].add_chunk(q.rid, local, not q.more_chunks(),
                                                        self.now))

    def _p_sent(self, q: Req) -> tuple[int, ...]:
        """The P blocks whose KV goes to D's ``d_remote``, block for block."""
        if "front-trim" in self.quirks:  # vllm #48633 C3: align by trimming the front
            return (q.p_blocks or ())[:len(q.d_remote)]
        return q.p_local

    def _p_add(self, q: Req) -> None:
        assert q.p_blocks is not None and q.d_blocks is not None
        # Before any layer of the prefill is computed: at its first step (D first), or while
        # that step waits for D's metadata in the layer-0 hook (P first).
        assert q.chunk == 1, q.chunk
        q.p_added = True
        q.t_padd = self.now
        plan = self.plan
        base = q.d_rank * self.d_tp
        for w in self.workers_of(q.p_rank):
            # The D workers this TP rank writes into (none: MLA's idle ranks, a full prefix hit)
            js = plan.targets[w % self.tp] if q.loads() else ()
            n = len(plan.senders[js[0]]) if js else 1
            local = self._p_sent(q)[q.span(0)]  # the blocks its first chunk completes
            req = self.store.intern(PrefillRequest(
                q.rid, tuple(d_addr(base + j) for j in js), local, q.p_target, n,
                final=not q.more_chunks(), epoch=q.p_epoch))
            self._effects(("p", w), self.p[w].add_request(req, self.now))

    def _in_step(self, r: int) -> str:
        """A request of the step in progress, with its chunk when prefills take several."""
        q = self.reqs[r]
        return q.rid if self.cfg.chunks == 1 else f"{q.rid} chunk {q.chunk - 1}"

    def _all_p(self) -> str:
        return "P0" if len(self.p) == 1 else f"P0,P{len(self.p) - 1}"

    def _do_layer(self) -> None:
        for w in range(len(self.p)):
            self._do_hook(w, note=False)
        self._note(self._all_p(), f"layer {self.phase} computed on every rank; collective")
        self._do_barrier()

    def _do_hook(self, w: int, note: bool = True) -> None:
        k = self.phase
        assert k is not None
        i = w // self.tp
        if not self.rank_alive(i):  # the dummy stepper of a dead rank joins the collective
            self.collectives[w] += 1
            self.hooks_done[w] = True
            return
        batch = self.p_batch[i]
        reqs = self.reqs
        # the requests whose chunk in this step is announced to the core (a first chunk that
        # completes no block is not: its layers are not reported for the request)
        rids = [reqs[r].rid for r in batch if reqs[r].announced(reqs[r].chunk - 1)]
        pool = self.p_pool[i]
        for r in batch:  # the forward pass writes the request's KV into its own blocks
            stolen = [b for b in reqs[r].p_blocks or () if pool[b] != r]
            if stolen:
                how = self.free_why.get(("P", i, stolen[0]), "?")
                raise Violation("use-after-free",
                                f"{self.wname(w)} computes layer {k} of {reqs[r].rid} into "
                                f"P block(s) {stolen}, freed ({how}) and now "
                                f"{_owner(pool[stolen[0]])}")
        if "shared-layer-slot" in self.quirks:
            L = self.cfg.layers
            for x in self.fifo[w]:  # a write of this chunk's other layer reads the slot
                q = reqs[x[0]]
                if x[0] in batch and q.chunk_of(x[1], L) == q.chunk - 1 and x[1] % L != k:
                    raise Violation("use-after-free",
                                    f"{self.wname(w)} computes layer {k} of "
                                    f"{reqs[x[0]].rid} into the physical KV slot its "
                                    f"{self.what(x[0], x[1])} write is still reading")
        try:
            effects = self.p[w].layer_computed(k, rids, self.now)
        except RuntimeError as exc:
            raise Violation("forward-never-waits",
                            f"layer hook of {self.wname(w)} raised {type(exc).__name__}: {exc}; "
                            "the worker dies inside the forward pass (its DP peers would wait "
                            "in the collective for ever)") from exc
        for e in effects:
            if not isinstance(e, WriteLayer):
                raise Violation("forward-never-waits",
                                f"layer hook of {self.wname(w)} returned {type(e).__name__}, "
                                "not only writes to enqueue")
        self.collectives[w] += 1
        self.hooks_done[w] = True
        if note:
            self._note(f"P{w}", f"layer {k} hook ({','.join(rids) or 'dummy'})")
        self._effects(("p", w), effects)

    def _do_barrier(self) -> None:
        k = self.phase
        assert k is not None
        live = set(self.collectives)
        if len(live) != 1:
            raise Violation("forward-never-waits",
                            f"DP ranks made different numbers of collective calls: "
                            f"{self.collectives}")
        if k + 1 < self.cfg.layers:
            self.phase = k + 1
            self.hooks_done = [False] * len(self.p)
            return
        # end of the step: a request with chunks left stays running; the scheduler calls
        # request_finished for every request whose prefill completed
        self.phase = None
        self.hooks_done = [False] * len(self.p)
        self.steps += 1
        for i in range(self.cfg.dp):
            running = self.p_running[i]
            for r in self.p_batch[i]:
                if self.reqs[r].more_chunks():
                    running.append(r)
                elif self.design.free_on_request_finished:
                    self._free_p(i, r, "request_finished said free now")
            self.p_batch[i] = []
            # vLLM frees a request's blocks only once it is finished: one that P's workers
            # reported finished sending (failed) while it still computes waits for its end
            pending = self.p_free_pending[i]
            self.p_free_pending[i] = [r for r in pending if r in running]
            for r in pending:
                if r not in running:
                    self._free_p(i, r, "finished_sending")

    def _free_p(self, i: int, r: int, why: str) -> None:
        q = self.reqs[r]
        if q.p_freed:
            if self.design.free_on_request_finished:
                return  # this scheduler already freed them at request_finished
            raise Violation("double-free", f"P rank {i} frees the blocks of {q.rid} twice")
        pool = self.p_pool[i]
        for b in q.p_blocks or ():
            if pool[b] != r:
                raise Violation("double-free",
                                f"P rank {i} frees block {b} of {q.rid} but it is owned by "
                                f"{_owner(pool[b])}")
            pool[b] = None
            self.free_why[("P", i, b)] = f"{why}, step {self.steps}"
        q.p_freed = True
        if q.p_stage == "finished":
            q.p_stage = "released"
        self._note(f"P{i}", f"scheduler frees block(s) {list(q.p_blocks or ())} of {q.rid} "
                            f"({why})")

    def _on_send_finished(self, i: int, e: SendFinished) -> None:
        q = self.reqs[int(e.req_id[1:])]
        t = i % self.tp
        reports = list(q.send_reports)
        reports[t] += 1
        q.send_reports = tuple(reports)
        if reports[t] > 1:
            raise Violation("reported-twice", f"{self.wname(i)} reports {q.rid} finished twice")
        oks = list(q.send_ok)
        oks[t] = e.ok
        q.send_ok = tuple(oks)
        bound = self.cfg.request_timeout_s + self.cfg.transfer_timeout_s
        if self.design.timers and q.t_padd is not None and self.now - q.t_padd > bound + 1e-9:
            raise Violation("request-ends", f"{self.wname(i)} released {q.rid} "
                                            f"{self.now - q.t_padd:g} s after it started, beyond "
                                            f"request timeout + transfer timeout = {bound:g} s")
        self._note(f"P{i}", f"SendFinished({q.rid}, {'ok' if e.ok else 'failed'})")
        for w in self.fifo[i]:
            if w[0] == q.idx:
                raise Violation("use-after-free",
                                f"{self.wname(i)} released {q.rid} (SendFinished) while its "
                                f"{self.what(w[0], w[1])} write is still in flight")
        if min(reports) == 0:
            return  # the scheduler frees only when every TP worker reported finished_sending
        i = q.p_rank
        if q.p_stage == "scheduled":
            q.p_stage = "finished"
        if q.p_freed:
            q.p_stage = "released"
        elif self.phase is None and q.idx not in self.p_batch[i] and (
                q.idx not in self.p_running[i]):
            self._free_p(i, q.idx, "finished_sending")
        else:  # vLLM frees between steps, and never a request it still computes (this step's
            # or one with chunks left: a send that failed early waits for the prefill's end)
            self.p_free_pending[i].append(q.idx)
