"""The byte encoding of the side-channel messages (declared in :mod:`lw.fsm.messages`).

Every message is a tagged ``msgspec.Struct`` carrying the protocol version. ``decode`` turns any
byte string into a message or raises :class:`WireError`; it never raises anything else, so a
listener can feed it whatever arrived on a socket.
"""

from __future__ import annotations

import msgspec

from lw.fsm.messages import (
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    Ack,
    DoneSending,
    FailedSending,
    FirstToken,
    FirstTokenStatus,
    Heartbeat,
    HeartbeatAck,
    KVFormat,
    KVLayout,
    LayerLayout,
    Message,
    MetaReply,
    MetaRequest,
    MetaStatus,
    RequestStatus,
    Sender,
    StatusQuery,
    StatusReply,
    TimelineEntry,
)

__all__ = [
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "Abort",
    "AbortAck",
    "Ack",
    "DoneSending",
    "FailedSending",
    "FirstToken",
    "FirstTokenStatus",
    "Heartbeat",
    "HeartbeatAck",
    "KVFormat",
    "KVLayout",
    "LayerLayout",
    "Message",
    "MetaReply",
    "MetaRequest",
    "MetaStatus",
    "RequestStatus",
    "Sender",
    "StatusQuery",
    "StatusReply",
    "TimelineEntry",
    "WireError",
    "decode",
    "encode",
]

MAX_MESSAGE_BYTES = 1 << 20  # refused before parsing: 1 MiB


class WireError(ValueError):
    """Raised by :func:`decode` for any input that is not a valid message of this protocol."""


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
