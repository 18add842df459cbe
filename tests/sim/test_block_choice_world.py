"""The checker's world chooses the blocks each side hands its core (lw.sim.request.Req:
``d_remote``, ``p_local`` sliced by ``span``) the way lw.fsm.block_choice chooses them for the
vLLM adapter, with one token per block: so the world can call the core's functions where it
registers D's blocks and announces P's chunks, and its kv-placement property (which keeps its own
slices) then judges the functions the adapter runs."""

from __future__ import annotations

import random

import pytest

from lw.fsm.block_choice import blocks_to_push, blocks_to_receive
from lw.sim.config import WorldConfig
from lw.sim.request import Req


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_the_worlds_slices_are_the_core_choice_at_one_token_per_block(n: int, chunks: int
                                                                       ) -> None:
    rng = random.Random(n * 10 + chunks)
    for hit in range(n):  # a full hit loads nothing: the world never registers it
        if n - hit < chunks - 1:
            continue  # a world the config refuses
        cfg = WorldConfig(requests=1, blocks_per_request=n, d_blocks=n, p_blocks=n, chunks=chunks,
                          prefix_hits=(hit,))
        q = Req(0, 0, 0, 1, hit=hit, sizes=cfg.chunk_sizes(n - hit))
        q.d_blocks = tuple(rng.sample(range(100), n))
        q.p_blocks = tuple(rng.sample(range(100), n))
        assert blocks_to_receive(q.d_blocks, n, hit, 1) == (hit, q.d_remote)
        for c in range(len(q.sizes)):
            done = hit + sum(q.sizes[:c + 1])
            assert blocks_to_push(q.p_blocks, n, done, hit, sum(q.sizes[:c]), 1) == (
                q.p_local[q.span(c)])
