"""Endpoint snapshots derived from the endpoints' fields (the model checker hashes states by them).

A snapshot holds every instance field of an endpoint and, recursively, of the records it keeps
(per-request records, targets), made canonical: lists and tuples in order, sets and plain dicts
sorted, immutable values (frozen dataclasses and structs, numbers, strings) as they are. The only
fields treated otherwise are the ones a :data:`Rules` table names, each with its reason:

* ``OMIT``: fixed when the endpoint is made (config, declaration, identity), a cache of a pure
  function of other fields, free text, or observability that no decision reads;
* ``KEYS``: a dict of which only the keys matter (e.g. tombstone expiry times no decision reads);
* ``UNORDERED``: an ordered dict whose order no decision within the checked bounds reads.

So a field added later is in the snapshot unless someone names it in the table on purpose (a
broken snapshot made the explorer visit fewer states and still print "all properties hold").
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque
from collections.abc import Mapping
from typing import Any

OMIT, KEYS, UNORDERED = "omit", "keys", "unordered"
# class -> field -> (how, why)
Rules = Mapping[type, Mapping[str, tuple[str, str]]]

_ATOMS = frozenset({type(None), bool, int, float, str, bytes})
_SEQ = frozenset({list, tuple, deque})
_SETS = frozenset({set, frozenset})
_PLANS: dict[tuple[int, type, tuple[str, ...]], tuple[tuple[str, str], ...]] = {}
_FROZEN: dict[type, bool] = {}
_HASHABLE: dict[type, bool] = {}
_FROZEN_CANON: dict[int, tuple[Any, tuple]] = {}  # id -> (object kept alive, its canonical form)


def fields_of(obj: Any) -> tuple[str, ...]:
    """Instance field names of ``obj``: its ``__slots__`` (whole MRO) or its ``__dict__``."""
    names: list[str] = []
    for klass in type(obj).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else list(slots)
    names = [n for n in names if n not in ("__dict__", "__weakref__")]
    if hasattr(obj, "__dict__"):
        names += list(vars(obj))
    return tuple(names)


def derive(obj: Any, rules: Rules) -> tuple:
    """The canonical, hashable snapshot of ``obj`` under ``rules`` (see the module doc)."""
    cls = type(obj)
    names = fields_of(obj)
    key = (id(rules), cls, names)
    plan = _PLANS.get(key)
    if plan is None:
        mine = rules.get(cls, {})
        plan = tuple((n, mine[n][0] if n in mine else "") for n in names
                     if mine.get(n, ("",))[0] != OMIT)
        _PLANS[key] = plan
    out = []
    for name, how in plan:
        v = getattr(obj, name)
        if how == KEYS:
            out.append(_sorted(tuple(v)))
        elif how == UNORDERED:
            out.append(_sorted(tuple((k, _canon(x, rules)) for k, x in v.items())))
        else:
            out.append(_canon(v, rules))
    return tuple(out)


def _sorted(items: tuple) -> tuple:
    try:
        return tuple(sorted(items))
    except TypeError:  # mixed types: any fixed order will do
        return tuple(sorted(items, key=repr))


def _frozen(t: type) -> bool:
    f = _FROZEN.get(t)
    if f is None:
        params = getattr(t, "__dataclass_params__", None)
        struct = getattr(t, "__struct_config__", None)
        f = bool((params is not None and params.frozen) or (struct is not None and struct.frozen))
        _FROZEN[t] = f
    return f


def _hashable(v: Any) -> bool:
    t = type(v)
    h = _HASHABLE.get(t)
    if h is None:
        try:
            hash(v)
            h = True
        except TypeError:  # e.g. a frozen struct with a list field
            h = False
        _HASHABLE[t] = h
    return h


def _frozen_canon(v: Any, rules: Rules) -> tuple:
    """An immutable value that does not hash (a list inside): its fields, computed once."""
    hit = _FROZEN_CANON.get(id(v))
    if hit is not None and hit[0] is v:
        return hit[1]
    names = getattr(type(v), "__struct_fields__", None) or fields_of(v)
    out = (type(v).__name__, *(_canon(getattr(v, n), rules) for n in names))
    if len(_FROZEN_CANON) > 65536:
        _FROZEN_CANON.clear()
    _FROZEN_CANON[id(v)] = (v, out)
    return out


def _canon(v: Any, rules: Rules) -> Any:
    t = type(v)
    if t in _ATOMS:
        return v
    if t in _SEQ:
        return tuple([_canon(x, rules) for x in v])
    if t is dict:
        return _sorted(tuple((k, _canon(x, rules)) for k, x in v.items()))
    if t is OrderedDict:
        return tuple((k, _canon(x, rules)) for k, x in v.items())
    if t in _SETS:
        return _sorted(tuple(v))
    if _frozen(t):
        return v if _hashable(v) else _frozen_canon(v, rules)
    if dataclasses.is_dataclass(v) or hasattr(v, "__dict__") or hasattr(t, "__slots__"):
        return derive(v, rules)
    raise TypeError(f"snapshot: no canonical form for a {t.__name__}")
