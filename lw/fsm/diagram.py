"""Mermaid state diagrams generated from the declarations (pure string building, no I/O)."""

from __future__ import annotations

from lw.fsm.machine import STAY, Declaration


def mermaid(decl: Declaration, title: str, blurb: str) -> str:
    """A Markdown document with a Mermaid ``stateDiagram-v2`` of ``decl`` and its table."""
    lines = [f"# {title}", "", blurb, "", "```mermaid", "stateDiagram-v2"]
    lines += [f"    [*] --> {s}" for s in (decl.initial, *decl.entries)]
    edges: dict[tuple[str, str], list[str]] = {}
    for t in decl.transitions:
        if t.dest == STAY:
            continue
        for s in t.sources:
            edges.setdefault((s, t.dest), []).append(t.event)
    for (src, dst), evs in edges.items():
        lines.append(f"    {src} --> {dst}: {', '.join(evs)}")
    for f in sorted(decl.finals):
        lines.append(f"    {f} --> [*]")
    lines += ["```", "", "## Transition table", "",
              "Generated from the declaration; `=` means a declared no-op (the event is expected "
              "there and changes nothing). A pair not listed is a protocol error.", "",
              "| event | from | to | note |", "|---|---|---|---|"]
    for t in decl.transitions:
        src = ", ".join(t.sources)
        lines.append(f"| `{t.event}` | {src} | {t.dest} | {t.note} |")
    return "\n".join(lines) + "\n"
