"""What D's KV memory holds, for the fencing property (a mixin of :class:`lw.sim.world.World`).

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
from lw.sim.failover import EPOCH_TAG
from lw.sim.properties import Violation
from lw.sim.request import Req

# (D worker, block, layer, head slice) -> the claim whose bytes are there: the request's
# index, plus its claim epoch times lw.sim.failover.EPOCH_TAG (prefill failover)
Memory = dict[tuple[int, int, int, int], int]


class KVBytes:
    """D memory contents, late landings of in-doubt bytes, and the checksums over them."""

    def _tracks_bytes(self) -> bool:
        return self.cfg.kv_checksum or self.cfg.late_writes

    def _slice(self, w: int) -> int:
        """The head slice P worker ``w`` writes in a D block (MLA: the whole latent vector)."""
        return 0 if self.cfg.mla else w % self.tp

    def _land(self, w: int, r: int, layer: int, v: int, remote: tuple[int, ...],
              epoch: int) -> None:
        if self._tracks_bytes():
            s = self._slice(w)
            tag = self.claim_tag(r, epoch)
            for b in remote:
                self.d_mem[(v, b, layer, s)] = tag

    def _zombie_deadline(self) -> float:
        """When in-doubt bytes stop being able to land: never, with ``late_writes``."""
        return math.inf if self.cfg.late_writes else self.now + self.cfg.transfer_timeout_s

    def _zland_actions(self) -> list[Action]:
        if not self.cfg.late_writes:
            return []  # bounded: the ownership check covers every moment they may land
        return [("zland", *z[:4]) for z in self.zombies]

    def _do_zland(self, i: int, r: int, seq: int, v: int) -> None:
        z = next(z for z in self.zombies if z[:4] == (i, r, seq, v))
        self.zombies.remove(z)
        self._land(i, r, seq % self.cfg.layers, v, z[4], z[6])
        for b in z[4]:  # the fault's bytes reach whichever request holds the block now
            owner = self.d_pool[v // self.d_tp][b]
            if owner is not None:
                self.reqs[owner].touched = True
        self._arrow(f"P{i}", f"D{v}", f"LATE bytes of {self.reqs[r].rid} {self.what(r, seq)} -> "
                                      f"block(s) {list(z[4])}", dashed=True)

    def _memory_key(self) -> tuple | None:
        """The memory as far as a property can tell: which entries hold their block's current
        owner's bytes (every other content is some other claim's, which one does not matter:
        request indices are never reused)."""
        if not self._tracks_bytes():
            return None
        pools, reqs = self.d_pool, self.reqs
        current = {q.idx: self.claim_tag(q.idx, q.epoch) for q in reqs}
        return tuple(sorted(k for k, r in self.d_mem.items()
                            if current.get(pools[k[0] // self.d_tp][k[1]]) == r))

    def _forget_memory(self, d: int) -> None:
        """A new process of D engine ``d`` registered its memory anew."""
        dead = self.d_workers_of(d)
        self.d_mem = {k: r for k, r in self.d_mem.items() if k[0] not in dead}

    def _kept_sums(self, req_id: str, layers: int) -> list[list[int]]:
        """What P's driver kept of its writes with kv_checksum, per layer: a sum per block it
        wrote (a sum here is the writing request's index + 1)."""
        q = self.reqs[int(req_id[1:])]
        return [[self.claim_tag(q.idx, q.p_epoch) + 1] * len(q.d_remote) for _ in range(layers)]

    def _block_sums(self, v: int, plan: SumPlan, layers: int) -> list[list[int]]:
        """D worker ``v``'s sums over its own memory where the plan's sender wrote, per layer
        (0 where nothing was written). The memory is kept per head slice, the one the plan's
        runs cover."""
        s = self._slice(plan.sender[1])
        return [[self.d_mem.get((v, b, k, s), -1) + 1 for b in plan.blocks]
                for k in range(layers)]

    def _claim_name(self, tag: int) -> str:
        """Whose bytes a memory tag stands for, for reports."""
        r, epoch = tag % EPOCH_TAG, tag // EPOCH_TAG
        return f"bytes of {self.reqs[r].rid}" + (f" (claim epoch {epoch})" if epoch or
                                                 self.cfg.retry_prefill else "")

    def _check_fenced(self, q: Req) -> None:
        """Property stale-kv, when D's engine starts decoding ``q``."""
        if not self._tracks_bytes():
            return
        for v in self.d_workers_of(q.d_rank):
            slices = {self._slice(w) for w in self.writers(q, v)}
            for b in q.d_remote:
                for k in range(self.cfg.layers):
                    for s in slices:
                        r = self.d_mem.get((v, b, k, s))
                        if r != self.claim_tag(q.idx, q.epoch):
                            what = "nothing" if r is None else self._claim_name(r)
                            raise Violation(
                                "stale-kv", f"{self.dname(q.d_rank)} decodes {q.rid} but "
                                            f"D{v} block {b} layer {k} (head slice {s}) holds "
                                            f"{what}")
