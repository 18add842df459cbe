"""P never writes outside D's block pool or into a layout of another size (issue 12, part 7).

Mutation testing found that no test or check killed mutants of ``PrefillEndpoint._accept_layout``:
P could accept remote block ids past the end of D's pool, a D layout with another number of
layers, or blocks of another byte size. D's answer is forged here (an accepted ``MetaReply`` with
the layout under test) because P must hold the line whatever D says: a D of another version, or
a stale cached layout.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lw.fsm import PrefillEndpoint, PrefillRequest, Send, SendFinished, WriteLayer
from lw.fsm.kvmap import make_format
from lw.fsm.messages import (
    PROTOCOL_VERSION,
    FailedSending,
    KVFormat,
    KVLayout,
    LayerLayout,
    MetaReply,
    Sender,
)
from lw.transport.wire import decode, encode

L = 3
D_ADDR = "tcp://d0"
BLOCK = 4096


def _layout(engine: str, num_blocks: int | list[int], layers: int = L, block_len: int = BLOCK,
            fmt: KVFormat | None = None) -> KVLayout:
    sizes = num_blocks if isinstance(num_blocks, list) else [num_blocks] * layers
    return KVLayout(engine, 1, f"{engine}-te:1",
                    [LayerLayout(0x1000_0000 + i * 0x100_0000, block_len, block_len, n)
                     for i, n in enumerate(sizes)], fmt or KVFormat())


def _prefill(local: KVLayout | None = None) -> PrefillEndpoint:
    return PrefillEndpoint(Sender("P", 0, 1, "tcp://p0"), L, local=local)


def _accept(p: PrefillEndpoint, rid: str, layout: KVLayout) -> list:
    """D accepts P's claim with ``layout`` (through the real wire format)."""
    msg = MetaReply(PROTOCOL_VERSION, rid, "accepted", Sender("D", 0, 1, D_ADDR), layout)
    return p.on_message(decode(encode(msg)), 0.0)


def _drive(p: PrefillEndpoint, remote: tuple[int, ...], layout: KVLayout) -> list:
    """Add a request, let D accept with ``layout``, compute every layer; all effects."""
    req = PrefillRequest("r", D_ADDR, tuple(range(len(remote))), remote)
    out = p.add_request(req, 0.0)
    out += _accept(p, "r", layout)
    for layer in range(L):
        out += p.layer_computed(layer, ["r"], 0.0)
    return out


def _assert_inside(writes: list[WriteLayer], p: PrefillEndpoint) -> None:
    """Every write addresses existing blocks of an existing layer, and bytes inside both blocks."""
    for w in writes:
        assert len(w.layout.layers) == p.num_layers
        dst = w.layout.layers[w.layer]
        assert all(0 <= b < dst.num_blocks for b in w.remote_blocks), (w.remote_blocks, dst)
        src_len = p.local.layers[w.layer].block_len if p.local is not None else dst.block_len
        for src, off, n in w.segments or ((0, 0, min(src_len, dst.block_len)),):
            assert n > 0 and src + n <= src_len and off + n <= dst.block_len, (w.segments, dst)
        if w.segments is None:  # a whole-block copy needs blocks of one size on both sides
            assert src_len == dst.block_len


def _failed_cleanly(p: PrefillEndpoint, out: list, needle: str) -> None:
    """No write at all; the request failed, P's blocks are released and D is told."""
    assert [e for e in out if isinstance(e, WriteLayer)] == []
    assert p.state_of("r") == "FAILED" and p.live_requests() == []
    fin = [e for e in out if isinstance(e, SendFinished)]
    assert [f.ok for f in fin] == [False] and needle in fin[0].reason
    # D accepted us, so it waits for a word: FailedSending, not silence until its deadline.
    told = [e.msg for e in out if isinstance(e, Send) and isinstance(e.msg, FailedSending)]
    assert [m.req_id for m in told] == ["r"]


@settings(max_examples=150, deadline=None)
@given(pool=st.integers(1, 12), remote=st.lists(st.integers(0, 14), min_size=1, max_size=4,
                                                unique=True))
def test_p_writes_only_inside_decoders_pool(pool: int, remote: list[int]) -> None:
    p = _prefill()
    out = _drive(p, tuple(remote), _layout("D", pool))
    writes = [e for e in out if isinstance(e, WriteLayer)]
    if max(remote) < pool:
        assert [w.layer for w in writes] == list(range(L))
        _assert_inside(writes, p)
    else:
        _failed_cleanly(p, out, "outside decoder's")


@pytest.mark.parametrize("pool", [1, 2, 8])
def test_last_block_of_the_pool_is_writable_and_the_next_is_not(pool: int) -> None:
    p = _prefill()
    out = _drive(p, (pool - 1,), _layout("D", pool))
    assert len([e for e in out if isinstance(e, WriteLayer)]) == L
    p2 = _prefill()
    _failed_cleanly(p2, _drive(p2, (pool - 1, pool), _layout("D", pool)), "outside decoder's")


