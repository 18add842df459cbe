"""OpenTelemetry spans of each request's KV transfer, when vLLM's tracing is on.

With ``--otlp-traces-endpoint`` vLLM exports a span per request (``llm_request``) in the trace its
HTTP request carried (``traceparent``). lw adds, per worker and request, a span of the transfer
in the same trace with the same parent (the caller's span: lw's proxy forwards the client's
``traceparent`` to D and P), and beneath it the lifecycle: P's claim, each chunk written (an
event per layer), the wait for D's acknowledgement; D's wait for a sender's claim and the
receive; a failure sets the error status with its reason. vLLM 0.32 creates ``llm_request`` only
when the request has finished, in its API-server process, with a span id nothing else can know,
so lw's spans are its siblings, not its children.

Spans are built when a request ends, from the worker's timeline (lw.fsm.timeline), off the
forward path (the timeline is read once per step that ends traced requests); with tracing off
nothing here runs (the adapter holds no tracer).
"""

from __future__ import annotations

import atexit
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lw.contract.client import TRACE_HEADERS

log = logging.getLogger("lw.tracing")

__all__ = ["TRACE_HEADERS", "Phase", "LifecycleTracer", "phases_of", "trace_headers_of",
           "tracing_endpoint"]

MAX_OPEN = 65536
"""Requests whose trace context a worker keeps until they end (the oldest go first)."""


def tracing_endpoint(vllm_config: Any) -> str | None:
    """vLLM's ``--otlp-traces-endpoint`` (None: tracing off)."""
    obs = getattr(vllm_config, "observability_config", None)
    return getattr(obs, "otlp_traces_endpoint", None) or None


def trace_headers_of(request: Any) -> tuple[tuple[str, str], ...]:
    """The W3C trace-context headers vLLM kept for a request (empty: not traced)."""
    headers = getattr(request, "trace_headers", None) or {}
    return tuple((k.lower(), v) for k, v in headers.items() if k.lower() in TRACE_HEADERS)


@dataclass
class Phase:
    """One span to export: a name, start and end (monotonic s), attributes, events
    ``(name, t, attributes)`` and an error reason ("" = ok)."""

    name: str
    start: float
    end: float
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, float, dict[str, Any]]] = field(default_factory=list)
    error: str = ""


def phases_of(entries: Iterable[tuple], role: str, req_id: str, end: float, ok: bool,
              reason: str, layers: int) -> tuple[Phase, list[Phase]]:
    """The transfer span and its lifecycle spans for one request, from its timeline entries
    (``(t, req, event, src, dst, detail)``, oldest first; batch milestones included).

    ``end``: when the outcome was reported (the span's end when the timeline lost the last
    event); ``ok``/``reason``: the outcome; ``layers``: the model's (P's lifecycle states)."""
    mine = [e for e in entries if e[1] == req_id or (type(e[1]) is tuple and req_id in e[1])]
    start = mine[0][0] if mine else end
    last = max([end, *(e[0] for e in mine)]) if mine else end
    name = "lw.kv_push" if role == "prefill" else "lw.kv_receive"
    root = Phase(name, start, last, error="" if ok else reason or "failed")
    children = (_prefill_phases(mine, last, layers) if role == "prefill"
                else _decode_phases(mine, last))
    for e in mine:
        if e[2] == "fail":
            root.events.append(("failed", e[0], {"lw.reason": str(e[5]), "lw.state": e[3]}))
    return root, children


def _first(entries: list[tuple], event: str, dst: str | None = None) -> float | None:
    return next((e[0] for e in entries if e[2] == event and (dst is None or e[4] == dst)), None)


def _wait(name: str, start: float, until: float | None, end: float, missing: str) -> Phase:
    """A phase from ``start`` until ``until``; one that never ended runs to ``end`` as an error
    saying what was ``missing``."""
    return Phase(name, start, until if until is not None else end,
                 error="" if until is not None else missing)


