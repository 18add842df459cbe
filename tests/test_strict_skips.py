"""The strict-skips hook of tests/conftest.py, run on tiny pytest sessions (``pytester``)."""

from __future__ import annotations

from pathlib import Path

import pytest

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()

TESTS = """
import pytest

def test_runs():
    pass

@pytest.mark.skipif(True, reason="no frobnicator here")
def test_needs_a_frobnicator():
    pass

def test_skips_inside():
    pytest.skip("skipped from the body")

@pytest.mark.xfail(reason="a known bug, not a skip")
def test_known_bug():
    assert False
"""


def _session(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, strict: bool,
             expected: str = "()", **files: str) -> pytest.RunResult:
    """Run pytest in-process on ``files`` with the suite's conftest (``EXPECTED_SKIPS`` set)."""
    if strict:
        monkeypatch.setenv("LW_STRICT_SKIPS", "1")
    else:
        monkeypatch.delenv("LW_STRICT_SKIPS", raising=False)
    # No entry-point plugins: hypothesis's would re-import (and assert-rewrite) all of hypothesis.
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makeconftest(CONFTEST + f"\nEXPECTED_SKIPS = {expected}\n")
    pytester.makepyfile(**files)
    return pytester.runpytest("-p", "no:cacheprovider")


def test_without_the_variable_skips_pass_as_usual(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _session(pytester, monkeypatch, strict=False, test_a=TESTS)
    result.assert_outcomes(passed=1, skipped=2, xfailed=1)
    assert result.ret == pytest.ExitCode.OK
    assert "unexpected skips" not in result.stdout.str()


def test_strict_fails_the_session_naming_each_skip_and_its_reason(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _session(pytester, monkeypatch, strict=True, test_a=TESTS)
    result.assert_outcomes(passed=1, skipped=2, xfailed=1)  # the xfail is not counted
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([
        "*unexpected skips (LW_STRICT_SKIPS=1)*",
        "SKIPPED test_a.py::test_needs_a_frobnicator: no frobnicator here",
        "SKIPPED test_a.py::test_skips_inside: skipped from the body",
        "2 unexpected skip(s): the session fails.*",
    ])
    assert "test_known_bug" not in result.stdout.str().split("unexpected skips")[1]


def test_strict_passes_when_every_skip_is_declared_expected(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = ('(("*::test_needs_a_frobnicator", "frobnicator", "none on CI"),'
                ' ("test_a.py::test_skips_*", "^skipped from", "tested elsewhere"))')
    result = _session(pytester, monkeypatch, strict=True, expected=expected, test_a=TESTS)
    result.assert_outcomes(passed=1, skipped=2, xfailed=1)
    assert result.ret == pytest.ExitCode.OK
    assert "unexpected skips" not in result.stdout.str()


def test_an_expected_entry_must_match_both_the_test_and_the_reason(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = '(("*::test_needs_a_frobnicator", "some other reason", "not this one"),)'
    result = _session(pytester, monkeypatch, strict=True, expected=expected, test_a=TESTS)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["SKIPPED *::test_needs_a_frobnicator: no frobnicator here"])


def test_strict_fails_a_module_skipped_by_importorskip(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM uninstalled: its test modules skip at import; the session fails and names them,
    even when that leaves no test at all."""
    missing = 'import pytest\npytest.importorskip("lw_no_such_module")\n\ndef test_x():\n    pass\n'
    result = _session(pytester, monkeypatch, strict=True, test_needs=missing)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        ["SKIPPED test_needs.py: could not import 'lw_no_such_module'*"])


def test_strict_keeps_a_failing_session_failing(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing = TESTS + "\ndef test_fails():\n    assert False\n"
    result = _session(pytester, monkeypatch, strict=True, test_a=failing)
    result.assert_outcomes(passed=1, failed=1, skipped=2, xfailed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*unexpected skips (LW_STRICT_SKIPS=1)*"])
