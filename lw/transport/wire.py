"""Side-channel messages between prefill (P) and decode (D) workers, and their byte encoding.

Every message is a tagged ``msgspec.Struct`` carrying the protocol version. ``decode`` turns any
byte string into a message or raises :class:`WireError`; it never raises anything else, so a
listener can feed it whatever arrived on a socket.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 1 << 20  # refused before parsing: 1 MiB

# Bounds that make absurd values a decode error rather than a problem for the core.
_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
_Text = Annotated[str, msgspec.Meta(max_length=1024)]
_Rank = Annotated[int, msgspec.Meta(ge=0, le=65535)]
_Count = Annotated[int, msgspec.Meta(ge=1, le=65536)]
_Addr = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]  # msgspec bounds are int64
_Len = Annotated[int, msgspec.Meta(ge=1, le=1 << 40)]
_NBlocks = Annotated[int, msgspec.Meta(ge=1, le=1 << 32)]
_Incarnation = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]


class WireError(ValueError):
    """Raised by :func:`decode` for any input that is not a valid message of this protocol."""


class _Msg(msgspec.Struct, frozen=True, tag_field="kind", forbid_unknown_fields=True):
    """Base of every side-channel message."""

    version: int


class Sender(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Who sent a message: engine, worker rank within it, incarnation and reply address."""

    engine_id: _Id
    rank: _Rank
    incarnation: _Incarnation
    addr: _Text  # side-channel address where this worker listens, e.g. tcp://10.0.0.2:5600


class LayerLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where one attention layer's KV blocks live in a worker's registered memory."""

    base_addr: _Addr
    block_stride: _Len  # bytes between block b and block b+1
    block_len: _Len  # bytes to copy per block (<= block_stride)
    num_blocks: _NBlocks


class KVLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A decode worker's KV-cache description: transfer-engine session and per-layer layout."""

    engine_id: _Id
    incarnation: _Incarnation
    te_session: _Text  # transfer-engine address, host:rpc_port
    layers: Annotated[list[LayerLayout], msgspec.Meta(min_length=1, max_length=4096)]


class MetaRequest(_Msg, tag="meta_req"):
    """P asks D to accept it as a sender for a request (and for D's layout when not cached)."""

    req_id: _Id
    sender: Sender
    want_layout: bool


MetaStatus = Literal["accepted", "refused", "unknown"]


class MetaReply(_Msg, tag="meta_rep"):
    """D's answer to MetaRequest: only ``accepted`` allows P to write into D's blocks."""

    req_id: _Id
    status: MetaStatus
    responder: Sender
    layout: KVLayout | None = None
    reason: _Text = ""


class DoneSending(_Msg, tag="done"):
    """P tells D that every layer write of this sender for a request has completed."""

    req_id: _Id
    sender: Sender
    expected_senders: _Count
    num_layers: _Count


class FailedSending(_Msg, tag="failed"):
    """P tells D that it stopped sending a request without completing it, and why."""

    req_id: _Id
    sender: Sender
    expected_senders: _Count
    reason: _Text
    in_doubt: bool = False  # a write timed out: its bytes may still land, D must wait its lease


class Ack(_Msg, tag="ack"):
    """D acknowledges a DoneSending or FailedSending (``accepted`` false: D had failed it)."""

    req_id: _Id
    of: Literal["done", "failed"]
    responder: Sender
    accepted: bool


class Abort(_Msg, tag="abort"):
    """D tells a P sender to stop writing a request (deadline, local abort, failure)."""

    req_id: _Id
    responder: Sender
    reason: _Text


class AbortAck(_Msg, tag="abort_ack"):
    """P confirms that no write of this request from this sender is or will be in flight."""

    req_id: _Id
    sender: Sender
    known: bool
    in_doubt: bool = False  # a write of ours timed out: its bytes may still land (lease applies)


Message = MetaRequest | MetaReply | DoneSending | FailedSending | Ack | Abort | AbortAck

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """Serialise a message to bytes (msgpack)."""
    if msg.version != PROTOCOL_VERSION:
        raise WireError(f"refusing to encode {type(msg).__name__} with version {msg.version}")
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Parse bytes into a message; raise WireError naming what was wrong for any bad input."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES} limit")
    try:
        msg = _decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise WireError(f"invalid message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise WireError(f"malformed message: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any decoder failure is a wire error by contract
        raise WireError(f"undecodable message: {type(exc).__name__}: {exc}") from None
    if msg.version != PROTOCOL_VERSION:
        raise WireError(
            f"unsupported protocol version {msg.version} in {type(msg).__name__} "
            f"(this side speaks {PROTOCOL_VERSION})"
        )
    return msg
