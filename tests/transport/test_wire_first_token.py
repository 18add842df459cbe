"""FirstToken on the wire (since protocol 6; the captured bytes are protocol 8's): round trips,
keeps its bytes, and every malformed one is a WireError naming the field, never a message the
core would have to doubt."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lw.fsm.messages import MAX_SPEC, first_token_problem
from lw.transport import wire
from lw.transport.wire import PROTOCOL_VERSION, FirstToken, Sender, WireError

PROMPT = "0123456789abcdef0123456789abcdef"
ids = st.text(min_size=1, max_size=40)
senders = st.builds(Sender, ids, st.integers(0, 65535), st.integers(0, 2**62),
                    st.text(max_size=60))
specs = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=MAX_SPEC)
tokens = st.builds(FirstToken, st.just(PROTOCOL_VERSION), ids, senders, st.integers(0, 65535),
                   st.integers(0, 2**31 - 1), st.sampled_from(["", PROMPT]), specs)

GOLDEN = (b"\x88\xa4kind\xabfirst_token\xa7version\x08\xa6req_id\xa2r1\xa6sender\x84"
          b"\xa9engine_id\xa1P\xa4rank\x00\xabincarnation\x01\xa4addr\xa8tcp://p0\xa5epoch\x02"
          b"\xa5token\xcd\x04\xd2\xa6prompt\xd9 " + PROMPT.encode() + b"\xa4spec\xa2s1")


@given(tokens)
def test_round_trip(msg: FirstToken) -> None:
    assert wire.decode(wire.encode(msg)) == msg
    assert first_token_problem(msg.token, msg.spec) == ""


@settings(max_examples=200)
@given(tokens, st.data())
def test_mutated_tokens_give_a_message_or_a_wire_error(msg: FirstToken,
                                                       data: st.DataObject) -> None:
    raw = bytearray(wire.encode(msg))
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] ^= data.draw(st.integers(1, 255))
    try:
        got = wire.decode(bytes(raw))
    except WireError:
        return
    if isinstance(got, FirstToken):  # whatever decodes is within the declared bounds
        assert first_token_problem(got.token, got.spec) == ""


def test_a_captured_token_keeps_its_bytes() -> None:
    msg = wire.decode(GOLDEN)
    assert msg == FirstToken(PROTOCOL_VERSION, "r1", Sender("P", 0, 1, "tcp://p0"), 2, 1234,
                             PROMPT, "s1")
    assert wire.encode(msg) == GOLDEN


def _token(**over: object) -> bytes:
    obj = {"kind": "first_token", "version": PROTOCOL_VERSION, "req_id": "r1",
           "sender": {"engine_id": "P", "rank": 0, "incarnation": 1, "addr": "tcp://x"},
           "epoch": 0, "token": 5, "prompt": "", "spec": "s"}
    obj.update(over)
    return msgspec.msgpack.encode({k: v for k, v in obj.items() if v is not _DROP})


_DROP = object()


@pytest.mark.parametrize(
    ("over", "fragment"),
    [
        ({"token": -1}, "token"),
        ({"token": 2**31}, "token"),
        ({"token": "5"}, "token"),
        ({"token": 5.0}, "token"),
        ({"token": True}, "token"),
        ({"token": _DROP}, "token"),
        ({"spec": "x" * (MAX_SPEC + 1)}, "spec"),
        ({"spec": "a b"}, "spec"),
        ({"spec": "caf\u00e9"}, "spec"),
        ({"spec": "a\nb"}, "spec"),
        ({"spec": _DROP}, "spec"),
        ({"epoch": -1}, "epoch"),
        ({"epoch": 65536}, "epoch"),
        ({"epoch": _DROP}, "epoch"),
        ({"prompt": "XYZ"}, "prompt"),
        ({"prompt": PROMPT + "0"}, "prompt"),
        ({"req_id": ""}, "req_id"),
        ({"req_id": "r" * 257}, "req_id"),
        ({"sender": None}, "sender"),
        ({"extra": 1}, "extra"),
        ({"version": 5}, "unsupported protocol version 5"),
    ],
)
def test_malformed_tokens_are_refused_naming_the_field(over: dict, fragment: str) -> None:
    with pytest.raises(WireError) as err:
        wire.decode(_token(**over))
    assert fragment in str(err.value)


def test_senders_check_what_the_wire_would_refuse() -> None:
    """A Struct built in Python is not validated: P checks before it builds one."""
    assert first_token_problem(5, "s") == ""
    assert "outside" in first_token_problem(-1, "s")
    assert "outside" in first_token_problem(2**31, "s")
    assert "printable" in first_token_problem(5, "x" * (MAX_SPEC + 1))
    assert "printable" in first_token_problem(5, "a b")
