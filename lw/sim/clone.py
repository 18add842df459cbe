"""Fast copies of worlds: pickle with every immutable part kept by reference.

A :class:`Store` belongs to one family of worlds (an initial world and every copy of it). It
holds what never changes once made — configs, declarations, dispatch tables, senders, layouts,
interned requests and messages — and a pickled world refers to them by index. Measured on this
machine (docs/benchmarks.md): a clone costs a fraction of ``copy.deepcopy``'s time.

Two more savings, both for state no decision reads: an endpoint's lifecycle ``Timeline``
(observability: ``lw status``, traces) is not carried into copies (a copy gets an empty one
that records nothing, shared), and the per-request records with ``__slots__`` are pickled as a plain
tuple of their slot values instead of going through ``copyreg``'s generic slot state.
"""

from __future__ import annotations

import io
import itertools
import pickle
import weakref
from collections.abc import Callable
from typing import Any

from lw.fsm.decode_ghosts import Ghosts
from lw.fsm.decode_request import DECODE_RECORDS
from lw.fsm.prefill_request import PREFILL_RECORDS
from lw.fsm.timeline import Timeline

SLOT_RECORDS: tuple[type, ...] = (*PREFILL_RECORDS, *DECODE_RECORDS, Ghosts)

_STORES: weakref.WeakValueDictionary[int, Store] = weakref.WeakValueDictionary()
_TOKENS = itertools.count(1)


class Store:
    """Immutable objects shared by a family of worlds, addressed by index in pickles."""

    def __init__(self) -> None:
        self.token = next(_TOKENS)
        self.objs: list[Any] = []
        self.index: dict[int, int] = {}
        self.values: dict[Any, Any] = {}  # value -> canonical instance (interning)
        self.msgs: dict[tuple, Any] = {}  # network message key -> representative message
        _STORES[self.token] = self

    def ref(self, obj: Any) -> int:
        """Index of ``obj`` in the store (added on first use; kept alive by the store)."""
        i = self.index.get(id(obj))
        if i is None:
            i = len(self.objs)
            self.objs.append(obj)
            self.index[id(obj)] = i
        return i

    def intern(self, obj: Any) -> Any:
        """The canonical instance equal to ``obj`` (hashable immutables only)."""
        return self.values.setdefault(obj, obj)


def _lookup(token: int, i: int) -> Any:
    return _STORES[token].objs[i]


def _rebuild(cls: type, token: int, shared: int, state: dict[str, Any]) -> Any:
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    obj.__dict__.update(_STORES[token].objs[shared])
    return obj


def _store_of(token: int) -> Store:
    return _STORES[token]


_NO_TIMELINE = Timeline(0)  # records nothing, so one instance can stand in everywhere


def _no_timeline() -> Timeline:
    return _NO_TIMELINE


def _slots_rebuild(cls: type, values: tuple) -> Any:
    obj = cls.__new__(cls)
    for name, v in zip(cls.__slots__, values, strict=True):  # type: ignore[attr-defined]
        object.__setattr__(obj, name, v)
    return obj


def _slots_reducer(cls: type) -> Callable[[Any], Any]:
    names = tuple(cls.__slots__)  # type: ignore[attr-defined]

    def reduce(obj: Any) -> Any:
        return (_slots_rebuild, (cls, tuple([getattr(obj, n) for n in names])))

    return reduce


class Cloner:
    """Serialise and copy worlds of one family; ``shared_attrs`` names the immutable fields."""

    def __init__(self, store: Store, shared_attrs: dict[type, tuple[str, ...]],
                 by_reference: tuple[type, ...]) -> None:
        self.store = store
        token = store.token
        table: dict[type, Callable[[Any], Any]] = {}
        for cls, names in shared_attrs.items():
            table[cls] = self._split_reducer(names)
        for cls in by_reference:
            table[cls] = lambda obj: (_lookup, (token, store.ref(obj)))
        table[Store] = lambda obj: (_store_of, (obj.token,))
        table[Timeline] = lambda obj: (_no_timeline, ())
        for cls in SLOT_RECORDS:
            table[cls] = _slots_reducer(cls)
        self.table = table

    def _split_reducer(self, names: tuple[str, ...]) -> Callable[[Any], Any]:
        store = self.store
        token = store.token
        cache: dict[int, int] = {}  # id(first shared attr) -> index of the shared dict

        def reduce(obj: Any) -> Any:
            d = obj.__dict__
            key = tuple(id(d[n]) for n in names)
            idx = cache.get(key)
            if idx is None:
                idx = store.ref({n: d[n] for n in names})
                cache[key] = idx
            state = {k: v for k, v in d.items() if k not in names}
            return (_rebuild, (type(obj), token, idx, state))

        return reduce

    def dumps(self, obj: Any) -> bytes:
        """Serialise (shared parts by reference)."""
        buf = io.BytesIO()
        p = pickle.Pickler(buf, pickle.HIGHEST_PROTOCOL)
        p.dispatch_table = self.table  # type: ignore[assignment]
        p.dump(obj)
        return buf.getvalue()

    def loads(self, blob: bytes) -> Any:
        """An independent object from :meth:`dumps` output."""
        return pickle.loads(blob)

    def clone(self, obj: Any) -> Any:
        """An independent copy."""
        return pickle.loads(self.dumps(obj))
