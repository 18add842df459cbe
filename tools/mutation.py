"""Mutation testing of lw's sans-I/O core (``lw/fsm``) and, with ``--scope security``, of the
code that decides who and what is let in: one command, a score, the survivors.

    .venv/bin/python tools/mutation.py [--scope fsm|security] [--jobs 2] [--module prefill]
        [--sample N] [--list]

Below, for the default scope ``fsm``; ``--scope security`` (tools/mutation_scopes.py: lw/contract,
the side channel's frames, the proxy's control plane, limits, intake and prefill allowlist, the
engines' admission) has its own fast tests, no ``lw check``, and its equivalents in
``tools/mutation_equivalent_security.json``. The mutator is tools/mutation_mutants.py.

Each mutant is one small AST change of one module of ``lw/fsm`` (comparison and boolean
operators, ``not`` removed, an ``if``/``while`` condition negated, an int constant +-1, a bool
flipped, arithmetic swapped, a statement that emits an effect or changes state deleted, a
returned value replaced by ``None``). It is applied to a private copy of the package (never to
the working tree) and must be killed by the *killer suite*:

1. the fast tests (``tests/fsm``, ``tests/transport/test_wire.py`` and the ``tests/sim`` tests
   under ``--max-test-seconds`` in the traced baseline) that execute the mutated line, fastest
   first, stopping at the first failure; a mutant that hangs past the timeout counts as killed;
2. for the mutants the tests miss, ``lw check`` at small bounds (``CHECKS``): exit != 0 kills.

A baseline run (unmutated copy, line tracing restricted to ``lw/fsm``) records which test runs
which line and how long it takes; it is cached by the hash of ``lw`` and the tests. Results are
cached per mutant (hash of the mutated module): a killed mutant stays killed, a survivor is run
again when ``lw`` or the tests changed. Each run is a fork of a worker that has already imported
pytest, hypothesis, msgspec and transitions, so a mutant costs its tests, not an interpreter.

Survivors shown equivalent (no observable behaviour differs) are listed in
``tools/mutation_equivalent.json`` by mutant id (printed with every survivor), each with its
reason. The score is printed raw (killed / all mutants) and adjusted (killed / (all mutants -
listed equivalent survivors)); an entry that matches no mutant, or a mutant that was killed, is
printed as stale (and makes the command exit 1), never ignored.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mutation_mutants import Mutant, mutants_of
from mutation_scopes import FSM, ROOT, SCOPES, Scope

SCOPE: Scope = FSM
"""The target set of this run (``--scope``); set before the workers fork, read by them."""


def all_mutants(modules: list[str]) -> list[tuple[Mutant, str]]:
    """Mutants of the named modules of the scope (all when empty), in file and line order."""
    out: list[tuple[Mutant, str]] = []
    for path in SCOPE.files():
        rel = path.relative_to(ROOT).as_posix()
        if modules and path.stem not in modules and rel not in modules:
            continue
        out += [(m, src) for m, src in mutants_of(rel, path.read_text())
                if SCOPE.mutated(rel, m.function)]
    return out


# ------------------------------------------------------------------------------- hashing
def _hash_files(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.relative_to(ROOT).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def test_files() -> list[Path]:
    """The test modules the killer suite draws from."""
    files: list[Path] = []
    for t in SCOPE.test_paths:
        q = ROOT / t
        files += sorted(q.rglob("test_*.py")) if q.is_dir() else sorted(ROOT.glob(t))
    return files


def lw_hash() -> str:
    """Hash of lw and of the test helpers (every test module's results depend on them)."""
    helpers = [p for t in SCOPE.test_paths if (ROOT / t).is_dir()
               for p in (ROOT / t).rglob("*.py") if not p.name.startswith("test_")]
    return _hash_files([*(ROOT / "lw").rglob("*.py"), *helpers])


def suite_hash() -> str:
    """Hash of everything a result depends on besides the mutant: lw, the tests, the checks."""
    return (lw_hash() + _hash_files(test_files())
            + hashlib.sha256(repr(SCOPE.checks).encode()).hexdigest()[:8])


def mutant_key(m: Mutant, mutated: str) -> str:
    return hashlib.sha256(m.module.encode() + b"\0" + mutated.encode()).hexdigest()[:24]


# ------------------------------------------------------------------------------- sandbox
def make_sandbox(parent: Path | None = None) -> Path:
    """A private copy of lw and the tests; docs and scripts are linked (read only)."""
    box = Path(tempfile.mkdtemp(prefix="lw-mutation-", dir=parent))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "lw", box / "lw", ignore=ignore)
    shutil.copytree(ROOT / "tests", box / "tests", ignore=ignore)
    for name in ("docs", "scripts", "benchmarks", "pyproject.toml", "README.md"):
        if (ROOT / name).exists():
            (box / name).symlink_to(ROOT / name)
    return box


