"""Per-request shapes in ``lw-trace`` files: parsed and refused by line and field, and used by
``lw validate`` to build each request's world in its own size (a vLLM run's prompts differ).

The runs here are the world's own: a request run to its end in a world of its shape, its
endpoints' timelines written as a trace (fast, no engines, no sockets)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lw.contract import tracefile
from lw.contract.tracefile import RequestShape, TraceFormatError, WorkerTrace
from lw.sim import validate_cli
from lw.sim.validate_world import ValidationConfig, ValidationWorld

PREFILL = {"meta_retry_s": 0.5, "meta_attempts": 2, "ack_retry_s": 0.5, "ack_attempts": 2,
           "request_timeout_s": 30.0, "kv_checksum": True}
DECODE = {"prefill_timeout_s": 60.0, "lease_s": 90.0, "retry_prefill": 0}
LAYERS = 2


def _world_run(shape: RequestShape) -> tuple[list[tuple], list[tuple]]:
    """P's and D's timelines of one request run to its end, without faults, in a world of
    ``shape`` (the first enabled action each time)."""
    cfg = ValidationConfig(dp=1, tp=1, d_dp=1, d_tp=1, requests=1, layers=LAYERS,
                           blocks_per_request=shape.blocks, d_blocks=shape.blocks,
                           p_blocks=shape.blocks, chunks=shape.chunks,
                           prefix_hits=(shape.prefix_hit,), chunk_blocks=shape.chunk_blocks,
                           kv_checksum=True, faults=False)
    w = ValidationWorld(cfg)
    runs: tuple[list[tuple], list[tuple]] = ([], [])
    for step in range(1, 1000):  # each event at the step that recorded it: the world's clock
        acts = w.enabled()  # stands still here, and the first unexplained event is the earliest
        if not acts:
            break
        w.apply(acts[0])
        for run, ep in zip(runs, (w.p[0], w.d[0]), strict=True):
            run += [(step * 0.01, *ev[1:]) for ev in ep.timeline.ring]
            ep.timeline.ring.clear()
    return runs


def _trace(tmp_path: Path, shapes: dict[str, RequestShape], own: bool = True) -> str:
    """A run of one P and one D worker in which each request of ``shapes`` ran after the other,
    written with the per-request shapes (``own``) or with only the run's (the first's)."""
    p = WorkerTrace("P", "prefill", 0, 1)  # the engine D's claims name (the world's)
    d = WorkerTrace("D", "decode", 0, 1)
    for k, (rid, shape) in enumerate(shapes.items()):
        p_run, d_run = _world_run(shape)
        for worker, run in ((p, p_run), (d, d_run)):
            worker.entries += [tracefile.Entry(
                10.0 * k + t, tuple(rid if r == "r0" else r for r in ((req,) if isinstance(
                    req, str) else req)), ev, a, b, str(det), 0)
                for t, req, ev, a, b, det in run]
    first = next(iter(shapes.values()))
    run_shape = {"layers": LAYERS, "prefill_tp": 1, "decode_tp": 1,
                 "blocks_per_request": first.blocks, "chunks": first.chunks, "mla": False,
                 "kv_heads": 1, "transfer_timeout_s": 10.0}
    path = str(tmp_path / "run.jsonl")
    tracefile.dump(path, "test", run_shape, PREFILL, DECODE, [p, d], faults=(),
                   requests=shapes if own else None)
    return path


SHAPES = {"a": RequestShape(1), "b": RequestShape(3, 2, 0, (2, 1)),
          "c": RequestShape(4, 2, 1, (0, 3))}


def test_requests_of_different_shapes_are_valid(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = _trace(tmp_path, SHAPES)
    assert tracefile.load(path).requests == SHAPES
    assert validate_cli.main([path, "-v"]) == 0, capsys.readouterr().out
    assert "valid: 3 requests, 3 valid, 0 rejected" in capsys.readouterr().out


def test_without_its_own_shape_a_request_is_rejected(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The run's one shape (1 block, 1 chunk) does not describe request b's 2 chunks."""
    path = _trace(tmp_path, SHAPES, own=False)
    assert validate_cli.main([path, "--request", "b"]) == 1
    out = capsys.readouterr().out
    assert "b: rejected" in out and "first unexplained: " in out, out


def test_a_planted_wrong_chunk_is_rejected_and_named(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """P's core recorded a second chunk of 2 blocks where the request's shape says 1."""
    path = _trace(tmp_path, SHAPES)
    lines = Path(path).read_text().splitlines()
    k = next(i for i, line in enumerate(lines)
             if '"req": "b"' in line and '"chunk_scheduled"' in line)
    obj = json.loads(lines[k])
    obj["detail"] = "2"
    lines[k] = json.dumps(obj)
    Path(path).write_text("\n".join(lines) + "\n")
    assert validate_cli.main([path]) == 1
    out = capsys.readouterr().out
    assert "b: rejected" in out and f"line {k + 1} " in out, out
    assert "chunk_scheduled AWAIT_DECODER_META->AWAIT_DECODER_META (1)" in out, out


def _header(requests: Any) -> str:
    return json.dumps({"format": "lw-trace", "version": 1, "shape": {
        "layers": 2, "prefill_tp": 1, "decode_tp": 1, "blocks_per_request": 1, "chunks": 1,
        "mla": False, "kv_heads": 1}, "prefill": PREFILL, "decode": DECODE,
        "requests": requests})


@pytest.mark.parametrize("requests, says", [
    ([1], "field 'requests' must be an object"),
    ({"r": 3}, "requests['r']: expected an object"),
    ({"r": {"chunks": 1}}, "requests['r']: field 'blocks' missing"),
    ({"r": {"blocks": 0, "chunks": 1}}, "requests['r']: field 'blocks' must be >= 1, got 0"),
    ({"r": {"blocks": 2, "chunks": "2"}}, "requests['r']: field 'chunks' must be int"),
    ({"r": {"blocks": 2, "chunks": 1, "prefix_hit": 3}}, "field 'prefix_hit' is 3, more than"),
    ({"r": {"blocks": 2, "chunks": 2, "chunk_blocks": [2]}}, "has 1 entries for 2 chunks"),
    ({"r": {"blocks": 3, "chunks": 2, "chunk_blocks": [1, 1]}}, "sums to 2, not the 3 blocks"),
    ({"r": {"blocks": 2, "chunks": 2, "chunk_blocks": [2, 0]}}, "an empty chunk after the first"),
    ({"r": {"blocks": 2, "chunks": 2, "chunk_blocks": [1, -1]}}, "a list of integers >= 0"),
    ({"r": {"blocks": 1, "chunks": 3}}, "1 block(s) to write in 3 chunks"),
])
def test_malformed_request_shapes_name_line_and_field(tmp_path: Path, requests: Any,
                                                      says: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(_header(requests) + "\n")
    with pytest.raises(TraceFormatError) as err:
        tracefile.load(str(path))
    assert f"{path}:1: " in str(err.value) and says in str(err.value), str(err.value)


def test_a_trace_without_request_shapes_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "old.jsonl"
    head = json.loads(_header({}))
    del head["requests"]
    path.write_text(json.dumps(head) + "\n")
    trace = tracefile.load(str(path))
    assert trace.requests == {} and trace.request_shape("any") == RequestShape(1, 1)
