"""What D's KV memory holds, for the fencing property (a part of :class:`lw.sim.world.World`).

With ``kv_checksum`` or ``late_writes`` the world records which claim's bytes each
(D worker, block, layer, head slice) holds. Writes land there; with ``late_writes`` so do the
bytes of a write that failed in doubt, at any later moment while that D process lives (a
partition that heals after every deadline and lease, the TCP stack retransmitting), possibly into
blocks D has since given to another request. P's DONE carries its checksums and D's driver
recomputes its own from this memory, as the runtime does with CRC-32C. Property ``stale-kv``: no
request is reported loaded while one of its blocks holds bytes of another claim.
"""

from __future__ import annotations

import math

from lw.fsm.effects import SumPlan
from lw.sim.config import Action
from lw.sim.properties import Violation
from lw.sim.request import Req
from lw.sim.state import EPOCH_TAG, WorldState


class KVBytes:
    """D memory contents (``d_mem``), late landings of in-doubt bytes (``zombies``), and the
    checksums over them."""

    __slots__ = ("s",)

    def __init__(self, s: WorldState) -> None:
        self.s = s

    def tracks_bytes(self) -> bool:
        """Whether the world records the bytes D's blocks hold (kv_checksum, late_writes)."""
        return self.s.cfg.kv_checksum or self.s.cfg.late_writes

    def _slice(self, w: int) -> int:
        """The head slice P worker ``w`` writes in a D block (MLA: the whole latent vector)."""
        return 0 if self.s.cfg.mla else w % self.s.tp

    def land(self, w: int, r: int, layer: int, v: int, remote: tuple[int, ...],
             epoch: int) -> None:
        """Bytes of request ``r`` (claim epoch ``epoch``) from P worker ``w`` reach D worker
        ``v``'s blocks ``remote`` at ``layer``."""
        if self.tracks_bytes():
            s = self._slice(w)
            tag = self.s.claim_tag(r, epoch)
            mem = self.s.d_mem
            for b in remote:
                mem[(v, b, layer, s)] = tag

    def zombie_deadline(self) -> float:
        """When in-doubt bytes stop being able to land: never, with ``late_writes``."""
        s = self.s
        return math.inf if s.cfg.late_writes else s.now + s.cfg.transfer_timeout_s

    def zland_actions(self) -> list[Action]:
        """The in-doubt bytes that may land now (only with late_writes)."""
        if not self.s.cfg.late_writes:
            return []  # bounded: the ownership check covers every moment they may land
        return [("zland", *z[:4]) for z in self.s.zombies]

    def do_zland(self, i: int, r: int, seq: int, v: int) -> None:
        """In-doubt bytes land late, in whatever the blocks hold now."""
        s = self.s
        z = next(z for z in s.zombies if z[:4] == (i, r, seq, v))
        s.zombies.remove(z)
        self.land(i, r, seq % s.cfg.layers, v, z[4], z[6])
        tag = s.claim_tag(r, z[6])
        for b in z[4]:  # the fault's bytes reach whichever request holds the block now
            owner = s.d_pool[v // s.d_tp][b]
            if owner is None:
                continue
            q = s.reqs[owner]
            q.touched = True
            if (q.d_stage == "decoding" and b in q.d_remote
                    and s.claim_tag(q.idx, q.epoch) != tag):
                # Checked when D started decoding it; these bytes come after: no checksum
                # sees them, the engine reads them as this request's KV.
                raise Violation("stale-kv",
                                f"{s.dname(v // s.d_tp)} decodes {q.rid} while the in-doubt "
                                f"bytes of {s.reqs[r].rid} {s.what(r, seq)} from P worker {i} "
                                f"land late in its block {b}: D freed or reused that block "
                                "before anything stopped them (a lease is no bound on when "
                                "bytes a link still carries arrive)")
        s.arrow(f"P{i}", f"D{v}", f"LATE bytes of {s.reqs[r].rid} {s.what(r, seq)} -> "
                                  f"block(s) {list(z[4])}", dashed=True)

    def memory_key(self) -> tuple | None:
        """The memory as far as a property can tell: which entries hold their block's current
        owner's bytes (every other content is some other claim's, which one does not matter:
        request indices are never reused)."""
        if not self.tracks_bytes():
            return None
        s = self.s
        pools, d_tp = s.d_pool, s.d_tp
        current = {q.idx: s.claim_tag(q.idx, q.epoch) for q in s.reqs}
        return tuple(sorted(k for k, r in s.d_mem.items()
                            if current.get(pools[k[0] // d_tp][k[1]]) == r))

    def forget_memory(self, d: int) -> None:
        """A new process of D engine ``d`` registered its memory anew."""
        dead = self.s.d_workers_of(d)
        self.s.d_mem = {k: r for k, r in self.s.d_mem.items() if k[0] not in dead}

    def kept_sums(self, req_id: str, layers: int) -> list[list[int]]:
        """What P's driver kept of its writes with kv_checksum, per layer: a sum per block it
        wrote (a sum here is the writing request's index + 1)."""
        q = self.s.reqs[int(req_id[1:])]
        return [[self.s.claim_tag(q.idx, q.p_epoch) + 1] * len(q.d_remote)
                for _ in range(layers)]

    def block_sums(self, v: int, plan: SumPlan, layers: int) -> list[list[int]]:
        """D worker ``v``'s sums over its own memory where the plan's sender wrote, per layer
        (0 where nothing was written). The memory is kept per head slice, the one the plan's
        runs cover."""
        s = self._slice(plan.sender[1])
        mem = self.s.d_mem
        return [[mem.get((v, b, k, s), -1) + 1 for b in plan.blocks] for k in range(layers)]

    def _claim_name(self, tag: int) -> str:
        """Whose bytes a memory tag stands for, for reports."""
        r, epoch = tag % EPOCH_TAG, tag // EPOCH_TAG
        return f"bytes of {self.s.reqs[r].rid}" + (f" (claim epoch {epoch})" if epoch or
                                                   self.s.cfg.retry_prefill else "")

    def check_fenced(self, q: Req) -> None:
        """Property stale-kv, when D's engine starts decoding ``q``."""
        if not self.tracks_bytes():
            return
        s = self.s
        for v in s.d_workers_of(q.d_rank):
            slices = {self._slice(w) for w in s.writers(q, v)}
            for b in q.d_remote:
                for k in range(s.cfg.layers):
                    for sl in slices:
                        r = s.d_mem.get((v, b, k, sl))
                        if r != s.claim_tag(q.idx, q.epoch):
                            what = "nothing" if r is None else self._claim_name(r)
                            raise Violation(
                                "stale-kv", f"{s.dname(q.d_rank)} decodes {q.rid} but "
                                            f"D{v} block {b} layer {k} (head slice {sl}) holds "
                                            f"{what}")