def test_layers_with_fewer_blocks_than_layer_0_are_not_written_past_their_end() -> None:
    """Found by the mutation work: P checked block ids against layer 0 only (fixed)."""
    p = _prefill()
    out = _drive(p, (0, 5), _layout("D", [8, 4, 8]))
    _assert_inside([e for e in out if isinstance(e, WriteLayer)], p)
    _failed_cleanly(p, out, "outside decoder's 4 blocks (its smallest layer)")


@pytest.mark.parametrize("sizes", [[4, 8, 8], [4, 4, 4]])
def test_a_refusal_names_the_smallest_layer_only_when_it_is_not_layer_0(sizes: list[int]) -> None:
    """The operator reads the pool size that refused: layer 0's unless a later layer is smaller."""
    p = _prefill()
    out = _drive(p, (0, 5), _layout("D", sizes))
    (fin,) = [e for e in out if isinstance(e, SendFinished)]
    assert fin.reason.endswith("remote block ids [5] outside decoder's 4 blocks")


@pytest.mark.parametrize("layers", [1, L - 1, L + 1])
def test_decoder_layout_with_another_number_of_layers_is_never_written(layers: int) -> None:
    p = _prefill()
    out = _drive(p, (0, 1), _layout("D", 8, layers=layers))
    _failed_cleanly(p, out, f"has {layers} layers")


@pytest.mark.parametrize("d_len", [BLOCK // 2, BLOCK * 2, BLOCK + 64])
def test_opaque_blocks_of_another_size_are_never_written(d_len: int) -> None:
    """With a local layout, P compares block bytes: a D block of another size is refused."""
    p = _prefill(local=_layout("P", 8, block_len=BLOCK))
    out = _drive(p, (0, 1), _layout("D", 8, block_len=d_len))
    _failed_cleanly(p, out, "head sizes differ")


def test_same_size_opaque_blocks_are_copied_whole() -> None:
    p = _prefill(local=_layout("P", 8))
    out = _drive(p, (0, 1), _layout("D", 8))
    writes = [e for e in out if isinstance(e, WriteLayer)]
    assert len(writes) == L and all(w.segments is None for w in writes)


@pytest.mark.parametrize("change", [dict(dtype="fp8"), dict(block_tokens=32),
                                    dict(total_heads=8)])
def test_head_format_of_another_shape_is_never_written(change: dict) -> None:
    fmt = make_format(tp_rank=0, tp_size=1, total_heads=4, block_tokens=16, dtype="bf16")
    p = _prefill(local=_layout("P", 8, fmt=fmt))
    d_fmt = make_format(**{**dict(tp_rank=0, tp_size=1, total_heads=4, block_tokens=16,
                                  dtype="bf16"), **change})
    out = _drive(p, (0, 1), _layout("D", 8, fmt=d_fmt))
    _failed_cleanly(p, out, "cannot write into decode")


@settings(max_examples=60, deadline=None)
@given(p_tp=st.sampled_from([1, 2, 4]), d_tp=st.sampled_from([1, 2, 4]),
       heads=st.sampled_from([1, 2, 4, 8]), order=st.sampled_from(["HND", "NHD"]),
       mla=st.booleans(), head_bytes=st.sampled_from([64, 256]))
def test_head_sliced_writes_stay_inside_both_blocks(p_tp: int, d_tp: int, heads: int,
                                                    order: str, mla: bool,
                                                    head_bytes: int) -> None:
    """Whatever the TP shapes, every byte run fits in P's block and in D's block."""
    from lw.fsm.kvmap import targets_of, tp_problem

    if tp_problem(p_tp, heads, mla) or tp_problem(d_tp, heads, mla):
        return
    for pr in range(p_tp):
        pf = make_format(tp_rank=pr, tp_size=p_tp, total_heads=heads, block_tokens=16,
                         dtype="bf16", order=order, mla=mla)
        local = _layout("P", 8, block_len=(pf.head_hi - pf.head_lo) * head_bytes, fmt=pf)
        for dr in targets_of(pf, d_tp):
            df = make_format(tp_rank=dr, tp_size=d_tp, total_heads=heads, block_tokens=16,
                             dtype="bf16", order=order, mla=mla)
            d_layout = _layout("D", 8, block_len=(df.head_hi - df.head_lo) * head_bytes, fmt=df)
            p = PrefillEndpoint(Sender("P", pr, 1, "tcp://p0"), L, local=local)
            out = _drive(p, (0, 7), d_layout)
            writes = [e for e in out if isinstance(e, WriteLayer)]
            assert len(writes) == L, [e for e in out if isinstance(e, SendFinished)]
            _assert_inside(writes, p)
