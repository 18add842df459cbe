"""The committed diagrams are what the declarations generate."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from lw.diagrams import documents, run

ROOT = Path(__file__).resolve().parents[2]


def test_committed_diagrams_are_fresh() -> None:
    out = subprocess.run([sys.executable, "-m", "lw", "diagrams", "--check"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_check_names_the_stale_file(tmp_path: Path, capsys) -> None:
    assert run(tmp_path, check=False) == 0
    (tmp_path / "decode.md").write_text("hand edited\n")
    assert run(tmp_path, check=True) == 1
    assert "decode.md" in capsys.readouterr().err


def test_diagrams_are_mermaid_state_diagrams_of_both_lifecycles() -> None:
    docs = documents()
    assert set(docs) == {"prefill.md", "decode.md"}
    for text in docs.values():
        assert "```mermaid\nstateDiagram-v2" in text
    assert "AWAIT_DECODER_META --> META_READY" in docs["prefill.md"]
    assert "RECEIVING --> DONE" in docs["decode.md"]
