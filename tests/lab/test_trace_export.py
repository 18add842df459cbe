"""The vLLM run's mapping to the checker's world (lw.lab.trace_export): each
request's shape from what its cores recorded, and the model's KV shape (no engines)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lw.contract import tracefile
from lw.contract.tracefile import RequestShape, WorkerTrace
from lw.lab.trace_export import model_kv, request_shapes


def test_shapes_from_what_the_cores_recorded() -> None:
    """The vLLM adapter's mapping: blocks from D's allocation, chunks from P's pushes; a request
    released before its last chunk gets the rest as one chunk; disagreements are problems."""
    p = WorkerTrace("prefill", "prefill", 0, 1)
    d = WorkerTrace("decode", "decode", 0, 1)

    def e(req: str, event: str, detail: str) -> tracefile.Entry:
        return tracefile.Entry(0.0, (req,), event, "", "", detail, 0)

    d.entries = [e("x", "allocated", "5 blocks, expects 1 sender(s)"),
                 e("y", "allocated", "3 blocks, expects 1 sender(s)"),
                 e("z", "allocated", "2 blocks, expects 1 sender(s)"),
                 e("u", "allocated", "4 blocks, expects 1 sender(s)")]
    p.entries = [e("x", "admitted", "0 blocks to tcp://h:1 (first chunk; 5 in all)"),
                 e("x", "chunk_scheduled", "3"), e("x", "chunk_scheduled", "2"),
                 e("y", "admitted", "1 blocks to tcp://h:1 (first chunk; 3 in all)"),
                 e("z", "admitted", "2 blocks to tcp://h:1"),
                 e("u", "admitted", "4 blocks to tcp://h:1 (first chunk; 6 in all)")]
    shapes, problems = request_shapes([p, d])
    assert shapes["x"] == RequestShape(5, 3, 0, (0, 3, 2))
    assert shapes["y"] == RequestShape(3, 2, 0, (1, 2))
    assert shapes["z"] == RequestShape(2, 1, 0, (2,))
    assert problems == ["u: P was told of 6 blocks to write, D allocated 4"]
    p2 = WorkerTrace("prefill", "prefill", 1, 1)  # P's TP rank 1 was told of other chunks
    p2.entries = [e("y", "admitted", "2 blocks to tcp://h:2 (first chunk; 3 in all)"),
                  e("y", "chunk_scheduled", "1")]
    _, problems = request_shapes([p, p2, d])
    assert any(x.startswith("y: P workers disagree on its chunks") for x in problems), problems


def test_model_kv_reads_layers_heads_and_mla(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2}))
    assert model_kv(tmp_path) == (3, 2, False)
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 2, "num_attention_heads": 8, "kv_lora_rank": 64}))
    assert model_kv(tmp_path) == (2, 1, True)


def test_a_re_prefill_has_its_first_attempts_chunks() -> None:
    """With retry_prefill a request is admitted again on another P engine: the world splits
    every attempt alike, so the shape is the first attempt's (no disagreement reported)."""
    d = WorkerTrace("decode", "decode", 0, 1)
    d.entries = [tracefile.Entry(0.0, ("r",), "allocated", "", "", "3 blocks, expects 1", 0)]
    first = WorkerTrace("p0", "prefill", 0, 1)
    again = WorkerTrace("p1", "prefill", 0, 1)
    first.entries = [tracefile.Entry(1.0, ("r",), "admitted", "", "",
                                     "2 blocks to tcp://h:1 (first chunk; 3 in all)", 0),
                     tracefile.Entry(1.5, ("r",), "chunk_scheduled", "", "", "1", 0)]
    again.entries = [tracefile.Entry(5.0, ("r",), "admitted", "", "", "3 blocks to tcp://h:1",
                                     0)]
    for order in ([again, first, d], [first, again, d]):
        shapes, problems = request_shapes(order)
        assert shapes["r"] == RequestShape(3, 2, 0, (2, 1)) and problems == []


def test_the_demo_fails_a_trace_that_is_not_valid(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``lw demo --engine vllm --validate``'s verdict: valid exits 0; a rejected trace, or
    requests whose shape P and D disagree on, exit 1 with the first unexplained event named."""
    from lw.lab.vllm_demo import _validate

    from ..sim.test_validate_shapes import SHAPES, _trace

    path = _trace(tmp_path, SHAPES)
    assert _validate((path, [])) == 0
    assert "traces validated=1 rejected=0 undecided=0" in capsys.readouterr().out
    assert _validate((path, ["b: P was told of 4 blocks to write, D allocated 3"])) == 1
    out = capsys.readouterr().out
    assert "REJECTED: b: P was told" in out and "traces validated=0 rejected=1" in out
    lines = Path(path).read_text().splitlines()
    del lines[next(i for i, line in enumerate(lines)
                   if '"req": "b"' in line and '"layer_sent"' in line)]
    Path(path).write_text("\n".join(lines) + "\n")
    assert _validate((path, [])) == 1
    out = capsys.readouterr().out
    assert "b: rejected" in out and "first unexplained: " in out, out
    assert "traces validated=0 rejected=1 undecided=0" in out
