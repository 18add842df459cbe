"""push_mode auto: a request's push starts at the first chunk after which the compute left no
longer covers the transfer."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lw.fsm.push_schedule import PushEstimate, push_starts_now

# 1,024 tokens in 4 chunks of 256, 64 blocks; 0.6 ms of forward per token (~150 ms a chunk)
EST = {
    "uncapped": PushEstimate(6e-4, 0.3e-3),  # 64 blocks: 19 ms on the wire
    "kv_over_prefill=0.5": PushEstimate(6e-4, 4.8e-3),  # 307 ms
    "kv_over_prefill=1.0": PushEstimate(6e-4, 9.6e-3),  # 614 ms
}


def start_chunk(est: PushEstimate, chunks: int = 4, tokens: int = 1024, blocks: int = 64) -> int:
    """The chunk whose step starts the push."""
    per = tokens // chunks
    for c in range(chunks):
        if push_starts_now(blocks_to_send=blocks, tokens_after_chunk=tokens - per * (c + 1),
                           est=est):
            return c
    raise AssertionError("the last chunk must always push")


def test_the_start_chunk_follows_the_link() -> None:
    assert start_chunk(EST["uncapped"]) == 3  # the last chunk carries it all
    assert start_chunk(EST["kv_over_prefill=0.5"]) == 1  # 307 ms > the 2 chunks left after 1
    assert start_chunk(EST["kv_over_prefill=1.0"]) == 0


def test_without_an_estimate_the_push_waits_for_the_last_chunk() -> None:
    assert start_chunk(PushEstimate()) == 3
    assert start_chunk(PushEstimate(6e-4, None)) == 3


def test_bad_margin_is_refused() -> None:
    with pytest.raises(ValueError, match="margin"):
        push_starts_now(blocks_to_send=1, tokens_after_chunk=1, est=PushEstimate(1, 1),
                        margin=0)


@given(st.floats(1e-6, 1e-2), st.floats(1e-6, 1.0), st.integers(1, 8), st.integers(1, 200))
def test_a_slower_link_never_starts_later(compute: float, wire: float, chunks: int,
                                          blocks: int) -> None:
    tokens = chunks * 256
    slow = start_chunk(PushEstimate(compute, wire * 2), chunks, tokens, blocks)
    fast = start_chunk(PushEstimate(compute, wire), chunks, tokens, blocks)
    assert slow <= fast <= chunks - 1
