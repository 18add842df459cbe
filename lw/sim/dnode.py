"""D's engine in the checker world: its workers' reports (RecvDone, RecvFailed, Quarantine),
which the scheduler aggregates per request, with the partial-kv property, decoding, and the
first token P sent (streamed to the client, decoded on from) (a part of
:class:`lw.sim.world.World`)."""

from __future__ import annotations

from lw.fsm import Quarantine, RecvDone, RecvFailed, ReleaseBlocks
from lw.fsm.effects import FirstTokenTaken
from lw.sim.config import _owner
from lw.sim.heads import held
from lw.sim.kvbytes import KVBytes
from lw.sim.properties import Violation
from lw.sim.request import Req
from lw.sim.state import WorldState
from lw.sim.tokens import d_token, origin, show, spec_of


class DNode:
    """D's scheduler: reports, decoding, frees (``d_pool``, ``free_why``, the requests' D-side
    fields)."""

    __slots__ = ("s", "kv", "__weakref__")  # the ports hold it weakly

    def __init__(self, s: WorldState, kv: KVBytes) -> None:
        self.s = s
        self.kv = kv

    def do_decode(self, r: int) -> None:
        """D finishes decoding request ``r`` and frees its blocks."""
        q = self.s.reqs[r]
        if self.s.cfg.first_token_from_p:
            self._decode_on(q, "decodes")
        self.free_d(q, "decode finished")
        q.d_stage = "done"

    # ------------------------------------------------------------------ the first token
    def on_first_token(self, v: int, e: FirstTokenTaken) -> None:
        """D worker ``v`` took P's first token of a request: the scheduler streams it to the
        client if the request holds no token yet and it was sampled with the request's spec;
        otherwise it is discarded (property first-token-bound judges both steps)."""
        s = self.s
        q = s.reqs[int(e.req_id[1:])]
        o = origin(e.token)
        if (o.idx, o.epoch, o.spec, o.by_d) != (q.idx, e.epoch, e.spec, False):
            raise Violation("first-token-bound", f"D{v} took {show(e.token)} as {q.rid}'s, "
                                                 f"sampled under epoch {e.epoch} with spec "
                                                 f"{e.spec}")
        if e.epoch != q.epoch:
            raise Violation("first-token-bound",
                            f"D{v} took {q.rid}'s first token of claim epoch {e.epoch} while "
                            f"the request is under epoch {q.epoch}: a token of a prefill D "
                            "gave up")
        target: Req | None = q
        if "token-by-slot" in s.quirks:  # the hand-off is keyed by the request's first slot
            owner = s.d_pool[q.d_rank][q.d_blocks[0]] if q.d_blocks else None
            target = None if owner is None else s.reqs[owner]
        where = s.dpart(q.d_rank)
        if target is None or target.client is not None or target.d_stage not in (
                "allocated", "decoding"):
            s.note(where, f"scheduler discards {q.rid}'s first {show(e.token)}"
                          + ("" if target is None or target.client is None else
                             f": {target.rid}'s client holds {show(target.client)}"))
            return
        if e.spec != spec_of(target.idx) and "token-spec-unchecked" not in s.quirks:
            s.note(where, f"scheduler refuses {q.rid}'s first {show(e.token)}: the request "
                          f"asked for spec {spec_of(target.idx)}")
            return
        target.client = e.token
        s.flags.add("first-token")
        s.note(where, f"{target.rid}'s client is streamed {show(e.token)}")
        self._check_client(target)

    def _check_client(self, q: Req) -> None:
        """Property first-token-bound at the client: the token it was streamed was sampled
        for its request, under the claim epoch D holds, with the spec the client asked for."""
        assert q.client is not None
        o = origin(q.client)
        why = (f"drawn for r{o.idx}" if o.idx != q.idx else
               f"drawn with spec {o.spec}, the client asked for {spec_of(q.idx)}"
               if o.spec != spec_of(q.idx) else
               f"drawn under claim epoch {o.epoch}, D holds {q.epoch}"
               if not o.by_d and o.epoch != q.epoch else "")
        if why:
            raise Violation("first-token-bound", f"{q.rid}'s client is streamed "
                                                 f"{show(q.client)} as its first token: {why}")

    def _decode_on(self, q: Req, how: str) -> None:
        """D decodes ``q`` on (or recomputes it after a failed transfer) from the first token
        its client was streamed: P's, or one D samples itself if none came (property
        first-token-continuation)."""
        s = self.s
        if q.client is None:  # D samples the first token itself and streams it
            q.client = d_token(q.idx, q.epoch)
            self._check_client(q)
        own = "recompute-own-token" in s.quirks and how != "decodes"
        q.base = d_token(q.idx, q.epoch) if own else q.client
        s.note(s.dpart(q.d_rank), f"{q.rid}: D {how} on from {show(q.base)}")
        if q.base != q.client:
            raise Violation("first-token-continuation",
                            f"D {how} {q.rid} on from {show(q.base)}, but its client was "
                            f"streamed {show(q.client)}")

    def free_d(self, q: Req, why: str) -> None:
        """D's scheduler frees ``q``'s blocks."""
        s = self.s
        d = q.d_rank
        pool = s.d_pool[d]
        for b in q.d_blocks or ():
            if pool[b] != q.idx:
                raise Violation("double-free", f"{s.dname(d)} frees block {b} of {q.rid} but "
                                               f"it is owned by {_owner(pool[b])}")
            pool[b] = None
            s.free_why[("D", d, b)] = why
        s.note(s.dpart(d), f"frees block(s) {list(q.d_blocks or ())} of {q.rid} ({why})")

    def fresh_blocks(self, v: int, req_id: str, count: int) -> tuple[int, ...] | None:
        """D worker ``v`` asks its scheduler for fresh blocks for a request's next claim epoch
        (retry_fresh_blocks): the lowest free ones of its engine's pool when enough are free,
        else refused. Its old blocks stay the request's in the pool until D releases them."""
        s = self.s
        q = s.reqs[int(req_id[1:])]
        d = v // s.d_tp
        pool = s.d_pool[d]
        free = [b for b, o in enumerate(pool) if o is None]
        if len(free) < count:  # (retries need d_tp 1: WorldConfig refuses them otherwise)
            s.flags.add("fresh-refused")
            s.note(s.dpart(d), f"no {count} free block(s) for {q.rid}'s next epoch: refused")
            return None
        got = tuple(free[:count])
        for b in got:
            pool[b] = q.idx
        old = q.d_remote
        q.d_blocks = q.d_cached + got
        s.flags.add("fresh-blocks")
        s.note(s.dpart(d), f"{q.rid} gets fresh block(s) {list(got)} for its next epoch "
                           f"(block(s) {list(old)} held until D releases them)")
        return got

    def on_release(self, v: int, e: ReleaseBlocks) -> None:
        """D worker ``v`` frees the blocks of a request's abandoned claim epoch."""
        s = self.s
        q = s.reqs[int(e.req_id[1:])]
        d = v // s.d_tp
        pool = s.d_pool[d]
        for b in e.block_ids:
            if pool[b] != q.idx or b in (q.d_blocks or ()):
                raise Violation("double-free", f"D{v} releases block {b} of {q.rid}'s claim "
                                               f"epoch {e.epoch}, but it is "
                                               + ("the request's current block" if pool[b] ==
                                                  q.idx else _owner(pool[b])))
            pool[b] = None
            s.free_why[("D", d, b)] = f"claim epoch {e.epoch} of {q.rid} released"
        s.note(f"D{v}", f"releases block(s) {list(e.block_ids)} of {q.rid}'s claim epoch "
                        f"{e.epoch}")

    def on_quarantine(self, v: int, e: Quarantine) -> None:
        """D worker ``v`` failed a request and holds its blocks until its senders stopped."""
        s = self.s
        q = s.reqs[int(e.req_id[1:])]
        if tuple(e.block_ids) != q.d_remote:
            raise Violation("double-free", f"D{v} quarantines blocks "
                                           f"{list(e.block_ids)} for {q.rid}, which "
                                           f"receives into {list(q.d_remote)}")
        q.quarantined = True
        q.t_dfail = s.now
        s.note(f"D{v}", f"{e.req_id} FAILED, block(s) {list(e.block_ids)} quarantined")

    def _recv_report(self, v: int, q: Req, ok: bool) -> None:
        """Count one D worker's RecvDone/RecvFailed for ``q`` (each reports exactly once)."""
        j = v % self.s.d_tp
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
        s = self.s
        want = {(w, k, b) for w in s.writers(q, v) for k in range(s.cfg.layers)
                for b in q.d_remote}
        missing = sorted(want - {(w, k, b) for w, x, k, b in q.landed if x == v})
        inflight = [s.what(w[0], w[1]) for f in s.fifo for w in f
                    if w[0] == q.idx and w[4] == v]
        return missing, inflight

    def _check_heads_covered(self, q: Req, v: int) -> None:
        """Property partial-kv by the world's own head model (lw.sim.heads), not the sender
        plan kvmap computed: every head D worker ``v`` holds, of every layer and block it
        decodes ``q`` from, came with a write that landed."""
        s = self.s
        cfg = s.cfg
        need = held(v % s.d_tp, s.d_tp, cfg.kv_heads(), cfg.mla)
        got: dict[tuple[int, int], set[int]] = {}
        for w, x, k, b in q.landed:
            if x == v:
                got.setdefault((k, b), set()).update(held(w % s.tp, s.tp, cfg.kv_heads(),
                                                          cfg.mla))
        for k in range(cfg.layers):
            for b in q.d_remote:
                lost = sorted(set(need) - got.get((k, b), set()))
                if lost:
                    raise Violation("partial-kv",
                                    f"{s.dname(q.d_rank)} decodes {q.rid} but no write "
                                    f"carried head(s) {lost} of D{v} block {b} layer {k} (its "
                                    f"senders: P worker(s) {sorted(s.writers(q, v))})")

    def on_recv_done(self, v: int, e: RecvDone) -> None:
        """D worker ``v`` reports every layer of a request landed."""
        s = self.s
        q = s.reqs[int(e.req_id[1:])]
        self._recv_report(v, q, True)
        # every earlier epoch may have taken its deadline and a fencing lease
        retried = q.epoch * (s.cfg.prefill_timeout_s + s.cfg.quarantine_s())
        self._check_d_bound(v, q, retried + s.cfg.prefill_timeout_s)
        missing, inflight = self._missing_kv(q, v)
        if missing or inflight:
            raise Violation("partial-kv",
                            f"D{v} reports {q.rid} done but no write landed for (P worker, "
                            f"layer, D block) {missing} (in flight: {inflight})")
        if s.d_tp > 1:
            s.note(f"D{v}", f"RecvDone({q.rid}): all its layers landed")
        self._d_settle(q)

    def _d_settle(self, q: Req) -> None:
        """The engine's scheduler: a request is finished receiving once every TP worker reported
        (vLLM aggregates finished_recving); DONE only if every worker was DONE."""
        s = self.s
        if min(q.recv_reports) == 0:
            return
        if not all(q.recv_ok):
            if s.cfg.first_token_from_p and q.client is not None:
                # the client holds a first token: D recomputes from the prompt and that token
                # (or ends the request with an error, which continues nothing)
                self._decode_on(q, "recomputes after the failed transfer")
            self.free_d(q, "failed_recving")
            q.d_stage = "failed"
            q.quarantined = False
            return
        for v in s.d_workers_of(q.d_rank):
            missing, inflight = self._missing_kv(q, v)
            if missing or inflight:
                raise Violation("partial-kv",
                                f"{s.dname(q.d_rank)} decodes {q.rid} but no write landed "
                                f"in D{v} for (P worker, layer, D block) {missing} (in flight: "
                                f"{inflight})")
            self._check_heads_covered(q, v)
        self.kv.check_fenced(q)
        q.d_stage = "decoding"
        s.flags.add("done")
        if s.d_tp == 1:
            s.note(s.dpart(q.d_rank), f"RecvDone({q.rid}): all layers landed; decoding")
        else:
            s.note(s.dpart(q.d_rank), f"{q.rid}: every TP worker is DONE; decoding")

    def _check_d_bound(self, v: int, q: Req, bound: float) -> None:
        s = self.s
        if s.design.timers and q.t_alloc is not None and s.now - q.t_alloc > bound + 1e-9:
            raise Violation("request-ends", f"D{v} finished {q.rid} {s.now - q.t_alloc:g} s "
                                            f"after allocation, beyond its bound of {bound:g} s")

    def on_recv_failed(self, v: int, e: RecvFailed) -> None:
        """D worker ``v`` failed a request and released its blocks."""
        s = self.s
        q = s.reqs[int(e.req_id[1:])]
        self._recv_report(v, q, False)
        if tuple(e.block_ids) != q.d_remote:
            raise Violation("double-free", f"D{v} releases blocks {list(e.block_ids)} for "
                                           f"{q.rid}, which receives into {list(q.d_remote)}")
        self._check_d_bound(v, q, (q.epoch + 1) * (s.cfg.prefill_timeout_s
                                                   + s.cfg.quarantine_s()))
        s.note(f"D{v}", f"RecvFailed({q.rid}): {e.reason[:60]}")
        self._d_settle(q)
