"""``lw config --explain`` on good and bad ``--kv-transfer-config`` files: each setting's value
and source, exit 2 naming every refused key and contradiction, model checks only with
``--model``, and the cluster key never printed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lw import cli

SECRET = "do-not-print-me-0123456789"


def _file(tmp_path: Path, extra: dict[str, Any], **outer: Any) -> str:
    doc = {"kv_connector": "LwConnector", "kv_connector_module_path": "lw.vllm_adapter",
           "kv_role": "kv_consumer", "kv_port": 14700, **outer,
           "kv_connector_extra_config": extra}
    path = tmp_path / "kv.json"
    path.write_text(json.dumps(doc))
    return str(path)


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str], list[str]]:
    code = cli.main(["config", *args])
    got = capsys.readouterr()
    return code, got.out.splitlines(), got.err.splitlines()


def _row(lines: list[str], name: str) -> str:
    """One setting's value, source and note, single-spaced."""
    (line,) = [x for x in lines if x.split()[:1] == [name]]
    return " ".join(line.split()[1:])


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LW_CLUSTER_KEY", raising=False)
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)


def test_a_good_file_prints_every_setting_with_its_source(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _file(tmp_path, {"host": "10.0.0.2", "request_timeout_s": 20, "retry_prefill": 1,
                            "cluster_key": SECRET, "experimental": {"layer_batch_ms": 5}})
    code, out, err = _run(capsys, "--explain", "--role", "decode", path)
    assert (code, err) == (0, [])
    assert out[0].startswith("lw config --explain: decode engine (kv_consumer), TP 1, "
                             "kv_port 14700")
    assert out[-1] == "ok"
    assert _row(out, "host") == '"10.0.0.2" file'
    assert _row(out, "request_timeout_s") == "20 file"
    assert _row(out, "prefill_timeout_s") == "60 default"
    assert _row(out, "experimental.layer_batch_ms") == "5 file (not read by a decode engine)"
    assert _row(out, "lease_s") == "60 derived from request_timeout_s"
    assert _row(out, "transfer_timeout_s") == "20 derived from request_timeout_s"
    assert _row(out, "retry_fresh_blocks") == "false fixed"
    assert _row(out, "cluster_key") == "(not shown) file"
    assert SECRET not in "\n".join(out)
    assert {"placement", "transfer", "liveness", "failover", "security",
            "experimental (unsupported)", "derived"} <= set(out)
    assert "  not checked: TP 1 against the model's KV heads (give --model)" in out


def test_sources_from_the_environment_are_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LW_CLUSTER_KEY", SECRET)
    monkeypatch.setenv("VLLM_HOST_IP", "10.1.2.3")
    code, out, _ = _run(capsys, "--explain", "--role", "prefill",
                        _file(tmp_path, {}, kv_role="kv_producer"))
    assert code == 0
    assert _row(out, "host") == '"10.1.2.3" environment $VLLM_HOST_IP'
    assert _row(out, "cluster_key") == "(not shown) environment $LW_CLUSTER_KEY"
    monkeypatch.delenv("LW_CLUSTER_KEY")
    _, out, _ = _run(capsys, "--explain", "--role", "prefill",
                     _file(tmp_path, {}, kv_role="kv_producer"))
    assert _row(out, "cluster_key") == ('"" default (unset: side channel and metaserver '
                                        "calls unauthenticated)")
    assert SECRET not in "\n".join(out)
    assert _row(out, "bind_host") == '"" default (= host, 10.1.2.3)'


def test_a_bad_file_exits_2_naming_every_refused_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _file(tmp_path, {"host": "10.0.0.2", "lease_s": 100, "layer_batch_ms": 5,
                            "leas": 3, "heartbeat_s": -1, "push_mode": "eager",
                            "cluster_key": 12345678901234567890,
                            "experimental": {"bogus": 1, "layer_batch_ms": 2000}})
    code, out, err = _run(capsys, "--explain", "--role", "decode", path)
    assert code == 2
    assert all(line.startswith("error: ") for line in err)
    text = "\n".join(err)
    for needle in ("lease_s is no longer a setting: derived from request_timeout_s",
                   "layer_batch_ms moved to kv_connector_extra_config.experimental."
                   "layer_batch_ms",
                   "unknown kv_connector_extra_config key 'leas'",
                   "unknown kv_connector_extra_config.experimental key 'bogus'",
                   "experimental.layer_batch_ms must be in [0, 1000], got 2000",
                   "push_mode='eager'", "heartbeat_s must be >= 0",
                   "cluster_key must be a string, got a value that is not shown (secret)"):
        assert needle in text, needle
    assert len(err) == 8 and out[-1] == "8 problem(s)"
    assert "12345678901234567890" not in text + "\n".join(out)
    assert "(values as if the refused keys were not given)" in out
    assert _row(out, "heartbeat_s") == "0.5 default"  # shown without the refused value


def test_model_checks_run_only_with_model(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 8,
                                                   "num_key_value_heads": 4}))
    path = _file(tmp_path, {"host": "10.0.0.2", "peer_tp_size": 3})
    code, out, err = _run(capsys, "--explain", "--role", "decode", "--tp", "2", path)
    assert (code, err) == (0, [])
    assert "  not checked: TP 2 and peer_tp_size 3 against the model's KV heads " \
           "(give --model)" in out
    code, out, err = _run(capsys, "--explain", "--role", "decode", "--tp", "3", "--model",
                          str(model), path)
    assert code == 2
    assert any("peer_tp_size=3: the prefill engine cannot shard this model's KV" in e
               for e in err)
    assert any("--tp 3: this engine cannot shard the model's KV (4 KV heads do not split "
               "evenly over TP 3)" in e for e in err)
    (model / "config.json").write_text(json.dumps({"kv_lora_rank": 512,
                                                   "num_attention_heads": 16}))
    code, out, err = _run(capsys, "--explain", "--role", "decode", "--tp", "3", "--model",
                          str(model), path)
    assert (code, err) == (0, [])
    assert any(f"checked with --model {model} (MLA" in line for line in out)


