"""The synthetic KV pattern names whose bytes a wrong block holds (a corrupt request's report)."""

from __future__ import annotations

import numpy as np

from lw.lab.synthetic.pattern import Pattern


def test_a_wrong_block_names_the_writer_or_says_it_cannot() -> None:
    p = Pattern(256)
    block = np.zeros(256, np.uint8)
    reqs = ["req-0", "req-1", "req-2"]
    assert p.identify(block, reqs, 8, 4) == "zeros (never written)"
    p.fill(block, "req-2", 5, 3)
    assert not p.check(block, "req-1", 5, 3)
    assert p.identify(block, reqs, 8, 4) == "req-2 layer 5 block 3"
    block[128:] = 0  # only the first half landed
    assert p.identify(block, reqs, 8, 4) == "req-2 layer 5 block 3 (its first bytes only: a " \
                                            "partial write)"
    block[:8] = 1
    assert p.identify(block, reqs, 8, 4) == "unknown bytes"
