"""The committed diagrams are what the declarations generate."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lw.diagrams import documents, run

ROOT = Path(__file__).resolve().parents[2]


def test_committed_diagrams_are_fresh() -> None:
    out = subprocess.run([sys.executable, "-m", "lw", "diagrams", "--check"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_check_names_the_stale_file(tmp_path: Path, capsys) -> None:
    out = tmp_path / "diagrams"
    deployment = tmp_path / "deployment.md"  # a region generated in a hand-written doc
    deployment.write_text((ROOT / "docs" / "deployment.md").read_text())
    assert run(out, check=False) == 0
    assert run(out, check=True) == 0
    (out / "decode.md").write_text("hand edited\n")
    assert run(out, check=True) == 1
    assert "decode.md" in capsys.readouterr().err
    assert run(out, check=False) == 0
    deployment.write_text(deployment.read_text().replace("| `lease_s` | 90 |", "| `lease_s` | 9 |"))
    assert run(out, check=True) == 1
    assert "deployment.md" in capsys.readouterr().err


def test_diagrams_are_mermaid_state_diagrams_of_both_lifecycles() -> None:
    docs = documents()
    assert set(docs) == {"prefill.md", "decode.md"}
    for text in docs.values():
        assert "```mermaid\nstateDiagram-v2" in text
    assert "AWAIT_DECODER_META --> META_READY" in docs["prefill.md"]
    assert "RECEIVING --> DONE" in docs["decode.md"]


def test_every_config_key_is_documented_once_in_code() -> None:
    from lw.diagrams import fill_region
    from lw.vllm_adapter.config import LwConfig, key_table

    table = key_table().splitlines()
    assert [row.split("`")[1] for row in table[2:]] == list(LwConfig.extra_keys())
    assert all(row.count(" | ") == 3 and row.split(" | ")[3].strip(" |") for row in table[2:])
    with pytest.raises(ValueError, match="config-keys"):
        fill_region("no markers here", "config-keys", "x.py", "table")
