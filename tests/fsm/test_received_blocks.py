"""Which blocks of a prompt D receives after its own prefix hit (a decision the vLLM adapter
used to make inline), against an oracle that maps every token to its block."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lw.fsm.prefill_request import received_blocks


@st.composite
def prompts(draw: st.DrawFn) -> tuple[int, int, int]:
    bs = draw(st.integers(1, 64))
    prompt = draw(st.integers(1, 4096))
    cached = bs * draw(st.integers(0, (prompt - 1) // bs))
    return prompt, cached, bs


@given(prompts())
def test_d_receives_exactly_the_blocks_of_the_tokens_it_misses(case: tuple[int, int, int]
                                                               ) -> None:
    prompt, cached, bs = case
    oracle = sorted({t // bs for t in range(cached, prompt)})  # token t lives in block t // bs
    assert list(received_blocks(prompt, cached, bs)) == oracle


@pytest.mark.parametrize("prompt,cached,bs,fragment", [
    (64, 64, 32, "leaves nothing"), (64, 70, 32, "leaves nothing"), (64, -1, 32, "leaves"),
    (64, 31, 32, "not whole blocks"), (0, 0, 32, "must be >= 1"), (64, 0, 0, "must be >= 1"),
])
def test_impossible_inputs_are_refused_saying_which(prompt: int, cached: int, bs: int,
                                                    fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        received_blocks(prompt, cached, bs)
