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


def test_a_corrupt_report_counts_its_class_first_and_says_whose_bytes_and_when() -> None:
    p = Pattern(64)
    kv = np.zeros((2, 4, 64), np.uint8)  # layers x slots x one head's bytes
    blocks = (2, 3)
    for layer in range(2):
        for i, slot in enumerate(blocks):
            p.fill(kv[layer, slot], "req-1", layer, i)
    late = np.zeros(64, np.uint8)
    p.fill(late, "req-0", 1, 0)  # an earlier owner's write landing in the tail of a block
    kv[0, 3, 32:] = late[32:]
    report = p.corrupt_report("req-1", {(0, 1)}, blocks, 2, [(kv, 0, 1)],
                              ["req-0", "req-1", "req-2"])
    assert report == ("1 of 4 blocks wrong; req-1 layer 0 block 1 (slot 3) holds "
                      "[0, 32): req-1 layer 0 block 1; [32, 64): req-0 layer 1 block 0; "
                      "req-0 was allocated before it")
