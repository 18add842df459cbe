"""P's engine in the checker world: its scheduler (queue, running chunked requests, block pool,
frees between steps) and the lock-step forward pass whose layer hooks call the core (a part of
:class:`lw.sim.world.World`)."""

from __future__ import annotations

from lw.fsm import PrefillRequest, SendFinished, WriteLayer
from lw.fsm.lifecycles import AWAIT_DECODER_META, FAILED
from lw.sim.config import Action, _owner, d_addr
from lw.sim.ports import Ports
from lw.sim.properties import Violation
from lw.sim.request import Req
from lw.sim.state import WorldState
from lw.sim.tokens import OTHER_SPEC, p_token, show, spec_of

# Abstract time: the world may idle before these (P's engine busy or slow to start, schedule or
# compute a layer; in the fine-grained model only before the first hook of a layer, so that both
# models reach the same states); message and transfer delays are covered by timers firing while
# they are in flight, and by writes timing out.
SLOW = frozenset({"start", "schedule", "layer"})


class PNode:
    """P's scheduler and forward pass: reads and writes the P side of the state (``p_*``
    pools and queues, ``phase``, ``hooks_done``, ``collectives``, ``steps``, ``unpolled``)
    and the requests' P-side fields."""

    __slots__ = ("s", "ports", "__weakref__")  # the ports hold it weakly

    def __init__(self, s: WorldState, ports: Ports) -> None:
        self.s = s
        self.ports = ports

    def blocked_hooks(self) -> dict[int, list[str]]:
        """P workers whose layer hook cannot return now (only in a design whose hook waits)."""
        s = self.s
        out: dict[int, list[str]] = {}
        if not s.design.hook_waits_for_meta or s.phase is None or not s.p_alive:
            return out
        for w in range(len(s.p)):
            if s.hooks_done[w]:
                continue
            waiting = [s.reqs[r].rid for r in s.p_batch[w // s.tp]
                       if not self._meta_ready(w, r)]
            if waiting:
                out[w] = waiting
        return out

    def _meta_ready(self, w: int, r: int) -> bool:
        st = self.s.p[w].state_of(self.s.reqs[r].rid)
        return st is not None and st != AWAIT_DECODER_META

    def schedulable(self, i: int) -> bool:
        """Whether DP rank ``i`` has a queued request that fits its free blocks."""
        s = self.s
        return bool(s.p_queue[i]) and s.p_pool[i].count(None) >= s.cfg.blocks_per_request

    def can_step(self) -> bool:
        """Whether a P engine step can start now."""
        s = self.s
        return s.phase is None and any(s.rank_alive(i) and (self.schedulable(i) or s.p_running[i])
                                       for i in range(s.cfg.dp))

    def slow_for(self, acts: list[Action], rid: str) -> bool:
        """Whether P's engine could be slow before one of these actions of request ``rid``
        (the proxy starting it, P scheduling it, computing a layer of it)."""
        s = self.s
        q = s.req_of(rid)
        if q is None:
            return False
        for a in acts:
            if a[0] not in SLOW and not (a[0] == "hook" and not any(s.hooks_done)):
                continue
            if a[0] == "start" and a[1] == q.idx:
                return True
            if a[0] == "schedule" and (q.idx in s.p_queue[q.p_rank]
                                       or q.idx in s.p_running[q.p_rank]):
                return True
            if a[0] in ("layer", "hook") and q.idx in s.p_batch[q.p_rank]:
                return True
        return False

    def do_schedule(self) -> None:
        """P's engine starts a step on every live DP rank."""
        s = self.s
        if "poll-on-step" in s.quirks:  # the step polls the completions of its writes
            for w, done in enumerate(s.unpolled):
                s.unpolled[w] = []
                for r, seq, ok in done:
                    self.ports.run(("p", w), s.p[w].transfer_done(
                        s.reqs[r].rid, seq, ok, "" if ok else "peer gone", s.now))
        bpr = s.cfg.blocks_per_request
        for i in range(s.cfg.dp):
            if not s.rank_alive(i):
                continue  # a dead rank's place in the lock step is a dummy stepper's
            # vLLM schedules its running requests first: each computes its next chunk, which
            # completes the next of its blocks (announced to every worker of the rank).
            running, s.p_running[i] = s.p_running[i], []
            for r in running:
                s.p_batch[i].append(r)
                self._next_chunk(s.reqs[r])
            pool = s.p_pool[i]
            while s.p_queue[i] and pool.count(None) >= bpr:
                r = s.p_queue[i].pop(0)
                q = s.reqs[r]
                blocks = tuple([b for b, o in enumerate(pool) if o is None][:bpr])
                for b in blocks:
                    pool[b] = r
                q.p_blocks = blocks  # all of them at once (vLLM allocates chunk by chunk)
                q.p_stage = "scheduled"
                q.chunk = 1
                s.p_batch[i].append(r)
                if s.design.d_first or q.d_blocks is not None:
                    self.p_add(q)
                elif s.design.ahead:
                    self.p_add_ahead(q)
        s.phase = 0
        s.hooks_done = [False] * len(s.p)
        batches = "; ".join(f"P{i}: " + (",".join(s.in_step(r) for r in b) or "dummy")
                            for i, b in enumerate(s.p_batch))
        s.note(self._all_p(), f"step {s.steps + 1}: {batches}")

    def _next_chunk(self, q: Req) -> None:
        """The step now starting computes chunk ``q.chunk`` of ``q``: announce its blocks to
        every P worker of its rank (a chunk completing no block is not announced)."""
        s = self.s
        c = q.chunk
        q.chunk += 1
        if not q.p_added or not q.announced(c):
            return
        local = self._p_sent(q)[q.span(c)]
        for w in s.workers_of(q.p_rank):
            self.ports.run(("p", w), s.p[w].add_chunk(q.rid, local, not q.more_chunks(), s.now))

    def _p_sent(self, q: Req) -> tuple[int, ...]:
        """The P blocks whose KV goes to D's ``d_remote``, block for block."""
        if "front-trim" in self.s.quirks:  # vllm #48633 C3: align by trimming the front
            return (q.p_blocks or ())[:len(q.d_remote)]
        return q.p_local

    def p_add(self, q: Req) -> None:
        """Register ``q`` (scheduled, with D's blocks known) with every P worker of its rank."""
        assert q.p_blocks is not None and q.d_blocks is not None
        # Before any layer of the prefill is computed: at its first step (D first), or while
        # that step waits for D's metadata in the layer-0 hook (P first).
        assert q.chunk == 1, q.chunk
        s = self.s
        q.p_added = True
        q.t_padd = s.now
        local = self._p_sent(q)[q.span(0)]  # the blocks its first chunk completes
        for w in s.workers_of(q.p_rank):
            req = self._request(q, w, local, not q.more_chunks())
            self.ports.run(("p", w), s.p[w].add_request(req, s.now))

    def _request(self, q: Req, w: int, local: tuple[int, ...], final: bool) -> PrefillRequest:
        """What P worker ``w`` is told of ``q``: the D workers its TP rank writes into (none:
        MLA's idle ranks, a full prefix hit), D's blocks, the senders each D worker expects."""
        s = self.s
        js = s.plan.targets[w % s.tp] if q.loads() else ()
        n = len(s.plan.senders[js[0]]) if js else 1
        base = q.d_rank * s.d_tp
        return s.store.intern(PrefillRequest(
            q.rid, tuple(d_addr(base + j) for j in js), local, q.p_target, n, final=final,
            epoch=q.p_epoch))

    def p_add_ahead(self, q: Req) -> None:
        """Register ``q`` (scheduled, D's blocks not known yet) with every P worker of its rank
        as computed ahead: its first chunk's blocks, with those of D's prefix hit."""
        assert q.p_blocks is not None and q.chunk == 1
        s = self.s
        q.p_added = True
        q.ahead = "ahead"
        q.t_padd = s.now
        local = (q.p_blocks[:q.hit] + self._p_sent(q)[q.span(0)]) if q.announced(0) else ()
        for w in s.workers_of(q.p_rank):
            self.ports.run(("p", w), s.p[w].add_ahead(q.rid, local, not q.more_chunks(), "",
                                                      s.now))

    def p_bind(self, q: Req) -> None:
        """D allocated ``q``'s blocks: bind P's attempt computed ahead to them (D's prefix hit
        computed but not written). A worker that dropped it refuses: the proxy starts ``q``
        again, D first, once P has released the dropped attempt."""
        s = self.s
        q.ahead = "bound"
        q.t_padd = s.now  # its deadline counts from the bind
        for w in s.workers_of(q.p_rank):
            ep = s.p[w]
            # (the blocks and final of a bind are the endpoint's own: what it was announced)
            self.ports.run(("p", w), ep.bind(self._request(q, w, (), True), q.hit, s.now))
            if ep.state_of(q.rid) in (None, FAILED):
                q.refused = q.loads()  # a full hit needs nothing from P
        if q.refused:
            s.note(self._all_p(), f"{q.rid} was dropped before D's blocks came: bind refused")

    def _all_p(self) -> str:
        n = len(self.s.p)
        return "P0" if n == 1 else f"P0,P{n - 1}"

    def do_layer(self) -> None:
        """Every P worker computes the layer and they pass its collective (atomic layers)."""
        s = self.s
        for w in range(len(s.p)):
            self.do_hook(w, note=False)
        s.note(self._all_p(), f"layer {s.phase} computed on every rank; collective")
        self.do_barrier()

    def do_hook(self, w: int, note: bool = True) -> None:
        """P worker ``w`` computes the current layer and calls the core's layer hook."""
        s = self.s
        k = s.phase
        assert k is not None
        i = w // s.tp
        if not s.rank_alive(i):  # the dummy stepper of a dead rank joins the collective
            s.collectives[w] += 1
            s.hooks_done[w] = True
            return
        batch = s.p_batch[i]
        reqs = s.reqs
        # the requests whose chunk in this step is announced to the core (a first chunk that
        # completes no block is not: its layers are not reported for the request)
        rids = [reqs[r].rid for r in batch if reqs[r].announced(reqs[r].chunk - 1)]
        pool = s.p_pool[i]
        for r in batch:  # the forward pass writes the request's KV into its own blocks
            stolen = [b for b in reqs[r].p_blocks or () if pool[b] != r]
            if stolen:
                how = s.free_why.get(("P", i, stolen[0]), "?")
                raise Violation("use-after-free",
                                f"{s.wname(w)} computes layer {k} of {reqs[r].rid} into "
                                f"P block(s) {stolen}, freed ({how}) and now "
                                f"{_owner(pool[stolen[0]])}")
        if "shared-layer-slot" in s.quirks:
            L = s.cfg.layers
            for x in s.fifo[w]:  # a write of this chunk's other layer reads the slot
                q = reqs[x[0]]
                if x[0] in batch and q.chunk_of(x[1], L) == q.chunk - 1 and x[1] % L != k:
                    raise Violation("use-after-free",
                                    f"{s.wname(w)} computes layer {k} of "
                                    f"{reqs[x[0]].rid} into the physical KV slot its "
                                    f"{s.what(x[0], x[1])} write is still reading")
        try:
            effects = s.p[w].layer_computed(k, rids, s.now)
        except RuntimeError as exc:
            raise Violation("forward-never-waits",
                            f"layer hook of {s.wname(w)} raised {type(exc).__name__}: {exc}; "
                            "the worker dies inside the forward pass (its DP peers would wait "
                            "in the collective for ever)") from exc
        for e in effects:
            if not isinstance(e, WriteLayer):
                raise Violation("forward-never-waits",
                                f"layer hook of {s.wname(w)} returned {type(e).__name__}, "
                                "not only writes to enqueue")
        s.collectives[w] += 1
        s.hooks_done[w] = True
        if note:
            s.note(f"P{w}", f"layer {k} hook ({','.join(rids) or 'dummy'})")
        self.ports.run(("p", w), effects)

    def do_barrier(self) -> None:
        """The P ranks pass the layer's collective; after the last layer the step ends."""
        s = self.s
        k = s.phase
        assert k is not None
        live = set(s.collectives)
        if len(live) != 1:
            raise Violation("forward-never-waits",
                            f"DP ranks made different numbers of collective calls: "
                            f"{s.collectives}")
        if k + 1 < s.cfg.layers:
            s.phase = k + 1
            s.hooks_done = [False] * len(s.p)
            return
        # end of the step: a request with chunks left stays running; the scheduler calls
        # request_finished for every request whose prefill completed
        s.phase = None
        s.hooks_done = [False] * len(s.p)
        s.steps += 1
        for i in range(s.cfg.dp):
            running = s.p_running[i]
            for r in s.p_batch[i]:
                q = s.reqs[r]
                if q.more_chunks():
                    running.append(r)
                    continue
                if s.cfg.first_token_from_p and q.p_added:  # the step sampled its first token
                    q.token_due = (*q.token_due, (q.p_epoch, i))
                if s.design.free_on_request_finished:
                    self._free_p(i, r, "request_finished said free now")
            s.p_batch[i] = []
            # vLLM frees a request's blocks only once it is finished: one that P's workers
            # reported finished sending (failed) while it still computes waits for its end
            pending = s.p_free_pending[i]
            s.p_free_pending[i] = [r for r in pending if r in running]
            for r in pending:
                if r not in running:
                    self._free_p(i, r, "finished_sending")

    def _free_p(self, i: int, r: int, why: str) -> None:
        s = self.s
        q = s.reqs[r]
        if q.p_freed:
            if s.design.free_on_request_finished:
                return  # this scheduler already freed them at request_finished
            raise Violation("double-free", f"P rank {i} frees the blocks of {q.rid} twice")
        pool = s.p_pool[i]
        for b in q.p_blocks or ():
            if pool[b] != r:
                raise Violation("double-free",
                                f"P rank {i} frees block {b} of {q.rid} but it is owned by "
                                f"{_owner(pool[b])}")
            pool[b] = None
            s.free_why[("P", i, b)] = f"{why}, step {s.steps}"
        q.p_freed = True
        if q.p_stage == "finished":
            q.p_stage = "released"
        s.note(f"P{i}", f"scheduler frees block(s) {list(q.p_blocks or ())} of {q.rid} ({why})")

    def sample_actions(self) -> list[Action]:
        """P's scheduler may hand a sampled first token to its (live) workers now: any moment
        after the prefill's last step, before or after its writes, DONE and release."""
        s = self.s
        return [("sample", q.idx, e, i) for q in s.reqs for e, i in sorted(set(q.token_due))
                if s.rank_alive(i)]

    def do_sample(self, r: int, epoch: int, i: int) -> None:
        """P's scheduler hands request ``r``'s first token, sampled by its prefill under claim
        ``epoch`` on DP rank ``i``, to every worker of that rank (only TP rank 0's core sends
        it)."""
        s = self.s
        q = s.reqs[r]
        due = list(q.token_due)
        due.remove((epoch, i))  # (a prefill computed ahead, dropped and run again: twice)
        q.token_due = tuple(due)
        other = r in s.cfg.first_token_other_spec
        token = p_token(r, epoch, other)
        spec = OTHER_SPEC if other else spec_of(r)
        for w in s.workers_of(i):
            self.ports.run(("p", w), s.p[w].first_token(q.rid, token, spec, s.now))
        s.note(f"P{i * s.tp}", f"scheduler samples {q.rid}'s first {show(token)}")

    def on_send_finished(self, i: int, e: SendFinished) -> None:
        """P worker ``i`` reports a request finished sending: its blocks are freed once every
        TP worker reported and the prefill ended."""
        s = self.s
        q = s.reqs[int(e.req_id[1:])]
        t = i % s.tp
        reports = list(q.send_reports)
        reports[t] += 1
        q.send_reports = tuple(reports)
        if reports[t] > 1:
            raise Violation("reported-twice", f"{s.wname(i)} reports {q.rid} finished twice")
        oks = list(q.send_ok)
        oks[t] = e.ok
        q.send_ok = tuple(oks)
        bound = s.cfg.request_timeout_s + s.cfg.transfer_timeout_s
        if s.design.timers and q.t_padd is not None and s.now - q.t_padd > bound + 1e-9:
            raise Violation("request-ends", f"{s.wname(i)} released {q.rid} "
                                            f"{s.now - q.t_padd:g} s after it started, beyond "
                                            f"request timeout + transfer timeout = {bound:g} s")
        s.note(f"P{i}", f"SendFinished({q.rid}, {'ok' if e.ok else 'failed'})")
        for w in s.fifo[i]:
            if w[0] == q.idx:
                raise Violation("use-after-free",
                                f"{s.wname(i)} released {q.rid} (SendFinished) while its "
                                f"{s.what(w[0], w[1])} write is still in flight")
        if min(reports) == 0:
            return  # the scheduler frees only when every TP worker reported finished_sending
        i = q.p_rank
        if q.p_stage == "scheduled":
            q.p_stage = "finished"
        if q.p_freed:
            q.p_stage = "released"
        elif s.phase is None and q.idx not in s.p_batch[i] and q.idx not in s.p_running[i]:
            self._free_p(i, q.idx, "finished_sending")
        else:  # vLLM frees between steps, and never a request it still computes (this step's
            # or one with chunks left: a send that failed early waits for the prefill's end)
            s.p_free_pending[i].append(q.idx)
