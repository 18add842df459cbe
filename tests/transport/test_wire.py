"""Wire format: round trips, and any bytes give a message or a WireError — never another error."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lw.transport import wire
from lw.transport.wire import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    Ack,
    DoneSending,
    FailedSending,
    KVLayout,
    LayerLayout,
    MetaReply,
    MetaRequest,
    Sender,
    WireError,
)

ids = st.text(min_size=1, max_size=40)
ranks = st.integers(0, 65535)
senders = st.builds(Sender, ids, ranks, st.integers(0, 2**62), st.text(max_size=60))
# block_len <= block_stride: a layout whose blocks overlap is no layout (LayerLayout refuses it)
layers = st.tuples(st.integers(1, 2**30), st.integers(1, 2**30)).map(sorted).flatmap(
    lambda lens: st.builds(LayerLayout, st.integers(0, 2**62), st.just(lens[1]),
                           st.just(lens[0]), st.integers(1, 2**20)))
layouts = st.builds(KVLayout, ids, st.integers(0, 2**62), st.text(max_size=60),
                    st.lists(layers, min_size=1, max_size=8))
V = st.just(PROTOCOL_VERSION)
messages = st.one_of(
    st.builds(MetaRequest, V, ids, senders, st.booleans(),
              st.lists(st.integers(0, 2**32 - 1), max_size=8).map(tuple)),
    st.builds(MetaReply, V, ids, st.sampled_from(["accepted", "refused", "unknown"]), senders,
              st.none() | layouts, st.text(max_size=100)),
    st.builds(DoneSending, V, ids, senders, st.integers(1, 64), st.integers(1, 200)),
    st.builds(FailedSending, V, ids, senders, st.integers(1, 64), st.text(max_size=100)),
    st.builds(Ack, V, ids, st.sampled_from(["done", "failed"]), senders, st.booleans()),
    st.builds(Abort, V, ids, senders, st.text(max_size=100)),
    st.builds(AbortAck, V, ids, senders, st.booleans()),
)


@given(messages)
def test_round_trip(msg: wire.Message) -> None:
    assert wire.decode(wire.encode(msg)) == msg


@given(st.binary(max_size=512))
def test_random_bytes_give_message_or_wire_error(data: bytes) -> None:
    try:
        wire.decode(data)
    except WireError:
        pass


@settings(max_examples=300)
@given(messages, st.data())
def test_mutated_messages_give_message_or_wire_error(
    msg: wire.Message, data: st.DataObject
) -> None:
    raw = bytearray(wire.encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "truncate", "insert"]))
        if op == "flip" and raw:
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] ^= data.draw(st.integers(1, 255))
        elif op == "truncate":
            raw = raw[: data.draw(st.integers(0, len(raw)))]
        else:
            i = data.draw(st.integers(0, len(raw)))
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        wire.decode(bytes(raw))
    except WireError:
        pass


def _raw(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


def _sender() -> dict:
    return {"engine_id": "P", "rank": 0, "incarnation": 1, "addr": "tcp://x"}


@pytest.mark.parametrize(
    ("obj", "fragment"),
    [
        ({"kind": "nope", "version": 1}, "Invalid value 'nope'"),
        ({"kind": "abort", "version": 9, "req_id": "r", "responder": _sender(), "reason": ""},
         "unsupported protocol version 9"),
        ({"kind": "meta_req", "version": 1, "req_id": "r", "sender": _sender()}, "want_layout"),
        ({"kind": "meta_req", "version": 1, "req_id": "r", "sender": _sender(),
          "want_layout": True}, "blocks"),
        ({"kind": "meta_req", "version": 1, "req_id": "r", "sender": _sender(),
          "want_layout": True, "blocks": [-1]}, "blocks"),
        ({"kind": "done", "version": 1, "req_id": "r", "sender": _sender(),
          "expected_senders": "2", "num_layers": 2}, "expected_senders"),
        ({"kind": "done", "version": 1, "req_id": "r", "sender": _sender(),
          "expected_senders": -1, "num_layers": 2}, "expected_senders"),
        ({"kind": "meta_rep", "version": 1, "req_id": "r", "status": "accepted",
          "responder": _sender(), "layout": {"engine_id": "D", "incarnation": 1,
          "te_session": "h:1", "layers": [{"base_addr": -5, "block_stride": 1, "block_len": 1,
                                           "num_blocks": 1}]}}, "base_addr"),
        ({"kind": "abort_ack", "version": 1, "req_id": "", "sender": _sender(), "known": True},
         "req_id"),
        ([1, 2, 3], "Expected `object`"),
    ],
)
def test_bad_values_are_named(obj: object, fragment: str) -> None:
    with pytest.raises(WireError) as err:
        wire.decode(_raw(obj))
    assert fragment in str(err.value)


def test_oversized_input_refused_before_parsing() -> None:
    with pytest.raises(WireError, match="exceeds"):
        wire.decode(b"\x00" * (MAX_MESSAGE_BYTES + 1))


def test_non_bytes_refused() -> None:
    with pytest.raises(WireError, match="expected bytes"):
        wire.decode("text")  # type: ignore[arg-type]
