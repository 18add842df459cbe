"""The simulated side channel: messages in flight as a multiset (delivery in any order).

Two messages with the same :func:`msg_key` differ at most in free-text reasons, which no endpoint
decision reads, so they are counted as copies of one message (a sound merge).
"""

from __future__ import annotations

from collections.abc import Collection

from lw.fsm.messages import (
    Abort,
    AbortAck,
    Ack,
    DoneSending,
    FailedSending,
    FirstToken,
    Message,
    MetaReply,
    MetaRequest,
)

MsgKey = tuple  # (dest, src, kind, req_id, extra)
MESSAGE_TYPES = (MetaRequest, MetaReply, DoneSending, FailedSending, Ack, Abort, AbortAck,
                 FirstToken)

_SHORT = {
    MetaRequest: "MetaRequest",
    MetaReply: "MetaReply",
    DoneSending: "DoneSending",
    FailedSending: "FailedSending",
    Ack: "Ack",
    Abort: "Abort",
    AbortAck: "AbortAck",
    FirstToken: "FirstToken",
}


def msg_key(src: str, dest: str, msg: Message) -> MsgKey:
    """A hashable identity of a message in flight: everything a receiver's decision depends on."""
    kind = _SHORT[type(msg)]
    if isinstance(msg, MetaRequest):
        extra: tuple = (msg.want_layout, msg.blocks)  # D accepts only its own blocks
    elif isinstance(msg, MetaReply):  # with D restarts the incarnations decide what P does
        extra = (msg.status, msg.layout is not None, msg.responder.incarnation,
                 None if msg.layout is None else msg.layout.incarnation)
    elif isinstance(msg, Ack):
        extra = (msg.of, msg.accepted, msg.responder.incarnation)
    elif isinstance(msg, Abort):
        extra = (msg.responder.incarnation,)
    elif isinstance(msg, AbortAck):
        extra = (msg.known, msg.in_doubt)
    elif isinstance(msg, DoneSending):
        extra = (msg.num_layers, msg.expected_senders, msg.num_blocks)
    elif isinstance(msg, FirstToken):  # D's scheduler tells tokens and specs apart
        extra = (msg.token, msg.spec)
    else:  # FailedSending
        extra = (msg.expected_senders, msg.in_doubt)
    epoch = getattr(msg, "epoch", 0)  # D takes only its current claim epoch's (failover)
    return (dest, src, kind, msg.req_id, (*extra, epoch) if epoch else extra)


def describe_key(key: MsgKey) -> str:
    """Short human text for a message in flight, e.g. ``MetaReply(r0, accepted)``."""
    _dest, _src, kind, rid, extra = key
    if kind == "MetaReply":
        return f"MetaReply({rid}, {extra[0]})"
    if kind == "Ack":
        return f"Ack({rid}, {extra[0]}, {'accepted' if extra[1] else 'not accepted'})"
    if kind == "AbortAck":
        return f"AbortAck({rid}{', known' if extra[0] else ''}{', in doubt' if extra[1] else ''})"
    if kind == "FailedSending":
        return f"FailedSending({rid}{', in doubt' if extra[1] else ''})"
    if kind == "FirstToken":
        epoch = f", epoch {extra[2]}" if len(extra) > 2 else ""
        return f"FirstToken({rid}, token {extra[0]}, spec {extra[1]}{epoch})"
    return f"{kind}({rid})"


class Network:
    """Messages in flight: key -> count; ``msgs`` (shared by every copy) key -> a message."""

    def __init__(self, msgs: dict[MsgKey, Message] | None = None) -> None:
        self.counts: dict[MsgKey, int] = {}
        self.msgs: dict[MsgKey, Message] = {} if msgs is None else msgs

    def add(self, src: str, dest: str, msg: Message) -> MsgKey:
        """Put one copy of ``msg`` in flight from ``src`` to ``dest``."""
        key = msg_key(src, dest, msg)
        self.msgs.setdefault(key, msg)
        self.counts[key] = self.counts.get(key, 0) + 1
        return key

    def take(self, key: MsgKey) -> Message:
        """Remove one copy of a message in flight and return it."""
        n = self.counts[key] - 1
        if n:
            self.counts[key] = n
        else:
            del self.counts[key]
        return self.msgs[key]

    def duplicate(self, key: MsgKey) -> None:
        """The network delivers one more copy of this message later."""
        self.counts[key] += 1

    def drop_to(self, dests: Collection[str]) -> None:
        """Forget every message addressed to these dead processes (delivery would discard them)."""
        gone = set(dests)
        for key in [k for k in self.counts if k[0] in gone]:
            del self.counts[key]

    def keys(self) -> list[MsgKey]:
        """Keys in flight, in a deterministic (insertion) order."""
        return list(self.counts)

    def snapshot(self) -> tuple:
        """Order-independent, hashable content of the network, in a canonical order (the
        explorer fingerprints the key's text, and equal frozensets can print differently)."""
        return tuple(sorted(self.counts.items(), key=repr))

    def __len__(self) -> int:
        return sum(self.counts.values())
