"""Verifiable KV contents: every (request, layer, block index) gets its own byte pattern."""

from __future__ import annotations

import hashlib

import numpy as np


def word(req_id: str, layer: int, index: int) -> int:
    """64-bit seed of the block ``index`` (position within the request) of ``layer``."""
    digest = hashlib.blake2b(f"{req_id}|{layer}|{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class Pattern:
    """Fills and checks blocks of ``block_bytes``: word XOR the 8-byte position, so every byte
    depends on the request, the layer, the block's index in the request and its offset."""

    def __init__(self, block_bytes: int) -> None:
        if block_bytes <= 0 or block_bytes % 8:
            raise ValueError(f"block_bytes must be a positive multiple of 8, got {block_bytes}")
        self.block_bytes = block_bytes
        self._ramp = np.arange(block_bytes // 8, dtype=np.uint64)

    def fill(self, block: np.ndarray, req_id: str, layer: int, index: int) -> None:
        """Write the pattern into ``block`` (a contiguous uint8 view of one block)."""
        np.bitwise_xor(self._ramp, np.uint64(word(req_id, layer, index)), out=block.view(np.uint64))

    def check(self, block: np.ndarray, req_id: str, layer: int, index: int) -> bool:
        """True when every byte of ``block`` holds the pattern."""
        expected = np.bitwise_xor(self._ramp, np.uint64(word(req_id, layer, index)))
        return bool(np.array_equal(block.view(np.uint64), expected))
