"""The synthetic KV pattern names whose bytes a wrong block holds (a corrupt request's report)."""

from __future__ import annotations

import numpy as np

from lw.lab.synthetic.pattern import Pattern


def test_a_wrong_block_names_each_run_of_bytes_by_its_writer() -> None:
    p = Pattern(256)
    block = np.zeros(256, np.uint8)
    reqs = ["req-0", "req-1", "req-2"]
    assert p.identify(block, reqs, 8, 4) == "[0, 256): zeros"
    p.fill(block, "req-2", 5, 3)
    assert not p.check(block, "req-1", 5, 3)
    assert p.identify(block, reqs, 8, 4) == "[0, 256): req-2 layer 5 block 3"
    other = np.zeros(256, np.uint8)
    p.fill(other, "req-0", 5, 1)
    block[128:] = other[128:]  # the second half is another request's: a torn write
    assert p.identify(block, reqs, 8, 4) == ("[0, 128): req-2 layer 5 block 3; "
                                             "[128, 256): req-0 layer 5 block 1")
    block[:8] = 1
    assert p.identify(block, reqs, 8, 4).startswith("[0, 8): unknown bytes; [8, 128): req-2")