def _prefill_phases(entries: list[tuple], end: float, layers: int) -> list[Phase]:
    """P: claim (admitted -> every target accepted), one span per chunk written, DONE ack."""
    out: list[Phase] = []
    if not entries:
        return out
    t0 = entries[0][0]
    out.append(_wait("lw.claim", t0, _first(entries, "meta_accepted", "META_READY"), end,
                     "no decoder accepted"))
    starts = [t0] + [e[0] for e in entries if e[2] == "chunk_scheduled"]
    chunk: Phase | None = None
    k = 0
    last_layer: float | None = None  # when the prompt's last layer was written (DONE sent)
    for e in entries:
        if e[2] == "layer_sent" and e[4] != e[3]:
            if chunk is None:
                chunk = Phase("lw.chunk_written", starts[min(k, len(starts) - 1)], e[0],
                              {"lw.chunk": k})
                out.append(chunk)
            chunk.events.append(("layer_written", e[0], {"lw.write": str(e[5])}))
            chunk.end = e[0]
            if e[4] == f"LAYER_{layers - 1}_SENT":
                last_layer = e[0]
        elif e[2] == "chunk_sent" and chunk is not None:
            chunk.end = e[0]
            chunk = None
            last_layer = None
            k += 1
    if last_layer is not None:
        out.append(_wait("lw.await_done_ack", last_layer, _first(entries, "ack", "DONE"), end,
                         "no acknowledgement"))
    return out


def _decode_phases(entries: list[tuple], end: float) -> list[Phase]:
    """D: waiting for a sender's claim, then receiving until every sender's DONE."""
    out: list[Phase] = []
    if not entries:
        return out
    t0 = entries[0][0]
    claimed = _first(entries, "claim", "RECEIVING")
    out.append(_wait("lw.await_claim", t0, claimed, end, "no sender claimed the request"))
    if claimed is not None:
        recv = _wait("lw.receiving", claimed, _first(entries, "all_done", "DONE"), end,
                     "not every sender finished")
        for e in entries:
            if e[2] == "sender_done":
                recv.events.append(("sender_done", e[0], {"lw.detail": str(e[5])}))
        out.append(recv)
    return out


def system_random_ids() -> Any:
    """An OpenTelemetry id generator drawing from the OS (``secrets``), not from ``random``.

    vLLM seeds ``random`` in every engine process (``--seed``, 0 by default), and the SDK's
    default generator draws span ids from it: P's and D's workers then make the same span ids in
    the same order, and a trace holds several spans with one id."""
    from opentelemetry.sdk.trace.id_generator import IdGenerator

    class SystemRandomIds(IdGenerator):
        def generate_span_id(self) -> int:
            return secrets.randbits(64) or 1  # 0 is the invalid id

        def generate_trace_id(self) -> int:
            return secrets.randbits(128) or 1

    return SystemRandomIds()


