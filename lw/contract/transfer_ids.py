"""Transfer ids shared by D's connector and the proxy: one proxy transfer per client request,
one sub-transfer per vLLM request of it (``n`` > 1 children, prompt lists)."""

from __future__ import annotations

import hashlib

__all__ = ["MAX_TRANSFER_ID", "is_sub_transfer_of", "sub_transfer_id"]

MAX_TRANSFER_ID = 256
"""Longest transfer id (the core's request id limit, lw.fsm.messages)."""
_DIGEST_HEX = 32  # a long sub-transfer id keeps this many hex digits of its hash


def sub_transfer_id(transfer_id: str, request_id: str) -> str:
    """The transfer id of one vLLM request of a proxy transfer: deterministic, <= 256 chars."""
    sub = f"{transfer_id}@{request_id}"
    if len(sub) <= MAX_TRANSFER_ID:
        return sub
    digest = hashlib.blake2b(f"{transfer_id}\0{request_id}".encode(),
                             digest_size=_DIGEST_HEX // 2).hexdigest()
    return f"{transfer_id[:MAX_TRANSFER_ID - _DIGEST_HEX - 1]}@{digest}"


def is_sub_transfer_of(sub_id: str, transfer_id: str) -> bool:
    """Whether ``sub_id`` has the form :func:`sub_transfer_id` gives ``transfer_id``'s requests
    (the whole id before "@", or its cut when the sub-transfer id was hashed)."""
    head, sep, _ = sub_id.partition("@")
    if not sep or not head:
        return False
    return head == transfer_id or head == transfer_id[:MAX_TRANSFER_ID - _DIGEST_HEX - 1]
