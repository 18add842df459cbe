"""The committed diagrams are what the declarations and lw's imports generate."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lw import house
from lw.diagrams import documents, package_picture, run

ROOT = Path(__file__).resolve().parents[2]


def test_committed_diagrams_are_fresh() -> None:
    out = subprocess.run([sys.executable, "-m", "lw", "diagrams", "--check"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_check_names_the_stale_file(tmp_path: Path, capsys) -> None:
    out = tmp_path / "diagrams"
    deployment = tmp_path / "deployment.md"  # a region generated in a hand-written doc
    deployment.write_text((ROOT / "docs" / "deployment.md").read_text())
    design = tmp_path / "design.md"  # and the package picture in another
    design.write_text((ROOT / "docs" / "design.md").read_text())
    assert run(out, check=False) == 0
    assert run(out, check=True) == 0
    (out / "decode.md").write_text("hand edited\n")
    assert run(out, check=True) == 1
    assert "decode.md" in capsys.readouterr().err
    assert run(out, check=False) == 0
    deployment.write_text(deployment.read_text().replace("| `lease_s` | `request", "| `lease_s` |"))
    assert run(out, check=True) == 1
    assert "deployment.md" in capsys.readouterr().err
    assert run(out, check=False) == 0
    design.write_text(design.read_text().replace("lw_sim -->|", "lw_sim -->|1", 1))
    assert run(out, check=True) == 1
    assert "design.md" in capsys.readouterr().err


def test_diagrams_are_mermaid_state_diagrams_of_both_lifecycles() -> None:
    docs = documents()
    assert set(docs) == {"prefill.md", "decode.md"}
    for text in docs.values():
        assert "```mermaid\nstateDiagram-v2" in text
    assert "AWAIT_DECODER_META --> META_READY" in docs["prefill.md"]
    assert "RECEIVING --> DONE" in docs["decode.md"]


def test_every_config_key_is_documented_once_in_code() -> None:
    from lw.diagrams import fill_region
    from lw.vllm_adapter.config import LwConfig
    from lw.vllm_adapter.config_doc import key_table

    rows = [row for row in key_table().splitlines() if row.startswith("| `")]
    names = [row.split("`")[1] for row in rows]
    assert names == [*LwConfig.extra_keys()[:-1], *LwConfig.experimental_keys(),
                     *LwConfig.derived_keys()]  # each once, in its section's table
    assert all(cell.strip() for row in rows for cell in row.strip("|").split(" | "))
    with pytest.raises(ValueError, match="config-keys"):
        fill_region("no markers here", "config-keys", "x.py", "table")


def _links(picture: str) -> dict[str, set[str]]:
    """Node -> the nodes the picture draws below it (arrows and invisible links)."""
    out: dict[str, set[str]] = {}
    for line in picture.splitlines():
        for arrow in (" -->|", " ~~~ "):
            if arrow in line:
                a, _, rest = line.strip().partition(arrow)
                out.setdefault(a, set()).add(rest.rpartition(" ")[2])
    return out


def test_the_package_picture_draws_the_engines_below_the_checker() -> None:
    picture = package_picture(house.import_graph())
    assert picture in (ROOT / "docs" / "design.md").read_text()
    assert picture.startswith("```mermaid\nflowchart TB\n")
    links = _links(picture)
    below_the_checker = house.reach(links, {"lw_sim"})
    for package in (*house.ENGINE_PACKAGES, "lw.fsm"):
        node = package.replace(".", "_")
        assert f'  {node}["{package}<br/>runs in: ' in picture
        assert node in below_the_checker and node in house.reach(links, {"lw_lab"})
    assert 'lw_proxy["lw.proxy<br/>runs in: the proxy"]' in picture
    assert 'lw_sim["lw.sim<br/>runs in: tools"]' in picture


def test_a_new_import_changes_the_picture() -> None:
    """Any edge of the graph shows, so the committed picture goes stale with the imports."""
    graph = {"lw": set(), "lw.cli": set(), "lw.fsm": set(), "lw.fsm.core": set(),
             "lw.proxy": set(), "lw.proxy.server": {"lw.fsm.core"},
             "lw.vllm_adapter": set(), "lw.vllm_adapter.connector": {"lw.fsm.core"},
             "lw.sim": set(), "lw.sim.world": {"lw.fsm.core"}}
    before = package_picture(graph)
    assert "  lw_sim -->|1| lw_fsm" in before
    assert "  lw_sim ~~~ lw_proxy" in before and "  lw_sim ~~~ lw_vllm_adapter" in before
    assert 'lw["lw (cli)<br/>runs in: tools"]' in before
    assert 'lw_fsm["lw.fsm<br/>runs in: vLLM\'s processes, the proxy"]' in before
    graph["lw.sim.world"].add("lw.proxy.server")
    after = package_picture(graph)
    assert "  lw_sim -->|1| lw_proxy" in after and "lw_sim ~~~ lw_proxy" not in after
    graph["lw.sim.world"].add("lw.fsm")  # a second module of the same package pair
    assert "  lw_sim -->|2| lw_fsm" in package_picture(graph)
    assert package_picture(graph) == package_picture(dict(reversed(graph.items())))
