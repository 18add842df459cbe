"""Declared state machines: one table of transitions per machine, written as data.

A :class:`Declaration` is the single source of truth. From it we build (1) ``transitions``'
reference machine, (2) the compiled dispatch table used on the hot path and (3) the Mermaid
diagrams. ``tests/fsm/test_tables.py`` proves (1) and (2) agree on every (state, event) pair;
``transitions`` is needed only for (1) (the ``reference`` extra).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# Sentinel destination of a declared no-op: the event is expected in that state and changes nothing
# (duplicates, late completions, events after a final state).
STAY = "="


class ProtocolError(RuntimeError):
    """An event arrived that the declaration says is impossible in the current state."""

    def __init__(self, machine: str, req_id: str, state: str, event: str, detail: str = "") -> None:
        self.machine = machine
        self.req_id = req_id
        self.state = state
        self.event = event
        msg = f"{machine}: request {req_id!r} in state {state} cannot take event {event!r}"
        super().__init__(msg + (f" ({detail})" if detail else ""))


@dataclass(frozen=True)
class Transition:
    """One declared row: on ``event`` in any of ``sources``, go to ``dest`` (or STAY)."""

    event: str
    sources: tuple[str, ...]
    dest: str
    note: str = ""


@dataclass(frozen=True)
class Declaration:
    """A machine: its states, initial and final states, and the transition table.

    ``entries``: further states a record may start in (besides ``initial``), e.g. a prefill
    admitted before its decoder is known."""

    name: str
    states: tuple[str, ...]
    initial: str
    finals: frozenset[str]
    transitions: tuple[Transition, ...]
    events: tuple[str, ...] = field(default=())
    entries: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for s in (self.initial, *self.entries):
            if s not in self.states or s in self.finals:
                raise ValueError(f"{self.name}: entry state {s} must be a live state")
        evs: list[str] = []
        seen: set[tuple[str, str]] = set()
        for t in self.transitions:
            if t.event not in evs:
                evs.append(t.event)
            for s in t.sources:
                if s not in self.states:
                    raise ValueError(f"{self.name}: unknown source state {s} in {t}")
                if (s, t.event) in seen:
                    raise ValueError(f"{self.name}: two rows for ({s}, {t.event})")
                seen.add((s, t.event))
            if t.dest != STAY and t.dest not in self.states:
                raise ValueError(f"{self.name}: unknown destination {t.dest} in {t}")
            if t.dest != STAY and any(s in self.finals for s in t.sources):
                raise ValueError(f"{self.name}: final states may only STAY ({t})")
        object.__setattr__(self, "events", tuple(evs))

    def compile(self) -> dict[tuple[str, str], str]:
        """The hot-path dispatch table: (state, event) -> destination state (STAY resolved)."""
        table: dict[tuple[str, str], str] = {}
        for t in self.transitions:
            for s in t.sources:
                table[(s, t.event)] = s if t.dest == STAY else t.dest
        return table

    def reference_machine(self, model: Any, initial: str | None = None) -> Any:
        """Build ``transitions``' own Machine for ``model`` (the reference semantics)."""
        try:
            from transitions import Machine
        except ImportError as exc:  # only the reference check needs it, not the hot path
            raise ImportError("the reference machine needs the 'transitions' package: pip "
                              "install 'lw-layerwise[reference]'") from exc

        m = Machine(
            model=model,
            states=list(self.states),
            initial=initial or self.initial,
            auto_transitions=False,
            ignore_invalid_triggers=False,
        )
        for t in self.transitions:
            if t.dest == STAY:
                m.add_transition(t.event, list(t.sources), None)  # dest None: internal
            else:
                m.add_transition(t.event, list(t.sources), t.dest)
        return m


def rows(event: str, sources: Iterable[str], dest: str, note: str = "") -> Transition:
    """Shorthand for a Transition from several sources."""
    return Transition(event, tuple(sources), dest, note)
