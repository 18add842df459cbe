"""The data plane of the checker world: writes the core submits (with the placement and layout
properties checked on each) and their completion, which lands their bytes in D's blocks (a
mixin of :class:`lw.sim.world.World`)."""

from __future__ import annotations

from lw.fsm import WriteLayer
from lw.fsm.messages import KVLayout
from lw.sim.config import HEAD_BYTES
from lw.sim.heads import write_problem
from lw.sim.properties import Violation
from lw.sim.request import Req


class DataPath:
    """Writes in flight per P worker, and what they carry."""

    def _on_write(self, i: int, e: WriteLayer) -> None:
        q = self.reqs[int(e.req_id[1:])]
        v = _d_worker_of(e.layout)
        what = self.what(q.idx, e.seq)
        if (i, v) not in q.accepted:
            raise Violation("write-before-accept",
                            f"{self.wname(i)} submits a write of {q.rid} {what} before "
                            f"{self.dwname(v)} accepted it as a sender")
        if v // self.d_tp != q.d_rank or i not in self.writers(q, v):
            raise Violation("write-before-accept", f"{self.wname(i)} writes {q.rid} {what} into "
                                                   f"{self.dwname(v)}, which the sender plan "
                                                   "does not say it feeds")
        cached = sorted(set(e.remote_blocks) & set(q.d_cached))
        if cached:
            raise Violation("cached-block-written",
                            f"{self.wname(i)} writes {q.rid} {what} into D block(s) "
                            f"{cached}, which D serves from its prefix cache")
        self._check_placement(i, q, e)
        self._check_layout(i, q, v, e)
        if "staging-queue" in self.quirks and self.fifo[i]:
            raise Violation("p-memory-bounded",
                            f"{self.wname(i)} stages a copy of {q.rid} {what} while "
                            f"{len(self.fifo[i])} staged layer(s) still wait to be sent: the "
                            "queue of copies grows with every layer D is slower than compute")
        self.fifo[i].append((q.idx, e.seq, e.local_blocks, e.remote_blocks, v,
                             self.now + self.cfg.transfer_timeout_s, e.layout.incarnation))
        to = f" to D{v}" if self.d_tp > 1 else ""
        self._note(f"P{i}", f"write of {q.rid} {what}{to} submitted (in flight)")

    def _check_placement(self, i: int, q: Req, e: WriteLayer) -> None:
        """Property kv-placement: write ``seq`` (chunk * L + layer, the chunks counted as the
        core announces them) carries exactly that chunk's P blocks (those of the tokens D
        misses that it completes) and the D blocks that hold those tokens, block for block,
        and only once the forward pass computed that chunk's layer."""
        L = self.cfg.layers
        c, k = q.chunk_of(e.seq, L), e.seq % L
        who = f"{self.wname(i)} writes {q.rid} {self.what(q.idx, e.seq)}"
        if k != e.layer or not 0 <= c < len(q.sizes):
            raise Violation("kv-placement", f"{who} as layer {e.layer}: its prefill computes "
                                            f"{len(q.sizes)} chunk(s) of {L} layer(s)")
        span = q.span(c)
        local, remote = q.p_local[span], q.d_remote[span]
        if e.local_blocks != local or e.remote_blocks != remote:
            whose = "the tokens D misses" if len(q.sizes) == 1 else (
                f"the tokens D misses that chunk {c} completes")
            raise Violation("kv-placement",
                            f"{who} from P block(s) {list(e.local_blocks)} into D block(s) "
                            f"{list(e.remote_blocks)}; {whose} are in P block(s) {list(local)} "
                            f"and go to D block(s) {list(remote)}")
        now = q.chunk - 1  # the chunk P computes (or last computed)
        if c > now or (c == now and q.idx in self.p_batch[q.p_rank] and (
                self.phase is None or k > self.phase)):
            raise Violation("kv-placement", f"{who} before the forward pass computed it")

    def _check_layout(self, i: int, q: Req, v: int, e: WriteLayer) -> None:
        """Property layout-match: a write is addressed with its D worker's current layout (or
        with an earlier incarnation's, which fails), inside D's pool, with P's layer count and
        byte runs that fit both blocks."""
        cur = self.d[v].layout
        lay = e.layout
        who = f"{self.wname(i)}'s write of {q.rid} {self.what(q.idx, e.seq)} into {self.dwname(v)}"
        if lay.incarnation == cur.incarnation and lay != cur:
            raise Violation("layout-match", f"{who} uses a layout that is not D's own (the "
                                            "addresses of an earlier incarnation)")
        if len(lay.layers) != self.cfg.layers:
            raise Violation("layout-match", f"{who} uses a layout of {len(lay.layers)} layers; "
                                            f"P computes {self.cfg.layers}")
        n = min(self.cfg.d_blocks, cur.layers[min(e.layer, len(cur.layers) - 1)].num_blocks)
        past = [b for b in e.remote_blocks if not 0 <= b < n]
        if past:
            raise Violation("layout-match", f"{who} targets block(s) {past}, past the end of "
                                            f"D's {n} registered block(s)")
        mine = self.p[i].local
        if e.segments is not None and mine is not None:
            src, dst = mine.layers[e.layer].block_len, lay.layers[e.layer].block_len
            bad = [s for s in e.segments if s[0] + s[2] > src or s[1] + s[2] > dst]
            if bad:
                raise Violation("layout-match", f"{who} has byte runs {bad} outside the blocks "
                                                f"({src} bytes on P, {dst} on D)")
        if mine is not None and lay.incarnation == cur.incarnation:
            # the world's own head model (lw.sim.heads), not kvmap's answer to itself
            why = write_problem(i % self.tp, self.tp, v % self.d_tp, self.d_tp,
                                self.cfg.kv_heads(), self.cfg.mla, e.segments,
                                mine.layers[e.layer].block_len, lay.layers[e.layer].block_len,
                                HEAD_BYTES)
            if why:
                raise Violation("kv-placement", f"{who}: {why}")

    def _do_complete(self, i: int, j: int = 0) -> None:
        r, seq, _local, remote, v, _deadline, inc = self.fifo[i].pop(j)
        q = self.reqs[r]
        e = v // self.d_tp
        ok = self.d_alive[e] and inc == self.d_inc[e]
        if ok:
            layer = seq % self.cfg.layers
            q.landed = q.landed | {(i, v, layer, b) for b in remote}
            self._land(i, r, layer, v, remote, q.p_epoch)
            self._arrow(f"P{i}", f"D{v}", f"KV {q.rid} {self.what(r, seq)} -> block(s) "
                                          f"{list(remote)}", dashed=True)
        if "poll-on-step" in self.quirks:  # noticed only when P's engine steps next
            self.unpolled[i].append((r, seq, ok))
            return
        self._effects(("p", i), self.p[i].transfer_done(q.rid, seq, ok, "" if ok else
                                                        "peer gone", self.now))


def _d_worker_of(layout: KVLayout) -> int:
    """The D worker a WriteLayer goes to, from its layout's transfer-engine session."""
    return int(layout.te_session.split("-", 1)[0][1:])
