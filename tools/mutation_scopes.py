"""What ``tools/mutation.py`` mutates and which tests must kill it: one :class:`Scope` per
``--scope`` (lw's sans-I/O core, and the code that decides who and what is let in)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["FSM", "SCOPES", "SECURITY", "Scope"]

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Scope:
    """A target set: the modules mutated, the killer suite and the equivalents file."""

    name: str  # the --scope value
    label: str  # names the scope in the score line
    modules: tuple[str, ...]  # files, or directories of which every *.py
    test_paths: tuple[str, ...]  # the test files/directories the killer suite draws from
    equivalent: Path  # the survivors shown equivalent (JSON list of {id, mutant, reason})
    cache_name: str  # file name of its results cache
    # `lw check` runs for the mutants the tests miss (argv after `lw check --design d-first
    # --mode exhaustive`)
    checks: tuple[tuple[str, ...], ...] = ()
    # tests under these prefixes are in the killer suite only when their traced run is short
    timed: tuple[str, ...] = ()
    # module -> the only functions mutated in it ("" is module level); absent: all of it
    functions: dict[str, frozenset[str]] = field(default_factory=dict)
    pytest_args: tuple[str, ...] = ()  # added to every pytest run (a marker filter)
    # a test is in the killer suite only if it ran a line of the scope, and a module-level
    # mutant runs the tests that ran a line of its module (else: every fast test)
    needs_lines: bool = False
    # two pytest runs per mutant: the first test's module, then the others (collecting the
    # proxy's test modules costs more than running most of their tests)
    staged: bool = False
    # the baseline also traces threads a test starts (servers in threads: the proxy's apps)
    trace_threads: bool = False
    # a mutant's tests that run longer than this + 4 x their traced time count as a hang (a kill)
    hang_floor_s: float = 10.0
    # tests of files that start subprocesses run for every mutant (their lines are not traced)
    subprocess_tests: bool = True
    preimport: tuple[str, ...] = ()  # third-party modules imported before the workers fork

    def files(self) -> list[Path]:
        """The modules mutated, in path order."""
        out: list[Path] = []
        for m in self.modules:
            p = ROOT / m
            out += sorted(p.glob("*.py")) if p.is_dir() else [p]
        return out

    def mutated(self, module: str, function: str) -> bool:
        """Whether the scope mutates this function (or module level, "") of ``module``."""
        only = self.functions.get(module)
        return only is None or function in only


_BASE_IMPORTS = ("hypothesis", "msgspec", "numpy", "pytest")

FSM = Scope(
    name="fsm", label="lw/fsm", modules=("lw/fsm",),
    test_paths=("tests/fsm", "tests/sim", "tests/transport/test_wire.py"),
    equivalent=ROOT / "tools" / "mutation_equivalent.json", cache_name="results.json",
    # Small exhaustive bounds, a few seconds each: several P ranks, a P rank writing two D TP
    # ranks, and (state-bounded) faults.
    checks=(
        ("--dp", "2", "--requests", "2", "--layers", "2"),
        ("--dp", "2", "--d-tp", "2", "--requests", "2", "--layers", "2"),
        ("--dp", "1", "--requests", "1", "--layers", "1", "--faults", "--max-states", "2500"),
    ),
    timed=("tests/sim/",), preimport=(*_BASE_IMPORTS, "transitions"),
)

# Who is let in: the contract's signed params, control-call signatures and client screening
# (lw/contract; tracefile.py is left out: it reads `lw validate`'s own recorded traces, a local
# file the operator points it at, and lets nobody in), the side channel's frame MAC and replay
# checks, the proxy's control plane, body limits and intake, the sidecar's prefill allowlist
# and the engines' admission middleware.
SECURITY = Scope(
    name="security", label="security",
    modules=tuple(f"lw/contract/{m}.py" for m in (
        "__init__", "ahead", "auth", "client", "params", "sampling", "transfer_ids",
        "worker_addrs")) + (
        "lw/transport/frames.py", "lw/proxy/control.py", "lw/proxy/limits.py",
        "lw/proxy/intake.py", "lw/proxy/sidecar.py", "lw/vllm_adapter/admission.py"),
    # tests/transport: the frame tests, not the data planes' and links' (other code, seconds)
    test_paths=("tests/contract", "tests/proxy", "tests/transport/test_frame*.py",
                "tests/transport/test_statusreply.py",
                # not the connector's tests: each imports vLLM and torch (seconds a mutant)
                "tests/vllm_adapter/test_admission*.py",
                "tests/vllm_adapter/test_edge_refusals.py"),
    equivalent=ROOT / "tools" / "mutation_equivalent_security.json",
    cache_name="results-security.json",
    timed=("tests/",),
    # the allowlist: how a prefill target is read and whether it is admitted (not the
    # Backend bookkeeping around it)
    functions={"lw/proxy/sidecar.py": frozenset({
        "", "_name", "_address", "_port_of", "_split", "_url", "canonical_url",
        "prefiller_from_headers", "admits", "parse_allow", "_allow", "target"})},
    pytest_args=("-m", "not slow"), needs_lines=True, subprocess_tests=False,
    staged=True, trace_threads=True,
    hang_floor_s=60.0,  # a loaded machine: a test module's setup alone took 10 s
    preimport=(*_BASE_IMPORTS, "aiohttp", "fastapi", "httpx", "starlette", "zmq"),
)

SCOPES = {s.name: s for s in (FSM, SECURITY)}
