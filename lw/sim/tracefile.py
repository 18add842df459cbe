"""The trace file ``lw validate`` reads: every worker's lifecycle timeline of a run, JSON lines.

Format ``lw-trace`` version 1, one JSON object per line:

* line 1, the header: ``{"format": "lw-trace", "version": 1, "source": TEXT, "shape": {...},
  "prefill": {PrefillConfig fields}, "decode": {DecodeConfig fields}}``; ``shape`` holds
  ``layers``, ``prefill_tp``, ``decode_tp``, ``blocks_per_request``, ``chunks``, ``mla``,
  ``kv_heads`` (and ``transfer_timeout_s``); ``faults`` (optional) lists the fault kinds the run
  may contain, of ``drop``, ``dup``, ``write``, ``crash``, ``abort``, ``corrupt``, ``suspect``
  (default: all).
* one line per worker that answered: ``{"worker": N, "engine": TEXT, "role": "prefill" |
  "decode", "rank": INT, "incarnation": INT, "truncated": BOOL}`` (N numbers them from 0).
* one line per timeline entry, oldest first per worker: ``{"w": N, "t": FLOAT, "req": TEXT |
  [TEXT, ...], "event": TEXT, "src": TEXT, "dst": TEXT, "detail": TEXT}``.

A worker that did not answer (dead, frozen) has no line: its events are unobserved.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

FORMAT = "lw-trace"
VERSION = 1
FAULT_KINDS = ("drop", "dup", "write", "crash", "abort", "corrupt", "suspect")
SHAPE_FIELDS: dict[str, type] = {"layers": int, "prefill_tp": int, "decode_tp": int,
                                 "blocks_per_request": int, "chunks": int, "mla": bool,
                                 "kv_heads": int}


class TraceFormatError(ValueError):
    """Malformed trace input; the message names the file, the line and the field."""


@dataclass(frozen=True)
class Entry:
    """One recorded lifecycle event of one worker (``reqs``: one id, or a batch's ids)."""

    t: float
    reqs: tuple[str, ...]
    event: str
    src: str
    dst: str
    detail: str
    line: int  # where it stands in the file (for reports)


@dataclass
class WorkerTrace:
    """One worker's identity and its timeline (oldest first)."""

    engine: str
    role: str  # "prefill" or "decode"
    rank: int
    incarnation: int
    truncated: bool = False
    entries: list[Entry] = field(default_factory=list)

    @property
    def name(self) -> str:
        """Readable name: engine, TP rank and incarnation."""
        return f"{self.engine}/{self.rank}#{self.incarnation}"


@dataclass
class Trace:
    """A whole run: its shape, the core's settings and every answering worker's timeline."""

    source: str
    shape: dict[str, Any]
    prefill: dict[str, Any]
    decode: dict[str, Any]
    workers: list[WorkerTrace]
    faults: tuple[str, ...] = FAULT_KINDS


def dump(path: str, source: str, shape: dict[str, Any], prefill: dict[str, Any],
         decode: dict[str, Any], workers: list[WorkerTrace],
         faults: tuple[str, ...] = FAULT_KINDS) -> None:
    """Write ``workers``' timelines as an ``lw-trace`` file."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"format": FORMAT, "version": VERSION, "source": source,
                            "shape": shape, "prefill": prefill, "decode": decode,
                            "faults": list(faults)}) + "\n")
        for n, w in enumerate(workers):
            f.write(json.dumps({"worker": n, "engine": w.engine, "role": w.role, "rank": w.rank,
                                "incarnation": w.incarnation, "truncated": w.truncated}) + "\n")
        for n, w in enumerate(workers):
            for e in w.entries:
                req: Any = e.reqs[0] if len(e.reqs) == 1 else list(e.reqs)
                f.write(json.dumps({"w": n, "t": e.t, "req": req, "event": e.event,
                                    "src": e.src, "dst": e.dst, "detail": e.detail}) + "\n")


def _field(obj: dict[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    if name not in obj:
        raise TraceFormatError(f"{where}: field {name!r} missing")
    v = obj[name]
    if isinstance(v, bool) and kind in (int, float, (int, float)):
        raise TraceFormatError(f"{where}: field {name!r} must be a number, got {v!r}")
    if not isinstance(v, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise TraceFormatError(f"{where}: field {name!r} must be {names}, got {v!r}")
    return v


def load(path: str) -> Trace:
    """Read an ``lw-trace`` file; TraceFormatError (file, line, field) when it is malformed."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"{path}: cannot read: {exc}") from exc
    if not lines:
        raise TraceFormatError(f"{path}:1: empty file (expected an {FORMAT} header)")
    objs: list[tuple[int, dict[str, Any]]] = []
    for i, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{path}:{i}: not JSON ({exc.msg} at column {exc.colno})"
                                   ) from exc
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{path}:{i}: expected a JSON object, got {type(obj).__name__}")
        objs.append((i, obj))
    line, head = objs[0]
    where = f"{path}:{line}"
    if head.get("format") != FORMAT:
        raise TraceFormatError(f"{where}: field 'format' must be {FORMAT!r}, got "
                               f"{head.get('format')!r}")
    version = _field(head, "version", int, where)
    if version != VERSION:
        raise TraceFormatError(f"{where}: field 'version' is {version}; this lw reads version "
                               f"{VERSION}")
    shape = _field(head, "shape", dict, where)
    for name, kind in SHAPE_FIELDS.items():
        _field(shape, name, kind, f"{where}: shape")
    faults = head.get("faults", list(FAULT_KINDS))
    if not isinstance(faults, list) or not set(faults) <= set(FAULT_KINDS):
        raise TraceFormatError(f"{where}: field 'faults' must be a list of {', '.join(FAULT_KINDS)}"
                               f", got {faults!r}")
    trace = Trace(str(head.get("source", "")), shape, _field(head, "prefill", dict, where),
                  _field(head, "decode", dict, where), [], tuple(faults))
    for line, obj in objs[1:]:
        where = f"{path}:{line}"
        if "worker" in obj:
            n = _field(obj, "worker", int, where)
            if n != len(trace.workers):
                raise TraceFormatError(f"{where}: field 'worker' is {n}, expected "
                                       f"{len(trace.workers)} (workers are numbered in order)")
            role = _field(obj, "role", str, where)
            if role not in ("prefill", "decode"):
                raise TraceFormatError(f"{where}: field 'role' must be prefill or decode, got "
                                       f"{role!r}")
            trace.workers.append(WorkerTrace(
                _field(obj, "engine", str, where), role, _field(obj, "rank", int, where),
                _field(obj, "incarnation", int, where), bool(obj.get("truncated", False))))
            continue
        n = _field(obj, "w", int, where)
        if not 0 <= n < len(trace.workers):
            raise TraceFormatError(f"{where}: field 'w' is {n}: no such worker line before it")
        req = _field(obj, "req", (str, list), where)
        reqs = (req,) if isinstance(req, str) else tuple(req)
        if not reqs or not all(isinstance(r, str) for r in reqs):
            raise TraceFormatError(f"{where}: field 'req' must be a request id or a non-empty "
                                   f"list of them, got {req!r}")
        detail = obj.get("detail", "")
        trace.workers[n].entries.append(Entry(
            float(_field(obj, "t", (int, float), where)), reqs, _field(obj, "event", str, where),
            _field(obj, "src", str, where), _field(obj, "dst", str, where),
            detail if isinstance(detail, str) else str(detail), line))
    return trace
