"""The snapshot an endpoint is hashed by in the model checker (``lw/fsm/snapshot.py``).

The explorer merges states with equal snapshots, so two states that differ in a field the rules
do not omit must never snapshot alike, and the snapshot must hash. These tests pin each kind of
value the module doc lists on small classes of their own (the endpoints' own fields are covered
by ``tests/sim/test_explorer.py``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import msgspec
import pytest

from lw.fsm.snapshot import KEYS, OMIT, UNORDERED, derive, fields_of


class Box:
    """A record with a plain ``__dict__``."""

    def __init__(self, **kw: object) -> None:
        self.__dict__.update(kw)


class Slotted:
    __slots__ = ("a", "__weakref__")

    def __init__(self, a: object) -> None:
        self.a = a


class SlottedChild(Slotted):
    __slots__ = "b"  # a single name given as a string

    def __init__(self, a: object, b: object) -> None:
        super().__init__(a)
        self.b = b


@dataclass(frozen=True)
class Point:
    x: int
    y: int


@dataclass(frozen=True)
class Pair2:
    x: int
    y: int


@dataclass(frozen=True)
class FrozenWithList:
    """Immutable, but does not hash (a list inside)."""

    name: str
    items: list = field(default_factory=list)


class FrozenStructWithList(msgspec.Struct, frozen=True):
    name: str
    items: list


@dataclass
class Mutable:
    n: int


NO_RULES: dict = {}


def snap(v: object, rules: dict = NO_RULES) -> tuple:
    s = derive(Box(v=v), rules)
    hash(s)  # the explorer keys states by it
    return s


def test_fields_come_from_every_slot_of_the_mro_without_dict_and_weakref() -> None:
    assert fields_of(Slotted(1)) == ("a",)
    assert fields_of(SlottedChild(1, 2)) == ("b", "a")
    assert fields_of(SlottedChild(1, 2)) == ("b", "a")  # asked again: the same
    assert derive(SlottedChild(1, 2), NO_RULES) != derive(SlottedChild(1, 3), NO_RULES)
    assert derive(SlottedChild(1, 2), NO_RULES) != derive(SlottedChild(0, 2), NO_RULES)


def test_atoms_are_kept_as_they_are() -> None:
    assert derive(Box(a=1, b="x", c=None, d=2.5, e=b"z", f=True), NO_RULES) == (
        1, "x", None, 2.5, b"z", True)


def test_sequences_are_kept_in_order_whatever_their_type() -> None:
    assert snap([1, 2]) == snap((1, 2)) == snap(deque([1, 2])) == ((1, 2),)
    assert snap([1, 2]) != snap([2, 1])
    assert snap([[1], [2]]) == (((1,), (2,)),)


def test_sets_and_plain_dicts_are_sorted() -> None:
    assert snap({3, 1, 2}) == snap(frozenset({2, 3, 1})) == ((1, 2, 3),)
    assert snap({"b": 1, "a": 2}) == snap({"a": 2, "b": 1}) == ((("a", 2), ("b", 1)),)
    assert snap({"a": [1]}) == ((("a", (1,)),),)
    assert snap({"a": 1}) != snap({"a": 2})


def test_values_of_mixed_types_still_sort_and_still_differ() -> None:
    assert snap({1, "a"}) == snap({"a", 1})
    assert snap({1, "a"}) != snap({2, "a"})
    assert snap({1, "a"}) != snap({"a"})


def test_ordered_dicts_keep_their_order_and_their_values() -> None:
    ab, ba = OrderedDict(a=1, b=2), OrderedDict(b=2, a=1)
    assert snap(ab) != snap(ba)
    assert snap(ab) == (((("a", 1), ("b", 2)),))
    assert snap(OrderedDict(a=1)) != snap(OrderedDict(a=2))
    assert snap(OrderedDict(a=[1])) != snap(OrderedDict(a=[2]))


def test_immutable_values_that_hash_are_kept_as_they_are() -> None:
    """A frozen dataclass (or struct) is its own canonical form: its type counts too."""
    assert snap(Point(1, 2)) == (Point(1, 2),)
    assert snap(Point(1, 2)) != snap(Pair2(1, 2))
    assert snap([Point(1, 2)]) == ((Point(1, 2),),)
    assert snap(Point(1, 2)) != snap(Point(1, 3))


def test_immutable_values_that_do_not_hash_are_taken_by_their_fields() -> None:
    for make in (FrozenWithList, FrozenStructWithList):
        v = make("n", [1, 2])
        assert snap(v) == snap(v) == snap(make("n", [1, 2])) == ((make.__name__, "n", (1, 2)),)
        assert snap(v) != snap(make("n", [1, 3]))
        assert snap(v) != snap(make("m", [1, 2]))


def test_a_mutable_record_is_read_again_each_time() -> None:
    """A mutable value inside a record is not cached: changing it changes the snapshot."""
    m = Mutable(1)
    holder = Box(m=m, items=[m])
    before = derive(holder, NO_RULES)
    m.n = 2
    after = derive(holder, NO_RULES)
    assert before != after
    assert after == derive(Box(m=Mutable(2), items=[Mutable(2)]), NO_RULES)


def test_rules_omit_keep_keys_or_ignore_order_of_their_fields_only() -> None:
    rules = {Box: {"o": (OMIT, "why"), "k": (KEYS, "why"), "u": (UNORDERED, "why")}}

    def s(o: object, k: dict, u: dict, v: object = 0) -> tuple:
        return derive(Box(o=o, k=k, u=u, v=v), rules)

    base = s(1, {"a": 1}, OrderedDict(a=1, b=2))
    assert base == (("a",), (("a", 1), ("b", 2)), 0)
    assert s(2, {"a": 1}, OrderedDict(a=1, b=2)) == base  # omitted
    assert s(1, {"a": 9}, OrderedDict(a=1, b=2)) == base  # only the keys of k count
    assert s(1, {"b": 1}, OrderedDict(a=1, b=2)) != base
    assert s(1, {"a": 1}, OrderedDict(b=2, a=1)) == base  # u's order does not count
    assert s(1, {"a": 1}, OrderedDict(a=1, b=3)) != base  # its values do
    assert s(1, {"a": 1}, OrderedDict(a=[1], b=2)) != s(1, {"a": 1}, OrderedDict(a=[2], b=2))
    assert s(1, {"a": 1}, OrderedDict(a=1, b=2), v=1) != base
    # The rules are per class: another class with the same field names keeps them all.
    assert derive(Slotted({"a": 1}), rules) != derive(Slotted({"a": 2}), rules)


def test_a_field_name_that_is_no_identifier_is_refused() -> None:
    odd = Box()
    odd.__dict__["not a name"] = 1
    with pytest.raises(ValueError, match="not a name"):
        derive(odd, NO_RULES)


@pytest.mark.parametrize("v", [1j, range(3), bytearray(b"x"), object()])
def test_a_value_without_a_canonical_form_is_refused(v: object) -> None:
    with pytest.raises(TypeError, match="no canonical form"):
        snap(v)
