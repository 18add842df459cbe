"""The data plane of the checker world: writes the core submits (with the placement and layout
properties checked on each) and their completion, which lands their bytes in D's blocks (a
part of :class:`lw.sim.world.World`)."""

from __future__ import annotations

from lw.fsm import FenceData, WriteLayer
from lw.fsm.messages import KVLayout
from lw.sim.config import HEAD_BYTES, p_addr
from lw.sim.heads import write_problem
from lw.sim.kvbytes import KVBytes
from lw.sim.ports import Ports
from lw.sim.properties import Violation
from lw.sim.request import Req
from lw.sim.state import WorldState


class DataPath:
    """Writes in flight per P worker (``fifo``), and what they carry (requests' ``landed``;
    the bytes through :class:`~lw.sim.kvbytes.KVBytes`)."""

    __slots__ = ("s", "ports", "kv", "__weakref__")  # the ports hold it weakly

    def __init__(self, s: WorldState, ports: Ports, kv: KVBytes) -> None:
        self.s = s
        self.ports = ports
        self.kv = kv

    def on_write(self, i: int, e: WriteLayer) -> None:
        """P worker ``i`` submits a write: check it, and queue it on the worker's data plane."""
        s = self.s
        q = s.reqs[int(e.req_id[1:])]
        v = _d_worker_of(e.layout)
        what = s.what(q.idx, e.seq)
        if (i, v) not in q.accepted:
            raise Violation("write-before-accept",
                            f"{s.wname(i)} submits a write of {q.rid} {what} before "
                            f"{s.dwname(v)} accepted it as a sender")
        if v // s.d_tp != q.d_rank or i not in s.writers(q, v):
            raise Violation("write-before-accept", f"{s.wname(i)} writes {q.rid} {what} into "
                                                   f"{s.dwname(v)}, which the sender plan "
                                                   "does not say it feeds")
        cached = sorted(set(e.remote_blocks) & set(q.d_cached))
        if cached:
            raise Violation("cached-block-written",
                            f"{s.wname(i)} writes {q.rid} {what} into D block(s) "
                            f"{cached}, which D serves from its prefix cache")
        self._check_placement(i, q, e)
        self._check_layout(i, q, v, e)
        if "staging-queue" in s.quirks and s.fifo[i]:
            raise Violation("p-memory-bounded",
                            f"{s.wname(i)} stages a copy of {q.rid} {what} while "
                            f"{len(s.fifo[i])} staged layer(s) still wait to be sent: the "
                            "queue of copies grows with every layer D is slower than compute")
        s.fifo[i].append((q.idx, e.seq, e.local_blocks, e.remote_blocks, v,
                          s.now + s.cfg.transfer_timeout_s, e.layout.incarnation))
        to = f" to D{v}" if s.d_tp > 1 else ""
        s.note(f"P{i}", f"write of {q.rid} {what}{to} submitted (in flight)")

    # ------------------------------------------------------------------ fences (fence_data)
    def on_fence(self, v: int, e: FenceData) -> None:
        """D worker ``v`` asks to fence the data plane from ``e.senders``: what it will cut is
        the in-doubt bytes of those P workers to ``v`` now (their connections)."""
        s = self.s
        workers = {w for w in range(len(s.p)) for x in e.senders if x.addr == p_addr(w)}
        cut = tuple(sorted(z[:4] for z in s.zombies if z[0] in workers and z[3] == v))
        s.fences = [f for f in s.fences if f[:3] != (v, e.req_id, e.epoch)]
        s.fences.append((v, e.req_id, e.epoch, cut, s.now + s.cfg.fence_s))
        s.note(s.dwname(v), f"fences the data plane from P worker(s) {sorted(workers)} "
                            f"({e.req_id} epoch {e.epoch})")

    def fenced_actions(self) -> list[tuple]:
        """The fences that may complete now (any moment after they were asked)."""
        s = self.s
        return [("fenced", f[0], f[1], f[2]) for f in s.fences if s.d_alive[f[0] // s.d_tp]]

    def do_fenced(self, v: int, req_id: str, epoch: int) -> None:
        """A fence completes (at the latest fence_s after it was asked: a clock deadline): the
        in-doubt bytes it cuts can no longer land; D is told."""
        s = self.s
        f = next(f for f in s.fences if f[:3] == (v, req_id, epoch))
        s.fences.remove(f)
        if s.cfg.fence_holds():
            s.zombies = [z for z in s.zombies if z[:4] not in f[3]]
            s.note(s.dwname(v), f"the data-plane fence for {req_id} epoch {epoch} holds")
        else:  # it returned, but the senders' bytes in flight still land (see PLANES)
            s.note(s.dwname(v), f"the data-plane fence for {req_id} epoch {epoch} returns; "
                                "the bytes it was to cut may still land")
        self.ports.run(("d", v), s.d[v].data_fenced(req_id, epoch, True, "", s.now))

    def _check_placement(self, i: int, q: Req, e: WriteLayer) -> None:
        """Property kv-placement: write ``seq`` (chunk * L + layer, the chunks counted as the
        core announces them) carries exactly that chunk's P blocks (those of the tokens D
        misses that it completes) and the D blocks that hold those tokens, block for block,
        and only once the forward pass computed that chunk's layer."""
        s = self.s
        L = s.cfg.layers
        c, k = q.chunk_of(e.seq, L), e.seq % L
        who = f"{s.wname(i)} writes {q.rid} {s.what(q.idx, e.seq)}"
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
        if c > now or (c == now and q.idx in s.p_batch[q.p_rank] and (
                s.phase is None or k > s.phase)):
            raise Violation("kv-placement", f"{who} before the forward pass computed it")

    def _check_layout(self, i: int, q: Req, v: int, e: WriteLayer) -> None:
        """Property layout-match: a write is addressed with its D worker's current layout (or
        with an earlier incarnation's, which fails), inside D's pool, with P's layer count and
        byte runs that fit both blocks."""
        s = self.s
        cur = s.d[v].layout
        lay = e.layout
        who = f"{s.wname(i)}'s write of {q.rid} {s.what(q.idx, e.seq)} into {s.dwname(v)}"
        if lay.incarnation == cur.incarnation and lay != cur:
            raise Violation("layout-match", f"{who} uses a layout that is not D's own (the "
                                            "addresses of an earlier incarnation)")
        if len(lay.layers) != s.cfg.layers:
            raise Violation("layout-match", f"{who} uses a layout of {len(lay.layers)} layers; "
                                            f"P computes {s.cfg.layers}")
        n = min(s.cfg.d_blocks, cur.layers[min(e.layer, len(cur.layers) - 1)].num_blocks)
        past = [b for b in e.remote_blocks if not 0 <= b < n]
        if past:
            raise Violation("layout-match", f"{who} targets block(s) {past}, past the end of "
                                            f"D's {n} registered block(s)")
        mine = s.p[i].local
        if e.segments is not None and mine is not None:
            src, dst = mine.layers[e.layer].block_len, lay.layers[e.layer].block_len
            bad = [g for g in e.segments if g[0] + g[2] > src or g[1] + g[2] > dst]
            if bad:
                raise Violation("layout-match", f"{who} has byte runs {bad} outside the blocks "
                                                f"({src} bytes on P, {dst} on D)")
        if mine is not None and lay.incarnation == cur.incarnation:
            # the world's own head model (lw.sim.heads), not kvmap's answer to itself
            why = write_problem(i % s.tp, s.tp, v % s.d_tp, s.d_tp,
                                s.cfg.kv_heads(), s.cfg.mla, e.segments,
                                mine.layers[e.layer].block_len, lay.layers[e.layer].block_len,
                                HEAD_BYTES)
            if why:
                raise Violation("kv-placement", f"{who}: {why}")

    def do_complete(self, i: int, j: int = 0) -> None:
        """Write ``j`` in flight of P worker ``i`` completes (it lands, if its D process is
        the one it was addressed to)."""
        s = self.s
        r, seq, _local, remote, v, _deadline, inc = s.fifo[i].pop(j)
        q = s.reqs[r]
        e = v // s.d_tp
        ok = s.d_alive[e] and inc == s.d_inc[e]
        if ok:
            layer = seq % s.cfg.layers
            q.landed = q.landed | {(i, v, layer, b) for b in remote}
            self.kv.land(i, r, layer, v, remote, q.p_epoch)
            s.arrow(f"P{i}", f"D{v}", f"KV {q.rid} {s.what(r, seq)} -> block(s) "
                                      f"{list(remote)}", dashed=True)
        if "poll-on-step" in s.quirks:  # noticed only when P's engine steps next
            s.unpolled[i].append((r, seq, ok))
            return
        self.ports.run(("p", i), s.p[i].transfer_done(q.rid, seq, ok, "" if ok else
                                                      "peer gone", s.now))


def _d_worker_of(layout: KVLayout) -> int:
    """The D worker a WriteLayer goes to, from its layout's transfer-engine session."""
    return int(layout.te_session.split("-", 1)[0][1:])
