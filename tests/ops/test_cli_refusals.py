"""``lw status`` refuses bad flags and keys with exit 2 and a message naming the flag or the
environment variable, before it asks any worker."""

from __future__ import annotations

import pytest

from lw.ops import cli

WORKERS = ["--workers", "127.0.0.1:9"]  # never asked: every case is refused before


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("key", ["short", "hex:zz", "hex:0011"])
def test_a_bad_cluster_key_flag_is_named(key: str, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LW_CLUSTER_KEY", raising=False)
    assert "--cluster-key" in _refused([*WORKERS, "--cluster-key", key], capsys)


def test_a_bad_cluster_key_from_the_environment_names_the_variable(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LW_CLUSTER_KEY", "tooshort")
    err = _refused(WORKERS, capsys)
    assert "LW_CLUSTER_KEY" in err and "16 bytes" in err


@pytest.mark.parametrize("flag, value", [("--watch", "nan"), ("--watch", "0"),
                                         ("--watch", "-1"), ("--timeout", "-1"),
                                         ("--timeout", "0"), ("--timeout", "nan"),
                                         ("--timeout", "inf")])
def test_a_non_positive_or_nan_interval_is_refused(flag: str, value: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert flag in _refused([*WORKERS, flag, value], capsys)


def test_trace_out_into_a_missing_directory_is_refused_up_front(
        capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused([*WORKERS, "--trace-out", "/nonexistent/dir/x.json"], capsys)
    assert "--trace-out" in err and "/nonexistent/dir" in err
