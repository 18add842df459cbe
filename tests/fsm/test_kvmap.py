"""The head mapping between P and D TP layouts: every D head written exactly once, right bytes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lw.fsm.kvmap import (
    LayoutMismatch,
    block_segments,
    expected_senders,
    heads_of,
    make_format,
    pair_problem,
    targets_of,
    tp_problem,
)

TOKENS = 4
HEAD_ELEM = 3  # bytes of one head of one token


def _fmt(rank: int, tp: int, heads: int, mla: bool, order: str = "HND"):  # noqa: ANN202
    return make_format(tp_rank=rank, tp_size=tp, total_heads=heads, block_tokens=TOKENS,
                       dtype="bf16", order=order, mla=mla)


def _block(fmt, fill: int | None = None) -> bytearray:  # noqa: ANN001
    """A block whose every byte names (global head, token, byte): what the slice must carry."""
    n = fmt.head_hi - fmt.head_lo
    out = bytearray(n * TOKENS * HEAD_ELEM)
    for i in range(n):
        for t in range(TOKENS):
            for b in range(HEAD_ELEM):
                if fmt.order == "HND":
                    off = (i * TOKENS + t) * HEAD_ELEM + b
                else:
                    off = (t * n + i) * HEAD_ELEM + b
                out[off] = fill if fill is not None else ((fmt.head_lo + i) * 31 + t * 7 + b) % 251
    return out


shapes = st.tuples(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]),
                   st.sampled_from([1, 2, 4, 8]), st.booleans(), st.sampled_from(["HND", "NHD"]))


@settings(max_examples=200, deadline=None)
@given(shapes)
def test_every_decode_head_is_written_once_with_the_right_bytes(shape) -> None:  # noqa: ANN001
    heads, p_tp, d_tp, mla, order = shape
    if tp_problem(p_tp, heads, mla) or tp_problem(d_tp, heads, mla):
        return
    p_fmts = [_fmt(i, p_tp, heads, mla, order) for i in range(p_tp)]
    d_fmts = [_fmt(j, d_tp, heads, mla, order) for j in range(d_tp)]
    for j, d in enumerate(d_fmts):
        senders = expected_senders(d, p_tp)
        assert senders == {i for i, p in enumerate(p_fmts) if j in targets_of(p, d_tp)}
        if mla:
            assert senders == {j % p_tp}  # one writer per D rank, spread over P ranks
        dst = _block(d, fill=0)
        written = bytearray(len(dst))
        for i in senders:
            p = p_fmts[i]
            assert pair_problem(p, d) == ""
            src = _block(p)
            for so, do, n in block_segments(p, len(src), d, len(dst)):
                assert not any(written[do:do + n]), "a byte of D's block written twice"
                dst[do:do + n] = src[so:so + n]
                written[do:do + n] = b"\x01" * n
        assert all(written), "a byte of D's block never written"
        assert dst == _block(d)
    for p in p_fmts:
        for j in range(d_tp):
            if j not in targets_of(p, d_tp):
                assert pair_problem(p, d_fmts[j]) != ""  # a stray sender is refused at the claim


def test_heads_follow_vllm_sharding() -> None:
    assert [heads_of(r, 2, 4) for r in range(2)] == [(0, 2), (2, 4)]
    assert [heads_of(r, 4, 2) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert heads_of(3, 4, 1, mla=True) == (0, 1)
    assert "do not split evenly" in tp_problem(3, 4)
    assert "not a multiple" in tp_problem(3, 2)


def test_p_tp2_into_d_tp1_writes_the_second_half_of_each_block() -> None:
    p1 = _fmt(1, 2, 4, False)
    d = _fmt(0, 1, 4, False)
    assert targets_of(p1, 1) == (0,)
    assert expected_senders(d, 2) == {0, 1}
    assert block_segments(p1, 100, d, 200) == ((0, 100, 100),)


def test_mla_with_more_prefill_ranks_leaves_some_idle() -> None:
    assert [targets_of(_fmt(i, 4, 1, True), 2) for i in range(4)] == [(0,), (1,), (), ()]


@pytest.mark.parametrize(("change", "needle"), [
    ({"dtype": "fp8"}, "different dtypes"),
    ({"block_tokens": 8}, "different block sizes"),
    ({"total_heads": 8}, "different numbers of KV heads"),
    ({"mla": True}, "MLA"),
])
def test_unmappable_pairs_are_refused_naming_both(change: dict, needle: str) -> None:
    p = _fmt(0, 1, 4, False)
    d = make_format(**{"tp_rank": 0, "tp_size": 1, "total_heads": 4, "block_tokens": 16,
                       "dtype": "bf16", **change})
    why = pair_problem(p, d)
    assert needle in why and "prefill [TP 0/1" in why and "decode [TP 0/1" in why
    with pytest.raises(LayoutMismatch, match=needle):
        block_segments(p, 96, d, 96)


def test_head_bytes_must_agree() -> None:
    with pytest.raises(LayoutMismatch, match="head sizes differ"):
        block_segments(_fmt(0, 2, 4, False), 100, _fmt(0, 1, 4, False), 100)
