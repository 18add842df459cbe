"""lw's OpenTelemetry spans: the lifecycle phases read from real endpoints' timelines, and the
export through the real OTLP/HTTP exporter to a local receiver that decodes the protobuf (the
tree: the transfer span under the caller's span, the phases under it, events, error status)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
pytest.importorskip("opentelemetry.proto")

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402

from lw.fsm import DecodeEndpoint, PrefillEndpoint, PrefillRequest  # noqa: E402
from lw.vllm_adapter.tracing import (  # noqa: E402
    LifecycleTracer,
    phases_of,
    system_random_ids,
    trace_headers_of,
)
from tests.fsm.harness import D_ADDR, Pair, d_layout, d_sender, p_sender  # noqa: E402
from tests.vllm_adapter.otlp_receiver import Receiver  # noqa: E402

L = 3
REMOTE = (10, 11, 12, 13, 14)
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
HEADERS = (("traceparent", f"00-{TRACE}-{PARENT}-01"),)


def tick(pair: Pair, dt: float = 0.01) -> None:
    pair.now += dt


def three_chunks(fail: bool = False) -> Pair:
    """A request pushed in chunks of 2, 2 and 1 blocks through the real core (every message
    on the wire format); ``fail``: the last chunk's first write fails."""
    pair = Pair([PrefillEndpoint(p_sender(0), L)], DecodeEndpoint(d_sender(), d_layout(L)))
    pair.now = 100.0
    pair.absorb("d", pair.d.add_request("r", REMOTE, 1, pair.now))
    tick(pair)
    p = pair.ps[0]
    pair.absorb(0, p.add_request(PrefillRequest("r", D_ADDR, (1, 2), REMOTE, 1, final=False),
                                 pair.now))
    tick(pair)
    pair.deliver_all()
    for local, final in (((1, 2), False), ((3, 4), False), ((5,), True)):
        if local != (1, 2):
            tick(pair)
            pair.absorb(0, p.add_chunk("r", local, final, pair.now))
        for layer in range(L):
            tick(pair)
            pair.absorb(0, p.layer_computed(layer, ["r"], pair.now))
            tick(pair)
            pair.complete_writes(ok=not (fail and final), reason="link down")
    tick(pair)
    pair.deliver_all()
    return pair


def test_prefill_phases_from_a_real_timeline() -> None:
    pair = three_chunks()
    root, phases = phases_of(list(pair.ps[0].timeline), "prefill", "r", pair.now, True, "", L)
    assert root.name == "lw.kv_push" and not root.error
    assert [p.name for p in phases] == ["lw.claim", "lw.chunk_written", "lw.chunk_written",
                                        "lw.chunk_written", "lw.await_done_ack"]
    claim, *chunks, ack = phases
    assert [c.attributes["lw.chunk"] for c in chunks] == [0, 1, 2]
    assert [len(c.events) for c in chunks] == [L, L, L]
    assert [e[2]["lw.write"] for e in chunks[2].events] == ["6", "7", "8"]
    assert root.start <= claim.start < claim.end <= chunks[0].end
    assert all(a.end <= b.start for a, b in zip(chunks, chunks[1:], strict=False))
    assert chunks[2].end == ack.start < ack.end <= root.end and not ack.error


def test_decode_phases_from_a_real_timeline() -> None:
    pair = three_chunks()
    root, phases = phases_of(list(pair.d.timeline), "decode", "r", pair.now, True, "", L)
    assert root.name == "lw.kv_receive" and not root.error
    wait, recv = phases
    assert (wait.name, recv.name) == ("lw.await_claim", "lw.receiving")
    assert wait.end == recv.start and [e[0] for e in recv.events] == ["sender_done"]