def own_provider(endpoint: str, worker: str) -> Any:
    """lw's tracer provider for one worker: ids from the OS, vLLM's exporter for ``endpoint``
    (``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` as vLLM reads it), batched off the step thread."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from vllm.tracing.otel import get_span_exporter

    provider = TracerProvider(resource=Resource.create({"service.name": "lw",
                                                        "lw.worker": worker}),
                              id_generator=system_random_ids())
    provider.add_span_processor(BatchSpanProcessor(get_span_exporter(endpoint)))
    atexit.register(provider.shutdown)
    return provider


class LifecycleTracer:
    """Exports one worker's transfer spans to vLLM's ``--otlp-traces-endpoint`` through a provider
    of its own (:func:`own_provider`), or through ``provider``."""

    def __init__(self, endpoint: str, role: str, worker: str, layers: int,
                 provider: Any = None) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._trace = trace
        self._tracer = (provider or own_provider(endpoint, worker)).get_tracer("lw")
        self._propagator = TraceContextTextMapPropagator()
        self.role = role
        self.worker = worker
        self.layers = layers
        self._open: OrderedDict[str, tuple[dict[str, str], dict[str, Any]]] = OrderedDict()
        self.exported = 0

    def traced(self, transfer_id: str) -> bool:
        """Whether a request's spans will be exported when it ends."""
        return transfer_id in self._open

    def begin(self, transfer_id: str, headers: tuple[tuple[str, str], ...],
              attributes: Mapping[str, Any]) -> None:
        """Remember a request's trace context and what its span will say (nothing for a request
        that is not traced)."""
        if not headers:
            return
        self._open[transfer_id] = (dict(headers), dict(attributes))
        while len(self._open) > MAX_OPEN:
            self._open.popitem(last=False)

    def rename(self, old: str, new: str) -> None:
        """A request computed ahead is bound under D's id: its span follows it (the events of
        its ahead part, under the old id, are not in it)."""
        opened = self._open.pop(old, None)
        if opened is not None:
            self._open[new] = opened

    def finish_all(self, ended: Iterable[tuple[str, bool, str, Mapping[str, Any]]],
                   entries: Iterable[tuple]) -> None:
        """:meth:`finish` for several requests that ended, reading the timeline once."""
        ended = list(ended)
        wanted = {tid for tid, *_ in ended}
        mine: dict[str, list[tuple]] = {tid: [] for tid in wanted}
        for e in entries:
            ids = e[1]
            if type(ids) is tuple:
                for tid in wanted.intersection(ids):
                    mine[tid].append(e)
            elif ids in wanted:
                mine[ids].append(e)
        for tid, ok, reason, attributes in ended:
            self.finish(tid, ok, reason, mine[tid], attributes)

    def finish(self, transfer_id: str, ok: bool, reason: str, entries: Iterable[tuple],
               attributes: Mapping[str, Any]) -> None:
        """Export the spans of a request that ended (a no-op if it was not traced)."""
        opened = self._open.pop(transfer_id, None)
        if opened is None:
            return
        headers, attrs = opened
        try:
            self._export(transfer_id, ok, reason, entries, {**attrs, **attributes}, headers)
        except Exception:  # noqa: BLE001 - tracing must never fail a transfer
            log.warning("lw: could not export the spans of %s", transfer_id, exc_info=True)

    def _export(self, transfer_id: str, ok: bool, reason: str, entries: Iterable[tuple],
                attributes: Mapping[str, Any], headers: dict[str, str]) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        now = time.monotonic()
        offset_ns = time.time_ns() - int(now * 1e9)  # timeline times are monotonic

        def ns(t: float) -> int:
            return int(t * 1e9) + offset_ns

        root, children = phases_of(entries, self.role, transfer_id, now, ok, reason,
                                   self.layers)
        parent = self._propagator.extract(headers)
        attrs = {"lw.transfer_id": transfer_id, "lw.role": self.role, "lw.worker": self.worker,
                 "lw.outcome": "ok" if ok else "failed", **attributes}
        if reason:
            attrs["lw.reason"] = reason
        span = self._tracer.start_span(root.name, context=parent, kind=SpanKind.INTERNAL,
                                       start_time=ns(root.start), attributes=attrs)
        inner = self._trace.set_span_in_context(span)
        for ph in children:
            child = self._tracer.start_span(ph.name, context=inner, start_time=ns(ph.start),
                                            attributes={"lw.transfer_id": transfer_id,
                                                        **ph.attributes})
            for name, t, a in ph.events:
                child.add_event(name, a, timestamp=ns(t))
            if ph.error:
                child.set_status(Status(StatusCode.ERROR, ph.error))
            child.end(end_time=ns(max(ph.end, ph.start)))
        for name, t, a in root.events:
            span.add_event(name, a, timestamp=ns(t))
        if root.error:
            span.set_status(Status(StatusCode.ERROR, root.error))
        span.end(end_time=ns(max(root.end, root.start)))
        self.exported += 1
