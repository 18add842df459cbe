"""Root conftest of the test suite: strict skips, and no per-example deadline for property tests.

With ``LW_STRICT_SKIPS=1`` in the environment (``scripts/test.sh`` sets it), a session in which
some test or test module was skipped fails (exit status 1) unless the skip is declared expected
in :data:`EXPECTED_SKIPS`; the summary names every unexpected skip and its reason. A skip hides a
test that did not run: on a correctly bootstrapped machine every test runs, so a skip is a
missing dependency (``pytest.importorskip("vllm")`` with vLLM uninstalled, no root for network
namespaces, ...) that the suite must report rather than pass over. Without the variable, skips
are reported as pytest always does.
"""

from __future__ import annotations

import fnmatch
import os
import re

import pytest
from hypothesis import settings

pytest_plugins = ["pytester"]  # tests/test_strict_skips.py runs tiny pytest sessions

# Property tests are judged by their examples, not their speed: Hypothesis's default 200 ms
# deadline per example fails a correct test on a loaded 2-core machine (seen:
# tests/fsm/test_push_schedule.py beside a benchmark). Tests with settings of their own keep them.
settings.register_profile("lw", deadline=None)
settings.load_profile("lw")

STRICT_ENV = "LW_STRICT_SKIPS"

# The skips that are expected on a correctly bootstrapped machine, all in one place:
# (node id glob, regular expression searched in the skip reason, why the skip is expected).
# Keep it empty unless such a skip is legitimate; an entry that matches nothing is harmless.
EXPECTED_SKIPS: tuple[tuple[str, str, str], ...] = ()


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The skip reason pytest shows for ``report`` (without its "Skipped: " prefix)."""
    longrepr = report.longrepr
    text = str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def _expected(nodeid: str, reason: str) -> bool:
    return any(fnmatch.fnmatchcase(nodeid, node_glob) and re.search(reason_re, reason)
               for node_glob, reason_re, _why in EXPECTED_SKIPS)


class _StrictSkips:
    """Records the session's unexpected skips; fails the session and lists them at the end."""

    def __init__(self) -> None:
        self.skipped: list[tuple[str, str]] = []

    def _record(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):  # an xfail is reported as skipped
            reason = _reason(report)
            if not _expected(report.nodeid, reason):
                self.skipped.append((report.nodeid, reason))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._record(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        """Module-level skips (``pytest.importorskip`` at import, ``allow_module_level``)."""
        self._record(report)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Turn a passing (or empty) session with unexpected skips into a failing one."""
        if self.skipped and session.exitstatus in (pytest.ExitCode.OK,
                                                   pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.skipped:
            return
        terminalreporter.section(f"unexpected skips ({STRICT_ENV}=1)", red=True, bold=True)
        for nodeid, reason in self.skipped:
            terminalreporter.line(f"SKIPPED {nodeid}: {reason}", red=True)
        terminalreporter.line(
            f"{len(self.skipped)} unexpected skip(s): the session fails. Install what is "
            f"missing (bash scripts/bootstrap.sh), or declare the skip in EXPECTED_SKIPS "
            f"(tests/conftest.py) with why it is expected.", red=True, bold=True)


def pytest_configure(config: pytest.Config) -> None:
    # Under pytest-xdist only the controller (no ``workerinput``) judges: it sees every report.
    if os.environ.get(STRICT_ENV, "") == "1" and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_StrictSkips(), "lw-strict-skips")
