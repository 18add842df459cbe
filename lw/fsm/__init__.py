"""lw's sans-I/O core: declared per-request lifecycles and the endpoints that drive them.

Nothing in this package does I/O, starts threads or reads a clock: events in, effects out.
"""

from lw.fsm.decode import DecodeEndpoint
from lw.fsm.decode_request import DecodeConfig, check_lease
from lw.fsm.effects import (
    ArmTimer,
    CancelTimer,
    Effect,
    FenceData,
    FirstTokenTaken,
    FreshBlocks,
    Granted,
    KeptSums,
    Quarantine,
    RecvDone,
    RecvFailed,
    ReleaseBlocks,
    Reprefill,
    Send,
    SendFinished,
    SumBlocks,
    SumPlan,
    Sums,
    WriteLayer,
)
from lw.fsm.failures import FAILURE_KINDS, Failure, FailureKind
from lw.fsm.lifecycles import decode_declaration, prefill_declaration
from lw.fsm.machine import STAY, Declaration, ProtocolError, Transition
from lw.fsm.prefill import PrefillConfig, PrefillEndpoint, PrefillRequest
from lw.fsm.silence import Silence

__all__ = [
    "FAILURE_KINDS",
    "STAY",
    "ArmTimer",
    "CancelTimer",
    "DecodeConfig",
    "DecodeEndpoint",
    "Declaration",
    "Effect",
    "Failure",
    "FailureKind",
    "FenceData",
    "FirstTokenTaken",
    "FreshBlocks",
    "Granted",
    "KeptSums",
    "PrefillConfig",
    "PrefillEndpoint",
    "PrefillRequest",
    "ProtocolError",
    "Quarantine",
    "ReleaseBlocks",
    "Reprefill",
    "RecvDone",
    "RecvFailed",
    "Send",
    "SendFinished",
    "Silence",
    "SumBlocks",
    "SumPlan",
    "Sums",
    "Transition",
    "WriteLayer",
    "check_lease",
    "decode_declaration",
    "prefill_declaration",
]
