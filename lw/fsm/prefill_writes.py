"""P's endpoint: the push itself, from a computed layer to its written blocks (a part of
:class:`lw.fsm.prefill.PrefillEndpoint`, split from it as a concern of its own).

Chunks are announced (:meth:`LayerWrites.add_chunk`), each computed layer becomes one
:class:`WriteLayer` per target once D accepted (writes numbered in (chunk, layer) order,
``WriteLayer.seq``), and the data plane's completions (:meth:`LayerWrites.transfer_done`) move
the lifecycle past every write completed in order; DONE goes out after the last.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from lw.fsm.effects import ArmTimer, Effect, WriteLayer
from lw.fsm.lifecycles import AHEAD, AWAIT_DECODER_META, FAILED
from lw.fsm.machine import ProtocolError
from lw.fsm.prefill_request import PrefillConfig, PrefillRecord

__all__ = ["LayerWrites"]


class LayerWrites:
    """Layer events, chunks and write completions: the methods PrefillEndpoint takes from
    here (they use its attributes and helpers)."""

    __slots__ = ()

    num_layers: int
    config: PrefillConfig
    counters: dict[str, int]
    _reqs: dict[str, PrefillRecord]
    _finished: dict[str, str]
    _table: dict
    _ring: deque | None
    _landed_at: dict[str, float]

    if TYPE_CHECKING:  # the endpoint's, not overridden here
        def _fire(self, rec: PrefillRecord, event: str, now: float,
                  detail: str | int = "") -> str: ...

        def _fail(self, rec: PrefillRecord, reason: str, now: float,
                  out: list[Effect]) -> None: ...

        def _maybe_release(self, rec: PrefillRecord, out: list[Effect]) -> None: ...

        def _renamed(self, req_id: str) -> PrefillRecord | None: ...

        def _who(self) -> str: ...

        def _hold_done(self, rec: PrefillRecord, now: float, out: list[Effect]) -> bool: ...

        def _send_done(self, rec: PrefillRecord, out: list[Effect]) -> None: ...

    def layer_computed(self, layer: int, req_ids: Iterable[str], now: float) -> list[Effect]:
        """The forward pass finished ``layer`` for these requests (hot path; never waits).

        All or nothing: the batch is checked before any request changes, so a ProtocolError for
        one request loses no effect of the others."""
        reqs = self._reqs
        table = self._table
        recs = [rec for rid in req_ids if (rec := reqs.get(rid) or self._renamed(rid))
                is not None]
        L = self.num_layers
        for rec in recs:
            c = rec.computed
            if rec.state == FAILED:
                continue  # computation goes on; nothing is sent, whatever layer it is
            if (c >= rec.limit or layer != c % L
                    or (rec.state, "layer_computed") not in table):
                raise ProtocolError(
                    "prefill", rec.req.req_id, rec.state, "layer_computed",
                    f"layer {layer} computed but " + (
                        f"{c} was expected next" if c < min(L, rec.limit) else
                        f"layer {c % L} of chunk {c // L} was expected next" if c < rec.limit
                        else f"no chunk is announced after chunk {c // L - 1}"),
                )
        out: list[Effect] = []
        if recs and self._ring is not None:
            # the hook's own tuple when it is one (the runtime's is): no copy per layer
            ids = req_ids if type(req_ids) is tuple else tuple(r.req.req_id for r in recs)
            self._ring.append((now, ids, "layer_computed", "", "", layer))
        for rec in recs:
            st = rec.state
            if st == FAILED:
                continue
            rec.computed += 1
            rec.progress_at = now
            if st != AWAIT_DECODER_META and st != AHEAD:
                self._submit_ready(rec, out, now)
        return out

    def add_chunk(self, req_id: str, local_blocks: tuple[int, ...], final: bool,
                  now: float) -> list[Effect]:
        """Progressive push: this step computes another chunk of the prompt, which completes
        ``local_blocks`` (the P blocks of the next remote blocks, in order); ``final``: it is
        the prompt's last chunk. Its layers are reported by :meth:`layer_computed` as usual.
        A chunk that does not fit the request fails it (D is told), naming what was wrong."""
        rec = self._reqs.get(req_id)
        if rec is None:
            if req_id in self._finished:
                self.counters["stale_messages"] += 1  # failed and released: nothing to send
                return []
            raise ProtocolError("prefill", req_id, "UNKNOWN", "chunk_scheduled",
                                f"no such request on {self._who()}")
        if rec.state == FAILED:
            self._fire(rec, "chunk_scheduled", now, len(local_blocks))
            return []
        have = rec.announced + len(local_blocks)
        want = len(rec.req.remote_blocks) + rec.skip  # unknown before the bind (AHEAD)
        problem = ""
        if rec.final:
            problem = "a chunk after the prompt's last chunk"
        elif not local_blocks:
            problem = "a chunk that completes no block is not announced"
        elif rec.state != AHEAD and (have > want or (final and have != want)):
            problem = (f"{have} of {want} blocks complete after this chunk"
                       + (" (its last)" if final else ""))
        out: list[Effect] = []
        if problem:
            self.counters["bad_chunks"] += 1
            self._fail(rec, f"bad chunk from the scheduler: {problem}", now, out)
            return out
        self._fire(rec, "chunk_scheduled", now, len(local_blocks))
        self._announce(rec, local_blocks)
        rec.final = final
        return out

    def _announce(self, rec: PrefillRecord, local_blocks: tuple[int, ...]) -> None:
        """Record a chunk: the blocks its layers write (P side and D side), without those of
        D's own prefix hit (``rec.skip``; none before a bind: D's blocks are not known)."""
        lo = rec.announced
        hi = rec.announced = lo + len(local_blocks)
        cut = min(len(local_blocks), max(0, rec.skip - lo))
        mine = local_blocks[cut:] if cut else local_blocks
        rec.local += mine
        remote = rec.req.remote_blocks
        a, b = lo + cut - rec.skip, hi - rec.skip
        rec.chunks.append((mine, remote if a == 0 and b == len(remote) else remote[a:b]))
        rec.limit += self.num_layers

    def transfer_done(
        self, req_id: str, seq: int, ok: bool, reason: str, now: float, in_doubt: bool = False
    ) -> list[Effect]:
        """The data plane finished write ``seq`` of a request to one target (its
        ``WriteLayer.seq``: the layer, for a request sent in one chunk; ``ok`` false: it failed;
        ``in_doubt``: it failed after handing bytes over, which may still land)."""
        out: list[Effect] = []
        rec = self._reqs.get(req_id)
        if rec is None:
            raise ProtocolError("prefill", req_id, "UNKNOWN", "layer_sent", "no such live request")
        left = rec.pending.get(seq, 0)
        if rec.inflight <= 0 or left <= 0:
            raise ProtocolError("prefill", req_id, rec.state, "layer_sent",
                                f"no write of {self._what(seq)} in flight")
        rec.inflight -= 1
        if left == 1:
            del rec.pending[seq]
        else:
            rec.pending[seq] = left - 1
        if not ok and in_doubt:
            rec.in_doubt = True
        if not ok and self._ring is not None:
            self._ring.append((now, req_id, "write_failed", rec.state, "", f"{seq}: {reason}"))
        if ok:
            rec.progress_at = now
            landed = self._landed_at  # link_moved, inlined: once per landed write
            for tg in rec.targets:  # the link to its D moves: requests queued behind progress
                landed[tg.addr] = now
        if not ok:
            self._fail(rec, f"{self._what(seq)} write failed: {reason}", now, out)
        elif rec.state == FAILED:
            if left == 1:
                self._fire(rec, "layer_sent", now, seq)
        elif left == 1:  # the write reached every target
            self._written(rec, seq, now, out)
        self._maybe_release(rec, out)
        return out

    def _written(self, rec: PrefillRecord, seq: int, now: float, out: list[Effect]) -> None:
        """Write ``seq`` reached every target (or had no block to write): the lifecycle moves
        past every write completed in order, and DONE goes out after the last."""
        L = self.num_layers
        rec.out_of_order.add(seq)
        if rec.sent != seq and self._ring is not None:  # written ahead of an earlier one
            self._ring.append((now, rec.req.req_id, "layer_written", rec.state, "", seq))
        while rec.sent in rec.out_of_order:
            rec.out_of_order.discard(rec.sent)
            self._fire(rec, "layer_sent", now, rec.sent)
            rec.sent += 1
            if rec.sent % L == 0 and not (rec.final and rec.sent == rec.limit):
                self._fire(rec, "chunk_sent", now, rec.sent // L - 1)
        if rec.final and rec.sent == rec.limit and not rec.out_of_order:
            if self._hold_done(rec, now, out):
                return  # the ack timer's first firing sends it if the token did not
            self._send_done(rec, out)
            out.append(ArmTimer(("ack", rec.req.req_id), now + self.config.ack_retry_s))

    def _what(self, seq: int) -> str:
        L = self.num_layers
        return f"layer {seq}" if seq < L else f"layer {seq % L} of chunk {seq // L}"

    def _submit_ready(self, rec: PrefillRecord, out: list[Effect], now: float) -> None:
        rid = rec.req.req_id
        n = len(rec.targets)
        L = self.num_layers
        while rec.submitted < rec.computed:
            seq = rec.submitted
            layer = seq % L
            local, remote = rec.chunks[seq // L]
            if not local:  # a chunk of D's own prefix hit (computed ahead): nothing to write
                rec.submitted += 1
                self._written(rec, seq, now, out)
                continue
            for t in rec.targets:
                assert t.layout is not None
                out.append(WriteLayer(rid, layer, t.layout, local, remote, t.segs[layer],
                                      t.addr, seq, self.config.kv_checksum, rec.deadline))
            rec.pending[seq] = n
            rec.submitted += 1
            rec.inflight += n
            self.counters["layer_writes"] += n
