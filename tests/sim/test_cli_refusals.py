"""``lw validate`` and ``lw check`` refuse bad input with exit 2 (never 1, which reads as a
rejection or a violation, nor 0), naming the flag or the trace's line and field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lw.sim import cli, validate_cli

SHAPE = {"layers": 1, "prefill_tp": 1, "decode_tp": 1, "blocks_per_request": 1, "chunks": 1,
         "mla": False, "kv_heads": 1}
PREFILL = {"meta_retry_s": 1.0, "meta_attempts": 2, "ack_retry_s": 1.0, "ack_attempts": 2,
           "request_timeout_s": 30.0}
HEAD: dict[str, Any] = {"format": "lw-trace", "version": 1, "source": "test", "shape": SHAPE,
                        "prefill": PREFILL, "decode": {"prefill_timeout_s": 60.0, "lease_s": 90.0}}
WORKER = {"worker": 0, "engine": "p", "role": "prefill", "rank": 0, "incarnation": 1}
EVENT = {"w": 0, "t": 0.5, "req": "r", "event": "admitted", "src": "", "dst": "", "detail": ""}


def _trace(tmp_path: Path, head: dict[str, Any], *lines: dict[str, Any]) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(o) + "\n" for o in (head, *lines)))
    return str(path)


def _exit(main: Any, argv: list[str]) -> int:
    try:
        return int(main(argv))
    except SystemExit as exc:  # argparse's refusals
        return int(exc.code or 0)


def test_blank_file_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n\n")
    assert validate_cli.main([str(path)]) == 2
    assert "t.jsonl:1:" in capsys.readouterr().err


@pytest.mark.parametrize("change, says", [
    ({"shape": {**SHAPE, "layers": 0}}, "'layers'"),
    ({"shape": {**SHAPE, "prefill_tp": 0}}, "'prefill_tp'"),
    ({"shape": {**SHAPE, "transfer_timeout_s": "abc"}}, "'transfer_timeout_s'"),
    ({"prefill": {k: v for k, v in PREFILL.items() if k != "meta_attempts"}}, "'meta_attempts'"),
    ({"prefill": {**PREFILL, "meta_attempts": [2]}}, "'meta_attempts'"),
    ({"prefill": {**PREFILL, "meta_atempts": 2}}, "'meta_atempts'"),
    ({"decode": {"prefill_timeout_s": 60.0, "lease_s": -1}}, "lease_s"),
    ({"requets": {}}, "'requets'"),
    # a shape the reader takes but the world cannot: 1 block in 3 chunks
    ({"shape": {**SHAPE, "chunks": 3}}, "3 chunks"),
])
def test_a_bad_header_is_bad_input_not_a_rejection(tmp_path: Path, change: dict[str, Any],
                                                   says: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert validate_cli.main([_trace(tmp_path, {**HEAD, **change}, WORKER, EVENT)]) == 2
    err = capsys.readouterr().err
    assert "t.jsonl" in err and says in err


@pytest.mark.parametrize("line", [{**WORKER, "rank": -1}, {**EVENT, "t": float("nan")}])
def test_a_bad_line_is_bad_input(tmp_path: Path, line: dict[str, Any],
                                 capsys: pytest.CaptureFixture[str]) -> None:
    lines = [line, EVENT] if "worker" in line else [WORKER, line]
    assert validate_cli.main([_trace(tmp_path, HEAD, *lines)]) == 2
    err = capsys.readouterr().err
    assert ("'rank'" if "worker" in line else "'t'") in err


def test_a_request_the_trace_does_not_record_is_bad_input(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _trace(tmp_path, HEAD, WORKER, EVENT)
    assert validate_cli.main([path, "--request", "nosuch"]) == 2
    out = capsys.readouterr()
    assert "'nosuch'" in out.err and "valid" not in out.out


@pytest.mark.parametrize("flag, value", [("--max-states", "-1"), ("--max-states", "0"),
                                         ("--seconds", "-1"), ("--seconds", "nan"),
                                         ("--seconds", "0")])
def test_validate_refuses_a_budget_of_nothing(tmp_path: Path, flag: str, value: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = _trace(tmp_path, HEAD, WORKER, EVENT)
    assert _exit(validate_cli.main, [path, flag, value]) == 2
    assert flag in capsys.readouterr().err


def test_check_refuses_a_setting_the_core_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--retry-prefill", "100"]) == 2
    assert "retry_prefill" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["--mode", "random", "--seconds", "-1"], "--seconds"),
    (["--mode", "random", "--seconds", "nan"], "--seconds"),
    (["--seconds", "0"], "--seconds"),
    (["--max-states", "-5"], "--max-states"),
    (["--max-states", "0"], "--max-states"),
    (["--layers", "1", "--max-states", "0"], "--max-states"),
])
def test_check_refuses_a_budget_of_nothing(argv: list[str], flag: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit(cli.main, argv) == 2
    assert flag in capsys.readouterr().err
