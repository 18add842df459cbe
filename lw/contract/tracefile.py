"""The trace file ``lw validate`` reads: every worker's lifecycle timeline of a run, JSON lines.

Format ``lw-trace`` version 1, one JSON object per line:

* line 1, the header: ``{"format": "lw-trace", "version": 1, "source": TEXT, "shape": {...},
  "prefill": {PrefillConfig fields}, "decode": {DecodeConfig fields}}``; ``shape`` holds
  ``layers``, ``prefill_tp``, ``decode_tp``, ``blocks_per_request``, ``chunks``, ``mla``,
  ``kv_heads`` (and ``transfer_timeout_s``); ``faults`` (optional) lists the fault kinds the run
  may contain, of ``drop``, ``dup``, ``write``, ``crash``, ``abort``, ``corrupt``, ``suspect``
  (default: all); ``requests`` (optional) gives requests a shape of their own, see below.
* one line per worker that answered: ``{"worker": N, "engine": TEXT, "role": "prefill" |
  "decode", "rank": INT, "incarnation": INT, "truncated": BOOL}`` (N numbers them from 0).
* one line per timeline entry, oldest first per worker: ``{"w": N, "t": FLOAT, "req": TEXT |
  [TEXT, ...], "event": TEXT, "src": TEXT, "dst": TEXT, "detail": TEXT}``.

A worker that did not answer (dead, frozen) has no line: its events are unobserved.

A key the reader does not know (in the header, ``shape``, a per-request shape, or ``prefill`` /
``decode`` when the reader is given their declarations) is refused: a typo must not pass as a
default silently. So a writer that adds a field raises the version (a reader names the version
it reads); ``chunk_blocks`` below, added before this rule, kept version 1.

Per-request shapes: runs whose requests differ in size (a vLLM run's prompts) give each its own
in the header, ``"requests": {REQ: {"blocks": INT, "chunks": INT, "prefix_hit": INT,
"chunk_blocks": [INT, ...]}, ...}``, which replaces ``blocks_per_request`` and ``chunks`` for
that request (a request without an entry has the run's). ``blocks``: the request's blocks on D
(>= 1); ``prefix_hit`` (default 0): how many of its first blocks D already held, never written
by P; ``chunks``: the pushes P's core was told of (its first ``add_request`` and each
``add_chunk``); ``chunk_blocks`` (optional): the blocks each of those completes, in order; they
sum to ``blocks - prefix_hit`` and only the first may be 0 (default: the checker's split, see
lw.sim.config.WorldConfig.chunk_sizes).

A request P computed ahead of D's params (``lw proxy --start-mode compute-ahead``) is recorded
on P under the id P admitted it with until its bind, then under D's id: P's ``renamed`` entry
(``req``: the first id, ``detail``: D's) joins the two (:func:`joined`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

FORMAT = "lw-trace"
VERSION = 1
FAULT_KINDS = ("drop", "dup", "write", "crash", "abort", "corrupt", "suspect")
SHAPE_FIELDS: dict[str, type] = {"layers": int, "prefill_tp": int, "decode_tp": int,
                                 "blocks_per_request": int, "chunks": int, "mla": bool,
                                 "kv_heads": int}
# the least value of each count of the shape (kv_heads 0: the world's default for the TP sizes)
SHAPE_LOW = {"layers": 1, "prefill_tp": 1, "decode_tp": 1, "blocks_per_request": 1,
             "chunks": 1, "kv_heads": 0}
HEADER_KEYS = frozenset({"format", "version", "source", "shape", "prefill", "decode", "faults",
                         "requests"})
REQUEST_KEYS = frozenset({"blocks", "chunks", "prefix_hit", "chunk_blocks"})
# A header section's declaration (a dataclass: PrefillConfig, DecodeConfig) and the fields the
# reader needs there; the others may be absent (older runs) and take their defaults.
SettingsSpec = tuple[type, tuple[str, ...]]


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


def renames(workers: list[WorkerTrace]) -> dict[str, str]:
    """Requests computed ahead: the id P admitted each under -> D's id it was bound to."""
    return {e.reqs[0]: e.detail for w in workers if w.role == "prefill" for e in w.entries
            if e.event == "renamed" and e.reqs and e.detail}


def joined(workers: list[WorkerTrace]) -> list[WorkerTrace]:
    """``workers`` with each request computed ahead under D's id alone: P's entries under the id
    it was admitted with read as D's id, the ``renamed`` entries left out (the request is one
    lifecycle; the checked world names it once). Workers without a rename come back as they are."""
    names = renames(workers)
    if not names:
        return workers
    out: list[WorkerTrace] = []
    for w in workers:
        if w.role != "prefill":
            out.append(w)
            continue
        entries = [dataclasses.replace(e, reqs=tuple(names.get(r, r) for r in e.reqs))
                   if any(r in names for r in e.reqs) else e
                   for e in w.entries if e.event != "renamed"]
        out.append(dataclasses.replace(w, entries=entries))
    return out


