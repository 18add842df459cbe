"""``lw demo --engine synthetic`` refuses bad numbers and an unwritable ``--trace-out`` before it
starts a worker, with exit 2 and the flag named."""

from __future__ import annotations

import pytest

from lw.lab import demo
from lw.lab.synthetic import ClusterConfig

BASE = ["--engine", "synthetic", "--requests", "2", "--data-plane", "inprocess", "--quiet"]


@pytest.mark.parametrize("flag, value", [("--layer-ms", "-1"), ("--layer-ms", "nan"),
                                         ("--token-ms", "nan"), ("--kv-heads", "-2"),
                                         ("--block-kib", "0"), ("--block-kib", "-4")])
def test_a_bad_number_is_refused_naming_its_flag(flag: str, value: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main([*BASE, flag, value]) == 2
    assert flag in capsys.readouterr().err


def test_trace_out_into_a_missing_directory_is_refused_before_the_run(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main([*BASE, "--trace-out", "/nonexistent/x.json"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--trace-out" in err and "/nonexistent" in err


def test_the_config_refuses_them_for_every_caller() -> None:
    """Callers other than the demo (tests, benchmarks) get the same checks."""
    for bad in (dict(layer_ms=float("nan")), dict(kv_heads=-1), dict(block_bytes=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ClusterConfig(data_plane="inprocess", **bad)  # type: ignore[arg-type]


def test_the_vllm_demo_on_nixl_says_so_or_refuses_without_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``--data-plane nixl`` without NIXL installed: exit 2 before a model or engine is made."""
    from lw.lab import vllm_demo
    from lw.transport.dataplane import nixl

    monkeypatch.setattr(nixl, "nixl_missing", lambda: "NIXL is not installed")
    assert demo.main(["--engine", "vllm", "--data-plane", "nixl"]) == 2
    assert "--data-plane mooncake" in capsys.readouterr().err
    assert "NIXL" in vllm_demo.plane_label("nixl") and "lease-only" in vllm_demo.plane_label("nixl")
    assert vllm_demo.plane_label("mooncake") == "Mooncake over TCP"


def test_an_unknown_fault_in_a_list_is_refused_naming_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--fault a,b`` runs those rows of the table; one unknown name refuses the whole list
    before a worker starts."""
    assert demo.main([*BASE, "--fault", "none,partition-lon"]) == 2
    err = capsys.readouterr().err
    assert "unknown fault 'partition-lon'" in err and "partition-long" in err


def test_a_list_of_faults_runs_those_rows_as_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main([*BASE, "--fault", "none,drop"]) == 0
    out = capsys.readouterr().out
    lines = [ln.split()[0] for ln in out.splitlines() if ln.split()]
    assert lines.index("none") < lines.index("drop-messages"), out
    assert out.rstrip().splitlines()[-1].startswith("summary done=4 failed=0"), out