def test_a_failed_push_has_the_reason_on_its_span() -> None:
    pair = three_chunks(fail=True)
    (fin,) = pair.finished
    root, phases = phases_of(list(pair.ps[0].timeline), "prefill", "r", pair.now, fin.ok,
                             fin.reason, L)
    assert root.error and "link down" in root.error
    assert [e[0] for e in root.events] == ["failed"]
    assert "link down" in root.events[0][2]["lw.reason"]
    assert [p.name for p in phases][-1] == "lw.chunk_written"  # no DONE wait after a failure


class _Req:
    trace_headers = {"traceparent": f"00-{TRACE}-{PARENT}-01", "x-other": "no",
                     "TraceState": "k=v"}


def test_trace_headers_are_the_w3c_ones() -> None:
    assert trace_headers_of(_Req()) == (("traceparent", f"00-{TRACE}-{PARENT}-01"),
                                        ("tracestate", "k=v"))
    assert trace_headers_of(object()) == ()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def test_spans_reach_a_real_otlp_receiver_as_a_tree(receiver: Receiver) -> None:
    provider = TracerProvider(id_generator=system_random_ids())
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=receiver.url)))
    tracer = LifecycleTracer(receiver.url, "prefill", "lw-p0", L, provider=provider)
    ok, bad = three_chunks(), three_chunks(fail=True)
    t0 = time.time_ns()
    tracer.begin("r", HEADERS, {"lw.peer": "10.0.0.2:14700"})
    tracer.begin("f", (("traceparent", f"00-{TRACE}-{'1' * 16}-01"),), {})
    renamed = [(e[0], "f" if e[1] == "r" else ("f",), *e[2:]) for e in bad.ps[0].timeline]
    (fin,) = bad.finished
    # one worker's timeline holds both (batch milestones name a tuple of requests)
    tracer.finish_all([("r", True, "", {"lw.bytes": 5 * 4096 * L}),
                       ("f", fin.ok, fin.reason, {})], list(ok.ps[0].timeline) + renamed)
    tracer.begin("untraced", (), {})
    tracer.finish("untraced", True, "", [], {})
    provider.shutdown()  # SimpleSpanProcessor: every span was posted (and answered) already
    spans = receiver.of_trace(TRACE)
    by_id = {s.span_id: s for s in spans}
    roots = [s for s in spans if s.name == "lw.kv_push"]
    assert len(roots) == 2 and tracer.exported == 2
    good = next(s for s in roots if s.parent_id == PARENT)
    assert good.attributes["lw.transfer_id"] == "r" and good.attributes["lw.outcome"] == "ok"
    assert good.attributes["lw.peer"] == "10.0.0.2:14700"
    assert good.attributes["lw.bytes"] == 5 * 4096 * L and good.error is None
    kids = sorted((s for s in spans if s.parent_id == good.span_id), key=lambda s: s.start_ns)
    assert [s.name for s in kids] == ["lw.claim", "lw.chunk_written", "lw.chunk_written",
                                      "lw.chunk_written", "lw.await_done_ack"]
    assert [len(s.events) for s in kids[1:4]] == [L, L, L]
    assert all(good.start_ns <= s.start_ns <= s.end_ns <= good.end_ns for s in kids)
    assert abs(good.end_ns - t0) < 60e9  # monotonic times mapped to the wall clock
    failed = next(s for s in roots if s.parent_id == "1" * 16)
    assert failed.error and "link down" in failed.error
    assert failed.attributes["lw.outcome"] == "failed"
    assert all(by_id.get(s.parent_id) in (good, failed) or s.parent_id in (PARENT, "1" * 16)
               for s in spans)


def test_span_ids_do_not_follow_a_seeded_random() -> None:
    """vLLM seeds ``random`` alike in every engine: the SDK's default ids then repeat across P
    and D; lw's come from the OS."""
    import random

    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    def ids(gen: object) -> list[int]:
        random.seed(0)
        return [gen.generate_span_id() for _ in range(3)]  # type: ignore[attr-defined]

    assert ids(RandomIdGenerator()) == ids(RandomIdGenerator())  # what vLLM's seed does
    assert ids(system_random_ids()) != ids(system_random_ids())
