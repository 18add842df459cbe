"""Effects returned by the sans-I/O endpoints: the runtime performs them, the simulator records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lw.fsm.messages import KVLayout, Message

TimerKey = tuple[str, str]  # (kind, req_id), e.g. ("meta", "req-7")


@dataclass(frozen=True, slots=True)
class Send:
    """Send a side-channel message to the worker listening at ``dest``. ``with_sums`` (P's
    DONE, ``kv_checksum``): the driver puts the checksums of what this sender wrote to ``dest``
    (the writes the core marked ``checksum``) into the message before it goes."""

    dest: str
    msg: Message
    with_sums: bool = False


@dataclass(frozen=True, slots=True)
class WriteLayer:
    """Write one layer of a request's blocks from local memory into D's blocks (non-blocking)."""

    req_id: str
    layer: int
    layout: KVLayout  # D's layout: transfer-engine session and per-layer addresses
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    # Byte runs (src offset, dst offset, length) of each block that go to this D worker, from the
    # two head formats (lw.fsm.kvmap); None: the whole block, as long on both sides.
    segments: tuple[tuple[int, int, int], ...] | None = None
    target: str = ""  # side-channel address of the D worker written into (its DONE's dest)
    # The write's number within its request, in (chunk, layer) order: chunk * L + layer (-1 when
    # made: the layer, a request pushed in one chunk). ``transfer_done`` takes it back.
    seq: int = -1
    checksum: bool = False  # kv_checksum: the driver keeps the CRC-32C of what this writes

    def __post_init__(self) -> None:
        if self.seq < 0:
            object.__setattr__(self, "seq", self.layer)


@dataclass(frozen=True, slots=True)
class ArmTimer:
    """Call ``on_timer(key)`` at time ``at`` (re-arming the same key replaces it)."""

    key: TimerKey
    at: float


@dataclass(frozen=True, slots=True)
class CancelTimer:
    """Forget the timer ``key`` if armed."""

    key: TimerKey


@dataclass(frozen=True, slots=True)
class SendFinished:
    """P: no transfer touches this request's blocks any more; the scheduler may free them."""

    req_id: str
    ok: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class RecvDone:
    """D: every expected sender wrote every layer; the request may decode."""

    req_id: str


@dataclass(frozen=True, slots=True)
class RecvFailed:
    """D: the request failed and no sender can still write its blocks; report and free them."""

    req_id: str
    block_ids: tuple[int, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class Quarantine:
    """D: the request failed but writes may still land; its blocks must stay untouched."""

    req_id: str
    block_ids: tuple[int, ...]
    reason: str


Effect = (
    Send | WriteLayer | ArmTimer | CancelTimer | SendFinished | RecvDone | RecvFailed | Quarantine
)


def effects_of_type(effects: list[Effect], kind: type) -> list[Any]:
    """The effects of one kind, in order (a convenience for drivers and tests)."""
    return [e for e in effects if isinstance(e, kind)]