@dataclass(frozen=True)
class RequestShape:
    """One request's own shape (header field ``requests``): its blocks on D, how many of them D
    held already, and the chunks P's core was told of (their blocks, or () for the default)."""

    blocks: int
    chunks: int = 1
    prefix_hit: int = 0
    chunk_blocks: tuple[int, ...] = ()

    def as_json(self) -> dict[str, Any]:
        """The header entry of this shape (defaults left out)."""
        out: dict[str, Any] = {"blocks": self.blocks, "chunks": self.chunks}
        if self.prefix_hit:
            out["prefix_hit"] = self.prefix_hit
        if self.chunk_blocks:
            out["chunk_blocks"] = list(self.chunk_blocks)
        return out


@dataclass
class Trace:
    """A whole run: its shape, the core's settings and every answering worker's timeline."""

    source: str
    shape: dict[str, Any]
    prefill: dict[str, Any]
    decode: dict[str, Any]
    workers: list[WorkerTrace]
    faults: tuple[str, ...] = FAULT_KINDS
    requests: dict[str, RequestShape] = field(default_factory=dict)  # shapes of their own

    def request_shape(self, rid: str) -> RequestShape:
        """The shape of request ``rid``: its own, else the run's."""
        own = self.requests.get(rid)
        if own is not None:
            return own
        return RequestShape(int(self.shape["blocks_per_request"]), int(self.shape["chunks"]))


def dump(path: str, source: str, shape: dict[str, Any], prefill: dict[str, Any],
         decode: dict[str, Any], workers: list[WorkerTrace],
         faults: tuple[str, ...] = FAULT_KINDS,
         requests: dict[str, RequestShape] | None = None) -> None:
    """Write ``workers``' timelines as an ``lw-trace`` file (``requests``: per-request shapes)."""
    head: dict[str, Any] = {"format": FORMAT, "version": VERSION, "source": source,
                            "shape": shape, "prefill": prefill, "decode": decode,
                            "faults": list(faults)}
    if requests:
        head["requests"] = {rid: rs.as_json() for rid, rs in requests.items()}
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(head) + "\n")
        for n, w in enumerate(workers):
            f.write(json.dumps({"worker": n, "engine": w.engine, "role": w.role, "rank": w.rank,
                                "incarnation": w.incarnation, "truncated": w.truncated}) + "\n")
        for n, w in enumerate(workers):
            for e in w.entries:
                req: Any = e.reqs[0] if len(e.reqs) == 1 else list(e.reqs)
                f.write(json.dumps({"w": n, "t": e.t, "req": req, "event": e.event,
                                    "src": e.src, "dst": e.dst, "detail": e.detail}) + "\n")


def from_snapshot(snap: Any) -> list[WorkerTrace]:
    """Every answering worker of an ``lw status`` snapshot (lw.ops.client.query with a
    timeline) with its timeline, as the trace's worker lines and entries."""
    workers = []
    for r in snap.replies:
        w = WorkerTrace(r.worker.engine_id, r.role, r.worker.rank, r.worker.incarnation,
                        r.truncated)
        w.entries = [Entry(e.t, tuple(e.req_ids), e.event, e.src, e.dst, e.detail, 0)
                     for e in r.timeline]
        workers.append(w)
    return workers


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


def _unknown(obj: dict[str, Any], known: frozenset[str] | set[str], where: str) -> None:
    """Refuse keys outside ``known`` (a typo would otherwise read as the default)."""
    extra = sorted(str(k) for k in obj.keys() - known)
    if extra:
        raise TraceFormatError(f"{where}: unknown field(s) {', '.join(map(repr, extra))}; known: "
                               f"{', '.join(sorted(known))}")


def _number(obj: dict[str, Any], name: str, where: str) -> float:
    """A finite number field (JSON lets NaN and Infinity through)."""
    v = float(_field(obj, name, (int, float), where))
    if not math.isfinite(v):
        raise TraceFormatError(f"{where}: field {name!r} must be a finite number, got {v}")
    return v


def _settings(section: dict[str, Any], spec: SettingsSpec, where: str) -> None:
    """Check a ``prefill`` / ``decode`` section against its declaration: known fields of the
    declared types, the needed ones present, and the values the declaration accepts."""
    kind, needed = spec
    hints = typing.get_type_hints(kind)
    _unknown(section, {f.name for f in dataclasses.fields(kind)}, where)
    for name in needed:
        _field(section, name, object, where)
    for name in section:
        want = hints[name]
        if want is float:
            _number(section, name, where)
        elif want in (int, bool, str):
            _field(section, name, want, where)
    try:
        kind(**section)  # its own checks: ranges, and fields that bound each other
    except (TypeError, ValueError) as exc:
        raise TraceFormatError(f"{where}: {exc}") from exc


def _count(obj: dict[str, Any], name: str, where: str, low: int, default: int | None = None
           ) -> int:
    """An integer field >= ``low`` (``default`` when absent, if given)."""
    if default is not None and name not in obj:
        return default
    v = _field(obj, name, int, where)
    if v < low:
        raise TraceFormatError(f"{where}: field {name!r} must be >= {low}, got {v}")
    return int(v)


