"""D never reports a request loaded with KV heads nobody wrote, and formats or layouts that
contradict themselves are refused where they are decoded, not deep in the core."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lw.fsm import DecodeEndpoint, PrefillEndpoint, PrefillRequest, RecvDone, Send, WriteLayer
from lw.fsm.kvmap import _holders, expected_senders, heads_of, make_format, tp_problem
from lw.fsm.messages import KVFormat, KVLayout, LayerLayout, MetaReply, MetaRequest, Sender
from lw.transport.wire import PROTOCOL_VERSION, WireError, decode, encode

L = 2
HEAD_BYTES = 256


def _layout(engine: str, rank: int, tp: int, heads: int = 8) -> KVLayout:
    fmt = make_format(tp_rank=rank, tp_size=tp, total_heads=heads, block_tokens=16, dtype="bf16")
    n = (fmt.head_hi - fmt.head_lo) * HEAD_BYTES
    layers = [LayerLayout(0x1000_0000 * (rank + 1) + i * 0x100_0000, n, n, 64) for i in range(L)]
    return KVLayout(engine, 1, f"{engine}{rank}-te:1", layers, fmt)


def _run(d: DecodeEndpoint, ps: list[PrefillEndpoint]) -> tuple[list, list[str]]:
    """Start ``r`` on every P rank and run the exchange to its end: D's reports and P's
    refusal reasons."""
    queue: list[Send] = []
    writes: list[tuple[int, WriteLayer]] = []
    reports: list = []
    refusals: list[str] = []

    def absorb(who: int | None, effects: list) -> None:
        for e in effects:
            if isinstance(e, Send):
                queue.append(e)
            elif isinstance(e, WriteLayer):
                writes.append((who, e))
            elif type(e).__name__ in ("RecvDone", "RecvFailed"):
                reports.append(e)

    for i, p in enumerate(ps):
        absorb(i, p.add_request(PrefillRequest("r", "d0", (1, 2), (5, 6), 1), 0.0))
        for layer in range(L):
            absorb(i, p.layer_computed(layer, ["r"], 0.0))
    while queue or writes:
        while queue:
            s = queue.pop(0)
            msg = decode(encode(s.msg))
            if s.dest == "d0":
                absorb(None, d.on_message(msg, 0.0))
            else:
                if isinstance(msg, MetaReply) and msg.status == "refused":
                    refusals.append(msg.reason)
                i = int(s.dest[1:])
                absorb(i, ps[i].on_message(msg, 0.0))
        if writes:
            i, w = writes.pop(0)
            absorb(i, ps[i].transfer_done(w.req_id, w.seq, True, "", 0.0))
    return reports, refusals


def _p_ranks(tp: int) -> list[PrefillEndpoint]:
    return [PrefillEndpoint(Sender("P", i, 1, f"p{i}"), L, local=_layout("P", i, tp))
            for i in range(tp)]


def test_d_counting_senders_for_another_prefill_tp_refuses_the_claims() -> None:
    """P of TP 2 into D of TP 1 that counted senders for a P of TP 1 (peer_tp_size unset): it
    waits for rank 0 alone, so rank 0's DONE would have finished the request with heads 4..7
    unwritten. Both claims are refused, naming the setting."""
    d_layout = _layout("D", 0, 1)
    d = DecodeEndpoint(Sender("D", 0, 1, "d0"), d_layout)
    d.add_request("r", (5, 6), expected_senders(d_layout.fmt, 1), 0.0)
    reports, refusals = _run(d, _p_ranks(2))
    assert not any(isinstance(r, RecvDone) for r in reports)
    assert len(refusals) == 2
    assert "peer_tp_size" in refusals[0] and "ranks [0, 1]" in refusals[0]
    assert "is not a sender of this D worker" in refusals[1]


def test_d_counting_senders_for_the_right_tp_receives_every_head() -> None:
    d_layout = _layout("D", 0, 1)
    d = DecodeEndpoint(Sender("D", 0, 1, "d0"), d_layout)
    d.add_request("r", (5, 6), expected_senders(d_layout.fmt, 2), 0.0)
    reports, refusals = _run(d, _p_ranks(2))
    assert refusals == [] and reports == [RecvDone("r")]


def test_a_wrong_peer_tp_that_still_covers_the_heads_is_accepted() -> None:
    """D rank 0 of TP 2 (heads 0..3) counted for a P of TP 1 and gets P of TP 2: P rank 0 holds
    exactly those heads, so the rank set is the same and the request completes."""
    d_layout = _layout("D", 0, 2)
    d = DecodeEndpoint(Sender("D", 0, 1, "d0"), d_layout)
    assert expected_senders(d_layout.fmt, 1) == expected_senders(d_layout.fmt, 2) == {0}
    d.add_request("r", (5, 6), expected_senders(d_layout.fmt, 1), 0.0)
    reports, refusals = _run(d, _p_ranks(2)[:1])
    assert refusals == [] and reports == [RecvDone("r")]


def test_counted_senders_that_leave_heads_unwritten_are_refused() -> None:
    """Counted senders (no rank set): the claim that would complete the count is refused when
    the heads of all of them do not cover D's."""
    d = DecodeEndpoint(Sender("D", 0, 1, "d0"), _layout("D", 0, 1))
    d.add_request("r", (5, 6), 1, 0.0)
    reports, refusals = _run(d, _p_ranks(2)[:1])
    assert not any(isinstance(r, RecvDone) for r in reports)
    assert refusals and "KV heads 4..7" in refusals[0] and "unwritten" in refusals[0]


