"""The core stays sans-I/O: importing lw.fsm loads no network, thread, clock or ML module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

FORBIDDEN = ("zmq", "torch", "vllm", "mooncake", "socket", "asyncio", "threading", "time",
             "select", "selectors", "subprocess")
FSM_DIR = Path(__file__).resolve().parents[2] / "lw" / "fsm"


def test_importing_lw_fsm_loads_no_io_module() -> None:
    code = (
        "import sys; before = set(sys.modules); import lw.fsm; "
        f"bad = sorted(m for m in set(sys.modules) - before if m.split('.')[0] in {FORBIDDEN!r}); "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"lw.fsm pulled in: {out.stdout.strip()}"


def test_fsm_sources_import_nothing_forbidden() -> None:
    for path in FSM_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"


def test_fsm_imports_nothing_of_lw_above_it() -> None:
    for path in FSM_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lw"):
                assert node.module.startswith("lw.fsm"), f"{path.name} imports {node.module}"
            if isinstance(node, ast.Import):
                for a in node.names:
                    assert not a.name.startswith("lw") or a.name.startswith("lw.fsm"), a.name
