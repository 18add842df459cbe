"""D's scheduler-side decisions on P's first tokens: whether a token that arrived becomes the
request's first output, whether a request whose KV landed waits for its token, and which token
a model runner that samples from a per-request generator must be seeded with.

The D endpoint (lw.fsm.decode_first_token) decides which tokens are the request's (live epoch,
accepted sender, prompt); this desk decides what D's scheduler does with one, from the facts
the scheduler gathers (:class:`TokenCase`). Pure: vLLM's scheduler subclass
(lw.vllm_adapter.lw_scheduler) asks, acts and counts.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

__all__ = ["FirstTokenDesk", "TokenCase", "Verdict"]


class Verdict(enum.Enum):
    """What becomes of a first token that reached D's scheduler."""

    TAKE = "take"  # the request's first output token: stream it, continue from it
    ENDED = "ended"  # the request is gone: nothing to do
    FALLBACK = "fallback"  # the request cannot use it (the reason says why): vLLM's path
    LATE = "late"  # D computes token 1 itself already: discarded, the request fell back late
    RESAMPLED = "resampled"  # a re-prefill's P sampled again: discarded, the client holds one


@dataclass(frozen=True)
class TokenCase:
    """What D's scheduler knows of a request when P's token for it arrives."""

    live: bool  # the scheduler holds it, unfinished
    awaiting_kv: bool  # it still waits for its KV (nothing scheduled for it yet)
    outputs: int  # output tokens it holds
    ineligible: str | None  # why it cannot continue from a token drawn elsewhere (None: it can)


class FirstTokenDesk:
    """Per-request first-token state of one D scheduler: heard, taken, waiting, to seed."""

    def __init__(self, wait_s: float) -> None:
        if not wait_s >= 0:
            raise ValueError(f"the first-token wait must be >= 0 s, got {wait_s}")
        self.wait_s = wait_s
        self._heard: set[str] = set()  # P's token came (taken or not): nothing to wait for
        self._taken: set[str] = set()  # the request's first output token is P's
        self._waits: dict[str, float] = {}  # KV landed, P's token not yet: since when
        self._seeds: dict[str, int] = {}  # taken, not yet scheduled: the runner's token 1

    def arrived(self, req_id: str, case: TokenCase,
                spec_problem: Callable[[], str | None]) -> tuple[Verdict, str | None]:
        """P's token for ``req_id`` arrived: the verdict and, for FALLBACK, its reason.
        ``spec_problem`` says why the token's sampling spec does not fit the request (asked
        only when everything else allows taking it)."""
        if not case.live:
            return Verdict.ENDED, None
        self._heard.add(req_id)
        if case.ineligible is not None:  # whenever the token comes: the reason is the request's
            return Verdict.FALLBACK, case.ineligible
        if not case.awaiting_kv or case.outputs > 0:
            if req_id in self._taken:
                return Verdict.RESAMPLED, None
            return Verdict.LATE, "late"
        why = spec_problem()
        if why is not None:
            return Verdict.FALLBACK, why
        self._taken.add(req_id)
        return Verdict.TAKE, None

    def seed(self, req_id: str, token: int) -> None:
        """A taken token the model runner must start ``req_id`` from when it is scheduled."""
        self._seeds[req_id] = token

    def may_schedule(self, req_id: str, now: float) -> tuple[bool, bool]:
        """A request whose KV landed, eligible and holding no token: (whether it may be
        scheduled now, whether that is because its wait for P's token just expired)."""
        if req_id in self._heard:
            self._waits.pop(req_id, None)
            return True, False
        since = self._waits.setdefault(req_id, now)
        if now - since < self.wait_s:
            return False, False
        del self._waits[req_id]
        return True, True

    def not_waiting(self, req_id: str) -> None:
        """``req_id`` is past (or outside) the wait: forget when it began."""
        self._waits.pop(req_id, None)

    def seeds_for(self, scheduled: Iterable[str]) -> list[tuple[str, int]]:
        """The tokens to seed the requests scheduled for the first time (each given once)."""
        out = []
        for rid in scheduled:
            token = self._seeds.pop(rid, None)
            if token is not None:
                out.append((rid, token))
        return out

    def forget(self, live: Collection[str]) -> None:
        """Drop every request not in ``live`` (ended, or finished before it was scheduled)."""
        for table in (self._waits, self._seeds):
            for rid in [r for r in table if r not in live]:
                del table[rid]
        if self._heard:
            self._heard = {r for r in self._heard if r in live}
            self._taken = {r for r in self._taken if r in live}

    def holds(self, req_id: str) -> bool:
        """Whether the desk remembers anything of ``req_id`` (tests: nothing outlives it)."""
        return (req_id in self._heard or req_id in self._taken or req_id in self._waits
                or req_id in self._seeds)
