"""The compiled dispatch table and `transitions`' own machine agree on every (state, event)."""

from __future__ import annotations

import pytest
from transitions import MachineError

from lw.fsm.lifecycles import decode_declaration, prefill_declaration
from lw.fsm.machine import STAY, Declaration, Transition


class _Model:
    """Plain model object that `transitions` decorates with triggers."""


def _reference_outcome(decl: Declaration, state: str, event: str) -> str | None:
    model = _Model()
    decl.reference_machine(model, initial=state)
    try:
        ok = model.trigger(event)
    except MachineError:
        return None
    assert ok is True
    return model.state


@pytest.mark.parametrize(
    "decl",
    [prefill_declaration(1), prefill_declaration(2), prefill_declaration(4), decode_declaration()],
    ids=["prefill-L1", "prefill-L2", "prefill-L4", "decode"],
)
def test_compiled_table_agrees_with_transitions(decl: Declaration) -> None:
    table = decl.compile()
    for state in decl.states:
        for event in decl.events:
            expected = _reference_outcome(decl, state, event)
            assert table.get((state, event)) == expected, (state, event)


def test_final_states_never_move_and_failed_is_reachable_from_every_live_state() -> None:
    for decl in (prefill_declaration(3), decode_declaration()):
        table = decl.compile()
        for (state, _), dest in table.items():
            if state in decl.finals:
                assert dest == state
        for state in decl.states:
            if state not in decl.finals:
                assert table[(state, "fail")] == "FAILED"


def test_states_only_move_forward() -> None:
    """Progress is (chunk, state): the one edge back in the state list, CHUNK_SENT ->
    LAYER_0_SENT, is the next chunk's first layer (the record's chunk count goes up with it).
    On D progress is (epoch, state): only ``retry`` goes back, to a new claim epoch."""
    for decl in (prefill_declaration(5), decode_declaration()):
        order = {s: i for i, s in enumerate(decl.states)}
        back = []
        for (state, event), dest in decl.compile().items():
            if order[dest] < order[state]:
                back.append((state, event, dest))
        want = ([("CHUNK_SENT", "layer_sent", "LAYER_0_SENT")] if decl.name == "prefill" else
                [("RECEIVING", "retry", "PREFILL_REQUESTED"),
                 ("FENCING", "retry", "PREFILL_REQUESTED")])
        assert sorted(back) == sorted(want)


def test_declaration_rejects_contradictions() -> None:
    with pytest.raises(ValueError, match="two rows"):
        Declaration("x", ("A", "B"), "A", frozenset({"B"}),
                    (Transition("e", ("A",), "B"), Transition("e", ("A",), STAY)))
    with pytest.raises(ValueError, match="final states may only STAY"):
        Declaration("x", ("A", "B"), "A", frozenset({"B"}), (Transition("e", ("B",), "A"),))
    with pytest.raises(ValueError, match="unknown destination"):
        Declaration("x", ("A",), "A", frozenset(), (Transition("e", ("A",), "Z"),))
