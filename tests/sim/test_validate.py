"""``lw validate``: recorded runs of the synthetic cluster are behaviours of the world, a driver
defect the checker cannot see is not, and malformed trace files are refused by file and line."""

from __future__ import annotations

import json
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import pytest

from lw.sim import validate_cli
from lw.synthetic import ClusterConfig, run_cluster
from lw.synthetic import workers as synthetic_workers

SMALL = dict(requests=6, prefill_dp=2, layers=3, blocks_per_request=2, block_bytes=4096,
             d_blocks=8, p_blocks=8, layer_ms=1.0, data_plane="inprocess", run_timeout_s=30.0)


class EarlyPlane:
    """A planted driver defect: the data plane reports each write complete at once, before any
    of its bytes land (here they never do: a late landing would outlive the test's memory). The
    checker's world takes a completion to mean the bytes landed."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def submit(self, xfer_id: Hashable, session: str, entries: Sequence[tuple[int, int, int]],
               ) -> None:
        self._inner.submit(xfer_id, session, [])  # complete, nothing copied

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _run(tmp_path: Path, **kw: Any) -> str:
    out = str(tmp_path / "run.jsonl")
    res = run_cluster(ClusterConfig(**{**SMALL, **kw, "timelines_out": out}))  # type: ignore[arg-type]
    assert not res.errors, res.errors
    assert res.counters.get("timeline_workers") == 3
    return out


def test_clean_run_is_valid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _run(tmp_path, kv_checksum=True)
    assert validate_cli.main([path]) == 0
    out = capsys.readouterr().out
    assert "valid: 6 requests, 6 valid, 0 rejected" in out


@pytest.mark.parametrize("shape", [dict(prefill_tp=2), dict(decode_tp=2),
                                   dict(prefill_tp=2, decode_tp=2, mla=True), dict(chunks=2)])
def test_tp_mla_and_chunked_runs_are_valid(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           shape: dict[str, Any]) -> None:
    """Each D TP worker carries its own incarnation number: they are matched per rank."""
    out = str(tmp_path / "run.jsonl")
    res = run_cluster(ClusterConfig(**{**SMALL, **shape, "timelines_out": out}))  # type: ignore[arg-type]
    assert not res.errors, res.errors
    assert validate_cli.main([out]) == 0, capsys.readouterr().out


def test_a_recorded_step_the_model_cannot_take_is_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One write completion removed from P's timeline: its next completion skips a layer."""
    path = _run(tmp_path)
    lines = Path(path).read_text().splitlines()
    gone = next(i for i, line in enumerate(lines)
                if '"req": "req-2"' in line and '"layer_sent"' in line and '"detail": "1"' in line)
    del lines[gone]
    Path(path).write_text("\n".join(lines) + "\n")
    assert validate_cli.main([path, "--request", "req-2"]) == 1
    out = capsys.readouterr().out
    # the next completion is the first entry the model cannot explain, and the model's own next
    # step there is the missing one
    nxt = next(i for i, line in enumerate(lines) if '"req": "req-2"' in line
               and '"layer_sent"' in line and '"detail": "2"' in line)
    assert f"line {nxt + 1} " in out and "layer_sent LAYER_1_SENT->LAYER_2_SENT (2)" in out
    assert "the model allowed there: " in out and "layer_sent LAYER_0_SENT->LAYER_1_SENT (1)" in out


def test_search_budget_gives_undecided_not_a_verdict(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _run(tmp_path)
    assert validate_cli.main([path, "--max-states", "3"]) == 0
    assert "undecided" in capsys.readouterr().out
    assert validate_cli.main([path, "--max-states", "3", "--strict"]) == 1


def test_write_complete_before_bytes_land_is_rejected(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    real = synthetic_workers._data_plane

    def planted(cfg: ClusterConfig, name: str, host: str = "127.0.0.1") -> Any:
        dp = real(cfg, name, host)
        return EarlyPlane(dp) if name.startswith("p") else dp

    monkeypatch.setattr(synthetic_workers, "_data_plane", planted)
    path = _run(tmp_path, kv_checksum=True)
    assert validate_cli.main([path]) == 1
    out = capsys.readouterr().out
    assert "REJECTED" in out
    # the first event no behaviour explains: D refusing the sender's DONE on its checksums
    assert "first unexplained: decode-0/0" in out
    assert "fail RECEIVING->FAILED (KV checksum" in out


def _write(tmp_path: Path, lines: list[str]) -> str:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return str(p)


HEAD = {"format": "lw-trace", "version": 1, "source": "test",
        "shape": {"layers": 1, "prefill_tp": 1, "decode_tp": 1, "blocks_per_request": 1,
                  "chunks": 1, "mla": False, "kv_heads": 1},
        "prefill": {"meta_retry_s": 1.0, "meta_attempts": 2, "ack_retry_s": 1.0,
                    "ack_attempts": 2, "request_timeout_s": 30.0},
        "decode": {"prefill_timeout_s": 60.0, "lease_s": 90.0}}
WORKER = {"worker": 0, "engine": "prefill-dp0", "role": "prefill", "rank": 0, "incarnation": 1}


@pytest.mark.parametrize("lines, says", [
    ([json.dumps({**HEAD, "version": 7})], ":1: field 'version' is 7"),
    ([json.dumps(HEAD), "{not json"], ":2: not JSON"),
    ([json.dumps(HEAD), json.dumps(WORKER),
      json.dumps({"w": 0, "t": 0.0, "req": "r", "src": "", "dst": "", "detail": ""})],
     ":3: field 'event' missing"),
    ([json.dumps(HEAD), json.dumps({"w": 0, "t": 0.0, "req": "r", "event": "admitted",
                                    "src": "", "dst": "", "detail": ""})],
     ":2: field 'w' is 0: no such worker"),
    ([json.dumps({**HEAD, "shape": {**HEAD["shape"], "layers": "8"}})],  # type: ignore[dict-item]
     ":1: shape: field 'layers' must be int"),
])
def test_malformed_trace_exits_2_naming_line_and_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[str], says: str) -> None:
    path = _write(tmp_path, lines)
    assert validate_cli.main([path]) == 2
    err = capsys.readouterr().err
    assert path + says in err, err