def _mutated(msg: msgspec.Struct, path: tuple[str, ...], value: object) -> bytes:
    """``msg`` encoded with one nested field replaced, bypassing the Structs' own checks (as a
    peer's encoder would)."""
    raw = msgspec.msgpack.decode(encode(msg))
    node = raw
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return msgspec.msgpack.encode(raw)


def _claim(fmt: KVFormat) -> MetaRequest:
    return MetaRequest(PROTOCOL_VERSION, "r", Sender("P", 0, 1, "p0"), True, (5, 6), fmt)


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("head_hi", 3, "heads 0..2 are not what TP rank 0 of 2 holds of 8 (0..3)"),
    ("tp_size", 3, "8 KV heads do not split evenly over TP 3"),
    ("tp_rank", 2, "tp_rank 2 outside TP 2"),
    ("tp_size", 65536, "<= 4096"),
    ("total_heads", 100_000, "<= 4096"),
])
def test_a_claim_whose_format_contradicts_itself_is_a_wire_error(
        field: str, value: int, needle: str) -> None:
    fmt = make_format(tp_rank=0, tp_size=2, total_heads=8, block_tokens=16, dtype="bf16")
    with pytest.raises(WireError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        decode(_mutated(_claim(fmt), ("fmt", field), value))


def test_an_mla_format_with_more_than_one_head_is_a_wire_error() -> None:
    fmt = make_format(tp_rank=0, tp_size=2, total_heads=1, block_tokens=16, dtype="bf16",
                      mla=True)
    with pytest.raises(WireError, match="MLA format has one latent head"):
        decode(_mutated(_claim(fmt), ("fmt", "total_heads"), 8))


def test_a_layout_whose_blocks_overlap_is_a_wire_error() -> None:
    """block_len > block_stride: a write into block b would run into block b + 1."""
    reply = MetaReply(PROTOCOL_VERSION, "r", "accepted", Sender("D", 0, 1, "d0"),
                      _layout("D", 0, 1))
    with pytest.raises(WireError, match="exceeds block_stride"):
        decode(_mutated(reply, ("layout", "layers", 0, "block_stride"), 1024))
    with pytest.raises(ValueError, match="blocks would overlap"):
        LayerLayout(0, 1024, 2048, 4)


@given(st.sampled_from([1, 2, 4, 8, 16, 64]), st.sampled_from([1, 2, 4, 8, 16, 32, 128]),
       st.booleans())
def test_holders_are_the_ranks_that_hold_each_head(heads: int, tp: int, mla: bool) -> None:
    """The closed form of who holds a head agrees with asking every rank."""
    heads = 1 if mla else heads
    if tp_problem(tp, heads, mla):
        return
    for h in range(heads):
        want = [r for r in range(tp)
                if heads_of(r, tp, heads, mla)[0] <= h < heads_of(r, tp, heads, mla)[1]]
        assert list(_holders(h, tp, heads, mla)) == want
