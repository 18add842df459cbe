"""Protocol variants the checker can be pointed at: world-level behaviour switches, not core copies.

Every variant runs the same ``lw.fsm`` endpoints; what changes is how the world around them
behaves (who the proxy contacts first, whether the forward pass waits, when P frees blocks).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Design:
    """One protocol variant: the switches that make the world behave like that design."""

    name: str
    title: str
    summary: str
    d_first: bool  # the proxy asks D to allocate before P starts (else P and D start together)
    hook_waits_for_meta: bool  # a P layer hook blocks until D's metadata for its requests arrived
    timers: bool  # deadlines and retries exist (the pre-#3866 plan had none)
    free_on_request_finished: bool  # P frees blocks when compute ends, not on SendFinished
    expected: str  # what the checker must report: "holds", "deadlock" or "use-after-free"


DESIGNS: dict[str, Design] = {
    "d-first": Design(
        name="d-first",
        title="lw's protocol (D first)",
        summary=(
            "D allocates its blocks first, then the proxy starts the prefill; P's layer hooks "
            "only record the layer (never wait); P frees blocks only on SendFinished."
        ),
        d_first=True,
        hook_waits_for_meta=False,
        timers=True,
        free_on_request_finished=False,
        expected="holds",
    ),
    "p-first": Design(
        name="p-first",
        title="pre-#3866 plan (P first)",
        summary=(
            "The proxy starts P and D together; D allocates only when it has free blocks; a P "
            "rank's layer hook blocks inside the forward pass until D's metadata for its "
            "requests is ready, with no timeout (no deadlines anywhere)."
        ),
        d_first=False,
        hook_waits_for_meta=True,
        timers=False,
        free_on_request_finished=False,
        expected="deadlock",
    ),
    "eager-free": Design(
        name="eager-free",
        title="the seed's eager free",
        summary=(
            "As d-first, but P's request_finished returns 'free now' when compute ends: the "
            "scheduler frees (and may reallocate) the blocks while layers are still being sent."
        ),
        d_first=True,
        hook_waits_for_meta=False,
        timers=True,
        free_on_request_finished=True,
        expected="use-after-free",
    ),
}
