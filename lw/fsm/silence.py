"""Whether a peer that live requests need and that has gone silent is lost: the verdict the
facts of a liveness detector lead to (how long it has been quiet, the budget its history earns
it, the cap, and what the kernel says of its process). Pure: the driver gathers the facts."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ALIVE", "GONE", "PENDING", "PROCESS_EVIDENCE", "UNKNOWN", "Silence",
           "fixed_budget_loses", "silence_loses"]

# What the driver's connection to the peer shows of its process. A process starved of CPU,
# stopped or paused by its GC keeps its TCP connections (its kernel acknowledges and accepts
# reconnections); a dead one's host resets and refuses them, a host gone or cut off lets them
# time out.
ALIVE = "alive"  # the connection is up: a process holds the peer's port
GONE = "gone"  # down (reset, refused, timed out) for longer than a reconnection takes
PENDING = "pending"  # down only briefly: a reconnection may be under way
UNKNOWN = "unknown"  # no connection to judge by
PROCESS_EVIDENCE = (ALIVE, GONE, PENDING, UNKNOWN)


@dataclass(frozen=True)
class Silence:
    """A needed peer's silence as the detector saw it at one heartbeat round."""

    quiet_s: float  # since the peer was last heard from (a message, an answer, a landed write)
    budget_s: float  # what its connection's history earns it (floor .. cap)
    cap_s: float  # no silence is survived past this: a wedged process must be found too
    process: str  # one of PROCESS_EVIDENCE

    def __post_init__(self) -> None:
        if self.process not in PROCESS_EVIDENCE:
            raise ValueError(f"process evidence must be one of {PROCESS_EVIDENCE}, "
                             f"got {self.process!r}")

    def reason(self) -> str:
        """Why the peer is lost, for the request's failure and the log."""
        shown = {GONE: "our connection to it is down",
                 UNKNOWN: "no connection to it to judge by",
                 ALIVE: "our connection to it is up: its process lives",
                 PENDING: "our connection to it is reconnecting"}[self.process]
        return (f"no message or heartbeat answer for {self.quiet_s:.1f}s (budget "
                f"{self.budget_s:.1f}s, heartbeat_cap_s {self.cap_s:g}s; {shown})")


def silence_loses(s: Silence) -> bool:
    """lw's verdict: a slow peer is not a dead one. Within its budget the peer is waited
    for; past it, it is lost only when the connection shows no process (or there is none to
    judge by); one whose process lives, or whose connection is reconnecting, is waited for up
    to the cap."""
    if s.quiet_s <= s.budget_s:
        return False
    if s.quiet_s > s.cap_s:
        return True
    return s.process in (GONE, UNKNOWN)


def fixed_budget_loses(s: Silence) -> bool:
    """The verdict of a detector with one fixed budget and no evidence (what lw had, and most
    heartbeat leases do): a peer silent past the budget is lost, however alive its process."""
    return s.quiet_s > s.budget_s
