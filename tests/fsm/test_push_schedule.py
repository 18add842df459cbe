"""push_mode auto: a request's push starts at the first chunk after which the compute left no
longer covers the transfer."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lw.fsm.push_schedule import (
    WAIT_SHARE,
    WAIT_WIRE_S,
    PushEstimate,
    attended_pairs,
    compute_left,
    last_layer_waits_for_token,
    push_starts_now,
    writes_wait_for_forward,
)

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


def test_without_an_estimate_the_push_starts_at_the_first_chunk() -> None:
    """An unmeasured link may be slow: starting late could leave the whole transfer after the
    last layer, starting early costs only the early writes' share of the forward."""
    assert start_chunk(PushEstimate()) == 0
    assert start_chunk(PushEstimate(6e-4, None)) == 0
    assert start_chunk(PushEstimate(None, 1e-3)) == 0


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


def test_attended_pairs_counts_each_token_with_those_at_or_before_it() -> None:
    assert attended_pairs(0, 1) == 1
    assert attended_pairs(0, 4) == 1 + 2 + 3 + 4
    assert attended_pairs(2, 4) == 3 + 4
    assert attended_pairs(5, 5) == 0
    assert attended_pairs(0, 256) + attended_pairs(256, 1024) == attended_pairs(0, 1024)
    with pytest.raises(ValueError, match="start <= end"):
        attended_pairs(4, 2)


def test_later_chunks_cost_more_so_the_push_starts_later_than_an_average_rate_says() -> None:
    """4,096 tokens in 16 chunks; half the forward is attention. The average rate over the
    prompt puts too little compute after the early chunks, and the push would start early."""
    tokens, chunks, blocks = 4096, 16, 256
    per_token, per_pair = 0.7e-3, 0.7e-3 * tokens / attended_pairs(0, tokens)
    exact = PushEstimate(per_token, 4e-3, per_pair)
    average = PushEstimate(per_token + per_pair * attended_pairs(0, tokens) / tokens, 4e-3)
    assert compute_left(exact, 0, tokens) == pytest.approx(compute_left(average, 0, tokens))

    def start(est: PushEstimate) -> int:
        per = tokens // chunks
        return next(c for c in range(chunks) if push_starts_now(
            blocks_to_send=blocks, tokens_after_chunk=tokens - per * (c + 1), est=est,
            tokens_computed=per * (c + 1)))

    assert start(average) < start(exact) < chunks - 1
    assert compute_left(PushEstimate(), 0, 10) is None


def test_a_last_chunk_push_waits_for_its_forward_only_on_a_shared_core_and_a_short_transfer(
        ) -> None:
    """A 128-token prompt in one chunk (8 blocks, ~77 ms of forward at 0.6 ms a token): its
    4 ms on the wire wait where lw's threads share the forward's core; not on a core of lw's
    own, not unmeasured, not a transfer longer than WAIT_WIRE_S (a 1,024-token prompt's last
    chunk on the uncapped link: 19 ms), nor one longer than WAIT_SHARE of the forward."""
    def waits(est: PushEstimate, shares: bool = True, blocks: int = 8, tokens: int = 128,
              before: int = 0) -> bool:
        return writes_wait_for_forward(blocks_to_send=blocks, tokens=tokens,
                                       pairs=attended_pairs(before, before + tokens), est=est,
                                       shares_core=shares)

    short = PushEstimate(6e-4, 0.5e-3)
    assert waits(short)
    assert not waits(short, shares=False)
    assert not waits(PushEstimate())
    assert not waits(PushEstimate(6e-4, None))
    assert not waits(PushEstimate(None, 0.5e-3))
    assert not waits(short, blocks=0)
    assert not waits(EST["uncapped"], blocks=64, tokens=256, before=768)  # 19 ms > 10
    assert not waits(EST["kv_over_prefill=0.5"], blocks=64, tokens=256, before=768)
    # at the bounds: WAIT_WIRE_S on the wire still waits, a hair more does not ...
    at = PushEstimate(6e-4, WAIT_WIRE_S / 8)
    assert waits(at) and not waits(PushEstimate(6e-4, WAIT_WIRE_S / 8 * 1.01))
    # ... and WAIT_SHARE of a short forward (16 tokens: 9.6 ms) likewise
    share = PushEstimate(6e-4, 16 * 6e-4 * WAIT_SHARE / 8)
    assert waits(share, tokens=16)
    assert not waits(PushEstimate(6e-4, 16 * 6e-4 * WAIT_SHARE / 8 * 1.01), tokens=16)


def test_the_last_layer_waits_for_the_token_where_it_would_outlast_the_sampling() -> None:
    """Bytes still on the wire when the token leaves (their wire time above the sampling
    time): the token goes first; bytes gone by then, an unmeasured link or sampling, nothing
    to write: not."""
    est = PushEstimate(compute_s_per_token=1e-3, wire_s_per_block=1e-3)
    share = 1 / 32  # one layer of 32
    sample_s = 0.0035
    blocks = 113  # 113 blocks' last layer: 3.53 ms on the wire
    assert last_layer_waits_for_token(blocks_to_send=blocks, share=share, est=est,
                                      sample_s=sample_s)
    assert not last_layer_waits_for_token(blocks_to_send=112, share=share, est=est,
                                          sample_s=sample_s)  # 3.50 ms: gone as it leaves
    assert last_layer_waits_for_token(blocks_to_send=4, share=1.0, est=est, sample_s=sample_s)
    assert not last_layer_waits_for_token(blocks_to_send=blocks, share=share,
                                          est=PushEstimate(1e-3, None), sample_s=sample_s)
    assert not last_layer_waits_for_token(blocks_to_send=blocks, share=share, est=est,
                                          sample_s=None)
    assert not last_layer_waits_for_token(blocks_to_send=0, share=1.0, est=est,
                                          sample_s=sample_s)
    assert not last_layer_waits_for_token(blocks_to_send=blocks, share=0.0, est=est,
                                          sample_s=sample_s)
