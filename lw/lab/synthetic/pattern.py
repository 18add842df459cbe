"""Verifiable KV contents: each (request, layer, block index, KV head) has its own byte pattern."""

from __future__ import annotations

import hashlib

import numpy as np


def word(req_id: str, layer: int, index: int, head: int = 0) -> int:
    """64-bit seed of global KV ``head`` of block ``index`` (position within the request)."""
    digest = hashlib.blake2b(f"{req_id}|{layer}|{index}|{head}".encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little")


class Pattern:
    """Fills and checks one head's slice of a block (``block_bytes`` per head): word XOR the 8-byte
    position, so every byte depends on the request, layer, block index, head and offset."""

    def __init__(self, block_bytes: int) -> None:
        if block_bytes <= 0 or block_bytes % 8:
            raise ValueError(f"block_bytes must be a positive multiple of 8, got {block_bytes}")
        self.block_bytes = block_bytes
        self._ramp = np.arange(block_bytes // 8, dtype=np.uint64)

    def fill(self, block: np.ndarray, req_id: str, layer: int, index: int, head: int = 0) -> None:
        """Write the pattern into ``block`` (a contiguous uint8 view of one head's slice)."""
        np.bitwise_xor(self._ramp, np.uint64(word(req_id, layer, index, head)),
                       out=block.view(np.uint64))

    def check(self, block: np.ndarray, req_id: str, layer: int, index: int,
              head: int = 0) -> bool:
        """True when every byte of ``block`` holds the pattern."""
        expected = np.bitwise_xor(self._ramp, np.uint64(word(req_id, layer, index, head)))
        return bool(np.array_equal(block.view(np.uint64), expected))

    def fill_heads(self, block: np.ndarray, req_id: str, layer: int, index: int, head_lo: int,
                   head_hi: int) -> None:
        """Fill a TP rank's HND block holding global heads [head_lo, head_hi)."""
        n = self.block_bytes
        for k, head in enumerate(range(head_lo, head_hi)):
            self.fill(block[k * n:(k + 1) * n], req_id, layer, index, head)

    def check_heads(self, block: np.ndarray, req_id: str, layer: int, index: int, head_lo: int,
                    head_hi: int) -> bool:
        """True when every head slice of a TP rank's HND block holds its own pattern."""
        n = self.block_bytes
        return all(self.check(block[k * n:(k + 1) * n], req_id, layer, index, head)
                   for k, head in enumerate(range(head_lo, head_hi)))

    def identify(self, block: np.ndarray, req_ids: list[str], layers: int, indices: int,
                 head: int = 0) -> str:
        """What a wrong head slice holds, for a corrupt request's report: each run of bytes
        written by one (request, layer, block index) among those given, zeros, or unknown."""
        words = block.view(np.uint64)
        seeds = words ^ self._ramp  # word XOR position: each word's writer's seed
        names = {word(rid, layer, index, head): f"{rid} layer {layer} block {index}"
                 for rid in req_ids for layer in range(layers) for index in range(indices)}
        key = np.where(words == 0, np.uint64(0), seeds)  # zero words: one run, whatever seed
        zero = words == 0
        runs: list[str] = []
        start = 0
        n = len(seeds)
        while start < n:
            end = start + 1
            while end < n and key[end] == key[start] and zero[end] == zero[start]:
                end += 1
            what = "zeros" if zero[start] else names.get(int(seeds[start]), "unknown bytes")
            runs.append(f"[{start * 8}, {end * 8}): {what}")
            start = end
        if len(runs) > 4:
            runs = runs[:3] + [f"... {len(runs) - 3} more runs"]
        return "; ".join(runs)

    def corrupt_report(self, rid: str, wrong: set[tuple[int, int]], blocks: tuple[int, ...],
                       layers: int, ranks: list[tuple[np.ndarray, int, int]],
                       allocated: list[str]) -> str:
        """A corrupt request's reason: ``N of M blocks wrong`` (its class, counted), then what
        its first wrong block holds, run by run, and which other writers were allocated before
        or after it (a late write of an earlier owner, or a block held twice). ``ranks``: each
        D TP rank's KV array and head range; ``allocated``: request ids in allocation order."""
        layer, i = min(wrong)
        kv, lo, _hi = next(((kv, lo, hi) for kv, lo, hi in ranks if not self.check_heads(
            kv[layer, blocks[i]], rid, layer, i, lo, hi)), ranks[0])
        held = self.identify(kv[layer, blocks[i]][:self.block_bytes], allocated, layers,
                             len(blocks), lo)
        order = {r: k for k, r in enumerate(allocated)}  # first allocation of each
        others = sorted({run.split(": ", 1)[1].split(" ", 1)[0] for run in held.split("; ")
                         if ": " in run} & set(order) - {rid}, key=order.__getitem__)
        when = "".join(f"; {w} was allocated "
                       f"{'after' if order[w] > order.get(rid, -1) else 'before'} it"
                       for w in others)
        return (f"{len(wrong)} of {layers * len(blocks)} blocks wrong; {rid} layer {layer} "
                f"block {i} (slot {blocks[i]}) holds {held}{when}")