def test_contradictions_with_the_command_line_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "--explain", "--role", "prefill", _file(tmp_path, {}))
    assert code == 2 and "kv_role is 'kv_consumer' in the file, but --role says prefill" in err[0]
    code, _, err = _run(capsys, "--explain", "--role", "decode", "--tp", "2",
                        _file(tmp_path, {"retry_prefill": 1}))
    assert code == 2 and "retry_prefill=1 needs the decode engine's tensor_parallel_size 1" \
        in err[0]
    code, out, err = _run(capsys, "--explain", "--role", "decode",
                          _file(tmp_path, {}, kv_port=70000))
    assert code == 2 and "valid TCP ports" in err[0]
    assert "placement" not in out  # nothing to show: no config could be built


def test_a_multiconnector_file_is_read_for_lws_part(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = {"kv_connector": "MultiConnector", "kv_role": "kv_consumer", "engine_id": "d0",
           "kv_connector_extra_config": {"connectors": [
               {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"},
               {"kv_connector": "LwConnector", "kv_connector_module_path": "lw.vllm_adapter",
                "kv_port": 14800, "kv_connector_extra_config": {"host": "10.0.0.2"}}]}}
    path = tmp_path / "multi.json"
    path.write_text(json.dumps(doc))
    code, out, _ = _run(capsys, "--explain", "--role", "decode", str(path))
    assert code == 0 and "kv_port 14800" in out[0]


@pytest.mark.parametrize(("content", "needle"), [
    ("{not json", "kv.json: Expecting property name"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}', "not 'LwConnector'"),
    ('{"host": "10.0.0.2"}', "not a --kv-transfer-config"),
    ('{"kv_connector_extra_config": 3}', "kv_connector_extra_config must be a JSON object"),
])
def test_unreadable_files_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 content: str, needle: str) -> None:
    path = tmp_path / "kv.json"
    path.write_text(content)
    code, _, err = _run(capsys, "--explain", "--role", "decode", str(path))
    assert code == 2 and needle in "\n".join(err)


def test_the_command_needs_explain_and_a_role(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    for args in (["--role", "decode", "f"], ["--explain", "f"],
                 ["--explain", "--role", "both", "f"], ["--explain", "--role", "decode",
                                                        "--tp", "0", "f"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(["config", *args])
        assert exc.value.code == 2
    assert "config" in cli.usage()
