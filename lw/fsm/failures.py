"""Why a D request failed, as data: the :class:`FailureKind` the decode endpoint gives each
failure where it decides it (lw.fsm.decode), carried by its reports (``RecvFailed``,
``Quarantine``), its timeline's ``fail`` event (:class:`Failure`) and the status replies that
relay it, so that metrics, ``lw status`` and the proxy's client errors read a kind, never the
words of a reason.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class FailureKind(enum.StrEnum):
    """Why a D request failed, as a bounded label (metric labels, log kinds, client errors).
    The values travel in status replies (protocol 8): a new kind is a version change."""

    CHECKSUM_MISMATCH = "checksum_mismatch"
    BAD_DONE = "bad_done"
    PREFILL_FAILED = "prefill_failed"
    PREFILL_LOST = "prefill_lost"
    PREFILL_DEADLINE = "prefill_deadline"
    METASERVER = "metaserver"
    ABORTED = "aborted"
    OTHER = "other"


FAILURE_KINDS: dict[FailureKind, str] = {
    FailureKind.CHECKSUM_MISMATCH: "the bytes in D's blocks differ from the sender's KV "
                                   "checksums",
    FailureKind.BAD_DONE: "a sender's DONE does not describe the request (layers, blocks, no "
                          "checksums)",
    FailureKind.PREFILL_FAILED: "the prefill worker reported its push failed (a write, its "
                                "deadline, ...)",
    FailureKind.PREFILL_LOST: "the prefill worker died, restarted or went silent",
    FailureKind.PREFILL_DEADLINE: "no complete KV within D's prefill deadline",
    FailureKind.METASERVER: "D could not ask the proxy for the prefill",
    FailureKind.ABORTED: "the local scheduler ended the request first (client gone, "
                         "preempted, ...)",
    FailureKind.OTHER: "none of the above (lw's core gives no request this kind: the metrics "
                       "count a label they do not know so)",
}
"""Every kind with its meaning (the metrics declare each label, the docs list them)."""


class Failure(NamedTuple):
    """The detail of a D ``fail`` timeline event: its kind and its reason. It reads as the
    reason (``str``), so that every reader of a timeline's text sees the words it always did;
    the status reply sends the kind beside them (``TimelineEntry.failure``)."""

    kind: FailureKind
    reason: str

    def __str__(self) -> str:
        return self.reason