def _enter_sandbox(box: Path) -> None:
    """In a forked child: make ``import lw`` find the sandbox copy only."""
    os.chdir(box)
    here = {str(ROOT), "", "."}
    sys.path[:] = [str(box)] + [p for p in sys.path if p not in here]
    os.environ["PYTHONPATH"] = str(box)
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    sys.dont_write_bytecode = True
    shutil.rmtree(box / ".hypothesis", ignore_errors=True)
    log = os.open(box / "run.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)


def run_forked(box: Path, fn: Callable[[], int], timeout: float) -> tuple[int | None, float]:
    """Run ``fn`` in a forked child inside ``box``: (exit code or None on timeout, seconds)."""
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child
        code = 70
        try:
            os.setpgid(0, 0)
            _enter_sandbox(box)
            code = int(fn())
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - any crash of the mutant kills it
            import traceback
            traceback.print_exc()
            code = 71
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = t0 + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), time.monotonic() - t0
        if time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return None, time.monotonic() - t0
        time.sleep(0.02)


# ------------------------------------------------------------------------------- pytest runs
class _Recorder:
    """pytest plugin: first failing test, and (baseline) per-test lines of the scope's modules
    and timing."""

    def __init__(self, box: Path, trace: bool) -> None:
        self.files = {str(box / p.relative_to(ROOT)) for p in SCOPE.files()}
        self.packages = tuple(".".join(p.relative_to(ROOT).with_suffix("").parts)
                              .removesuffix(".__init__") for p in SCOPE.files())
        self.root = str(box) + os.sep
        self.trace = trace
        self.lines: dict[str, set[tuple[str, int]]] = {}
        self.module_level: set[tuple[str, int]] = set()
        self.durations: dict[str, float] = {}
        self.failed: list[str] = []
        self._cur: set[tuple[str, int]] = self.module_level

    def _global(self, frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename in self.files:
            return self._local
        return None

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            self._cur.add((frame.f_code.co_filename[len(self.root):], frame.f_lineno))
        return self._local

    def pytest_configure(self, config: Any) -> None:
        if self.trace:
            sys.settrace(self._global)
            if SCOPE.trace_threads:  # servers in threads: their lines count for the test
                threading.settrace(self._global)

    def pytest_runtest_setup(self, item: Any) -> None:
        if self.trace:
            for name, mod in list(sys.modules.items()):
                if name.startswith(self.packages):
                    for obj in vars(mod).values():
                        if callable(getattr(obj, "cache_clear", None)):
                            obj.cache_clear()  # every test that needs a cached value computes it
            self._cur = self.lines.setdefault(item.nodeid, set())
            sys.settrace(self._global)

    def pytest_runtest_teardown(self, item: Any) -> None:
        self._cur = self.module_level

    def pytest_runtest_logreport(self, report: Any) -> None:
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration
        if report.failed and report.nodeid not in self.failed:
            self.failed.append(report.nodeid)
            (Path(self.root) / "killer.txt").write_text(report.nodeid)


def _pytest(args: list[str], plugin: _Recorder) -> int:
    import pytest

    return int(pytest.main(["-q", "-p", "no:cacheprovider", "-W", "ignore", *SCOPE.pytest_args,
                            *args],
                           plugins=[plugin]))


def trace_tests(box: Path, files: list[str]) -> dict[str, Any]:
    """Run test modules once on the unmutated copy, tracing the scope's lines per test."""

    def child() -> int:
        rec = _Recorder(box, trace=True)
        _pytest(files, rec)
        data = {
            "lines": {k: sorted(f"{f}:{n}" for f, n in v) for k, v in rec.lines.items()},
            "module_level": sorted(f"{f}:{n}" for f, n in rec.module_level),
            "durations": rec.durations,
            "failed": rec.failed,
        }
        (box / "baseline.json").write_text(json.dumps(data))
        return 0

    code, _ = run_forked(box, child, 3600)
    if code != 0:
        sys.exit(f"baseline test run failed (exit {code}); see {box / 'run.log'}")
    return json.loads((box / "baseline.json").read_text())


def baseline(cache: dict[str, Any]) -> dict[str, Any]:
    """Per-test lines and durations (traced again only for changed test modules, or all when
    lw changed) and the duration of each check, merged into one table."""
    base = cache.setdefault("baseline", {})
    lwh = lw_hash()
    if base.get("lw") != lwh:
        base.clear()
        base["lw"] = lwh
    per_file = base.setdefault("files", {})
    stale = []
    for f in test_files():
        rel = f.relative_to(ROOT).as_posix()
        h = _hash_files([f])
        if per_file.get(rel, {}).get("hash") != h:
            stale.append((rel, h))
    box = make_sandbox()
    try:
        if stale:
            print(f"baseline: tracing {len(stale)} test module(s) on an unmutated copy ...",
                  flush=True)
            data = trace_tests(box, [rel for rel, _ in stale])
            for rel, h in stale:
                mine = {k: v for k, v in data["lines"].items() if k.split("::")[0] == rel}
                per_file[rel] = {
                    "hash": h, "lines": mine,
                    "durations": {k: v for k, v in data["durations"].items() if k in mine},
                    "failed": [k for k in data["failed"] if k.split("::")[0] == rel],
                    "module_level": data["module_level"],
                }
        checks_key = hashlib.sha256(repr(SCOPE.checks).encode()).hexdigest()[:8]
        if base.get("checks_key") != checks_key:
            secs_all = []
            for argv in SCOPE.checks:
                code, secs = run_forked(box, lambda a=argv: _check(a), 600)
                if code != 0:
                    sys.exit(f"baseline `lw check {' '.join(argv)}` exited {code}")
                secs_all.append(secs)
            base["check_seconds"] = secs_all
            base["checks_key"] = checks_key
    finally:
        shutil.rmtree(box, ignore_errors=True)
    current = {f.relative_to(ROOT).as_posix() for f in test_files()}
    merged: dict[str, Any] = {"lines": {}, "durations": {}, "failed": [], "module_level": set(),
                              "check_seconds": base["check_seconds"]}
    for rel, d in per_file.items():
        if rel not in current:
            continue
        merged["lines"].update(d["lines"])
        merged["durations"].update(d["durations"])
        merged["failed"] += d["failed"]
        merged["module_level"] |= set(d["module_level"])
    merged["subprocess_tests"] = [
        t for t in merged["lines"]
        if SCOPE.subprocess_tests and "subprocess" in (ROOT / t.split("::")[0]).read_text()]
    return merged


def _check(argv: tuple[str, ...]) -> int:
    from lw.sim.cli import main  # the sandbox's copy

    return int(main(["--design", "d-first", "--mode", "exhaustive", *argv]) or 0)


# ------------------------------------------------------------------------------- workers
_BOX: Path | None = None


def _worker_init(parent: Path) -> None:
    global _BOX
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _BOX = make_sandbox(parent)


@dataclass
class Job:
    """A mutant to run: where, the mutated source, the tests to run and the time budgets."""

    mutant: Mutant
    mutated: str
    tests: list[str]
    test_timeout: float
    check_timeouts: list[float]


def run_job(job: Job) -> dict[str, Any]:
    """Apply one mutant to this worker's sandbox, run the killer suite, restore the module."""
    assert _BOX is not None
    target = _BOX / job.mutant.module
    original = target.read_text()
    target.write_text(job.mutated)
    t0 = time.monotonic()
    try:
        res = _kill(job)
    finally:
        target.write_text(original)
    res["seconds"] = round(time.monotonic() - t0, 2)
    return res


def _stages(tests: list[str]) -> list[list[str]]:
    """The pytest runs of one mutant: one, or (``Scope.staged``) first the test module whose
    tests come earliest on average (``tests`` is fastest first: unit tests before the proxy's
    servers), then the rest, so that a mutant that module kills costs only its setup."""
    if not SCOPE.staged:
        return [tests] if tests else []
    where: dict[str, list[int]] = {}
    for i, t in enumerate(tests):
        where.setdefault(t.split("::")[0], []).append(i)
    first = min(where, key=lambda f: sum(where[f]) / len(where[f]), default="")
    head = [t for t in tests if t.split("::")[0] == first]
    rest = [t for t in tests if t.split("::")[0] != first]
    return [s for s in (head, rest) if s]


def _kill(job: Job) -> dict[str, Any]:
    assert _BOX is not None
    box = _BOX
    for tests in _stages(job.tests):
        (box / "killer.txt").unlink(missing_ok=True)
        code, _ = run_forked(box, lambda t=tests: _pytest(["-x", *t], _Recorder(box, False)),
                             job.test_timeout)
        if code is None:
            return {"status": "timeout", "by": "tests (hang)"}
        if code != 0:
            who = (box / "killer.txt").read_text() if (box / "killer.txt").exists() else ""
            return {"status": "killed", "by": who or f"pytest exit {code}"}
    for argv, limit in zip(SCOPE.checks, job.check_timeouts, strict=True):
        code, _ = run_forked(box, lambda a=argv: _check(a), limit)
        cmd = "lw check " + " ".join(argv)
        if code is None:
            return {"status": "timeout", "by": cmd + " (hang)"}
        if code != 0:
            return {"status": "killed", "by": cmd}
    return {"status": "survived", "by": ""}


# ------------------------------------------------------------------------------- main
def _tests_for(m: Mutant, base: dict[str, Any], fast: list[str],
               index: dict[str, set[str]]) -> list[str]:
    """Fast tests that execute the mutant's lines; for module-level code all fast tests, or
    (``Scope.needs_lines``) those that execute any line of its module."""
    lines = {f"{m.module}:{n}" for n in range(m.line, m.end_line + 1)}
    if not m.function or lines & base["module_level"]:
        if SCOPE.needs_lines:
            return [t for t in fast if t in index.get(m.module, set())]
        return fast
    hit = set(base["subprocess_tests"])  # what they run in a child process is not traced
    for line in lines:
        hit |= index.get(line, set())
    return [t for t in fast if t in hit]


def _still_valid(old: dict[str, Any], shash: str, eff: str, fast: set[str]) -> bool:
    """A survivor stays one for the same suite or a part of it; a kill stays one while its
    killer is in the suite (``shash``: the whole suite, ``eff``: the one of this run)."""
    if old["status"] == "survived":
        return old["suite"] in (shash, eff)
    by = old["by"]
    return (by.startswith(("lw check", "pytest exit")) or by in fast
            or (by.startswith("tests") and eff == shash))


def _load_cache(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _save_cache(path: Path, cache: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cache, indent=0, sort_keys=True))
    tmp.replace(path)


def _iter_results(jobs: list[Job], n: int) -> Iterator[tuple[Job, dict[str, Any]]]:
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    parent = Path(tempfile.mkdtemp(prefix="lw-mutation-"))
    try:
        with ctx.Pool(n, initializer=_worker_init, initargs=(parent,)) as pool:
            yield from zip(jobs, pool.imap(run_job, jobs), strict=True)
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def _preimport() -> None:
    """Heavy third-party imports done once, before the workers fork (never lw itself)."""
    import importlib

    for name in SCOPE.preimport:
        importlib.import_module(name)


def main(argv: list[str] | None = None) -> int:
    """Entry point: enumerate, run, print per-module and total scores and the survivors."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scope", choices=sorted(SCOPES), default="fsm",
                    help="what to mutate: fsm (lw/fsm, the default) or security (the code "
                    "that decides who and what is let in; tools/mutation_scopes.py)")
    ap.add_argument("--jobs", type=int, default=2, help="parallel workers (default 2)")
    ap.add_argument("--module", action="append", default=[],
                    help="only this module of the scope (name or path; repeatable)")
    ap.add_argument("--sample", type=int, default=0, help="run N mutants drawn at random")
    ap.add_argument("--seed", type=int, default=0, help="seed of --sample")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--max-test-seconds", type=float, default=2.0,
                    help="a test of the scope's timed paths (fsm: tests/sim) is in the killer "
                    "suite when its traced baseline run is shorter")
    ap.add_argument("--cache", type=Path, default=None,
                    help="results cache (default ~/.cache/lw-mutation/results.json, "
                    "results-security.json for --scope security)")
    ap.add_argument("--fresh", action="store_true", help="ignore cached mutant results")
    ap.add_argument("--without", action="append", default=[], metavar="TEST_MODULE",
                    help="leave a test module out of the killer suite (to measure what it adds)")
    ap.add_argument("--min-score", type=float, default=0.0,
                    help="exit 1 when the adjusted total score (percent) is below this")
    ap.add_argument("--equivalent", type=Path, default=None,
                    help="JSON list of {id, reason} of survivors shown equivalent (default "
                    "tools/mutation_equivalent.json, mutation_equivalent_security.json)")
    args = ap.parse_args(argv)
    global SCOPE
    SCOPE = SCOPES[args.scope]
    args.cache = args.cache or (Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                                / "lw-mutation" / SCOPE.cache_name)
    args.equivalent = args.equivalent or SCOPE.equivalent
    t_start = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up the sandboxes

    mutants = all_mutants(args.module)
    if args.sample and args.sample < len(mutants):
        mutants = sorted(random.Random(args.seed).sample(mutants, args.sample),
                         key=lambda x: (x[0].module, x[0].line, x[0].col))
    if args.list:
        for m, _ in mutants:
            print(f"{m.id}  {m.describe()}")
        print(f"{len(mutants)} mutants")
        return 0

    _preimport()
    cache = _load_cache(args.cache)
    shash = suite_hash()
    base = baseline(cache)
    _save_cache(args.cache, cache)
    failing = set(base["failed"])
    fast = sorted((t for t, d in base["durations"].items()
                   if (d <= args.max_test_seconds or not t.startswith(SCOPE.timed or ("\0",)))
                   and t not in failing and t in base["lines"]
                   and (base["lines"][t] or not SCOPE.needs_lines)
                   and t.split("::")[0] not in args.without),
                  key=lambda t: base["durations"][t])
    for t in sorted(failing):
        print(f"note: {t} fails without any mutant; left out of the killer suite")
    index: dict[str, set[str]] = {}
    for t in fast:
        for line in base["lines"][t]:
            index.setdefault(line, set()).add(t)
            index.setdefault(line.rsplit(":", 1)[0], set()).add(t)  # its module
    suite_secs = sum(base["durations"][t] for t in fast)
    print(f"killer suite: {len(fast)} fast tests ({suite_secs:.1f} s traced), "
          f"{len(SCOPE.checks)} `lw check` runs ({sum(base['check_seconds']):.1f} s)")

    eff = shash + "".join(f" without {w}" for w in sorted(args.without))
    results: dict[Mutant, dict[str, Any]] = {}
    todo: list[Job] = []
    store = cache.setdefault("mutants", {})
    for m, mutated in mutants:
        key = mutant_key(m, mutated)
        old = store.get(key)
        if old and not args.fresh and _still_valid(old, shash, eff, set(fast)):
            results[m] = old
            continue
        tests = _tests_for(m, base, fast, index)
        t_budget = SCOPE.hang_floor_s + 4 * sum(base["durations"][t] for t in tests)
        c_budget = [10.0 + 4 * s for s in base["check_seconds"]]
        todo.append(Job(m, mutated, tests, t_budget, c_budget))
    print(f"{len(mutants)} mutants, {len(results)} cached, {len(todo)} to run "
          f"with {args.jobs} job(s)", flush=True)
    done = 0
    last_save = time.monotonic()
    for job, res in _iter_results(todo, args.jobs) if todo else iter(()):
        done += 1
        res["suite"] = eff
        res["mutant"] = asdict(job.mutant)
        store[mutant_key(job.mutant, job.mutated)] = res
        results[job.mutant] = res
        if res["status"] == "survived":
            print(f"  [{done}/{len(todo)}] SURVIVED {job.mutant.describe()}", flush=True)
        elif done % 25 == 0:
            print(f"  [{done}/{len(todo)}] {time.monotonic() - t_start:.0f} s", flush=True)
        if time.monotonic() - last_save > 30:
            _save_cache(args.cache, cache)
            last_save = time.monotonic()
    _save_cache(args.cache, cache)
    return report(mutants, results, time.monotonic() - t_start, args.min_score,
                  load_equivalent(args.equivalent), partial=bool(args.module),
                  sampled=bool(args.sample), eq_path=args.equivalent)


def load_equivalent(path: Path) -> dict[str, str]:
    """Mutant id -> why it is equivalent, from ``path`` (a JSON list of {id, mutant, reason})."""
    if not path.exists():
        return {}
    out: dict[str, str] = {}
    for entry in json.loads(path.read_text()):
        if not entry.get("reason", "").strip():
            sys.exit(f"{path}: entry {entry.get('id')!r} gives no reason")
        if entry["id"] in out:
            sys.exit(f"{path}: entry {entry['id']!r} listed twice")
        out[entry["id"]] = entry["reason"]
    return out


def report(mutants: list[tuple[Mutant, str]], results: dict[Mutant, dict[str, Any]],
           elapsed: float, min_score: float, equivalent: dict[str, str] | None = None,
           partial: bool = False, sampled: bool = False, eq_path: Path | None = None) -> int:
    """Print the per-module table, the survivors, the stale equivalent entries and the total
    score (raw and adjusted for the survivors shown equivalent); the exit code."""
    equivalent = equivalent or {}
    eq_path = eq_path or SCOPE.equivalent
    per: dict[str, dict[str, int]] = {}
    for m, _ in mutants:
        row = per.setdefault(m.module, {"mutants": 0, "tests": 0, "check": 0, "timeout": 0,
                                        "survived": 0, "equivalent": 0})
        r = results[m]
        row["mutants"] += 1
        if r["status"] == "survived":
            row["survived"] += 1
            row["equivalent"] += m.id in equivalent
        elif r["status"] == "timeout":
            row["timeout"] += 1
        elif r["by"].startswith("lw check"):
            row["check"] += 1
        else:
            row["tests"] += 1

    def pct(killed: int, of: int) -> float:
        return 100.0 * killed / max(of, 1)

    print()
    print(f"{'module':<24} {'mutants':>7} {'by tests':>8} {'by check':>8} {'hang':>5} "
          f"{'survived':>8} {'equiv':>5} {'raw':>7} {'adjusted':>8}")
    tot = dict.fromkeys(("mutants", "tests", "check", "timeout", "survived", "equivalent"), 0)

    def line(name: str, row: dict[str, int]) -> None:
        killed = row["mutants"] - row["survived"]
        print(f"{name:<24} {row['mutants']:>7} {row['tests']:>8} {row['check']:>8} "
              f"{row['timeout']:>5} {row['survived']:>8} {row['equivalent']:>5} "
              f"{pct(killed, row['mutants']):>6.1f}% "
              f"{pct(killed, row['mutants'] - row['equivalent']):>7.1f}%")

    for mod, row in sorted(per.items()):
        for k in tot:
            tot[k] += row[k]
        line(mod, row)
    line("total", tot)
    survivors = [m for m, _ in mutants if results[m]["status"] == "survived"]
    unexplained = [m for m in survivors if m.id not in equivalent]
    if unexplained:
        print(f"\nsurvivors not shown equivalent ({len(unexplained)}):")
        for m in unexplained:
            print(f"  {m.id}  {m.describe()}")
    explained = [m for m in survivors if m.id in equivalent]
    if explained:
        print(f"\nsurvivors shown equivalent ({len(explained)}, {eq_path.name}):")
        for m in explained:
            print(f"  {m.id}  {m.describe()}\n      {equivalent[m.id]}")
    # An entry is stale when its mutant no longer exists (the code changed) or was killed (the
    # claim was wrong, or a test now tells the difference): either way the list must be fixed.
    ran = {m.id: m for m, _ in mutants}
    stems = {Path(m.module).stem for m, _ in mutants}
    stale = []
    for mid in equivalent:
        m = ran.get(mid)
        if m is not None and results[m]["status"] != "survived":
            stale.append(f"{mid}: listed equivalent but killed ({results[m]['by']}): "
                         f"{m.describe()}")
        elif m is None and not sampled and mid.split(".")[0] in stems:
            stale.append(f"{mid}: matches no mutant of {SCOPE.label} (the code changed?)")
    if stale:
        print(f"\nSTALE entries of {eq_path} ({len(stale)}):")
        for s in stale:
            print(f"  {s}")
    killed = tot["mutants"] - tot["survived"]
    raw = pct(killed, tot["mutants"])
    adjusted = pct(killed, tot["mutants"] - tot["equivalent"])
    print(f"\n(hang: killed by the per-mutant timeout) elapsed {elapsed:.0f} s")
    print(f"MUTATION SCORE {SCOPE.label}: {adjusted:.1f}% adjusted = {killed} killed / "
          f"({tot['mutants']} mutants - {tot['equivalent']} shown equivalent); "
          f"raw {raw:.1f}% ({killed}/{tot['mutants']} killed)"
          + (" [partial run: --module/--sample]" if partial or sampled else ""))
    return 1 if adjusted < min_score or stale else 0


if __name__ == "__main__":
    sys.exit(main())
