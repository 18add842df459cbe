"""``lw-trace`` headers and lines the reader refuses by file, line and field: blank files, shapes
out of range, core settings their declarations refuse, unknown keys and non-finite numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lw.contract import tracefile
from lw.contract.tracefile import TraceFormatError
from lw.fsm.decode_request import DecodeConfig
from lw.fsm.prefill_request import PrefillConfig

SETTINGS = {"prefill": (PrefillConfig, ("meta_attempts",)), "decode": (DecodeConfig, ())}
SHAPE = {"layers": 1, "prefill_tp": 1, "decode_tp": 1, "blocks_per_request": 1, "chunks": 1,
         "mla": False, "kv_heads": 1, "transfer_timeout_s": 5.0}
HEAD: dict[str, Any] = {"format": "lw-trace", "version": 1, "source": "test", "shape": SHAPE,
                        "prefill": {"meta_attempts": 2, "request_timeout_s": 30.0},
                        "decode": {"lease_s": 90.0}}
WORKER = {"worker": 0, "engine": "p", "role": "prefill", "rank": 0, "incarnation": 1}
EVENT = {"w": 0, "t": 0.5, "req": "r", "event": "admitted", "src": "", "dst": "", "detail": ""}


def _load(tmp_path: Path, *objs: dict[str, Any]) -> tracefile.Trace:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return tracefile.load(str(path), SETTINGS)


def test_a_file_of_blank_lines_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n  \n\n")
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:1: no lw-trace header"):
        tracefile.load(str(path))


@pytest.mark.parametrize("change, says", [
    ({"shape": {**SHAPE, "layers": 0}}, "'layers' must be >= 1, got 0"),
    ({"shape": {**SHAPE, "layers": -3}}, "'layers' must be >= 1"),
    ({"shape": {**SHAPE, "prefill_tp": 0}}, "'prefill_tp' must be >= 1"),
    ({"shape": {**SHAPE, "kv_heads": -1}}, "'kv_heads' must be >= 0"),
    ({"shape": {**SHAPE, "transfer_timeout_s": "abc"}}, "'transfer_timeout_s' must be int or"),
    ({"shape": {**SHAPE, "transfer_timeout_s": -1}}, "'transfer_timeout_s' must be > 0"),
    ({"shape": {**SHAPE, "layrs": 2}}, "shape: unknown field.*'layrs'"),
    ({"requets": {}}, "unknown field.*'requets'"),
    ({"requests": {"r": {"blocks": 1, "chunks": 1, "prefix_hits": 0}}}, "'prefix_hits'"),
    ({"prefill": {"request_timeout_s": 30.0}}, "prefill: field 'meta_attempts' missing"),
    ({"prefill": {**HEAD["prefill"], "meta_attempts": "2"}}, "'meta_attempts' must be int"),
    ({"prefill": {**HEAD["prefill"], "meta_attempts": True}}, "'meta_attempts' must be a num"),
    ({"prefill": {**HEAD["prefill"], "meta_atempts": 2}}, "prefill: unknown field.*'meta_ate"),
    ({"prefill": {**HEAD["prefill"], "meta_attempts": 0}}, "PrefillConfig.meta_attempts"),
    ({"prefill": {**HEAD["prefill"], "kv_checksum": 1}}, "'kv_checksum' must be bool"),
    ({"decode": {"lease_s": -1}}, r"decode: DecodeConfig\.lease_s must be > 0"),
    ({"decode": {"lease_s": float("nan")}}, "'lease_s' must be a finite number"),
    ({"decode": {"lease_s": 90.0, "retry_prefill": 100}}, "retry_prefill must be in 0..64"),
])
def test_a_bad_header_is_refused_naming_line_and_field(tmp_path: Path, change: dict[str, Any],
                                                        says: str) -> None:
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:1: .*" + says):
        _load(tmp_path, {**HEAD, **change}, WORKER, EVENT)


@pytest.mark.parametrize("line, change, says", [
    (2, ("worker", {**WORKER, "rank": -1}), "'rank' must be >= 0"),
    (2, ("worker", {**WORKER, "incarnation": -2}), "'incarnation' must be >= 0"),
    (3, ("event", {**EVENT, "t": float("nan")}), "'t' must be a finite number"),
    (3, ("event", {**EVENT, "t": float("inf")}), "'t' must be a finite number"),
])
def test_a_bad_worker_or_event_line_is_refused(tmp_path: Path, line: int,
                                               change: tuple[str, dict[str, Any]],
                                               says: str) -> None:
    worker, event = (change[1], EVENT) if change[0] == "worker" else (WORKER, change[1])
    with pytest.raises(TraceFormatError, match=rf"t\.jsonl:{line}: .*{says}"):
        _load(tmp_path, HEAD, worker, event)


def test_base_trace_reads(tmp_path: Path) -> None:
    trace = _load(tmp_path, HEAD, WORKER, EVENT)
    assert trace.workers[0].entries[0].t == 0.5
