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
from collections.abc import Callable, Mapping
from typing import Any

OMIT, KEYS, UNORDERED = "omit", "keys", "unordered"
# class -> field -> (how, why)
Rules = Mapping[type, Mapping[str, tuple[str, str]]]

# What both endpoints leave out for the same reasons (each adds its own rules to these).
ENDPOINT_RULES: Mapping[str, tuple[str, str]] = {
    "me": (OMIT, "fixed when made (identity)"),
    "config": (OMIT, "fixed when made"),
    "declaration": (OMIT, "fixed when made (the lifecycle table)"),
    "_table": (OMIT, "fixed when made (compiled from the declaration)"),
    "_finished": (UNORDERED, "its order only decides which entry is forgotten past "
                             "finished_memory (4096) finished requests"),
    "timeline": (OMIT, "observability (lw status, traces)"),
    "_ring": (OMIT, "observability (the timeline's ring, appended inline)"),
    "_durations": (OMIT, "observability (time-in-state samples)"),
    "counters": (OMIT, "observability (statistics)"),
}
RECORD_RULES: Mapping[str, tuple[str, str]] = {
    "reason": (OMIT, "free text: copied into reports and messages, never decided on"),
    "since": (OMIT, "observability (time in state)"),
    "deadline": (OMIT, "the deadline and lease timers are armed by effects; P's writes carry "
                       "it as not_after, which the checker's world need not read: its writes "
                       "resolve within the transfer timeout of their submission"),
    "alarmed": (OMIT, "observability (stuck-request alarm)"),
}

_ATOMS = frozenset({type(None), bool, int, float, str, bytes})
_SEQ = frozenset({list, tuple, deque})
_SETS = frozenset({set, frozenset})
_PLANS: dict[tuple, Callable[[Any], tuple]] = {}
_SLOTS: dict[type, tuple[str, ...]] = {}
_KIND: dict[type, str] = {}
_FROZEN_CANON: dict[int, tuple[Any, tuple]] = {}  # id -> (object kept alive, its canonical form)


def fields_of(obj: Any) -> tuple[str, ...]:
    """Instance field names of ``obj``: its ``__slots__`` (whole MRO) and its ``__dict__``."""
    cls = type(obj)
    slots = _SLOTS.get(cls)
    if slots is None:
        names: list[str] = []
        for klass in cls.__mro__:
            s = klass.__dict__.get("__slots__", ())
            names += [s] if isinstance(s, str) else list(s)
        slots = tuple(n for n in names if n not in ("__dict__", "__weakref__"))
        _SLOTS[cls] = slots
    d = getattr(obj, "__dict__", None)
    return slots + tuple(d) if d else slots


def derive(obj: Any, rules: Rules) -> tuple:
    """The canonical, hashable snapshot of ``obj`` under ``rules`` (see the module doc)."""
    d = getattr(obj, "__dict__", None)
    key = (id(rules), type(obj), tuple(d)) if d is not None else (id(rules), type(obj))
    fn = _PLANS.get(key)
    if fn is None:
        fn = _PLANS[key] = _compile(type(obj), fields_of(obj), rules)
    return fn(obj)


def _compile(cls: type, names: tuple[str, ...], rules: Rules) -> Callable[[Any], tuple]:
    """A function computing the snapshot of a ``cls`` with these fields (made once per shape:
    atoms are taken as they are without a call, the rest goes through ``_canon``)."""
    mine = rules.get(cls, {})
    parts = []
    for n in names:
        how = mine[n][0] if n in mine else ""
        if how == OMIT:
            continue
        if not n.isidentifier():
            raise ValueError(f"snapshot: field name {n!r} of {cls.__name__}")
        if how == KEYS:
            parts.append(f"_sorted(tuple(o.{n}))")
        elif how == UNORDERED:
            parts.append(f"_sorted(tuple((k, _canon(x, R)) for k, x in o.{n}.items()))")
        else:
            parts.append(f"(x if (x := o.{n}).__class__ in _ATOMS else _canon(x, R))")
    src = "def snap(o):\n    return (" + "".join(p + ", " for p in parts) + ")\n"
    env: dict[str, Any] = {"_sorted": _sorted, "_canon": _canon, "_ATOMS": _ATOMS, "R": rules}
    exec(compile(src, f"<snapshot of {cls.__name__}>", "exec"), env)  # noqa: S102
    return env["snap"]


def _sorted(items: tuple) -> tuple:
    try:
        return tuple(sorted(items))
    except TypeError:  # mixed types: any fixed order will do
        return tuple(sorted(items, key=repr))


def _kind(v: Any) -> str:
    """How values of ``type(v)`` are made canonical (decided once per type)."""
    t = type(v)
    if t in _SEQ:
        k = "seq"
    elif t is dict:
        k = "dict"
    elif t is OrderedDict:
        k = "odict"
    elif t in _SETS:
        k = "set"
    elif _frozen(t):
        try:
            hash(v)
            k = "atom"
        except TypeError:  # e.g. a frozen struct with a list field
            k = "frozen"
    elif dataclasses.is_dataclass(v) or hasattr(v, "__dict__") or hasattr(t, "__slots__"):
        k = "obj"
    else:
        raise TypeError(f"snapshot: no canonical form for a {t.__name__}")
    _KIND[t] = k
    return k


def _frozen(t: type) -> bool:
    params = getattr(t, "__dataclass_params__", None)
    struct = getattr(t, "__struct_config__", None)
    return bool((params is not None and params.frozen) or (struct is not None and struct.frozen))


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
    k = _KIND.get(t) or _kind(v)
    if k == "seq":
        return tuple([x if x.__class__ in _ATOMS else _canon(x, rules) for x in v])
    if k == "obj":
        return derive(v, rules)
    if k == "dict":
        return _sorted(tuple([(a, x if x.__class__ in _ATOMS else _canon(x, rules))
                              for a, x in v.items()]))
    if k == "set":
        return _sorted(tuple(v))
    if k == "atom":
        return v
    if k == "odict":
        return tuple([(a, _canon(x, rules)) for a, x in v.items()])
    return _frozen_canon(v, rules)
