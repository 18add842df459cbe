"""Where a worker's KV blocks live in its memory: the byte runs a ``WriteLayer`` moves, and the
CRC-32C of blocks for ``kv_checksum`` (what P wrote, what landed in D's blocks).

The worker loop (lw.transport.runtime) owns one :class:`KVMemory` and asks it for the data
plane's ``(src, dst, len)`` entries of each write; nothing here does I/O or decides anything about
a request's lifecycle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lw.fsm import WriteLayer
from lw.fsm.effects import SumPlan
from lw.fsm.messages import KVLayout, LayerLayout
from lw.transport.blockruns import block_runs, block_sums, check_segments

__all__ = ["Entry", "KVMemory"]

Entry = tuple[int, int, int]
"""One data-plane run: (source address, destination address, length)."""


class KVMemory:
    """A worker's block memory: write addressing (cached per request and target) and checksums.

    ``local_layout`` gives, per layer, where this worker's blocks live (P); ``entries_for`` may
    replace the address computation. P keeps the CRC-32C of the writes the core marks
    ``checksum`` (kv_checksum)."""

    def __init__(self, local_layout: Sequence[LayerLayout] | None,
                 entries_for: Callable[[WriteLayer], list[Entry]] | None = None) -> None:
        self.local = list(local_layout) if local_layout is not None else None
        self._entries_for = entries_for
        self._local_uniform = _uniform(self.local) if self.local else None
        # req_id -> [(key, offset runs)], one per target D worker
        self._runs: dict[str, list[tuple[tuple, list[Entry]]]] = {}
        self._remote_uniform: dict[tuple[str, int], tuple[int, int] | None] = {}
        # kv_checksum (P): (req_id, target addr) -> {layer: per-block CRC-32C of what we wrote}
        self._checksums: dict[tuple[str, str], dict[int, list[int]]] = {}

    def forget(self, req_id: str) -> None:
        """The request is finished: drop its cached runs and sums."""
        self._runs.pop(req_id, None)
        if self._checksums:
            for key in [k for k in self._checksums if k[0] == req_id]:
                del self._checksums[key]

    # ------------------------------------------------------------ addressing
    def entries(self, w: WriteLayer) -> list[Entry]:
        """(src, dst, len) for one layer of one request (head-sliced when ``w.segments``);
        runs adjacent on both sides are pre-merged."""
        if self._entries_for is not None:
            return self._entries_for(w)
        assert self.local is not None
        loc = self.local[w.layer]
        rem = w.layout.layers[w.layer]
        check_segments(w.segments, loc.block_len, rem.block_len, w.layer)
        runs = self._runs_for(w)
        if runs is None:
            runs = block_runs(w.local_blocks, w.remote_blocks, loc.block_stride,
                              rem.block_stride, loc.block_len, w.segments, loc.num_blocks,
                              rem.num_blocks)
        lb, rb = loc.base_addr, rem.base_addr
        return [(lb + lo, rb + ro, n) for lo, ro, n in runs]

    def _runs_for(self, w: WriteLayer) -> list[Entry] | None:
        """Per-request (local offset, remote offset, len) runs, valid for every layer, cached
        per (D layout, blocks, segments); None when a side's block geometry varies by layer."""
        lu = self._local_uniform
        if lu is None or self.local is None:
            return None
        lay = w.layout
        rkey = (lay.te_session, lay.incarnation)
        ru = self._remote_uniform.get(rkey, False)
        if ru is False:
            ru = _uniform(lay.layers)
            if len(self._remote_uniform) > 4096:
                self._remote_uniform.clear()
            self._remote_uniform[rkey] = ru
        if ru is None:
            return None
        key = (rkey, w.local_blocks, w.remote_blocks, w.segments)
        cached = self._runs.get(w.req_id)
        if cached is None:
            cached = self._runs[w.req_id] = []
        for k, runs in cached:  # one entry per target D worker: a short list
            if k == key:
                return runs
        runs = block_runs(w.local_blocks, w.remote_blocks, lu[0], ru[0], lu[1], w.segments,
                          self.local[0].num_blocks, lay.layers[0].num_blocks)
        if len(cached) >= 16:  # the same request re-addressed many times: keep it bounded
            cached.clear()
        cached.append((key, runs))
        return runs

    # ------------------------------------------------------------ KV checksums
    def sum_write(self, w: WriteLayer) -> None:
        """P: CRC-32C of each block this write sends, from our source memory (kv_checksum)."""
        assert self.local is not None
        loc = self.local[w.layer]
        runs = (((0, loc.block_len),) if w.segments is None
                else tuple((src, n) for src, _dst, n in w.segments))
        sums = block_sums(loc.base_addr, loc.block_stride, loc.num_blocks, w.local_blocks, runs)
        # chunk by chunk, a layer's blocks are written in request order: append
        self._checksums.setdefault((w.req_id, w.target), {}).setdefault(w.layer, []).extend(sums)

    def kept_sums(self, req_id: str, target: str, layers: int) -> list[list[int]]:
        """P: per layer, the CRC-32C kept of what we wrote to ``target`` (empty: none)."""
        per_layer = self._checksums.get((req_id, target), {})
        return [per_layer.get(layer, []) for layer in range(layers)]

    @staticmethod
    def sums_over(layout: KVLayout, plan: SumPlan) -> list[list[int]]:
        """D: per layer of ``layout`` (our memory), the CRC-32C of each of the plan's blocks
        over that layer's runs."""
        return [block_sums(lay.base_addr, lay.block_stride, lay.num_blocks, plan.blocks, runs)
                for lay, runs in zip(layout.layers, plan.runs, strict=True)]


def _uniform(layers: Sequence[LayerLayout] | None) -> tuple[int, int] | None:
    """(stride, len) when every layer has the same block geometry, else None."""
    if not layers:
        return None
    first = layers[0]
    for lay in layers:
        if lay.block_stride != first.block_stride or lay.block_len != first.block_len:
            return None
    return first.block_stride, first.block_len