def _request_shapes(head: dict[str, Any], where: str) -> dict[str, RequestShape]:
    """The header's per-request shapes (field ``requests``), each checked as the world needs."""
    raw = head.get("requests", {})
    if not isinstance(raw, dict):
        raise TraceFormatError(f"{where}: field 'requests' must be an object of request id -> "
                               f"shape, got {type(raw).__name__}")
    out: dict[str, RequestShape] = {}
    for rid, obj in raw.items():
        at = f"{where}: requests[{rid!r}]"
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{at}: expected an object with 'blocks' and 'chunks', got "
                                   f"{obj!r}")
        _unknown(obj, REQUEST_KEYS, at)
        blocks = _count(obj, "blocks", at, 1)
        chunks = _count(obj, "chunks", at, 1)
        hit = _count(obj, "prefix_hit", at, 0, default=0)
        if hit > blocks:
            raise TraceFormatError(f"{at}: field 'prefix_hit' is {hit}, more than its "
                                   f"{blocks} blocks")
        sent = blocks - hit
        sizes: tuple[int, ...] = ()
        if "chunk_blocks" in obj:
            cb = obj["chunk_blocks"]
            if (not isinstance(cb, list) or not all(isinstance(b, int) and not isinstance(b, bool)
                                                    and b >= 0 for b in cb)):
                raise TraceFormatError(f"{at}: field 'chunk_blocks' must be a list of integers "
                                       f">= 0, got {cb!r}")
            if len(cb) != chunks:
                raise TraceFormatError(f"{at}: field 'chunk_blocks' has {len(cb)} entries for "
                                       f"{chunks} chunks")
            if sum(cb) != sent:
                raise TraceFormatError(f"{at}: field 'chunk_blocks' sums to {sum(cb)}, not the "
                                       f"{sent} blocks P writes (blocks - prefix_hit)")
            if sent and 0 in cb[1:]:
                raise TraceFormatError(f"{at}: field 'chunk_blocks' has an empty chunk after the"
                                       f" first ({cb!r}): the core announces none")
            sizes = tuple(cb)
        elif 0 < sent < chunks - 1:
            raise TraceFormatError(f"{at}: {sent} block(s) to write in {chunks} chunks: only the"
                                   " first may complete none (give 'chunk_blocks' or fewer "
                                   "chunks)")
        out[str(rid)] = RequestShape(blocks, chunks, hit, sizes)
    return out


def load(path: str, settings: Mapping[str, SettingsSpec] | None = None) -> Trace:
    """Read an ``lw-trace`` file; TraceFormatError (file, line, field) when it is malformed.
    ``settings``: the declarations the ``prefill`` and ``decode`` sections are checked against."""
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
    if not objs:  # blank lines only
        raise TraceFormatError(f"{path}:1: no {FORMAT} header (the file holds blank lines only)")
    line, head = objs[0]
    where = f"{path}:{line}"
    if head.get("format") != FORMAT:
        raise TraceFormatError(f"{where}: field 'format' must be {FORMAT!r}, got "
                               f"{head.get('format')!r}")
    version = _field(head, "version", int, where)
    if version != VERSION:
        raise TraceFormatError(f"{where}: field 'version' is {version}; this lw reads version "
                               f"{VERSION}")
    _unknown(head, HEADER_KEYS, where)
    shape = _field(head, "shape", dict, where)
    _unknown(shape, {*SHAPE_FIELDS, "transfer_timeout_s"}, f"{where}: shape")
    for name, kind in SHAPE_FIELDS.items():
        _field(shape, name, kind, f"{where}: shape")
        if name in SHAPE_LOW and shape[name] < SHAPE_LOW[name]:
            raise TraceFormatError(f"{where}: shape: field {name!r} must be >= {SHAPE_LOW[name]}"
                                   f", got {shape[name]}")
    if "transfer_timeout_s" in shape and not _number(shape, "transfer_timeout_s",
                                                     f"{where}: shape") > 0:
        raise TraceFormatError(f"{where}: shape: field 'transfer_timeout_s' must be > 0, got "
                               f"{shape['transfer_timeout_s']}")
    for name, spec in (settings or {}).items():
        _settings(_field(head, name, dict, where), spec, f"{where}: {name}")
    faults = head.get("faults", list(FAULT_KINDS))
    if not isinstance(faults, list) or not set(faults) <= set(FAULT_KINDS):
        raise TraceFormatError(f"{where}: field 'faults' must be a list of {', '.join(FAULT_KINDS)}"
                               f", got {faults!r}")
    trace = Trace(str(head.get("source", "")), shape, _field(head, "prefill", dict, where),
                  _field(head, "decode", dict, where), [], tuple(faults),
                  _request_shapes(head, where))
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
            rank, inc = _count(obj, "rank", where, 0), _count(obj, "incarnation", where, 0)
            trace.workers.append(WorkerTrace(_field(obj, "engine", str, where), role, rank, inc,
                                             bool(obj.get("truncated", False))))
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
            _number(obj, "t", where), reqs, _field(obj, "event", str, where),
            _field(obj, "src", str, where), _field(obj, "dst", str, where),
            detail if isinstance(detail, str) else str(detail), line))
    return trace
