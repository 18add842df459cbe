"""The synthetic proxy's routing of client requests over several D engines.

A client request reaches a D engine as an *attempt* with its own transfer id, as the real proxy
gives each decode attempt a new request id (``lw/proxy/exchange.py``): a retry is a
fresh D-first round, never confused with the old one on P or D. The router picks the live D
engine with the fewest attempts outstanding (ties go round robin), counts the tokens the client
received, and when a D engine dies says, per request, whether it may move: only before its first
token (after that the client has seen part of an answer) and while another D is alive. A dead D
is never picked again (nothing restarts it). What happens to the request inside P and D is the
endpoints' business, not the router's.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Router", "Lost"]


@dataclass(frozen=True)
class Lost:
    """An attempt that died with its D engine: its client request and the tokens it had
    streamed (0: the request may move to another D)."""

    attempt: str
    client: str
    tokens: int


class Router:
    """Which D engine serves each client request, and what the client has received."""

    def __init__(self, clients: Iterable[str], slots: int, window: int) -> None:
        self.pending: deque[str] = deque(clients)  # client requests waiting for a D
        self.total = len(self.pending)
        self.slots = slots
        self.window = window  # attempts outstanding per D engine (what its pool holds)
        self.down: set[int] = set()  # D engines seen dead: never picked again
        self.current: dict[str, str] = {}  # client -> its outstanding attempt
        self._attempts: dict[str, tuple[str, int]] = {}  # outstanding attempt -> (client, slot)
        self._load = [0] * slots
        self.tokens: Counter[str] = Counter()  # client -> tokens received
        self.tries: Counter[str] = Counter()  # client -> attempts started
        self._rr = 0

    @property
    def started(self) -> int:
        """Client requests that reached a D engine at least once."""
        return len(self.tries)

    def load(self, slot: int) -> int:
        """Attempts outstanding on D engine ``slot``."""
        return self._load[slot]

    def pick(self, ready: Iterable[int]) -> int | None:
        """The D engine for the next request: among the ready ones that are not down and have
        room, the least loaded; ties rotate, so equal engines take turns. None: none has room."""
        best: tuple[int, int] | None = None
        choice = None
        for slot in ready:
            if slot in self.down or self._load[slot] >= self.window:
                continue
            key = (self._load[slot], (slot - self._rr) % self.slots)
            if best is None or key < best:
                best, choice = key, slot
        if choice is not None:
            self._rr = (choice + 1) % self.slots
        return choice

    def start(self, client: str, slot: int) -> str:
        """Send ``client`` to D engine ``slot``: the new attempt's transfer id (the client's id
        for its first attempt, so single-decoder runs name requests as they always did)."""
        self.tries[client] += 1
        n = self.tries[client]
        attempt = client if n == 1 else f"{client}.retry{n - 1}"
        self.current[client] = attempt
        self._attempts[attempt] = (client, slot)
        self._load[slot] += 1
        return attempt

    def client_of(self, attempt: str) -> str | None:
        """The client request of an outstanding attempt; None for one that already ended."""
        entry = self._attempts.get(attempt)
        return entry[0] if entry is not None else None

    def slot_of(self, attempt: str) -> int | None:
        """The D engine of an outstanding attempt."""
        entry = self._attempts.get(attempt)
        return entry[1] if entry is not None else None

    def held(self, slot: int) -> dict[str, int]:
        """The attempts outstanding on D engine ``slot`` and the tokens each has streamed."""
        return {a: self.tokens[c] for a, (c, s) in self._attempts.items() if s == slot}

    def streamed(self, attempt: str, tokens: int) -> None:
        """D streamed token number ``tokens`` of ``attempt`` to the client."""
        client = self.client_of(attempt)
        if client is not None:
            self.tokens[client] = max(self.tokens[client], tokens)

    def ended(self, attempt: str) -> str | None:
        """``attempt`` has its outcome: its client request, None if it was not outstanding."""
        entry = self._attempts.pop(attempt, None)
        if entry is None:
            return None
        client, slot = entry
        self._load[slot] -= 1
        if self.current.get(client) == attempt:
            del self.current[client]
        return client

    def decoder_lost(self, slot: int) -> list[Lost]:
        """D engine ``slot`` died: mark it down and end every attempt it held."""
        self.down.add(slot)
        held = [a for a, (_c, s) in self._attempts.items() if s == slot]
        lost = []
        for attempt in held:
            client = self.ended(attempt)
            assert client is not None
            lost.append(Lost(attempt, client, self.tokens[client]))
        return lost

    def may_move(self, lost: Lost, max_tries: int) -> bool:
        """Whether a request of a dead D goes to another: no token streamed, tries left, and a
        D engine that is not down."""
        return (lost.tokens == 0 and self.tries[lost.client] < max_tries
                and len(self.down) < self.slots)

    def retry(self, client: str) -> None:
        """Queue ``client`` again, ahead of requests that never reached a D (it waited longest)."""
        self.pending.appendleft(client)

    def revive(self, slot: int) -> None:
        """D engine ``slot`` restarted (one decoder: a new incarnation on its port)."""
        self.down.discard(slot)
