"""``lw validate`` of a run computing ahead (``lw proxy --start-mode compute-ahead``): P admits
the request under the proxy's id before D's params came and renames it to D's at the bind; the
trace is joined under D's id and searched in the world's compute-ahead design."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lw.contract import tracefile
from lw.contract.tracefile import RequestShape, WorkerTrace
from lw.lab.trace_export import request_shapes
from lw.sim import validate_cli
from lw.sim.validate_world import ValidationConfig, ValidationWorld

from .test_validate_shapes import DECODE, LAYERS, PREFILL

AHEAD_ID = "proxy-7"  # what P admitted it under: the proxy's id, before D named the transfer


def _world_run(design: str) -> tuple[list[tuple], list[tuple]]:
    """P's and D's timelines of one 2-block request run to its end without faults; computing
    ahead, P's scheduler step comes before D's allocation (the world allows either order)."""
    cfg = ValidationConfig(dp=1, tp=1, d_dp=1, d_tp=1, requests=1, layers=LAYERS,
                           blocks_per_request=2, d_blocks=2, p_blocks=2, chunks=1,
                           prefix_hits=(0,), kv_checksum=True, faults=False, design=design)
    w = ValidationWorld(cfg)
    runs: tuple[list[tuple], list[tuple]] = ([], [])
    for step in range(1, 1000):
        acts = w.enabled()
        if not acts:
            break
        w.apply(next((a for a in acts if a[0] == "schedule"), acts[0]))
        for run, ep in zip(runs, (w.p[0], w.d[0]), strict=True):
            run += [(step * 0.01, *ev[1:]) for ev in ep.timeline.ring]
            ep.timeline.ring.clear()
    return runs


def _entries(run: list[tuple], rid: str, t0: float) -> list[tracefile.Entry]:
    return [tracefile.Entry(t0 + t, tuple(rid if r == "r0" else r for r in (
        (req,) if isinstance(req, str) else req)), ev, a, b, str(det), 0)
        for t, req, ev, a, b, det in run]


def _as_runtime_records(p: list[tracefile.Entry], rid: str) -> list[tracefile.Entry]:
    """P's entries as the runtime records them: under the ahead id until the bind, a
    ``renamed`` entry, then under D's id (lw.fsm.prefill_ahead.bind)."""
    k = next(i for i, e in enumerate(p) if e.event == "bind")
    before = [tracefile.Entry(e.t, tuple(AHEAD_ID if r == rid else r for r in e.reqs), e.event,
                              e.src, e.dst, e.detail, 0) for e in p[:k]]
    renamed = tracefile.Entry(p[k].t, (AHEAD_ID,), "renamed", "AHEAD", "AHEAD", rid, 0)
    return [*before, renamed, *p[k:]]


def _trace(tmp_path: Path, drop_bind: bool = False) -> str:
    """A run of request ``d1`` the D-first way, then ``a1`` computed ahead."""
    p = WorkerTrace("P", "prefill", 0, 1)
    d = WorkerTrace("D", "decode", 0, 1)
    for k, (rid, design) in enumerate((("d1", "d-first"), ("a1", "compute-ahead"))):
        p_run, d_run = _world_run(design)
        p_entries = _entries(p_run, rid, 10.0 * k)
        if design == "compute-ahead":
            p_entries = _as_runtime_records(p_entries, rid)
            if drop_bind:
                p_entries = [e for e in p_entries if e.event != "bind"]
        p.entries += p_entries
        d.entries += _entries(d_run, rid, 10.0 * k)
    shapes, problems = request_shapes([p, d])
    assert problems == [] and set(shapes) == {"d1", "a1"}, (shapes, problems)
    shape = {"layers": LAYERS, "prefill_tp": 1, "decode_tp": 1, "blocks_per_request": 2,
             "chunks": 1, "mla": False, "kv_heads": 1, "transfer_timeout_s": 10.0}
    path = str(tmp_path / "run.jsonl")
    tracefile.dump(path, "test", shape, PREFILL, DECODE, [p, d], faults=(), requests=shapes)
    return path


def test_a_request_computed_ahead_is_valid_under_ds_id(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The ahead id is no request of its own: two requests, both valid."""
    path = _trace(tmp_path)
    assert validate_cli.main([path, "-v"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "valid: 2 requests, 2 valid, 0 rejected" in out, out
    assert AHEAD_ID not in out, out


def test_a_request_computed_ahead_without_its_bind_is_rejected(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """P accepting D's claim for a request it never bound (it cannot know where to write):
    rejected, the first event no behaviour explains named."""
    path = _trace(tmp_path, drop_bind=True)
    assert validate_cli.main([path, "--request", "a1"]) == 1
    out = capsys.readouterr().out
    assert "a1: rejected" in out and "first unexplained: " in out, out


def test_shapes_of_a_request_computed_ahead_join_its_two_ids() -> None:
    """Its chunks from both names, its blocks in all from D's allocation (P's admission ahead
    cannot say them)."""
    p = WorkerTrace("P", "prefill", 0, 1)
    d = WorkerTrace("D", "decode", 0, 1)

    def e(req: str, event: str, detail: str) -> tracefile.Entry:
        return tracefile.Entry(0.0, (req,), event, "", "", detail, 0)

    d.entries = [e("r", "allocated", "5 blocks, expects 1 sender(s)")]
    p.entries = [e(AHEAD_ID, "admitted", "2 blocks computed ahead of D's parameters "
                                         "(first chunk)"),
                 e(AHEAD_ID, "chunk_scheduled", "1"), e(AHEAD_ID, "renamed", "r"),
                 e("r", "bind", "5 blocks to tcp://h:1 (D holds 0)"),
                 e("r", "chunk_scheduled", "2")]
    shapes, problems = request_shapes([p, d])
    assert problems == [] and shapes == {"r": RequestShape(5, 3, 0, (2, 1, 2))}, shapes


def test_the_trace_file_keeps_the_rename(tmp_path: Path) -> None:
    """The file holds what was recorded (two ids, the ``renamed`` entry); the join is the
    reader's (tracefile.joined)."""
    path = _trace(tmp_path)
    lines = [json.loads(x) for x in Path(path).read_text().splitlines()[1:]]
    assert any(x.get("event") == "renamed" and x.get("req") == AHEAD_ID for x in lines)
    joined = tracefile.joined(tracefile.load(path).workers)
    assert all(AHEAD_ID not in e.reqs and e.event != "renamed" for w in joined
               for e in w.entries)
