"""Byte runs of KV blocks in registered memory: what a layer write copies, and its checksums.

Pure arithmetic over addresses (plus reading memory for CRC-32C); the worker loop uses it to turn
a ``WriteLayer`` into data-plane entries and, with ``kv_checksum``, to checksum the blocks.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import crc32c

from lw.transport.dataplane.base import Entry

__all__ = ["block_runs", "block_sums", "check_segments"]


def block_sums(base: int, stride: int, num_blocks: int, blocks: Sequence[int],
                runs: Sequence[tuple[int, int]]) -> list[int]:
    """CRC-32C of each block's byte runs (offset, length), blocks in the given order."""
    out = []
    for b in blocks:
        if not 0 <= b < num_blocks:
            raise ValueError(f"block {b} outside 0..{num_blocks - 1}")
        crc = 0
        for off, n in runs:
            crc = crc32c.crc32c((ctypes.c_char * n).from_address(base + b * stride + off), crc)
        out.append(crc)
    return out


def check_segments(segments: tuple[tuple[int, int, int], ...] | None, local_len: int,
                    remote_len: int, layer: int) -> None:
    """Raise ValueError unless every byte run fits in a block on both sides."""
    if segments is None:
        if local_len != remote_len:
            raise ValueError(f"local block_len {local_len} != remote {remote_len} "
                             f"(layer {layer})")
        return
    if not segments:
        raise ValueError(f"no byte run to write (layer {layer})")
    for src, dst, n in segments:
        if n <= 0 or src < 0 or dst < 0 or src + n > local_len or dst + n > remote_len:
            raise ValueError(f"byte run {(src, dst, n)} outside the blocks "
                             f"({local_len} local, {remote_len} remote bytes; layer {layer})")


def block_runs(local_blocks: Sequence[int], remote_blocks: Sequence[int], lstride: int,
                rstride: int, blen: int, segments: tuple[tuple[int, int, int], ...] | None,
                n_loc: int, n_rem: int) -> list[Entry]:
    """(local offset, remote offset, len) of every block pair (and byte run), each merged into
    the previous one when it continues it on both sides."""
    segs = ((0, 0, blen),) if segments is None else segments
    runs: list[Entry] = []
    plo = pro = pn = -1
    for lblk, rblk in zip(local_blocks, remote_blocks, strict=True):
        if not 0 <= lblk < n_loc or not 0 <= rblk < n_rem:
            raise ValueError(f"block {lblk}->{rblk} outside the {n_loc}/{n_rem} blocks")
        lbase, rbase = lblk * lstride, rblk * rstride
        for src, dst, n in segs:
            lo, ro = lbase + src, rbase + dst
            if pn > 0 and plo + pn == lo and pro + pn == ro:
                pn += n
                runs[-1] = (plo, pro, pn)
            else:
                plo, pro, pn = lo, ro, n
                runs.append((lo, ro, n))
    return runs


# ================================================================ hook cost (benchmark helper)
