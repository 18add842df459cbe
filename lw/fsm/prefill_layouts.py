"""What a P worker rank knows of its D workers' KV memory: the layout each D address sent, and
the byte runs a local block maps to in a D block (heterogeneous TP and head formats).

Part of the prefill endpoint (lw.fsm.prefill); kept apart because it changes with the memory
model (kvmap), not with the request lifecycle."""

from __future__ import annotations

from lw.fsm.kvmap import LayoutMismatch, Segment, block_segments
from lw.fsm.messages import KVFormat, KVLayout

__all__ = ["Layouts", "Segments"]

Segments = tuple[tuple[Segment, ...] | None, ...]
"""Per layer: the byte runs of a local block that go into a D block (None: all of it)."""

_SEGMENT_CACHE = 4096


class Layouts:
    """Layouts cached per D worker address, and the block-to-block byte runs they imply."""

    def __init__(self, num_layers: int, local: KVLayout | None) -> None:
        self.num_layers = num_layers
        self.local = local
        self.fmt = local.fmt if local is not None else KVFormat()
        self.by_addr: dict[str, KVLayout] = {}
        self.segs: dict[tuple[str, int], Segments] = {}

    def get(self, addr: str) -> KVLayout | None:
        """The layout cached for ``addr`` (None: P must ask D for it)."""
        return self.by_addr.get(addr)

    def keep(self, addr: str, layout: KVLayout) -> None:
        """Cache the layout an accepted claim used."""
        self.by_addr[addr] = layout

    def forget(self, addr: str) -> None:
        """Drop ``addr``'s layout (a lost or restarted D: its addresses are no longer valid)."""
        self.by_addr.pop(addr, None)

    def check(self, addr: str, layout: KVLayout, remote_blocks: tuple[int, ...]
              ) -> tuple[Segments | None, str]:
        """The byte runs for writing ``remote_blocks`` of D ``addr`` with ``layout``, or None
        and why that cannot work (layer count, block ids outside D's pool, head formats)."""
        if len(layout.layers) != self.num_layers:
            return None, (f"decoder {addr} has {len(layout.layers)} layers, we have "
                          f"{self.num_layers}")
        pool = min(lay.num_blocks for lay in layout.layers)  # every layer must hold them
        bad = [b for b in remote_blocks if not 0 <= b < pool]
        if bad:
            return None, (f"remote block ids {bad[:4]} outside decoder's {pool} blocks"
                          + ("" if pool == layout.layers[0].num_blocks else
                             " (its smallest layer)"))
        key = (addr, layout.incarnation)
        segs = self.segs.get(key)
        if segs is None:
            try:
                segs = self._segments_for(layout)
            except LayoutMismatch as exc:
                return None, str(exc)
            if len(self.segs) > _SEGMENT_CACHE:
                self.segs.clear()
            self.segs[key] = segs
        return segs, ""

    def _segments_for(self, layout: KVLayout) -> Segments:
        if self.local is None:
            return (None,) * self.num_layers
        out: list[tuple[Segment, ...] | None] = []
        for mine, theirs in zip(self.local.layers, layout.layers, strict=True):
            segs = block_segments(self.fmt, mine.block_len, layout.fmt, theirs.block_len)
            whole = segs == ((0, 0, mine.block_len),) and mine.block_len == theirs.block_len
            out.append(None if whole else segs)
        return tuple(out)
